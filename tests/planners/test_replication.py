"""Expert-parallel planners (ep_static, eplb, predictive_replication, oracle_replication), the
token split, replica placement and the balance metrics, on hand-worked examples."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from core.balance import balance_metrics
from core.errors import ConfigError
from core.spec import HardwareSpec, ModelSpec, RoutingConfig, Workload
from core.types import OpKind
from experiments.pipeline import RunSpec, simulate_run
from planners.expert_parallel import Layout, home_slots, replicate_onto, split_tokens

PLANNERS = ["ep_static", "eplb", "predictive_replication", "oracle_replication"]


def tiny_spec(planner: str, **params) -> RunSpec:
    model = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/tiny.yaml").read_text()))
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text()))
    wl = Workload(
        batch_size=2,
        n_batches=3,
        prompt_len=8,
        gen_len=2,
        routing=RoutingConfig(source="synthetic"),
    )
    return RunSpec(model, hw, wl, planner, {"n_devices": 2, **params})


def test_split_tokens_even_over_copies():
    """Expert 0 has copies on device 0 (first) and device 1: its 5 tokens split 3 + 2."""
    slots = np.array([[0, 1], [2, 0]])
    out = split_tokens(slots, np.array([5, 2, 3]))
    assert out.tolist() == [[3, 2, 0], [2, 0, 3]]


def test_replica_goes_to_lightest_device_without_the_expert():
    """E=4 on G=2 round-robin: dev0 {0, 2}, dev1 {1, 3}. Load [8, 1, 1, 1], one replica: expert 0
    gets 2 copies (4 each); dev0 would hold 4 + 1, dev1 1 + 1, so the copy goes to dev1: 5 vs 6."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=1, lanes=True)
    slots = replicate_onto(np.array([8.0, 1, 1, 1]), lay)
    assert slots.tolist() == [[0, 2, -1], [1, 3, 0]]
    assert split_tokens(slots, np.array([8, 1, 1, 1])).sum(1).tolist() == [5, 6]


def test_homes_packed_by_load():
    """Loads [4, 3, 2, 1] on 2 devices, 2 each: 4 -> d0, 3 -> d1, 2 -> d1 (5), 1 -> d0 (5)."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=0, replicas=0, lanes=False)
    assert home_slots(lay, np.array([4.0, 3, 2, 1])).tolist() == [[0, 3], [1, 2]]


def test_balance_metrics_hand_worked():
    """One layer, 2 devices: device 0 runs 30 tokens in [0, 3] s, device 1 10 tokens in [0, 1] s.
    balancedness = mean 20 / max 30; utilisation = (3 + 1) / (2 x 3)."""
    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 2, "resource": ["gpu", "gpu:1"], "step": [0, 0], "layer": [1, 1],
        "batch": [0, 0], "tokens": [30, 10], "start_s": [0.0, 0.0], "end_s": [3.0, 1.0],
    })  # fmt: skip
    m = balance_metrics(trace, 2)
    assert m["balancedness"] == pytest.approx(2 / 3)
    assert m["utilisation"] == pytest.approx(4 / 6)
    assert m["device_busy_frac"] == pytest.approx([1.0, 1 / 3], abs=1e-4)


@pytest.mark.parametrize("planner", PLANNERS)
def test_planner_runs_and_reports_balance(planner):
    """Validates and simulates on 2 lanes; every routed token is computed once; summary has the fields."""
    params = {} if planner == "ep_static" else {"replica_slots": 1}
    res = simulate_run(tiny_spec(planner, lanes=True, **params))
    s = res.summary
    ex = res.trace[res.trace["kind"].astype(str) == str(OpKind.EXPERT)]
    assert (
        ex["tokens"].sum() == 2 * 3 * (8 + 1) * 2 * 2
    )  # bs x batches x (prompt + 1 decode) x top_k x 2 MoE layers
    assert set(ex["resource"].astype(str)) <= {"gpu", "gpu:1"}
    assert 0 < s["balancedness"] <= 1 and 0 < s["utilisation"] <= 1
    assert ("oracle upper bound" in s["planner_label"]) == (planner == "oracle_replication")


def test_gpus_mode_moves_tokens_and_replicas_over_p2p():
    res = simulate_run(tiny_spec("oracle_replication", replica_slots=1))
    kinds = set(res.trace["kind"].astype(str))
    assert {str(OpKind.DISPATCH), str(OpKind.COMBINE)} <= kinds
    copies = res.trace[(res.trace["kind"].astype(str) == str(OpKind.LOAD))]
    assert len(copies) == res.summary["plan"]["ep"]["copies"] > 0
    assert set(copies["resource"].astype(str)) <= {"p2p", "p2p:1"}


def test_predictive_copies_wait_for_the_routing_they_used():
    """Causal: a replica copy depends on a gate op that precedes it (previous batch or layer)."""
    res = simulate_run(
        tiny_spec("predictive_replication", lanes=True, replica_slots=1, predictor="last")
    )
    ops = res.schedule.ops
    copies = [o for o in ops if o.kind == OpKind.LOAD]
    assert copies
    for c in copies:
        gates = [ops[d] for d in c.deps if ops[d].kind == OpKind.GATE]
        assert gates and all(
            g.layer == c.layer and (g.batch, g.step) != (c.batch, c.step) for g in gates
        )


@pytest.mark.parametrize(
    "planner, params, match",
    [
        (
            "predictive_replication",
            {"replica_slots": 1, "replicas": 3},
            "exceeds the 2 replica slots",
        ),
        ("ep_static", {"n_devices": 5}, r"n_devices=5 must be in \[1, 4\]"),
        ("eplb", {"initial_load": "tests/planners/missing.npy"}, "cannot read"),
    ],
)
def test_bad_input_is_one_config_error(planner, params, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec(planner, **params))


def test_eplb_load_matrix_of_wrong_shape(tmp_path):
    bad = tmp_path / "load.npy"
    np.save(bad, np.ones((3, 4)))  # tiny has 2 MoE layers
    with pytest.raises(ConfigError, match=r"shape \(3, 4\).*\[2 MoE layers, 4 experts\]"):
        simulate_run(tiny_spec("eplb", initial_load=str(bad)))


def test_cli_exits_non_zero_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", "model=tiny", "hardware=tiny", "workload=tiny",
           "planner=predictive_replication", "+planner.params.replicas=9", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: planner replicas=9 exceeds")
