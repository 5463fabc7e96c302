"""Expert-parallel planners (ep_static, eplb, predictive_replication, oracle_replication), the
token split, replica placement and the balance metrics, on hand-worked examples."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from core.balance import balance_metrics
from core.errors import CapacityError, ConfigError, MoepipeError
from core.spec import HardwareSpec, LinkSpec, ModelSpec, RoutingConfig, Workload
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from experiments.pipeline import RunSpec, simulate_run
from experiments.replication import gap_line, utilisation_lines
from planners.expert_parallel import (
    ExpertTime,
    Layout,
    PredictionError,
    ReplicaParams,
    Replicator,
    balanced_split,
    expert_width,
    home_slots,
    polish,
    predicted_tokens,
    replicate_onto,
    split_tokens,
    swap_homes,
    times_held,
)

PLANNERS = ["ep_static", "eplb", "predictive_replication", "oracle_replication"]


def tiny_spec(planner: str, **params) -> RunSpec:
    model = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/tiny.yaml").read_text()))
    hw = HardwareSpec.from_dict({**yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text()),
                                 "n_gpus": 4})  # fmt: skip
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


def test_split_tokens_even_turns_the_remainder_with_the_expert():
    """Experts 0 and 1 each on devices 0 and 1, 3 tokens each: expert 0's extra token goes to its
    first copy, expert 1's to its second, so the devices get 3 and 3 (the first copy always
    taking it gave device 0 four and device 1 two)."""
    slots = np.array([[0, 1, 2], [1, 0, 3]])
    out = split_tokens(slots, np.array([3, 3, 0, 0]))
    assert out.tolist() == [[2, 1, 0, 0], [1, 2, 0, 0]]


def test_split_tokens_balanced_over_holders():
    """Device 0 holds experts 0 and 1, device 1 experts 2 and 0; tokens [5, 4, 1]. Evenly, expert
    0 splits 3 + 2: loads 7 and 3. Balanced, it fills the lighter device first, to a common level:
    1 + 4, loads 5 and 5. Whole tokens, each expert's count kept."""
    slots = np.array([[0, 1], [2, 0]])
    assert split_tokens(slots, np.array([5, 4, 1])).sum(1).tolist() == [7, 3]
    out = split_tokens(slots, np.array([5, 4, 1]), "balanced")
    assert out.tolist() == [[1, 4, 0], [4, 0, 1]]
    # 4 tokens over 3 holders at equal loads: 4/3 each, rounded 2 + 1 + 1 (lower device first)
    three = np.array([[0], [0], [0]])
    assert split_tokens(three, np.array([4]), "balanced")[:, 0].tolist() == [2, 1, 1]
    # the tokens left after rounding down go to the device holding fewest so far, not each
    # expert's lowest device: experts 0-3 on both devices, 1 token each -> 2 and 2 (not 4 and 0)
    both = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    assert split_tokens(both, np.array([1, 1, 1, 1]), "balanced").sum(1).tolist() == [2, 2]
    mixed = np.array([[0, 2, -1, 1, 0], [1, 3, 1, -1, 2]])
    assert split_tokens(mixed, np.array([1, 2, 1, 2]), "balanced").sum(1).tolist() == [3, 3]


def min_max_load(slots: np.ndarray, load: np.ndarray) -> float:
    """The smallest busiest-device load any split of load [E] over its holders in slots [G, K]
    allows: the most, over sets S of devices, of the load of the experts held only inside S
    divided by |S| (Hall's condition; exact, and exponential in G)."""
    g = slots.shape[0]
    hold = times_held(slots, len(load)) > 0
    best = 0.0
    for mask in range(1, 1 << g):
        inside = np.array([(mask >> d) & 1 for d in range(g)], dtype=bool)
        only = hold.any(0) & ~hold[~inside].any(0)
        best = max(best, float(load[only].sum()) / int(inside.sum()))
    return best


def test_balanced_split_reaches_the_smallest_busiest_load():
    """On random placements (homes plus random replicas, some slots empty, some ids twice on a
    device) the balanced split's busiest device is within its tolerance of the least any split
    allows (`min_max_load`, Hall's bound, exact), never above the even split's, and the whole
    tokens keep every expert's count, on devices holding it, within a token of the fractions."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = int(rng.integers(2, 6))
        e = int(rng.integers(g, 3 * g))
        homes = -(-e // g)
        slots = np.full((g, homes + int(rng.integers(1, 4))), -1)
        for x in range(e):
            slots[x % g, x // g] = x
        slots[:, homes:] = rng.integers(-1, e, size=(g, slots.shape[1] - homes))
        load = rng.integers(0, 50, size=e)
        frac = balanced_split(slots, load.astype(float))
        assert np.allclose(frac.sum(0), load)
        assert frac.sum(1).max() <= min_max_load(slots, load.astype(float)) + 1e-2
        assert frac.sum(1).max() <= predicted_tokens(slots, load.astype(float)).sum(1).max() + 1e-9
        whole = split_tokens(slots, load, "balanced")
        assert (whole.sum(0) == load).all() and (whole >= 0).all()
        assert not whole[times_held(slots, e) == 0].any() and np.abs(whole - frac).max() < 1


def test_min_max_load_by_hand():
    """Experts 0 (6) and 1 (2) only on device 0, expert 2 (4) on both: device 0 alone must take
    8, so 8 is the least busiest load, whatever expert 2 does; with expert 0 on both, 6."""
    assert min_max_load(np.array([[0, 1, 2], [2, -1, -1]]), np.array([6.0, 2, 4])) == 8.0
    assert min_max_load(np.array([[0, 1, 2], [2, 0, -1]]), np.array([6.0, 2, 4])) == 6.0


def test_balanced_dispatch_in_the_simulator():
    """dispatch=balanced: the expert ops carry balanced_split's tokens, so the same eplb
    placement is at least as balanced as under the even split; the gate's model uses the same
    rule (ExpertTime.dispatch), and the run's meta records it."""
    even = simulate_run(tiny_spec("eplb", replica_slots=1))
    bal = simulate_run(tiny_spec("eplb", replica_slots=1, dispatch="balanced"))
    assert bal.schedule.meta["ep"]["dispatch"] == "balanced"
    assert even.schedule.meta["ep"]["dispatch"] == "even"
    assert bal.summary["balancedness"] >= even.summary["balancedness"]
    # the gate's model: device 0 holds experts 0 and 1, device 1 experts 2 and 0
    slots, load = np.array([[0, 1], [2, 0]]), np.array([5.0, 4, 1])
    timer = replace(_timer(), dispatch="balanced")
    assert timer.device_times(slots, load).tolist() == [5.0, 5.0]
    assert _timer().device_times(slots, load).tolist() == [6.5, 3.5]
    with pytest.raises(
        ConfigError, match="planner dispatch='greedy' unknown; valid: even, balanced"
    ):
        simulate_run(tiny_spec("eplb", dispatch="greedy"))


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


def test_gpu_load_of_shared_lanes_counts_kernels_not_launches():
    """Two lanes of one GPU sharing its SMs: lane 0's op spans [0, 3] s with a 1 s launch (its
    kernel runs [1, 3]), lane 1's [0, 2] with a 0.5 s launch ([0.5, 2]): a kernel runs in
    [0.5, 3], so GPUtil's load is 2.5 / 3; without launch_s both ops count from 0 (load 1)."""
    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 2, "resource": ["gpu", "gpu:1"], "stream": ["lane0", "lane1"],
        "step": [0, 0], "layer": [1, 1], "batch": [0, 0], "tokens": [4, 4],
        "start_s": [0.0, 0.0], "end_s": [3.0, 2.0], "sm_s": [1.0, 0.5], "launch_s": [1.0, 0.5],
    })  # fmt: skip
    assert balance_metrics(trace, 2, lanes=True)["gpu_load"] == pytest.approx(2.5 / 3)
    assert balance_metrics(trace.drop(columns="launch_s"), 2, lanes=True)["gpu_load"] == 1.0


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


def test_phases_give_each_layer_and_batch_its_own_row():
    """Two phases on 2 devices. Layer 1: 30 and 10 tokens in [0, 3] and [0, 1] s: balancedness
    20 / 30, util (3 + 1) / (2 x 3). Layer 2: device 1 alone, 8 tokens in [4, 6] s: device 0 has
    0 tokens, balancedness 4 / 8, util 2 / (2 x 2)."""
    from core.balance import phases

    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 3, "resource": ["gpu", "gpu:1", "gpu:1"], "step": [0, 0, 0],
        "layer": [1, 1, 2], "batch": [0, 0, 0], "tokens": [30, 10, 8], "start_s": [0.0, 0.0, 4.0],
        "end_s": [3.0, 1.0, 6.0],
    })  # fmt: skip
    t = phases(trace, 2).set_index("layer")
    assert t.loc[1, ["tokens_0", "tokens_1", "max_tokens", "mean_tokens"]].tolist() == [
        30,
        10,
        30,
        20,
    ]
    assert t.loc[2, ["tokens_0", "tokens_1"]].tolist() == [0, 8]
    assert t["balancedness"].tolist() == pytest.approx([2 / 3, 1 / 2])
    assert t["span_s"].tolist() == pytest.approx([3.0, 2.0])
    assert t["phase_util"].tolist() == pytest.approx([4 / 6, 2 / 4])


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
    # the GPU bubble is the one GPU's time with no lane running a kernel (it was lane 0's and
    # the whole-GPU ops' idle time), and on 2 GPUs their mean idle time (it was GPU 0's)
    assert s["gpu_bubble_frac"] == pytest.approx(1 - s["gpu_load"])
    g2 = simulate_run(tiny_spec(planner, lanes=False, **params)).summary
    assert g2["gpu_bubble_frac"] == pytest.approx(1 - g2["utilisation"])
    assert g2["gpu_bubble_frac"] != pytest.approx(1 - g2["device_busy_frac"][0])
    assert ("oracle upper bound" in s["planner_label"]) == (planner == "oracle_replication")
    # the planners that plan from a load say how far it was from the truth
    tv = s["plan"]["ep"].get("prediction_tv")
    assert (tv is not None) == (planner in ("predictive_replication", "oracle_replication"))
    assert tv is None or (tv == 0.0) == (planner == "oracle_replication") and 0 <= tv <= 1


def test_prediction_error_is_the_total_variation_of_the_shares():
    err = PredictionError()
    err.planned_from(0, 0, np.array([2.0, 2.0, 0.0, 0.0]))
    err.observed(0, 0, [1, 1, 1, 1])  # shares 1/2 1/2 0 0 against 1/4 each: 0.5
    err.planned_from(1, 0, np.array([3.0, 3.0, 3.0, 3.0]))
    err.observed(1, 0, [2, 2, 2, 2])  # the same shares at another scale: 0
    err.planned_from(1, 1, np.array([1.0, 0.0, 0.0, 0.0]))
    err.observed(1, 1, [0, 0, 0, 5])  # disjoint: 1
    assert err.mean() == pytest.approx(0.5) and not err.planned
    assert PredictionError().mean() is None


def test_blended_oracle_plans_at_a_known_distance_and_is_not_called_a_bound(tmp_path):
    prior = tmp_path / "prior.npy"
    np.save(prior, np.array([[8.0, 1, 1, 1], [1, 1, 1, 8]]))  # tiny: 2 MoE layers, 4 experts
    tv = {}
    for w in (1.0, 0.5, 0.0):
        s = simulate_run(tiny_spec("oracle_replication", replica_slots=1, initial_load=str(prior),
                                   truth_weight=w)).summary  # fmt: skip
        tv[w] = s["plan"]["ep"]["prediction_tv"]
        assert s["planner_label"] == "oracle_replication" + (
            " (oracle upper bound)" if w == 1.0 else " (peeks at the routing)"
        )
    # the blend's shares are w x the truth's + (1 - w) x the prior's: its distance scales by 1 - w
    assert tv[1.0] == 0.0 and tv[0.0] > 0.1
    assert tv[0.5] == pytest.approx(tv[0.0] / 2)


def test_gpus_mode_moves_tokens_and_replicas_over_p2p():
    """Each replica copy arrives over its destination's link and leaves its source's by the
    outgoing direction, from the source the real run sends it from (`copy_moves`); the
    destination's experts wait for both ends."""
    res = simulate_run(tiny_spec("oracle_replication", replica_slots=1))
    kinds = set(res.trace["kind"].astype(str))
    assert {str(OpKind.DISPATCH), str(OpKind.COMBINE)} <= kinds
    tr = res.trace[(res.trace["kind"].astype(str) == str(OpKind.LOAD))]
    into = tr[tr["stream"].astype(str).str.fullmatch(r"replicas\d")]
    out = tr[tr["stream"].astype(str).str.startswith("replicas_out")]
    assert len(into) == len(out) == res.summary["plan"]["ep"]["copies"] > 0
    assert len(into) + len(out) == len(tr)
    assert set(into["resource"].astype(str)) <= {"p2p", "p2p:1"}
    assert set(out["resource"].astype(str)) <= {"p2p_out", "p2p_out:1"}
    ops, streams = res.schedule.ops, res.schedule.streams
    # each direction of a GPU's link is one pool: copies and the all-to-all share its bandwidth
    # (NCCL's kernels on the copies' own process group run beside the all-to-all's)
    for spec in streams.values():
        if spec.resource in (Resource.P2P, Resource.P2P_OUT):
            assert spec.pool == f"{spec.resource}:{spec.device}", spec.name
    for o in ops:  # a copy's two ends (emitted together) are on different GPUs, for one expert
        if o.kind == OpKind.LOAD and streams[o.stream].name.startswith("replicas") and not \
                streams[o.stream].name.startswith("replicas_out"):  # fmt: skip
            twin = ops[o.id + 1]
            assert streams[twin.stream].name.startswith("replicas_out")
            assert (twin.expert, twin.layer, twin.deps) == (o.expert, o.layer, o.deps)
            assert streams[twin.stream].device != streams[o.stream].device
    waited = 0
    for o in ops:  # experts wait for both ends of each copy they wait for
        if o.kind == OpKind.EXPERT:
            names = [streams[ops[d].stream].name for d in o.deps if ops[d].kind == OpKind.LOAD]
            n_out = sum(n.startswith("replicas_out") for n in names)
            assert n_out == len(names) - n_out
            waited += n_out
    assert waited > 0


def test_all_to_all_leaves_the_gpu_holding_the_sequences():
    """Batch 1 on 2 GPUs: GPU 0 holds the one sequence, so every pair GPU 1 computes comes from
    it. They leave by GPU 0's outgoing link (`send0`, p2p_out) and arrive by GPU 1's incoming
    one; the results travel back the other way. Before, each GPU was charged half of its own
    pairs as received, and GPU 0's sends were charged nowhere. GPU 1's experts wait for both
    ends of the dispatch, and GPU 0's receive of the results for GPU 1's experts."""
    spec = tiny_spec("ep_static")
    res = simulate_run(replace(spec, workload=replace(spec.workload, batch_size=1)))
    ops, streams = res.schedule.ops, res.schedule.streams
    name = {o.id: streams[o.stream].name for o in ops}
    remote = sum(o.tokens for o in ops if o.kind == OpKind.EXPERT and name[o.id] == "compute1")
    assert remote > 0
    assert res.summary["plan"]["ep"]["pairs_sent"] == [remote, 0]
    for kind, out, into in ((OpKind.DISPATCH, "send0", "dispatch1"),
                            (OpKind.COMBINE, "send1", "combine0")):  # fmt: skip
        moved = [o for o in ops if o.kind == kind]
        assert {name[o.id] for o in moved} == {out, into}
        for stream in (out, into):
            assert sum(o.tokens for o in moved if name[o.id] == stream) == remote
    assert [streams[s].resource_id for s in ("send0", "send1")] == ["p2p_out", "p2p_out:1"]
    for o in ops:
        deps = {name[d] for d in o.deps}
        if o.kind == OpKind.EXPERT and name[o.id] == "compute1":
            assert {"send0", "dispatch1"} <= deps
        if o.kind == OpKind.COMBINE and name[o.id] == "combine0":
            assert "compute1" in deps


def test_lanes_copy_on_the_one_gpus_queue():
    """Lanes are one GPU: every lane's replica copies run on its one copy path (`replicas` on
    `d2d`, at half its HBM bandwidth), so they add up there, not on a link per lane."""
    res = simulate_run(tiny_spec("predictive_replication", lanes=True, replica_slots=1,
                                 predictor="last", gate="none"))  # fmt: skip
    copies = res.trace[res.trace["kind"].astype(str) == str(OpKind.LOAD)]
    assert len(copies) == res.summary["plan"]["ep"]["copies"] > 1
    assert set(copies["stream"].astype(str)) == {"replicas"}
    assert set(copies["resource"].astype(str)) == {"d2d"}
    # no link between GPUs is declared: lanes move no tokens (the validator rejects p2p here)
    links = {s.resource for s in res.schedule.streams.values()}
    assert not links & {Resource.P2P, Resource.P2P_OUT}
    spec = tiny_spec("ep_static")
    d2d = spec.hardware.link(Resource.D2D)
    assert d2d.bandwidth_bytes_per_s == spec.hardware.gpu.mem_bw_bytes_per_s / 2
    took = (copies["end_s"] - copies["start_s"]).to_numpy()
    assert took == pytest.approx(d2d.time_s(spec.model.expert_bytes))
    ends = copies.sort_values("start_s")
    assert (ends["start_s"].to_numpy()[1:] >= ends["end_s"].to_numpy()[:-1] - 1e-12).all()


def test_lanes_gate_charges_every_lanes_copies_as_one_queue(monkeypatch):
    """The time+copy gate on lanes judges a placement by the copies of all lanes on the one
    queue: with each lane's queue judged alone (the gate before) it accepts more copies."""
    from planners import expert_parallel as ep

    spec = tiny_spec("predictive_replication", lanes=True, replica_slots=1, predictor="last",
                     gate="time+copy", n_devices=4)  # fmt: skip
    spec = replace(spec, workload=replace(spec.workload, batch_size=8),
                   hardware=replace(spec.hardware, links={
                       **spec.hardware.links, Resource.D2D: LinkSpec(1e10, 0.0)}))  # fmt: skip
    one = simulate_run(spec).summary["plan"]["ep"]["copies"]
    queue = ep.ExpertTime.queue  # each lane's queue judged alone, as on G GPUs
    monkeypatch.setattr(ep.ExpertTime, "queue",
                        lambda self, s, r: queue(replace(self, one_link=False), s, r))  # fmt: skip
    each = simulate_run(spec).summary["plan"]["ep"]["copies"]
    assert one < each


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


def test_layer_corr_first_placements_do_not_read_the_runs_routing(tmp_path):
    """A layer's first placement is loaded before the run, so it cannot follow routing: with a
    table that sends layer 0's expert e to layer 1's expert e, sending iteration 0's tokens at
    MoE layer 0 to experts {0, 1} or to {2, 3} leaves MoE layer 1's first placement the same
    (before, layer_corr placed it from that routing, and its copies cost nothing)."""
    from core.routing import Routing
    from experiments.pipeline import build_schedule
    from tests.conftest import random_routing

    spec = tiny_spec("predictive_replication", lanes=True, replica_slots=1)
    e = spec.model.n_experts
    table = np.zeros((len(spec.model.moe_layers), e, e))
    table[1] = 100 * np.eye(e)
    np.save(tmp_path / "t.npy", table)
    spec = replace(
        spec, params={**spec.params, "predictor": "layer_corr", "table": str(tmp_path / "t.npy")}
    )
    base = random_routing(spec.model, spec.workload)
    first = []
    for hot in ([0, 1], [2, 3]):
        ids = base.expert_ids.copy()
        ids[: spec.workload.batch_size, base.step_slice(0, spec.workload), 0] = hot
        s = build_schedule(spec, Routing(ids, base.gate_weights, base.n_experts, "hot"))
        first.append(s.meta["ep_slots"][(0, 0, 1)])
    assert first[0] == first[1]


def test_too_many_replica_slots_for_memory_name_the_param():
    with pytest.raises(CapacityError, match=r"planner replica_slots=\d+: .* lower replica_slots"):
        simulate_run(tiny_spec("predictive_replication", replica_slots=10**6))


def test_memory_is_checked_per_gpu():
    """On G GPUs each holds the dense weights, its share of the experts, its slots and its
    sequences' KV. Mixtral-8x22B's experts (271 GB) fit 8 H200s, not one: all G GPUs' experts
    were checked against one GPU's memory, so it was refused, and the replica slots that fit
    were 1/G of the truth. Lanes are one GPU: every lane's slots count against it."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/mixtral-8x22b.yaml").read_text()))
    wl = Workload(batch_size=8, n_batches=1, prompt_len=16, gen_len=1,
                  routing=RoutingConfig(source="synthetic"))  # fmt: skip
    slot = len(m.moe_layers) * m.expert_bytes
    held = m.total_bytes - m.n_experts * slot + m.n_experts // 8 * slot  # dense + 1/8 experts
    fit = int((hw.memory_bytes[Tier.GPU] - held) // slot)  # KV at 17 tokens: under one slot
    s = simulate_run(RunSpec(m, hw, wl, "eplb", {"n_devices": 8, "replica_slots": fit})).summary
    assert s["peak_bytes"]["gpu"] <= 8 * hw.memory_bytes[Tier.GPU]
    with pytest.raises(CapacityError, match=rf"lower replica_slots \(at most {fit} fit\)"):
        simulate_run(RunSpec(m, hw, wl, "eplb", {"n_devices": 8, "replica_slots": fit + 1}))
    with pytest.raises(CapacityError, match=r"do not fit 1 GPU\(s\) of 149 GB"):
        simulate_run(RunSpec(m, hw, wl, "ep_static", {"n_devices": 8, "lanes": True}))


def test_per_gpu_memory_of_tensor_parallel_dense_work_and_of_every_batch():
    """DeepSeek-V2-Lite on 8 GPUs of 5 GB. Data-parallel dense work puts 2.6 GB of dense weights
    on every GPU; with its 8 experts a layer a GPU (3.6 GB) nothing is left for replicas, and the
    line says the model does not fit (it said to lower replica_slots=0). Tensor-parallel dense
    work holds 1/8 of the heads, FFN columns and vocabulary, so replicas fit there. An
    expert-parallel run keeps every batch's KV: more batches of long prompts do not fit."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    hw = replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: 5 * 10**9})
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text()))
    wl = Workload(batch_size=8, n_batches=1, prompt_len=16, gen_len=1,
                  routing=RoutingConfig(source="synthetic"))  # fmt: skip
    with pytest.raises(CapacityError, match=r"do not fit 8 GPU\(s\) of 5 GB"):
        simulate_run(RunSpec(m, hw, wl, "ep_static", {"n_devices": 8}))
    tp = {"n_devices": 8, "dense": "tensor", "replica_slots": 1}
    assert simulate_run(RunSpec(m, hw, wl, "eplb", tp)).summary["makespan_s"] > 0
    # MLA's latent cache is whole on every GPU under tensor parallelism: 0.26 GB a batch here
    long, tp0 = wl.with_(batch_size=16, prompt_len=512, n_batches=2), {**tp, "replica_slots": 0}
    simulate_run(RunSpec(m, hw, long, "eplb", tp0))
    with pytest.raises(CapacityError, match="do not fit 8 GPU"):
        simulate_run(RunSpec(m, hw, long.with_(n_batches=3), "eplb", tp0))


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
        ("oracle_replication", {"truth_weight": 1.5}, r"truth_weight=1.5 must be in \[0, 1\]"),
        # ran as -1 (every slot)
        ("predictive_replication", {"replicas": -5}, r"replicas=-5 must be >= 0, or -1"),
        # accepted and never read
        ("eplb", {"gate": "time+copy"}, "gate='time\\+copy': eplb has no replica cost gate"),
        ("ep_static", {"gate": "time"}, "gate='time': ep_static has no replica cost gate"),
    ],
)
def test_bad_input_is_one_config_error(planner, params, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec(planner, **params))


def test_more_gpus_than_the_hardware_has_is_one_config_error():
    """G GPUs on hardware with fewer: refused (memory would be G x the GPU's, and the device
    links fall back to PCIe); G lanes of the one GPU are not GPUs and run."""
    spec = tiny_spec("ep_static")
    spec = replace(spec, hardware=replace(spec.hardware, n_gpus=1))
    with pytest.raises(ConfigError, match=r"n_devices=2 exceeds hardware tiny's n_gpus=1"):
        simulate_run(spec)
    assert simulate_run(replace(spec, params={**spec.params, "lanes": True})).summary


def test_eplb_rounds_its_replicas_down_to_equal_devices():
    """4 experts on 3 devices with 2 replica slots each: 10 physical experts do not split evenly
    over 3 devices as EPLB lays them out, so eplb uses 9 (5 replicas, within the budget of 6);
    with no replica slots 4 experts cannot be 3 equal shares, one line naming the fix."""
    s = simulate_run(tiny_spec("eplb", n_devices=3, lanes=True, replica_slots=2)).summary
    assert s["plan"]["eplb"]["replicas_used"] == 5
    with pytest.raises(
        ConfigError, match=r"need at least 2 replicas .* raise planner replica_slots"
    ):
        simulate_run(tiny_spec("eplb", n_devices=3, lanes=True, replica_slots=0))


def test_eplb_load_matrix_of_wrong_shape(tmp_path):
    bad = tmp_path / "load.npy"
    np.save(bad, np.ones((3, 4)))  # tiny has 2 MoE layers
    with pytest.raises(ConfigError, match=r"shape \(3, 4\).*\[2 MoE layers, 4 experts\]"):
        simulate_run(tiny_spec("eplb", initial_load=str(bad)))


@pytest.mark.parametrize(
    "values, match",
    [(np.full((2, 4), np.nan), r"finite counts >= 0.*8 NaN"), (-np.ones((2, 4)), "min -1.0"),
     (np.array([["a"] * 4] * 2), "not numbers")],
)  # fmt: skip
def test_eplb_load_matrix_that_is_no_load(values, match, tmp_path):
    """A load matrix of the right shape but no loads in it (NaN, negative, text) is
    refused, not turned into a placement."""
    bad = tmp_path / "load.npy"
    np.save(bad, values)
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec("eplb", initial_load=str(bad)))


def test_cli_exits_non_zero_with_one_line(tmp_path):
    cmd = [sys.executable, "-m", "experiments.run", "model=tiny", "hardware=tiny", "workload=tiny",
           "planner=predictive_replication", "+planner.params.replicas=9", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: planner replicas=9 exceeds")


class _MaxCost:
    """Stand-in cost model: an op takes max(flops, touch_bytes) seconds (1 flop/s, 1 B/s, no overhead)."""

    def compute_s(self, device, kind, flops, touch_bytes, share=1.0):
        return max(flops, touch_bytes) / share

    def compute_vec(self, device, kind, flops, touch, share=1.0):
        return np.maximum(flops, touch) / share


def _timer(copy_s: float = 0.0) -> ExpertTime:
    """One token = 1 flop, one expert = 1 byte: a device takes max(its tokens, its distinct experts) s."""
    return ExpertTime(_MaxCost(), 1.0, 1, True, copy_s)  # type: ignore[arg-type]


LAY = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=2, lanes=True)


def test_gate_keeps_the_fastest_prefix_of_greedy_copies():
    """Homes dev0 {0, 2}, dev1 {1, 3}; load [8, 1, 1, 1]: dev0 max(9, 2) = 9 s, dev1 2 s. Copy
    expert 0 to dev1: dev0 4 + 1 = 5 s, dev1 1 + 1 + 4 = 6 s. Expert 0 can go nowhere else, so
    the next copy is expert 1 onto dev0's free slot: 4 + 1 + 0.5 = 5.5 s on both: kept, the
    fastest of the prefixes (9, 6, 5.5 s)."""
    slots = replicate_onto(np.array([8.0, 1, 1, 1]), LAY, gate="time", timer=_timer())
    assert slots.tolist() == [[0, 2, 1], [1, 3, 0]]


def test_rehoming_gate_charges_both_placements_their_copies():
    """Copies take 10 s. Resident: dev0 {0, 1, 3}, dev1 {2, 3, 1}; load [6, 1, 5, 2]. Moving
    the homes to dev0 {0, 3}, dev1 {2, 1} needs no copy: 8 s. Keeping them with re-chosen
    replicas (dev0 + 2, dev1 + 0) takes 7.5 s but a copy on each device, 2.5 s of it late:
    10 s. The move pays; the gate charged only the move's copies and refused it."""
    rep = Replicator(ReplicaParams(gate="time+copy"), LAY, _timer(copy_s=10.0), [])
    old = np.array([[0, 1, 3], [2, 3, 1]])
    keep, new = np.array([[0, 1, 2], [2, 3, 0]]), np.array([[0, 3, -1], [2, 1, -1]])
    load = np.array([6.0, 1, 5, 2])
    assert rep.timer.span(new, load, None) == 8.0 and rep.timer.span(keep, load, None) == 7.5
    assert rep._pays(new, keep, old, load)
    assert not Replicator(ReplicaParams(gate="time"), LAY, _timer(10.0), [])._pays(
        new, keep, old, load
    )


def test_rehoming_takes_a_tie_that_balances_the_tokens():
    """Memory-bound: load [0.9, 0.1, 0.9, 0.1] on homes dev0 {0, 2}, dev1 {1, 3} gives 1.8 and
    0.2 tokens, each device 2 s (its two experts' bytes). Swapping experts 2 and 1 leaves both at
    2 s with 1.0 token each: the same time, balanced, so the re-homing takes it when its copies
    hide (copy_s 0.5 s behind a 2 s layer), and refuses it when they run late (copy_s 10 s)."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=0, replicas=0, lanes=False)
    load = np.array([0.9, 0.1, 0.9, 0.1])
    for copy_s, homes in ((0.5, [[0, 1], [2, 3]]), (10.0, [[0, 2], [1, 3]])):
        rep = Replicator(ReplicaParams(gate="time+copy"), lay, _timer(copy_s),
                         [np.array([[0, 2], [1, 3]])])  # fmt: skip
        rep.place(0, load)
        got = rep.place(0, load, home_load=load)
        assert sorted(map(sorted, got.tolist())) == homes, copy_s
        assert rep.homes[0].tolist() == got.tolist()


class _SpanTimer:
    """Stand-in for `ExpertTime` in `Replicator._pays`: given spans and copy queues per placement."""

    def __init__(self, copy_s: float, spans: dict, queues: dict) -> None:
        self.copy_s, self.spans, self.queues = copy_s, spans, queues

    def span(self, slots, load, scenarios):
        return self.spans[slots.tobytes()]

    def queue(self, slots, resident):
        return self.queues[slots.tobytes()]

    def late_copy_s(self, queue, layer_s):
        return max(0.0, queue * self.copy_s - layer_s)


def test_late_copies_do_not_hide_a_slower_span_in_a_tie():
    """Under time+copy a side whose copies run late totals its copy queue (10 copies of 0.2 s
    behind a 1.0 s or 0.9 s layer: 2 s either way). The totals tie, but the move's busiest
    device is slower (1.0 s against 0.9): refused, though it holds fewer peak tokens (5 against
    7). With the spans tied too, the tokens decide; under gate time (no copies charged) the
    slower span loses outright. Before, the tokens decided on the totals' tie alone."""
    keep, new, old = np.array([[0, 1], [2, 3]]), np.array([[0, 2], [1, 3]]), np.zeros((2, 2), int)
    load = np.array([4.0, 3, 1, 0])
    for spans, pays in (((1.0, 0.9), False), ((0.9, 0.9), True)):
        timer = _SpanTimer(0.2, {new.tobytes(): spans[0], keep.tobytes(): spans[1]},
                           {new.tobytes(): 10, keep.tobytes(): 10})  # fmt: skip
        for gate in ("time+copy", "time"):
            rep = Replicator(ReplicaParams(gate=gate), LAY, timer, [keep])  # type: ignore[arg-type]
            assert rep._pays(new, keep, old, load) is pays, (spans, gate)


def test_polish_moves_a_replica_the_greedy_misplaced():
    """Homes dev0 {0, 1}, dev1 {2, 3}, one replica slot each, budget 1; load [6, 6, 1, 1]. A
    replica of expert 2 on dev0 (a poor greedy choice) leaves dev0 at 12.5; polish moves the slot
    to expert 0 or 1 on dev1: 3 + 6 = 9 on dev0 and 3 + 1 + 1 = 5 on dev1."""
    lay = Layout(n_devices=2, n_experts=4, home_slots=2, replica_slots=1, replicas=1, lanes=True)
    bad = np.array([[0, 1, 2], [2, 3, -1]])
    out = polish(bad, np.array([6.0, 6, 1, 1]), lay)
    assert out[:, :2].tolist() == [[0, 1], [2, 3]]  # homes stay
    assert out[1, 2] in (0, 1) and out[0, 2] == -1 and (out[:, 2] >= 0).sum() == 1


def test_gate_declines_a_replica_in_a_memory_bound_layer():
    """Load [2, 1, 1, 1]: dev0 max(3, 2) = 3 s, dev1 2 s. Copying expert 0 to dev1 gives dev0
    max(2, 2) = 2 s but dev1 max(3, 3) = 3 s (one more expert's bytes): not sooner, declined;
    the ungated greedy would have placed it."""
    load = np.array([2.0, 1, 1, 1])
    assert replicate_onto(load, LAY, gate="time", timer=_timer()).tolist() == [
        [0, 2, -1],
        [1, 3, -1],
    ]
    assert replicate_onto(load, LAY)[1].tolist() == [1, 3, 0]


def test_gate_charges_only_copies_not_already_resident():
    """As the first gate test, with a 10 s copy, of which one layer's time (6 s) hides behind the
    other layers: 6 + (10 - 6) >= 9, declined unless dev1 already holds expert 0 (no copy
    needed), or when no residency is known (the first placement is preloaded)."""
    load, t = np.array([8.0, 1, 1, 1]), _timer(copy_s=10.0)
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    held = np.array([[0, 2, -1], [1, 3, 0]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == -1
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=held)[1, 2] == 0
    assert replicate_onto(load, LAY, gate="time+copy", timer=t)[1, 2] == 0


def test_copy_hidden_within_one_layer_is_free():
    """A 4 s copy against a 6 s layer runs behind the other layers: no charge; the excess of a
    longer queue is charged."""
    t = _timer(copy_s=4.0)
    assert t.late_copy_s(1, 6.0) == 0.0
    assert t.late_copy_s(2, 6.0) == 2.0
    load = np.array([8.0, 1, 1, 1])
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == 0


def test_copies_that_hold_sms_are_charged_even_when_hidden():
    """Copies by NCCL's p2p kernels (`copy_sm_share` of the SMs) slow the compute beside them:
    at a quarter, a hidden 4 s copy costs 1 s, two of them 2 s plus the 2 s they run late. In the
    first gate test's layer (9 s; two copies, one a device, make it 5.5 s) the copies are taken
    at a quarter (5.5 + 1) and declined at 0.9 (5.5 + 3.6, and one copy alone 6 + 3.6: past 9)."""
    t = replace(_timer(copy_s=4.0), copy_sm_share=0.25)
    assert t.late_copy_s(1, 6.0) == 1.0
    assert t.late_copy_s(2, 6.0) == 2.0 + 2.0
    load = np.array([8.0, 1, 1, 1])
    empty = np.array([[0, 2, -1], [1, 3, -1]])
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == 0
    t = replace(t, copy_sm_share=0.9)
    assert replicate_onto(load, LAY, gate="time+copy", timer=t, resident=empty)[1, 2] == -1


def test_grouped_gemm_is_one_op_per_device_and_layer():
    """grouped_gemm: one expert op per (step, layer, batch, device), reading the weights of the
    distinct experts it serves; per-expert mode: one op per (device, expert), same tokens."""
    grouped = simulate_run(tiny_spec("ep_static", lanes=True, grouped_gemm=True))
    loop = simulate_run(tiny_spec("ep_static", lanes=True, grouped_gemm=False))
    keys = ["step", "layer", "batch", "resource"]
    ex_g, ex_l = (
        r.trace[r.trace["kind"].astype(str) == str(OpKind.EXPERT)] for r in (grouped, loop)
    )
    assert ex_g.groupby(keys, observed=True).size().max() == 1
    assert len(ex_l) > len(ex_g)
    assert ex_g["tokens"].sum() == ex_l["tokens"].sum()
    n_busy = ex_l.groupby(keys, observed=True).size()  # distinct experts per device and layer
    g_ops = [o for o in grouped.schedule.ops if o.kind == OpKind.EXPERT]
    l_ops = [o for o in loop.schedule.ops if o.kind == OpKind.EXPERT]
    assert (
        sum(o.touch_bytes for o in g_ops)
        == sum(o.touch_bytes for o in l_ops)
        == len(l_ops) * l_ops[0].touch_bytes
    )
    assert len(n_busy) == len(g_ops)


def test_utilisation_is_busy_over_makespan_and_phase_util_is_separate():
    """Device 0: expert [0, 3] s then attention [3, 4] s; device 1: expert [0, 1] s. Makespan 4 s:
    utilisation = (4 + 1) / (2 x 4) = 5/8; expert phase [0, 3]: phase util = (3 + 1) / (2 x 3)."""
    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)], "resource": ["gpu", "gpu:1", "gpu"],
        "step": [0, 0, 0], "layer": [1, 1, 2], "batch": [0, 0, 0], "tokens": [30, 10, 40],
        "start_s": [0.0, 0.0, 3.0], "end_s": [3.0, 1.0, 4.0],
    })  # fmt: skip
    m = balance_metrics(trace, 2)
    assert m["utilisation"] == pytest.approx(5 / 8)
    assert m["expert_phase_util"] == pytest.approx(4 / 6)
    assert m["device_busy_frac"] == pytest.approx([1.0, 0.25], abs=1e-4)


def test_on_lanes_a_whole_gpu_op_keeps_every_lane_busy():
    """Lanes (2 partitions of one GPU): expert [0, 3] s on lane 0, [0, 1] s on lane 1, then
    attention [3, 4] s on the whole GPU (stream `compute`). Utilisation = (3 + 1 + 1 + 1) / (2 x 4);
    as 2 GPUs (the attention on GPU 0 alone) it is (3 + 1 + 1) / (2 x 4)."""
    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)], "resource": ["gpu", "gpu:1", "gpu"],
        "stream": ["lane0", "lane1", "compute"], "step": [0, 0, 0], "layer": [1, 1, 2],
        "batch": [0, 0, 0], "tokens": [30, 10, 40], "start_s": [0.0, 0.0, 3.0], "end_s": [3.0, 1.0, 4.0],
    })  # fmt: skip
    assert balance_metrics(trace, 2, lanes=True)["utilisation"] == pytest.approx(6 / 8)
    assert balance_metrics(trace, 2, lanes=True)["device_busy_frac"] == pytest.approx([1.0, 0.5])
    assert balance_metrics(trace, 2)["utilisation"] == pytest.approx(5 / 8)


def test_gpu_load_is_the_time_some_kernel_runs_per_gpu():
    """GPUtil's load. Lanes: one GPU, some kernel runs in [0, 3.5] and [4, 5] of 5 s (lane 0
    [0, 3], lane 1 [0, 1] and [2.5, 3.5], whole GPU [4, 5]): 4.5 / 5, while the lanes' mean busy
    time is (3 + 1 + 1 + 1 + 1) / (2 x 5) = 0.7. As 2 GPUs: GPU 0 busy 4 of 5 s, GPU 1 2 of 5:
    load 0.6, the same as utilisation."""
    trace = pd.DataFrame({
        "kind": [str(OpKind.EXPERT)] * 3 + [str(OpKind.ATTENTION)],
        "resource": ["gpu", "gpu:1", "gpu:1", "gpu"], "stream": ["lane0", "lane1", "lane1", "compute"],
        "step": [0] * 4, "layer": [1, 1, 3, 2], "batch": [0] * 4, "tokens": [30, 10, 10, 40],
        "start_s": [0.0, 0.0, 2.5, 4.0], "end_s": [3.0, 1.0, 3.5, 5.0],
    })  # fmt: skip
    lanes = balance_metrics(trace, 2, lanes=True)
    assert lanes["gpu_load"] == pytest.approx(4.5 / 5)
    assert lanes["utilisation"] == pytest.approx(0.7)
    gpus = balance_metrics(trace, 2)
    assert gpus["gpu_load"] == pytest.approx(0.6) == gpus["utilisation"]
    # GPU 1 receives tokens over its link in [1, 2] (a dispatch kernel) and gets a replica copy
    # in [3.5, 5] (the copy engine): load (4 + 3) / 10, utilisation unchanged
    moves = pd.DataFrame({
        "kind": [str(OpKind.DISPATCH), str(OpKind.LOAD)], "resource": ["p2p:1", "p2p:1"],
        "stream": ["dispatch1", "replicas1"], "step": [0, 0], "layer": [1, 1], "batch": [0, 0],
        "tokens": [10, 0], "start_s": [1.0, 3.5], "end_s": [2.0, 5.0],
    })  # fmt: skip
    both = pd.concat([trace, moves.assign(tensor=[str(Tensor.HIDDEN), str(Tensor.EXPERT)])],
                     ignore_index=True)  # fmt: skip
    gpus = balance_metrics(both, 2)
    assert gpus["gpu_load"] == pytest.approx(0.7) and gpus["utilisation"] == pytest.approx(0.6)
    # moved by NCCL's p2p kernels instead (gpu.copy_sms): the copy is load too, (4 + 4.5) / 10
    nccl = balance_metrics(both, 2, copy_kernels=True)
    assert nccl["gpu_load"] == pytest.approx(0.85) and nccl["utilisation"] == pytest.approx(0.6)


def test_lanes_partition_one_gpu_and_dense_work_runs_on_all_of_it():
    """G = 2 lanes: each expert op runs on its lane's stream at half the GPU (roofline x 2 plus
    one overhead), and every dense op is one whole-GPU op over the batch's tokens on `compute`;
    as 2 GPUs the dense work is split over the devices' sequences instead."""
    from core.cost import CostModel

    spec = tiny_spec("ep_static", lanes=True)
    res = simulate_run(spec)
    cost, sched = CostModel(spec.hardware), res.schedule
    ex = [o for o in sched.ops if o.kind == OpKind.EXPERT]
    assert {sched.streams[o.stream].name for o in ex} == {"lane0", "lane1"}
    assert {sched.streams[o.stream].share for o in ex} == {0.5}
    t = res.trace.set_index("op_id")
    for o in ex:
        half = cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes, 0.5)
        assert t.loc[o.id, "end_s"] - t.loc[o.id, "start_s"] == pytest.approx(half)
        full = cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes)
        assert half > full
    whole = simulate_run(tiny_spec("ep_static", lanes=True, lane_share=1.0))  # the whole GPU each
    o = next(o for o in whole.schedule.ops if o.kind == OpKind.EXPERT)
    w = whole.trace.set_index("op_id").loc[o.id]
    assert w["end_s"] - w["start_s"] == pytest.approx(
        cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes)
    )
    dense = [o for o in sched.ops if o.kind in COMPUTE_KINDS and o.kind != OpKind.EXPERT]
    assert {o.stream for o in dense} == {"compute"}
    attn = [o for o in dense if o.kind == OpKind.ATTENTION]
    assert all(o.tokens == 2 * (8 if o.step == 0 else 1) for o in attn)  # batch 2, prompt 8
    gpus = simulate_run(tiny_spec("ep_static")).schedule
    attn_g = [o for o in gpus.ops if o.kind == OpKind.ATTENTION]
    assert len(attn_g) == 2 * len(attn) and {o.tokens for o in attn_g} == {8, 1}


def test_gap_line_says_in_words_when_the_oracle_is_not_faster():
    st, pr, orc = ({"makespan_s": s} for s in (0.010, 0.009, 0.011))
    line = gap_line("c", 8, st, pr, orc)
    assert "nan" not in line and "no gap to close" in line and "predictive is faster" in line
    assert "closes 50%" in gap_line("c", 8, st, {"makespan_s": 0.0095}, {"makespan_s": 0.009})


def test_gap_line_does_not_judge_a_gap_within_noise():
    """An oracle 0.3% faster than ep_static (esft-g8 bs=8: 24.42 vs 24.34 ms) is no gap to
    close: [n/a ], not a PASS for closing 100% of it; 1% and up is judged."""
    st, orc = {"makespan_s": 0.02442}, {"makespan_s": 0.02434}
    line = gap_line("c", 8, st, dict(orc), orc)
    assert line.startswith("[n/a ]") and "0.33%" in line and "PASS" not in line
    assert gap_line("c", 8, st, dict(orc), orc, verdict=False).startswith("[note]")
    wide = {"makespan_s": 0.985 * 0.02442}
    assert gap_line("c", 8, st, dict(wide), wide).startswith("[PASS]")


def test_shared_lanes_share_the_gpus_sms_and_utilisation_reads_sm_time():
    """lane_sharing=shared: the lanes and the whole-GPU stream form one pool (share 1 each); an
    expert op's width is its GEMMs' 128 x 128 tiles (tiny: H 64, F 128, SwiGLU: the fused
    gate/up GEMM has 256 columns, 2 tiles per 128 rows; down 64 columns, 1 tile), averaged 2:1;
    utilisation and expert_phase_util count the whole-GPU seconds of work (`sm_s`), not the
    wall time the ops overlap; the work-conserving estimate is moot there."""
    from experiments.replication import work_conserving_s
    from planners.expert_parallel import POOL, expert_width

    spec = tiny_spec("predictive_replication", lanes=True, lane_sharing="shared", grouped_gemm=True)
    res = simulate_run(spec)
    sched, t = res.schedule, res.trace
    used = {o.stream for o in sched.ops if o.kind in COMPUTE_KINDS}
    assert used == {"lane0", "lane1", "compute"}
    assert {(sched.streams[s].pool, sched.streams[s].share) for s in used} == {(POOL, 1.0)}
    m = spec.model
    assert expert_width(m, [5]) == round((2 * 2 + 1) / 3)  # one expert, 5 rows
    assert expert_width(m, [5, 130]) == round((2 * 6 + 3) / 3)  # 1 + 2 row tiles
    ex = [o for o in sched.ops if o.kind == OpKind.EXPERT]
    assert ex and all(o.width >= 1 for o in ex)
    sm = t["sm_s"].to_numpy()
    pooled = t["kind"].astype(str).isin([str(k) for k in COMPUTE_KINDS]).to_numpy()
    assert not np.isnan(sm[pooled]).any() and np.isnan(sm[~pooled]).all()
    assert res.summary["utilisation"] == pytest.approx(sm[pooled].sum() / t["end_s"].max())
    phases = t[t["kind"].astype(str) == str(OpKind.EXPERT)].groupby(["step", "layer", "batch"])
    span = (phases["end_s"].max() - phases["start_s"].min()).sum()
    assert res.summary["expert_phase_util"] == pytest.approx(phases["sm_s"].sum().sum() / span)
    assert res.summary["plan"]["ep"]["lane_sharing"] == "shared"
    assert work_conserving_s(res, spec.hardware) is None
    with pytest.raises(ConfigError, match="lane_sharing='mps' unknown; valid: partition, shared"):
        simulate_run(tiny_spec("ep_static", lanes=True, lane_sharing="mps"))


def test_sharing_lines_compare_shared_lanes_with_partitioned_ones():
    from experiments.replication import sharing_lines

    def row(case, planner, ms, phase, sharing):
        return dict(case=case, planner=planner, model="m", batch_size=8, n_devices=2,
                    makespan_s=ms / 1e3, expert_phase_util=phase,
                    plan={"ep": {"lanes": True, "lane_sharing": sharing, "grouped_gemm": True}})  # fmt: skip

    rows = [row("p", "ep_static", 10, 0.5, "partition"), row("p", "predictive_replication", 8, 0.9, "partition"),
            row("s", "ep_static", 6, 0.95, "shared"), row("s", "predictive_replication", 6, 0.95, "shared")]  # fmt: skip
    assert sharing_lines(rows) == [
        "[note] s bs=8: lanes sharing the SMs: ep_static 6.00 ms (phase 0.950), predictive 6.00 ms "
        "(phase 0.950), gain 0.0%; partitioned (p): ep_static 10.00 ms (phase 0.500), predictive "
        "8.00 ms (phase 0.900), gain 20.0%"
    ]


def test_the_gate_weighs_shared_lanes_as_the_pool_runs_them():
    """On lanes that share the SMs the gate's span is the pool's makespan: two lanes each with
    one narrow kernel (3 tokens: one row tile, far from filling the GPU) run side by side, each
    its launch plus its work at its cap; two wide ones (4096 tokens each) share the GPU and
    take their work together plus one launch."""
    from core.cost import CostModel

    spec = tiny_spec("ep_static", lanes=True)
    m = spec.model
    raw = yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text())
    raw["gpu"].update(sms=16, overhead_us=1)
    cost = CostModel(HardwareSpec.from_dict(raw))
    timer = ExpertTime(cost, m.expert_flops(1), m.expert_bytes, True, 0.0, 1.0, m)
    slots = np.array([[0, 2], [1, 3]])
    over = cost.overhead_s(Resource.GPU, OpKind.EXPERT)
    for n, side_by_side in ((3, True), (4096, False)):
        load = np.array([n, n, 0.0, 0.0])
        work = cost.compute_s(Resource.GPU, OpKind.EXPERT, m.expert_flops(n), m.expert_bytes) - over
        cap = cost.cap(Resource.GPU, m.expert_flops(n), m.expert_bytes, expert_width(m, [n]))
        want = over + work / cap if side_by_side else over + 2 * work
        assert cap < 0.5 if side_by_side else cap == 1.0
        assert timer.span(slots, load, None) == pytest.approx(want)


def test_loop_lines_set_one_lane_beside_g_lanes():
    from experiments.replication import loop_lines

    def row(planner, n, util, ms, label=None):
        return dict(case="c", batch_size=16, planner=planner, planner_label=label or planner,
                    n_devices=n, utilisation=util, gpu_load=util + 0.1, makespan_s=ms / 1e3,
                    plan={"ep": {"lanes": True, "n_devices": n}})  # fmt: skip

    rows = [row("ep_static", 8, 0.7, 50), row("predictive_replication", 8, 0.75, 40),
            row("ep_static[1 lane]", 1, 0.15, 200)]  # fmt: skip
    assert loop_lines(rows) == [
        "[note] c bs=16: one lane (ep_static[1 lane]) -> 8 lanes (ep_static) -> with replicas "
        "(predictive): utilisation 0.150 -> 0.700 -> 0.750, GPU load 0.250 -> 0.800 -> 0.850, "
        "makespan 200.00 -> 50.00 -> 40.00 ms (5.00x)"
    ]
    assert loop_lines(rows[:2]) == []


def test_eplb_lines_set_predictive_beside_eplb_at_each_interval():
    from experiments.replication import eplb_lines

    def row(planner, bal, ms, copies, interval=None, bs=128, case="c"):
        plan = {"ep": {"copies": copies}, **({"eplb": {"interval": interval}} if interval else {})}
        return dict(case=case, batch_size=bs, n_batches=8, planner=planner, balancedness=bal,
                    makespan_s=ms / 1e3, plan=plan)  # fmt: skip

    rows = [row("eplb[interval=8]", 0.95, 64.0, 0, 8), row("eplb", 0.97, 68.0, 4000, 2),
            row("predictive_replication", 0.97, 65.0, 1200), row("eplb", 0.5, 9.0, 9, 2, bs=8),
            row("ep_static", 0.8, 74.0, 0)]  # fmt: skip
    assert eplb_lines(rows, ["c", "absent"]) == [
        "[note] c bs=128: eplb re-placing every 2 batches 0.9700 / 68.00 ms / 4000 copies, never in "
        "8 batches 0.9500 / 64.00 ms / 0 copies; predictive 0.9700 / 65.00 ms / 1200 copies: at "
        "least as balanced as eplb's most balanced, slower than its fastest"
    ]
    rows[2].update(balancedness=0.96, makespan_s=0.063)
    assert eplb_lines(rows, ["c"])[0].endswith(
        "less balanced than eplb's most balanced, at least as fast as its fastest"
    )
    assert eplb_lines(rows[1:], ["c"]) == []  # eplb at one interval only
    rows.append(row("oracle_replication", 0.99, 64.0, 900))  # with the oracle: the gap each closes
    line = eplb_lines(rows, ["c"])[0]
    assert "8 batches 0.9500 / 64.00 ms / 0 copies, closes 100% of the gap" in line
    assert "every 2 batches 0.9700 / 68.00 ms / 4000 copies, closes 60% of the gap" in line
    rows[-1].update(makespan_s=0.07395)  # a gap of 0.05 ms: no shares, its size instead
    line = eplb_lines(rows, ["c"])[0]
    assert "closes" not in line and line.endswith(
        "(the ep_static -> oracle gap is 0.05 ms, under 1%)"
    )


def test_prediction_lines_order_the_planners_by_their_distance_from_the_truth():
    from experiments.replication import prediction_lines

    def row(planner, tv, bal, ms, bs=32):
        return dict(case="c", batch_size=bs, planner=planner, balancedness=bal, makespan_s=ms / 1e3,
                    plan={"ep": {} if tv is None else {"prediction_tv": tv}})  # fmt: skip

    rows = [row("ep_static", None, 0.77, 10.83), row("eplb", None, 0.912, 15.33),
            row("oracle_replication", 0.0, 0.936, 10.19), row("predictive_replication", 0.082, 0.8975, 10.28),
            row("oracle_replication[truth=0.5]", 0.037, 0.911, 10.23),
            row("predictive_replication", 0.5, 0.5, 99.0, bs=8)]  # fmt: skip
    assert prediction_lines(rows, ["c", "absent"], {"c": 32}) == [
        "[note] c bs=32: distance of the load planned from to each batch's (mean total variation) "
        "-> balancedness / makespan: predictive_replication 0.082 -> 0.8975 / 10.28 ms; "
        "oracle_replication[truth=0.5] 0.037 -> 0.9110 / 10.23 ms; oracle_replication 0.000 -> "
        "0.9360 / 10.19 ms; eplb 0.9120 / 15.33 ms"
    ]
    assert prediction_lines(rows, ["c"], {})[0].startswith("[note] c bs=32:")  # else the largest
    assert prediction_lines(rows[2:], ["c"], {"c": 32}) == []  # no eplb to set them beside


def test_targets_are_judged_where_no_held_out_token_runs_twice():
    """A 1,000-token split and 8 batches of 4-token sequences: bs=16 (512 tokens) is fresh, bs=64
    wraps. The verdicts are at 16; 64 is a note that says it revisits; without a fresh batch the
    verdicts are at the largest and say so."""
    from experiments.replication import fresh_batch, targets

    case = dict(prompt_len=4, n_batches=8, batch_sizes=[1, 16, 64])
    assert fresh_batch(case, 1000) == 16 and fresh_batch(case, 10) is None

    def row(planner, bs, bal, ms):
        return dict(case="c", batch_size=bs, planner=planner, balancedness=bal, makespan_s=ms,
                    expert_phase_util=1.0, utilisation=1.0, gpu_load=1.0)  # fmt: skip

    rows = [row(p, bs, bal + (0.1 if bs == 64 else 0), ms)
            for bs in (16, 64)
            for p, bal, ms in (("ep_static", 0.7, 10.0), ("eplb", 0.9, 9.0),
                               ("oracle_replication", 0.95, 8.0),
                               ("predictive_replication", 0.85 if bs == 16 else 0.95, 9.5))]  # fmt: skip
    lines = [ln for ln in targets(rows, ["c"], fresh={"c": 16}) if ln[7:].startswith("c bs=")]
    assert lines[:2] == [
        "[FAIL] c bs=16: predictive balancedness 0.8500 < eplb 0.9000",
        "[FAIL] c bs=16: predictive closes 25% of the ep_static -> oracle makespan gap "
        "(ep_static 10000.00 ms, oracle 8000.00 ms, predictive 9500.00 ms); target >= 50%",
    ]
    assert lines[2] == (
        "[note] c bs=64 (revisits held-out tokens): predictive balancedness 1.0500 >= eplb 1.0000"
    )
    assert lines[3].startswith("[note] c bs=64 (revisits held-out tokens): predictive closes 25%")
    assert len(lines) == 4
    wrapped = [ln for ln in targets(rows, ["c"], fresh={"c": None}) if ln[7:].startswith("c bs=")]
    assert wrapped[0].startswith("[PASS] c bs=64 (revisits held-out tokens): predictive")
    assert len(wrapped) == 2
    # a case not held-out ESFT (absent from `fresh`): judged at its largest, nothing revisited
    other = [ln for ln in targets(rows, ["c"], fresh={}) if ln[7:].startswith("c bs=")]
    assert other[0].startswith("[PASS] c bs=64: predictive") and len(other) == 2


def test_a_case_can_set_its_own_kernels_and_variants(tmp_path):
    """cases.<name>.grouped_gemm and .variants (beside the global ones) reach the runs; a case
    variant naming an unknown planner is refused before anything runs."""
    from omegaconf import OmegaConf

    from experiments.replication import case_model, check_inputs, run_case

    cfg = OmegaConf.load("conf/experiment/replication.yaml")
    case = OmegaConf.create(dict(model="tiny", routing="synthetic_olmoe_top1", n_devices=2,
                                 lanes=True, lane_sharing="shared", grouped_gemm=False,
                                 batch_sizes=[2], prompt_len=8, n_batches=2,
                                 planners={"predictive_replication": {"predictor": "window"}},
                                 variants={"ep_static[1 lane]": {"planner": "ep_static",
                                                                 "params": {"n_devices": 1}},
                                           "orc": {"planner": "oracle_replication",
                                                   "params": {"gate": "none"}}}))  # fmt: skip
    cfg.variants = {}
    prep = {"switch_routing": {case_model(case).n_experts: RoutingConfig(source="synthetic")}}
    cfg.write_traces = True
    rows = run_case(cfg, "t", case, prep, tmp_path)
    one = [r for r in rows if r["planner"] == "ep_static[1 lane]"]
    assert len(one) == 1 and one[0]["plan"]["ep"]["n_devices"] == 1
    # a variant of the oracle keeps its upper-bound label
    assert [r["planner_label"] for r in rows if r["planner"] == "orc"] == [
        "orc (oracle upper bound)"
    ]
    # a rerun under other params and without traces leaves no trace of the earlier run
    assert (tmp_path / "t" / "bs2" / "eplb" / "trace.parquet").exists()
    cfg.write_traces = False
    cfg.planners.eplb.window = 1
    run_case(cfg, "t", case, prep, tmp_path)
    assert not (tmp_path / "t" / "bs2" / "eplb" / "trace.parquet").exists()
    assert not (tmp_path / "t" / "bs2" / "eplb" / "trace.json").exists()
    assert all(r["plan"]["ep"]["grouped_gemm"] is False for r in rows)
    assert {r["plan"]["ep"]["lane_sharing"] for r in rows} == {"shared"}
    case.variants = {"x": {"planner": "nope"}}
    cfg.cases = {"t": case}  # a copy of the node
    with pytest.raises(MoepipeError, match=r"cases.t.variants.x.planner='nope'; valid: ep_static"):
        check_inputs(cfg)


def test_a_case_sets_its_planners_params_between_the_configs_and_a_variants(tmp_path):
    """cases.<name>.planners overrides the config's params of that planner, in its own row and in
    its variants' (whose own params win); a planner name it does not know is refused first."""
    from omegaconf import OmegaConf

    from experiments.replication import case_model, check_inputs, run_case

    cfg = OmegaConf.load("conf/experiment/replication.yaml")
    case = OmegaConf.create(dict(model="tiny", routing="synthetic_olmoe_top1", n_devices=2,
                                 lanes=True, batch_sizes=[2, 3], prompt_len=8, n_batches=2,
                                 planners={"predictive_replication": {"predictor": "ema",
                                                                      "window": 3}},
                                 variants={"p[last]": {"planner": "predictive_replication",
                                                       "params": {"predictor": "last"}}}))  # fmt: skip
    cfg.variants = {}
    prep = {"switch_routing": {case_model(case).n_experts: RoutingConfig(source="synthetic")}}
    rows = run_case(cfg, "t", case, prep, tmp_path)
    for bs in (2, 3):  # every batch size alike
        by = {r["planner"]: r["params"] for r in rows if r["batch_size"] == bs}
        own, var = by["predictive_replication"], by["p[last]"]
        assert (own["predictor"], own["window"], own["gate"]) == ("ema", 3, "time+copy")
        assert (var["predictor"], var["window"]) == ("last", 3)
        assert by["eplb"]["window"] == cfg.planners.eplb.window  # other planners: as before
    case.planners = {"predictive": {"predictor": "ema"}}
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t.planners.predictive: unknown planner; valid"):
        check_inputs(cfg)
    # synthetic routing has no request tasks: task_mix there, in a row or a variant, is refused
    case.planners = {"predictive_replication": {"predictor": "window"}}
    case.variants = {"p[tm]": {"planner": "predictive_replication",
                               "params": {"predictor": "task_mix"}}}  # fmt: skip
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t: p\[tm\] has predictor task_mix, which reads "
                       r"each request's task, but synthetic_olmoe_top1 routing has none; drop "
                       r"that variant, or move it to the ESFT cases' variants"):  # fmt: skip
        check_inputs(cfg)
    case.variants = {}
    case.planners = {"predictive_replication": {"predictor": "task_mix"}}
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t: predictive_replication has predictor "
                       r"task_mix.*; set cases.t.planners.predictive_replication.predictor=window"):  # fmt: skip
        check_inputs(cfg)
    case.planners = {"predictive_replication": "window"}
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t.planners.predictive_replication='window': "
                       r"must be a mapping"):  # fmt: skip
        check_inputs(cfg)
    # G larger than the experts: one line before any case runs (it came when the case's turn
    # came, after the earlier cases' runs, naming the planner's param)
    case.planners, case.n_devices = {}, 5
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t.n_devices=5 gives 5 devices, more than "
                       r"tiny's 4 experts; set it to at most 4"):  # fmt: skip
        check_inputs(cfg)
    case.n_devices, cfg.hardware_profile = 0, "h200-hgx8"  # 0: the profile's 8 GPUs
    cfg.cases = {"t": case}
    with pytest.raises(MoepipeError, match=r"cases.t.n_devices=0 gives 8 devices"):
        check_inputs(cfg)


def test_runs_get_the_training_files_their_predictor_reads():
    """On held-out ESFT the experiment's predictive (task_mix) gets the per-task loads and the
    prior scenarios' hedge; its `[window]` variant gets exactly the params the experiment's
    predictive had before task_mix (the hedge, no per-task loads); the Switch cases' window gets
    neither."""
    from omegaconf import OmegaConf

    from experiments.replication import run_params

    cfg = OmegaConf.load("conf/experiment/replication.yaml")
    out, training = Path(cfg.out_dir), (Path("l.npy"), Path("t.npy"))
    case = cfg.cases["esft-g8-b32"]
    own = dict(cfg.planners.predictive_replication)
    pred = run_params(cfg, "esft-g8-b32", case, "predictive_replication", own, training, out)
    assert pred["predictor"] == "task_mix"
    assert pred["task_load"] == str(out / "esft_train_task_load.npy")
    assert pred["prior_scenarios"] == str(out / "esft_train_groups.npy")
    window = {**own, **dict(case.variants["predictive_replication[window]"].params)}
    win = run_params(cfg, "esft-g8-b32", case, "predictive_replication", window, training, out)
    before = dict(n_devices=8, lanes=False, grouped_gemm=True, dispatch="even", replica_slots=2,
                  initial_load="l.npy", table="t.npy", predictor="window", window=4,
                  prior_weight=2, gate="time+copy", rehome_interval=1,
                  prior_scenarios=str(out / "esft_train_groups.npy"))  # fmt: skip
    assert win == before
    switch = cfg.cases["switch-base-128-g8"]
    own = {**own, **dict(switch.planners.predictive_replication)}
    sw = run_params(cfg, "switch-base-128-g8", switch, "predictive_replication", own, training, out)
    assert sw["predictor"] == "window" and not {"task_load", "prior_scenarios"} & set(sw)


def test_lane_share_outside_zero_one_is_a_config_error():
    with pytest.raises(ConfigError, match=r"lane_share=1.5 must be in \[0, 1\]"):
        simulate_run(tiny_spec("ep_static", lanes=True, lane_share=1.5))


def test_unknown_gate_is_a_config_error():
    with pytest.raises(ConfigError, match="gate='fast' unknown"):
        simulate_run(tiny_spec("oracle_replication", gate="fast"))


def test_predictor_starts_from_the_prior_and_scales_shares_to_the_iteration():
    """Prior [1, 4] load [6, 2, 1, 1]: iteration 0 is predicted as its shares x that iteration's
    selections (20 -> [12, 4, 2, 2]) with no gate to wait for; after observing counts [0, 0, 5, 5]
    the EMA (alpha 0.5) holds shares [0.3, 0.1, 0.3, 0.3], scaled to the next iteration's 10."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    p = PredictiveParams(predictor="ema", ema_alpha=0.5)
    sel = {0: 20.0, 1: 10.0}
    pred = LoadPredictor(p, 1, 4, sel.__getitem__, np.array([[6.0, 2, 1, 1]]))
    load, used = pred.predict(0, 0)
    assert load.tolist() == pytest.approx([12, 4, 2, 2]) and used == ()
    pred.observe(0, 0, GateView(np.array([[2], [3]]), np.array([0, 0, 5, 5])), gates=(7,))
    load, used = pred.predict(1, 0)
    assert load.tolist() == pytest.approx([3, 1, 3, 3]) and used == (7,)


def test_gate_on_scenarios_keeps_a_copy_the_prediction_alone_declines():
    """Load [2, 1, 1, 1] alone: copying expert 0 leaves the busiest device at 3 s, declined (as
    above). Judged also on a scenario where expert 0 takes 6: no copy 3 and 7 s (mean 5); expert 0
    onto dev1 3 and 5 s (dev0 3 + 1, dev1 1 + 1 + 3), mean 4; then expert 1 onto dev0 3 and
    4.5 s, mean 3.75: both kept. A scenario equal to the prediction changes nothing."""
    load = np.array([2.0, 1, 1, 1])
    hedged = replicate_onto(load, LAY, gate="time", timer=_timer(),
                            scenarios=np.array([load, [6.0, 1, 1, 1]]))  # fmt: skip
    assert hedged.tolist() == [[0, 2, 1], [1, 3, 0]]
    same = replicate_onto(load, LAY, gate="time", timer=_timer(), scenarios=np.array([load, load]))
    assert same.tolist() == [[0, 2, -1], [1, 3, -1]]


def test_window_predictor_is_the_mean_share_of_the_last_iterations():
    """window=2: before any iteration the prior's shares; then the mean share of the last two
    observed iterations (the oldest dropped), scaled to the iteration's selections; homes are
    packed by the same mean. The prior scenarios are used only before the first observation."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    p = PredictiveParams(predictor="window", window=2)
    pred = LoadPredictor(p, 1, 4, lambda t: 8.0, np.array([[1.0, 1, 1, 1]]))
    pred.prior_scen = np.array([[[0.5, 0.5, 0, 0]]])  # [S=1, L=1, E=4] shares
    load, _ = pred.predict(0, 0)
    assert load.tolist() == [2, 2, 2, 2]
    assert pred.scenarios(0, load).tolist() == [[2, 2, 2, 2], [4, 4, 0, 0]]
    for t, counts in enumerate(([4, 0, 0, 0], [0, 4, 0, 0], [0, 0, 4, 0])):
        view = GateView(np.zeros((1, 1), dtype=np.int64), np.array(counts))
        pred.observe(t, 0, view, gates=(10 + t,))
    load, used = pred.predict(3, 0)
    assert load.tolist() == [0, 4, 4, 0] and used == (12,)
    assert pred.home_share(0).tolist() == [0, 0.5, 0.5, 0]
    assert pred.scenarios(0, load) is None


def test_window_predictor_keeps_the_prior_as_prior_weight_iterations():
    """Prior shares [0.5, 0.5, 0, 0] weighted as 2 iterations, one observed share [0, 0, 1, 0]:
    (2 x prior + observed) / 3 = [1/3, 1/3, 1/3, 0], scaled to the 6 selections; homes are packed
    by the same share. Without the weight the one observation alone ([0, 0, 6, 0])."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    view = GateView(np.zeros((1, 1), dtype=np.int64), np.array([0, 0, 4, 0]))
    prior = np.array([[3.0, 3, 0, 0]])
    for weight, want in ((2.0, [2, 2, 2, 0]), (0.0, [0, 0, 6, 0])):
        p = PredictiveParams(predictor="window", window=4, prior_weight=weight)
        pred = LoadPredictor(p, 1, 4, lambda t: 6.0, prior)
        pred.observe(0, 0, view, gates=(1,))
        assert pred.predict(1, 0)[0].tolist() == pytest.approx(want)
        assert (pred.home_share(0) * 6).tolist() == pytest.approx(want)
    # a layer without a prior (an all-zero row) is the window's mean alone, not shrunk by it
    p = PredictiveParams(predictor="window", window=4, prior_weight=2.0)
    pred = LoadPredictor(p, 2, 4, lambda t: 6.0, np.array([[3.0, 3, 0, 0], [0, 0, 0, 0]]))
    pred.observe(0, 1, view, gates=(1,))
    assert pred.predict(1, 1)[0].tolist() == pytest.approx([0, 0, 6, 0])
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"prior_weight=.*must be a finite number >= 0"):
            PredictiveParams(predictor="window", prior_weight=bad)


def test_task_mix_predicts_from_the_iterations_labels(tmp_path):
    """Per-label loads [3, 1, 0, 0] (shares [.75, .25, 0, 0]) and [0, 0, 2, 2] ([0, 0, .5, .5]);
    iteration 1's tokens labelled [0, 0, 0, 1]: (3 x the first + the second) / 4 = [.5625,
    .1875, .125, .125], times the 8 selections, with no gate to wait for (the labels are known
    when the batch forms); the homes are packed by the same share. Iteration 0 is planned from
    the prior, as the other predictors' first placement, loaded with the model before any
    request. A label never seen at a layer takes the prior's share there; a label beyond
    task_load's, or no task_load, or task_load without task_mix, is one error."""
    from planners.predictive_replication import (
        LoadPredictor,
        PredictedReplicas,
        PredictiveParams,
    )

    loads = np.array([[[3.0, 1, 0, 0], [0, 0, 0, 0]], [[0, 0, 2, 2], [1, 1, 1, 1]]])  # [2, L=2, 4]
    np.save(tmp_path / "tl.npy", loads)
    p = PredictiveParams(predictor="task_mix", task_load=str(tmp_path / "tl.npy"))
    labels = {0: np.array([1, 1, 1, 1]), 1: np.array([0, 0, 0, 1]), 2: np.array([0, 0, 0, 2])}
    prior = np.array([[1.0, 1, 1, 1], [4, 0, 0, 0]])
    pred = LoadPredictor(p, 2, 4, lambda t: 8.0, prior, labels.__getitem__)
    assert pred.predict(0, 0) == (pytest.approx(np.full(4, 2.0)), ())  # the prior, not labels
    load, used = pred.predict(1, 0)
    assert load.tolist() == pytest.approx([4.5, 1.5, 1, 1]) and used == ()
    # MoE layer 1: label 0 has no load there, so its tokens take the prior's [1, 0, 0, 0]
    assert pred.predict(1, 1)[0].tolist() == pytest.approx([6.5, 0.5, 0.5, 0.5])
    with pytest.raises(ConfigError, match="a request label 2 but task_load has 2 labels"):
        pred.predict(2, 0)

    class Homes:  # records what the homes are packed by
        def rehome_due(self, t):
            return True

        def place(self, moe, load, home_load, scenarios):
            self.home = home_load
            return np.zeros((2, 1), dtype=np.int64)

    rep = Homes()
    assert PredictedReplicas(rep, pred).place(1, 0)[1] == ()  # type: ignore[arg-type]
    assert rep.home.tolist() == pytest.approx([0.5625, 0.1875, 0.125, 0.125])
    with pytest.raises(ConfigError, match="predictor task_mix needs task_load="):
        PredictiveParams(predictor="task_mix")
    with pytest.raises(
        ConfigError, match="task_load is read only by predictor task_mix, not window"
    ):
        PredictiveParams(predictor="window", task_load=str(tmp_path / "tl.npy"))


def test_task_mix_learns_each_labels_share_online(tmp_path):
    """After iterations are seen, a label's share at a layer pools its tokens' selections over
    the last `window` iterations, the training share counted in as `prior_weight` times its mean
    selections an iteration; a label a window never saw keeps the training share; and the
    prediction waits for the previous iteration's gate there. window=2, prior_weight=1, top-1:
    label 0 trains as [1, 0, 0, 0]. Iteration 0: label 0's tokens pick experts [1, 1] (2
    selections); iteration 1: [1, 2, 2, 2] (4); iteration 2: [3, 3] (2), which drops iteration 0.
    After 0 and 1: seen [0, 3, 3, 0] over 6, strength 1 x 6 / 2 = 3: ([0, 3, 3, 0] + 3 x [1, 0,
    0, 0]) / 9. After 1 and 2 (window 2): seen [0, 1, 3, 2] over 6, the same strength."""
    from core.routing import GateView
    from planners.predictive_replication import LoadPredictor, PredictiveParams

    np.save(tmp_path / "tl.npy", np.array([[[5.0, 0, 0, 0]], [[0, 0, 0, 5]]]))  # [labels, L=1, E]
    p = PredictiveParams(predictor="task_mix", task_load=str(tmp_path / "tl.npy"), window=2,
                         prior_weight=1.0)  # fmt: skip
    labels = {0: np.array([0, 0, 1]), 1: np.array([0, 0, 0, 0]), 2: np.array([0, 0]),
              3: np.array([0, 1])}  # fmt: skip
    pred = LoadPredictor(p, 1, 4, lambda t: 9.0, np.ones((1, 4)), labels.__getitem__)
    picks = {0: [1, 1, 0], 1: [1, 2, 2, 2], 2: [3, 3]}  # label 1's token at iteration 0 picks 0
    for t, ids in picks.items():
        ids = np.array(ids)[:, None]
        pred.observe(t, 0, GateView(ids, np.bincount(ids.ravel(), minlength=4)), gates=(10 + t,))
        if t == 1:
            share = ([0, 3, 3, 0] + 3 * np.array([1.0, 0, 0, 0])) / 9
            np.testing.assert_allclose(pred.label_share(0)[0], share)
            # label 1: one selection (expert 0) in 2 iterations, strength 1 x 1 / 2
            np.testing.assert_allclose(pred.label_share(0)[1], [2 / 3, 0, 0, 1 / 3])
    np.testing.assert_allclose(
        pred.label_share(0)[0], ([0, 1, 3, 2] + 3 * np.array([1.0, 0, 0, 0])) / 9
    )
    np.testing.assert_allclose(pred.label_share(0)[1], [0, 0, 0, 1])  # not in the window: trained
    load, used = pred.predict(3, 0)  # labels [0, 1]: half each
    np.testing.assert_allclose(load, 9 * (pred.label_share(0)[0] + [0, 0, 0, 1]) / 2)
    assert used == (12,)


def test_task_mix_places_by_the_labels_and_needs_them(tmp_path):
    """The same routing under two labellings, each label's load making another expert hot: the
    first placement, loaded with the model, is the same under both (it is planned before any
    request); the second batch's holds that label's hot expert on both devices. A routing
    without labels (synthetic), or with another number of them than task_load, is one error."""
    from core.errors import TraceError
    from experiments.pipeline import build_schedule
    from tests.conftest import random_routing

    spec = tiny_spec("predictive_replication", lanes=True, replica_slots=1)
    e, n_moe = spec.model.n_experts, len(spec.model.moe_layers)
    loads = np.ones((2, n_moe, e))
    loads[0, :, 0], loads[1, :, 2] = 50, 50  # label 0: expert 0 hot; label 1: expert 2
    np.save(tmp_path / "tl.npy", loads)
    # every slot filled (no gate); the training shares outweigh the uniform routing seen
    spec = replace(spec, params={**spec.params, "predictor": "task_mix", "gate": "none",
                                 "prior_weight": 100.0, "task_load": str(tmp_path / "tl.npy")})  # fmt: skip
    base = random_routing(spec.model, spec.workload)
    slots = []
    for label in (0, 1):
        labelled = replace(base, labels=np.full(base.expert_ids.shape[:2], label, np.int16),
                           label_names=("a", "b"))  # fmt: skip
        slots.append(build_schedule(spec, labelled).meta["ep_slots"])
        assert all([0, 2][label] in row for row in slots[-1][(0, 1, 0)])  # batch 1: hot one
    assert slots[0][(0, 0, 0)] == slots[1][(0, 0, 0)]  # the first placement reads no labels
    assert slots[0][(0, 1, 0)] != slots[1][(0, 1, 0)]
    with pytest.raises(TraceError, match="predictor=task_mix needs each request's label"):
        build_schedule(spec, base)
    three = replace(base, labels=np.zeros(base.expert_ids.shape[:2], np.int16),
                    label_names=("a", "b", "c"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"task_load has 2 labels but the routing names 3 \(a, b"):
        build_schedule(spec, three)


def test_prior_scenarios_of_the_wrong_shape(tmp_path):
    bad = tmp_path / "groups.npy"
    np.save(bad, np.ones((3, 2, 5)))  # tiny has 2 MoE layers of 4 experts
    with pytest.raises(
        ConfigError,
        match=r"prior_scenarios .*shape \(3, 2, 5\).*\[scenarios >= 1, 2 MoE layers, 4\]",
    ):
        simulate_run(tiny_spec("predictive_replication", prior_scenarios=str(bad)))


def test_first_placement_fills_the_slots_when_that_is_no_slower():
    """The first placement is preloaded (no copy to pay for). Load [2, 1, 1, 1]: the gate alone
    places no replica (3 s either way, as above), EPLB's greedy fills both slots for the same
    3 s: taken. Load [0.5] x 4 is memory-bound: 2 distinct experts a device = 2 s, a third copy
    makes it 3 s: the gate's empty slots stay. Later placements are the gate's alone."""
    from planners.expert_parallel import ReplicaParams, Replicator

    def fresh() -> Replicator:
        return Replicator(ReplicaParams(gate="time"), LAY, _timer(), [LAY.round_robin()])

    rep = fresh()
    assert rep.place(0, np.array([2.0, 1, 1, 1])).tolist() == [[0, 2, 1], [1, 3, 0]]
    assert rep.place(0, np.array([2.0, 1, 1, 1])).tolist() == [[0, 2, -1], [1, 3, -1]]
    assert fresh().place(0, np.full(4, 0.5)).tolist() == [[0, 2, -1], [1, 3, -1]]


def test_swap_homes_by_hand():
    """G = 4, two homes each; experts 0 and 4 (load 10 each) share device 0 (home load 20, the
    others 2). The busiest device takes the first of its equally good swaps, expert 0 <-> expert 1
    of device 1 (delta 9: 11 and 11); the two left (2 and 2) have no swap that lowers their pair. Replica
    slots come back empty; every expert keeps exactly one home."""
    lay = Layout(n_devices=4, n_experts=8, home_slots=2, replica_slots=1, replicas=4, lanes=False)
    homes = np.array([[0, 4, 5], [1, 5, -1], [2, 6, -1], [3, 7, -1]])
    load = np.array([10.0, 1, 1, 1, 10, 1, 1, 1])
    out = swap_homes(homes, load, lay)
    assert out.tolist() == [[1, 4, -1], [0, 5, -1], [2, 6, -1], [3, 7, -1]]
    assert sorted(out[:, :2].ravel()) == list(range(8))


def test_swap_homes_swaps_each_device_once():
    """Every device receives at most one home copy per re-homing: with all the load on device 0,
    only one swap happens, though a second would lower device 0 further."""
    lay = Layout(n_devices=2, n_experts=6, home_slots=3, replica_slots=0, replicas=0, lanes=False)
    homes = np.array([[0, 1, 2], [3, 4, 5]])
    out = swap_homes(homes, np.array([5.0, 5, 5, 0, 0, 0]), lay)
    moved = [set(homes[d]) - set(out[d]) for d in range(2)]
    assert [len(m) for m in moved] == [1, 1]
    assert sorted(out.ravel()) == list(range(6))


def test_utilisation_lines_judge_where_ep_static_is_low_and_name_the_bound():
    def row(case, bs, planner, util):
        """A run whose GPUs idle 1 - util of its 1 s, on 5 causes (the line names 4)."""
        idle = 1 - util
        causes = {"compute-attention@gpu": 0.4 * idle, "compute-gate@gpu": 0.3 * idle,
                  "compute-expert@gpu": 0.2 * idle, "launch": 0.06 * idle, "host": 0.04 * idle}  # fmt: skip
        return dict(case=case, batch_size=bs, planner=planner, utilisation=util, makespan_s=1.0,
                    gpu_idle_causes_s=causes)  # fmt: skip

    rows = [row("a", 128, "ep_static", 0.5), row("a", 128, "eplb", 0.8),
            row("a", 128, "predictive_replication", 0.95), row("a", 128, "oracle_replication", 0.97),
            row("a", 1, "ep_static", 0.44), row("a", 1, "predictive_replication", 0.45),
            row("a", 1, "oracle_replication", 0.45), row("b", 128, "ep_static", 0.7)]  # fmt: skip
    assert utilisation_lines(rows, "utilisation", "util") == [
        "[PASS] a bs=128: util ep_static 0.500 < 0.6 -> predictive_replication 0.950 (target >= 0.9)",
        "[FAIL] a bs=1: util ep_static 0.440 < 0.6 -> predictive_replication 0.450 (target >= 0.9; "
        "the oracle upper bound reaches 0.450)",
        # what the best planner's GPUs waited for, 55% of the run in all (core.bubbles)
        "       predictive_replication's GPUs computed nothing 55.0% of the run, waiting on "
        "compute-attention@gpu 22.0%, compute-gate@gpu 16.5%, compute-expert@gpu 11.0%, "
        "launch 3.3%, other 2.2%",
    ]
    assert utilisation_lines(rows[-1:], "utilisation", "util") == [
        "[n/a ] util: no case has ep_static below 0.6 (lowest 0.700, b bs=128)"
    ]
    # a variant counts as what it varies: an ep_static variant is no replication planner
    more = [{**row("a", 1, "ep_static[1 lane]", 0.99), "variant_of": "ep_static"},
            {**row("a", 1, "eplb[interval=8]", 0.47), "variant_of": "eplb"}]  # fmt: skip
    assert utilisation_lines(rows + more, "utilisation", "util")[1].startswith(
        "[FAIL] a bs=1: util ep_static 0.440 < 0.6 -> eplb[interval=8] 0.470"
    )
    for ep, setting in (({"n_devices": 8, "lanes": False}, "8 GPUs"),
                        ({"n_devices": 8, "lanes": True}, "8 lanes of one GPU, each 1/G of its SMs"),
                        ({"n_devices": 4, "lanes": True, "lane_sharing": "shared"},
                         "4 lanes of one GPU, sharing its SMs")):  # fmt: skip
        marked = [dict(r, plan={"ep": ep}) for r in rows[:4]]
        assert utilisation_lines(marked, "utilisation", "util")[0].startswith(
            f"[PASS] a bs=128 ({setting}): util"
        )


def test_work_conserving_estimate_by_hand():
    """Lanes of half a 1 TFLOPS GPU, 1 ms per-op overhead. One expert phase: lane 0 runs 3
    GFLOP (6 + 1 = 7 ms at its half), lane 1 1 GFLOP (3 ms); then 2 ms of dense work: makespan
    9 ms. Work-conserving, the phase needs its 4 ms of work on the whole GPU plus one overhead
    (5 ms; lane 0 alone at the whole GPU would need 3 + 1): 2 ms less, 7 ms. The note compares
    the gains; off lanes there is no estimate."""
    from core.schedule import ScheduleBuilder
    from experiments.pipeline import RunResult
    from experiments.replication import work_conserving_lines, work_conserving_s

    raw = yaml.safe_load(Path("conf/hardware/tiny.yaml").read_text())
    raw["gpu"]["overhead_us"] = 1000
    hw = HardwareSpec.from_dict(raw)
    b = ScheduleBuilder(hw.memory_bytes)
    for d in (0, 1):
        b.stream(f"lane{d}", Resource.GPU, d, 0.5)
    b.stream("compute", Resource.GPU)
    for d, flops in ((0, 3e9), (1, 1e9)):
        b.add(OpKind.EXPERT, f"lane{d}", flops=flops, step=0, layer=1, batch=0)
    b.add(OpKind.ATTENTION, "compute", (0, 1), step=0, layer=2, batch=0)
    b.meta["ep"] = {"lanes": True}
    trace = pd.DataFrame({
        "op_id": [0, 1, 2], "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)],
        "stream": ["lane0", "lane1", "compute"], "step": [0] * 3, "layer": [1, 1, 2],
        "batch": [0] * 3, "start_s": [0.0, 0.0, 0.007], "end_s": [0.007, 0.003, 0.009],
    })  # fmt: skip
    result = RunResult(b.build(), trace, {})
    assert work_conserving_s(result, hw) == pytest.approx(0.007)
    b.meta["ep"] = {"lanes": False}
    assert work_conserving_s(RunResult(b.build(), trace, {}), hw) is None
    rows = [dict(case="s", batch_size=8, planner="ep_static", n_devices=2, makespan_s=0.009,
                 wc_makespan_s=0.007),
            dict(case="s", batch_size=8, planner="predictive_replication", n_devices=2,
                 makespan_s=0.0075, wc_makespan_s=0.0065)]  # fmt: skip
    assert work_conserving_lines(rows) == [
        "[note] s bs=8 (lanes): each lane's kernels run on 1/2 of the SMs; if they could use the "
        "SMs idle lanes leave (work-conserving), ep_static would take about 7.00 ms, not 9.00, "
        "and predictive 6.50, not 7.50: replication's gain 16.7% -> 7.1%"
    ]


def test_tensor_parallel_dense_splits_weights_and_all_reduces():
    """dense=tensor on 2 GPUs: each dense op runs every sequence on half the weights and flops
    (attention: its KV heads too), its partial sums are all-reduced in two phases that each send
    half the bytes per GPU, the head's logits are all-gathered, and no token is dispatched."""
    spec = tiny_spec("ep_static", dense="tensor")
    res = simulate_run(spec)
    m, sched = spec.model, res.schedule
    data = simulate_run(tiny_spec("ep_static")).schedule
    attn = [o for o in sched.ops if o.kind == OpKind.ATTENTION]
    assert len(attn) == len([o for o in data.ops if o.kind == OpKind.ATTENTION])
    prefill = [o for o in attn if o.step == 0]
    assert {o.tokens for o in prefill} == {2 * 8}  # both sequences on both GPUs
    ctx_kv = 2 * 8 * m.kv_bytes_per_token / 2  # 2 sequences x 8 tokens, half the KV heads
    for o in prefill:
        assert o.flops == pytest.approx(m.attention_flops(16, 4, sequences=2) / 2)
        assert o.touch_bytes == pytest.approx(m.attn_bytes / 2 + ctx_kv)
    head = [o for o in sched.ops if o.kind == OpKind.HEAD]
    assert {o.touch_bytes for o in head} == {m.head_bytes / 2}
    reduce = [o for o in sched.ops if o.kind == OpKind.ALL_REDUCE]
    assert {sched.streams[o.stream].name for o in reduce} == {"allreduce0", "allreduce1"}
    after_attn = [o for o in reduce if o.step == 0 and o.layer == 0 and o.batch == 0]
    # attention's all-reduce (2 phases x 2 GPUs) and the MoE layer's (routed + nothing shared)
    assert len(after_attn) == 8
    assert {o.nbytes for o in after_attn} == {16 * m.hidden_size * m.dtype_bytes // 2}
    gather = [o for o in reduce if o.layer == -1 and o.step == 0 and o.batch == 0]
    assert len(gather) == 2 and {o.nbytes for o in gather} == {2 * m.vocab_size * 4 // 2}
    # a phase waits for every GPU's part: the collective synchronises them
    first = after_attn[0]
    assert {sched.ops[d].kind for d in first.deps} == {OpKind.ATTENTION}
    assert len(first.deps) == 2
    kinds = {o.kind for o in sched.ops}
    assert OpKind.DISPATCH not in kinds and OpKind.COMBINE not in kinds
    # nor are the all-to-all's streams declared: each link carries copies and all-reduces
    assert {
        n.rstrip("0123456789") for n in sched.streams if "p2p" in sched.streams[n].resource
    } == {"replicas", "replicas_out", "allreduce"}
    routed = sum(o.tokens for o in sched.ops if o.kind == OpKind.EXPERT)
    assert routed == sum(o.tokens for o in data.ops if o.kind == OpKind.EXPERT)
    assert res.summary["plan"]["ep"]["dense"] == "tensor"


@pytest.mark.parametrize(
    "params, batch, parts",
    [
        ({}, 2, [("compute", 1), ("compute1", 1)]),  # each GPU its own sequence
        ({}, 1, [("compute", 1)]),  # GPU 1 holds no sequence: no gate there
        ({"dense": "tensor"}, 2, [("compute", 2), ("compute1", 2)]),  # every GPU every sequence
        ({"lanes": True}, 2, [("compute", 2)]),  # lanes: one whole-GPU op, as attention
    ],
)
def test_each_gpu_gates_the_sequences_it_holds(params, batch, parts):
    """On G GPUs each GPU runs the router on the sequences it holds, after its own attention;
    every expert op of the batch (and each dispatch) waits for all of the batch's gate parts."""
    spec = tiny_spec("predictive_replication", **params)
    spec = RunSpec(spec.model, spec.hardware, spec.workload.with_(batch_size=batch), spec.planner,
                   spec.params)  # fmt: skip
    sched = simulate_run(spec).schedule
    per = spec.workload.prompt_len  # prefill tokens per sequence
    gates = [o for o in sched.ops if o.kind == OpKind.GATE and o.step == 0 and o.layer == 1
             and o.batch == 0]  # fmt: skip
    assert [(sched.streams[o.stream].name, o.tokens // per) for o in gates] == parts
    for g in gates:  # after its own GPU's attention (under tensor: its all-reduce)
        (dep,) = [sched.ops[d] for d in g.deps]
        if params.get("dense") == "tensor":
            assert dep.kind == OpKind.ALL_REDUCE
        else:
            assert dep.kind == OpKind.ATTENTION and dep.stream == g.stream
    ids = {g.id for g in gates}
    waiting = [o for o in sched.ops if o.kind in (OpKind.EXPERT, OpKind.DISPATCH)
               and (o.step, o.layer, o.batch) == (0, 1, 0)]  # fmt: skip
    assert waiting and all(ids <= set(o.deps) for o in waiting)


def test_lanes_ignore_dense_tensor():
    """Lanes already run dense work as whole-GPU ops: dense=tensor adds no all-reduce there."""
    lanes = simulate_run(tiny_spec("ep_static", lanes=True, dense="tensor"))
    assert not any(o.kind == OpKind.ALL_REDUCE for o in lanes.schedule.ops)
    assert lanes.summary["plan"]["ep"]["dense"] is None


@pytest.mark.parametrize(
    "params, match",
    [
        ({"dense": "pipeline"}, "dense='pipeline' unknown; valid: data, tensor"),
        ({"dense": "tensor", "n_devices": 3}, "n_heads=4 does not split evenly over 3 ranks"),
    ],
)
def test_bad_dense_is_one_config_error(params, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec("ep_static", **params))


def test_tensor_parallel_kv_heads_and_qk_norm_as_the_real_run_splits_them():
    """tiny (4 query heads, 2 kv heads, 4 experts) on 4 GPUs, dense=tensor: each GPU holds one
    query head and one of the 2 kv heads (each kv head on 2 GPUs, as real/distributed.py and
    vLLM replicate it): the k and v projections and the KV cache per GPU are 1/2, the rest 1/4.
    As OLMoE (QK-norm over all heads) one more all-reduce per attention sums the per-token
    statistics of q and k (2 float32 a token) before the output's. Where the kv heads neither
    split over the GPUs nor divide them the simulator refuses, as the real run does."""
    spec = tiny_spec("ep_static", dense="tensor", n_devices=4)
    m = spec.model
    kv_w = 2 * 64 * 2 * 16 * 2  # k and v: hidden x (2 kv heads x 16) x 2 bytes each
    attn = [o for o in simulate_run(spec).schedule.ops
            if o.kind == OpKind.ATTENTION and o.step == 0]  # fmt: skip
    assert len(attn) == 4 * 2 * 3  # 4 GPUs x 2 layers x 3 batches
    cache = 2 * 8 * m.kv_bytes_per_token / 2  # 2 sequences x 8 tokens, one of 2 kv heads
    for o in attn:
        assert o.touch_bytes == pytest.approx((m.attn_bytes - kv_w) / 4 + kv_w / 2 + cache)
        proj = 2 * 16 * kv_w / 2  # 16 tokens through k and v (params = bytes / 2)
        assert o.flops == pytest.approx(
            (m.attention_flops(16, 4, sequences=2) - proj) / 4 + proj / 2
        )

    def after_attention(model: ModelSpec) -> list[int]:
        run = RunSpec(model, spec.hardware, spec.workload, "ep_static", spec.params)
        ops = simulate_run(run).schedule.ops
        return [o.nbytes for o in ops if o.kind == OpKind.ALL_REDUCE
                and (o.step, o.layer, o.batch) == (0, 0, 0)]  # fmt: skip

    olmoe = replace(spec.model, family="olmoe", name="tiny-qk")
    hidden = 16 * 64 * 2 * 3 // 4  # 16 tokens' hidden states, 3/4 of them sent per phase
    plain, normed = after_attention(spec.model), after_attention(olmoe)
    assert normed == [16 * 2 * 4 * 3 // 4] * 8 + plain  # 2 phases x 4 GPUs, then as before
    assert plain[:8] == [hidden] * 8
    with pytest.raises(ConfigError, match="n_kv_heads=6 neither splits evenly over 4 ranks"):
        bad = replace(spec.model, n_heads=12, n_kv_heads=6)
        simulate_run(RunSpec(bad, spec.hardware, spec.workload, "ep_static", spec.params))


def test_tensor_parallel_mla_keeps_the_latent_projection_whole():
    """MLA (kv_dim set): the kv_a projection that makes the latent every head reads runs whole on
    each GPU, and the latent cache is whole too; the other attention weights split in two."""
    base = yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text())
    small = dict(n_layers=2, moe_layers=[1], hidden_size=64, expert_ffn_size=128, n_experts=4,
                 top_k=2, n_heads=4, n_kv_heads=4, head_dim=16, vocab_size=256,
                 dense_ffn_size=128, shared_ffn_size=128, kv_dim=24, attn_params=20000,
                 qk_head_dim=24)  # fmt: skip
    m = ModelSpec.from_dict({**base, **small})
    spec = tiny_spec("ep_static", dense="tensor")
    res = simulate_run(RunSpec(m, spec.hardware, spec.workload, "ep_static", spec.params))
    whole = 64 * 24  # hidden x kv_dim params of kv_a
    for o in [o for o in res.schedule.ops if o.kind == OpKind.ATTENTION and o.step == 0]:
        assert o.touch_bytes == pytest.approx(
            (m.attn_bytes - 2 * whole) / 2 + 2 * whole + 2 * 8 * m.kv_bytes_per_token
        )
        proj = 2 * 16 * whole  # 16 tokens through kv_a
        assert o.flops == pytest.approx((m.attention_flops(16, 4, sequences=2) - proj) / 2 + proj)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("share", [1.0, 0.125])
@pytest.mark.parametrize("table", [False, True])
def test_device_times_are_each_devices_own_time(grouped, share, table):
    """The gate's `device_times` (all devices at once) equals `device_s` row by row to the last
    bit (the gate breaks ties of modelled time by device), and both are the device's ops
    costed one by one: random slots (empty ones and an expert twice on one device included)
    and fractional loads with zeros, one grouped op per device or one op per expert, a lane's
    share, a measured time table or the roofline."""
    from core.cost import CostModel
    from planners.expert_parallel import predicted_tokens

    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text()))
    raw = yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text())
    if table:
        raw["gpu"]["time_tables"] = {"compute-expert": [[1e9, 2e-5], [1e12, 3e-3]]}
    timer = ExpertTime(CostModel(HardwareSpec.from_dict(raw)), m.expert_flops(1),
                       m.expert_bytes, grouped, 0.0, share)  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(20):
        slots = rng.integers(-1, 64, size=(8, 10))
        slots[0, :2] = [5, 5]
        load = rng.gamma(0.5, 40.0, size=64) * (rng.random(64) > 0.3)
        rows = predicted_tokens(slots, load)
        got = timer.device_times(slots, load)
        assert got.tolist() == [timer.device_s(row) for row in rows]  # bit for bit: gate ties
        # and each is the device's ops (`_ops`) costed one by one, up to the order of the sums
        ops = [sum(timer.cost.compute_s(Resource.GPU, OpKind.EXPERT, f, b, share)
                   for f, b, _ in timer._ops(row)) for row in rows]  # fmt: skip
        assert got == pytest.approx(ops, rel=1e-12, abs=0)


def test_new_copies_count_each_devices_added_holdings():
    """Per device, the experts held and not held before (a second slot of one held already
    shares its weights, as the real run's `copy_moves`; empty slots not counted); the longest such
    queue. Checked against a count by hand on random slots."""
    from planners.expert_parallel import new_copies

    rng = np.random.default_rng(1)
    for _ in range(200):
        old, new = rng.integers(-1, 6, size=(2, 4, 3))
        want = max(len({x for x in n if x >= 0} - {x for x in o if x >= 0})
                   for n, o in zip(new.tolist(), old.tolist(), strict=True))  # fmt: skip
        assert new_copies(new, old) == want
        total = sum(len({x for x in n if x >= 0} - {x for x in o if x >= 0})
                    for n, o in zip(new.tolist(), old.tolist(), strict=True))  # fmt: skip
        assert new_copies(new, old, one_queue=True) == total  # lanes: one GPU's copy queue
    assert new_copies(np.array([[3, 3, -1]]), np.array([[3, -1, -1]])) == 0
    assert new_copies(np.array([[3, 4, 4]]), np.array([[3, -1, -1]])) == 1
    assert new_copies(np.array([[-1, -1]]), np.array([[0, 1]])) == 0


def test_gate_queues_copies_on_both_ends_of_the_link():
    """On G GPUs the gate's copy queue is the longer of each GPU's copies in and out: expert 0,
    held only by GPU 0, copied to GPUs 1-3 is one copy into each but three out of GPU 0 (the
    source the real run sends from, `copy_moves`); on lanes the same copies are one queue."""
    from core.cost import CostModel
    from planners.expert_parallel import ExpertTime, copy_moves

    old = np.array([[0, -1], [1, -1], [2, -1], [3, -1]])
    new = np.array([[0, -1], [1, 0], [2, 0], [3, 0]])
    assert copy_moves(old.tolist(), new.tolist()) == [(0, 0, 1), (0, 0, 2), (0, 0, 3)]
    timer = ExpertTime(CostModel(tiny_spec("ep_static").hardware), 1.0, 1, True, 1.0)
    assert timer.queue(new, old) == 3
    assert replace(timer, one_link=True).queue(new, old) == 3
    spread = np.array([[0, 1], [1, 0], [2, -1], [3, -1]])  # one copy each way
    assert timer.queue(spread, old) == 1 and replace(timer, one_link=True).queue(spread, old) == 2


def test_pool_ops_of_one_expert_each_equal_the_scalar_cost():
    """On lanes sharing the SMs, one op per expert: `pool_ops` (all at once) gives each busy
    expert exactly the launch, work and cap that `CostModel.compute_s`, `cap` and `expert_width`
    give it alone, from a few tokens (narrow kernels) to thousands (wide ones), with widths
    that fall on a half."""
    from core.cost import CostModel

    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/switch-base-128.yaml").read_text()))
    m = replace(m, expert_ffn_size=1100)  # 9 + 6 tiles per row tile: widths round half to even
    cost = CostModel(HardwareSpec.from_dict(
        yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text())))  # fmt: skip
    timer = ExpertTime(cost, m.expert_flops(1), m.expert_bytes, False, 0.0, 1.0, m)
    over = cost.overhead_s(Resource.GPU, OpKind.EXPERT)
    rng = np.random.default_rng(2)
    tokens = rng.gamma(0.3, 300.0, size=128) * (rng.random(128) > 0.4)
    tokens[:4] = [1.0, 300.5, 4000.25, 60000.0]
    want = []
    for n in tokens[tokens > 0]:
        f = m.expert_flops(1) * n
        width = expert_width(m, [np.ceil(n)])
        want.append((over, cost.compute_s(Resource.GPU, OpKind.EXPERT, f, m.expert_bytes) - over,
                     cost.cap(Resource.GPU, f, m.expert_bytes, width)))  # fmt: skip
    assert min(c for *_, c in want) < 0.5 < max(c for *_, c in want)
    assert timer.pool_ops(tokens) == want


def test_expert_parallel_memory_holds_one_batchs_activations_and_every_batchs_kv():
    """Mixtral-8x7B on 8 H200s, batches of 8 x 256 tokens: a second batch adds its KV, 8 x 257
    tokens x 4 KiB x 32 layers = 269.5 MB, and no activations: batches run one after another,
    so one batch's hidden states are live (each batch's 50 MB was counted as its KV)."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/mixtral-8x7b.yaml").read_text()))
    wl = Workload(batch_size=8, n_batches=1, prompt_len=256, gen_len=1,
                  routing=RoutingConfig(source="synthetic"))  # fmt: skip

    def resident_gb(n_batches: int) -> float:
        s = simulate_run(
            RunSpec(m, hw, wl.with_(n_batches=n_batches), "ep_static", {"n_devices": 8})
        )
        return s.summary["plan"]["placement"]["resident_gb"]["gpu"]

    kv_batch = 8 * 257 * m.kv_bytes_per_token * m.n_layers / 1e9
    assert resident_gb(2) - resident_gb(1) == pytest.approx(kv_batch, abs=2e-3)


def test_replica_moves_reserve_room_for_the_experts_in_flight():
    """eplb re-placing every iteration moves experts: each one a GPU gains is held beside the
    copy it replaces until that is sent (real/distributed.py holds them so), so the run reserves
    the most one iteration brings to a GPU, a whole number of experts; a GPU with room for the
    slots but not for that is refused in one line, where a run without moves still fits."""
    spec = tiny_spec("eplb", interval=1, replica_slots=1)
    moving = simulate_run(spec)
    eb = spec.model.expert_bytes
    staging = moving.summary["plan"]["ep"]["staging_bytes"]
    copies = [o for o in moving.schedule.ops if o.kind == OpKind.LOAD and o.tensor == Tensor.EXPERT]
    assert 0 < staging <= len(copies) * eb and staging % eb == 0
    still = simulate_run(replace(spec, params={**spec.params, "interval": 10**6}))
    assert "staging_bytes" not in still.summary["plan"]["ep"]
    grown = moving.schedule.resident_bytes[Tier.GPU] - still.schedule.resident_bytes[Tier.GPU]
    assert grown >= staging  # every GPU's, at least the fullest's
    # the GPU memory at which the moves no longer fit but the slots still do
    lo, hi = 0, spec.hardware.memory_bytes[Tier.GPU]  # refused / fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        hw = replace(spec.hardware, memory_bytes={**spec.hardware.memory_bytes, Tier.GPU: mid})
        try:
            simulate_run(replace(spec, hardware=hw))
            hi = mid
        except CapacityError:
            lo = mid
    hw = replace(spec.hardware, memory_bytes={**spec.hardware.memory_bytes, Tier.GPU: lo})
    with pytest.raises(CapacityError, match=r"replica moves bring up to \d+ experts .* re-home"):
        simulate_run(replace(spec, hardware=hw))
    simulate_run(replace(spec, hardware=hw, params={**spec.params, "interval": 10**6}))


def test_copy_waits_count_the_experts_a_late_copy_held_back():
    """tiny's 1 GB/s GPU link: a replica copy outlasts the layers before its own, and its
    expert op starts when the copy ends, after everything else it waited for; those ops are
    `late_copy_ops`, and `copy_wait_s` the most one device waited so. On a link as fast as
    one likes every copy is in time and both are 0."""
    spec = tiny_spec("oracle_replication", replica_slots=1)
    res = simulate_run(spec)
    ops, t = res.schedule.ops, res.trace.set_index("op_id")
    late, held = 0, [0.0, 0.0]
    for o in ops:
        copies = [d for d in o.deps if ops[d].kind == OpKind.LOAD]
        if o.kind != OpKind.EXPERT or not copies:
            continue
        start, arrived = t.loc[o.id, "start_s"], max(t.loc[d, "end_s"] for d in copies)
        others = max(t.loc[d, "end_s"] for d in o.deps if d not in copies)
        if start == arrived > others:  # the copy was the last thing it waited for
            late += 1
            held[res.schedule.streams[o.stream].device] += arrived - others
    assert res.summary["late_copy_ops"] == late > 0
    assert res.summary["copy_wait_s"] == pytest.approx(max(held), rel=1e-9)
    fast = {**spec.hardware.links, Resource.P2P: LinkSpec(1e18)}
    quick = simulate_run(replace(spec, hardware=replace(spec.hardware, links=fast)))
    assert quick.summary["plan"]["ep"]["copies"] > 0
    assert (quick.summary["late_copy_ops"], quick.summary["copy_wait_s"]) == (0, 0.0)


def test_collectives_slow_exactly_the_compute_they_overlap():
    """tiny on 2 GPUs with two-batch overlap and replica copies, the GPUs' collectives holding
    2 of 4 SMs (`gpu.comm_sms`): a compute op whose work overlaps no dispatch or combine of its
    GPU takes its cost-model duration (a replica copy beside it, the copy engine's, included),
    one that overlaps some takes longer, by at most the overlap (half the SMs: at half rate
    while it lasts), and the run is no shorter than without the cost. With NCCL's p2p kernels
    moving the copies (`gpu.copy_sms`) an op beside a copy alone is slowed too."""
    from core.cost import CostModel

    spec = tiny_spec("oracle_replication", replica_slots=1, micro_batches=2)
    spec = replace(spec, workload=replace(spec.workload, batch_size=4))
    gpu = replace(spec.hardware.gpu, sms=4, comm_sms=2)
    held = replace(spec, hardware=replace(spec.hardware, gpu=gpu))
    base, res = simulate_run(spec), simulate_run(held)
    assert res.summary["makespan_s"] >= base.summary["makespan_s"]
    sched, t = res.schedule, res.trace.set_index("op_id").sort_index()
    cost = CostModel(held.hardware).durations(sched)
    dev = {o.id: sched.streams[o.stream].device for o in sched.ops}
    a2a = [o.id for o in sched.ops if o.kind in (OpKind.DISPATCH, OpKind.COMBINE)]
    copies = [o.id for o in sched.ops if o.kind == OpKind.LOAD and o.tensor == Tensor.EXPERT]

    def overlap(o: int, ops: list[int]) -> float:
        s0, s1 = t.loc[o, "start_s"], t.loc[o, "end_s"]
        return sum(max(0.0, min(s1, t.loc[c, "end_s"]) - max(s0, t.loc[c, "start_s"]))
                   for c in ops if dev[c] == dev[o])  # fmt: skip

    slowed = beside_copies = 0
    for o in sched.ops:
        if o.kind not in COMPUTE_KINDS:
            continue
        took, over = t.loc[o.id, "end_s"] - t.loc[o.id, "start_s"], overlap(o.id, a2a)
        if over == 0:
            assert took == pytest.approx(cost[o.id], rel=1e-9, abs=1e-15)
            beside_copies += overlap(o.id, copies) > 0
        else:
            slowed += took > cost[o.id] * (1 + 1e-9)
            assert cost[o.id] <= took <= cost[o.id] + over + 1e-12
    assert slowed > 0 and beside_copies > 0, (slowed, beside_copies)
    assert not res.summary["plan"]["ep"]["copy_kernels"]
    # copies by NCCL's p2p kernels (gpu.copy_sms, 1 of the 4 SMs): the ops beside copies alone
    # are slowed now, and gpu_load counts the copies' time
    nccl = replace(held, hardware=replace(held.hardware, gpu=replace(gpu, comm_sms=1, copy_sms=1)))
    res = simulate_run(nccl)
    t = res.trace.set_index("op_id").sort_index()
    assert res.summary["plan"]["ep"]["copy_kernels"]
    by_copies = [o.id for o in sched.ops
                 if o.kind in COMPUTE_KINDS and overlap(o.id, a2a) == 0 and overlap(o.id, copies) > 0]  # fmt: skip
    took = [t.loc[i, "end_s"] - t.loc[i, "start_s"] for i in by_copies]
    assert any(d > cost[i] * (1 + 1e-9) for i, d in zip(by_copies, took, strict=True))
