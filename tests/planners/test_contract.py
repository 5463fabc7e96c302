"""Contract every registered planner keeps: its schedule validates, is deterministic, runs in the
simulator with every op exactly once, never exceeds a tier's memory, and respects the bounds."""

from __future__ import annotations

import numpy as np
import pytest

from core.cost import CostModel
from core.errors import CapacityError, ConfigError
from core.hardware import HardwareSpec
from core.trace import make_trace, summarize
from experiments.common.pipeline import RunSpec, build_schedule
from planners import planner_names
from planners.registry import entry, make_params
from sim.executor import simulate
from tests.conftest import RESIDENT, ROOT, TIGHT_CPU_GB, TIGHT_GPU_GB, conf, random_routing

PLANNERS = planner_names()


def run(model, hw, wl, name):
    routing = random_routing(model, wl)
    spec = RunSpec(model, hw, wl, name, {})
    schedule = build_schedule(spec, routing)
    start, end = simulate(schedule, CostModel(hw))
    return schedule, make_trace(schedule, start, end, "sim")


def check_contract(schedule, trace, model, wl) -> dict:
    """The contract's checks on one simulated run; returns its summary."""
    assert len(trace) == len(schedule.ops)
    start, end = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
    assert np.isfinite(start).all() and np.isfinite(end).all() and (end >= start).all()
    for op in schedule.ops:
        for d in op.deps:
            assert start[op.id] >= end[d] - 1e-12, op.label()
    # a stream is a FIFO queue: each op starts after the previous one (program order) ended
    for _, g in trace.groupby("stream", observed=True):
        order = np.argsort(g["op_id"].to_numpy())
        s_, e_ = g["start_s"].to_numpy()[order], g["end_s"].to_numpy()[order]
        assert (s_[1:] >= e_[:-1] - 1e-12).all()
    # a physical resource runs one op at a time, whichever streams share it (h2d: weights and
    # on-demand experts)
    rid = {name: st.resource_id for name, st in schedule.streams.items()}
    busy = trace[(trace["resource"] != "none") & (trace["end_s"] > trace["start_s"])]
    for _, g in busy.groupby(busy["stream"].astype(str).map(rid)):
        g = g.sort_values("start_s")
        assert (g["start_s"].to_numpy()[1:] >= g["end_s"].to_numpy()[:-1] - 1e-12).all()
    s = summarize(schedule, trace, wl)
    for tier, peak in s["peak_bytes"].items():
        assert peak <= schedule.capacity_bytes[tier], tier
    assert s["makespan_s"] >= s["lower_bound_s"] - 1e-12
    # the bubble's causes (core.bubbles) account for all of it, each second once
    causes = s["gpu_idle_causes_s"]
    assert all(v > 0 for v in causes.values())
    assert sum(causes.values()) == pytest.approx(s["gpu_bubble_s"], rel=1e-9, abs=1e-12)
    # the simulator starts an op once its predecessors, memory and resource let it: no delay
    # of its own (a real run's `late@` time)
    assert not [k for k in causes if k.startswith("late@")]
    # the schedule's own bound (deps + stream order) sits between the resource bound and the run
    assert s["lower_bound_s"] - 1e-12 <= s["dag_lower_bound_s"] <= s["makespan_s"] + 1e-9
    # the expert compute of every (step, layer) covers every routed token exactly once
    tokens = trace[trace["kind"] == "compute-expert"]["tokens"].sum()
    assert tokens == wl.n_sequences * wl.seq_positions * len(model.moe_layers) * model.top_k
    return s


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_contract(name, tiny_model, tiny_hw, tiny_workload):
    schedule, trace = run(tiny_model, tiny_hw, tiny_workload, name)
    check_contract(schedule, trace, tiny_model, tiny_workload)


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_contract_when_experts_stream_from_disk(name, tiny_model, tiny_workload):
    """The same contract where memory binds: loads wait for memory and peaks stay under
        capacity. Every offloading planner runs on one of the two tight GPUs and reads experts from
        disk; a planner that cannot run on one says so with a CapacityError naming the sizes (the
    expert-parallel ones where their experts do not fit). A CPU of half the size besides: fiddler
    holds no host copy of the experts it keeps on the GPU, and the rest fit the larger one."""
    ran = []
    for gpu_gb, cpu_gb in [(g, TIGHT_CPU_GB) for g in TIGHT_GPU_GB] + [(0.00045, 0.0001)]:
        d = conf("hardware", "tiny")
        d["memory_gb"] = {"gpu": gpu_gb, "cpu": cpu_gb, "disk": 100.0}
        hw = HardwareSpec.from_dict(d)
        try:
            schedule, trace = run(tiny_model, hw, tiny_workload, name)
        except CapacityError as e:
            assert "GB" in str(e) and "\n" not in str(e)
            continue
        ran.append(check_contract(schedule, trace, tiny_model, tiny_workload))
    disk = [s["bytes_moved"].get("disk", 0) for s in ran]
    if name in RESIDENT:  # refuses, or runs with every expert resident (nothing read from disk)
        assert not any(disk)
    else:
        assert any(disk)


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_is_deterministic(name, tiny_model, tiny_hw, tiny_workload):
    _, t1 = run(tiny_model, tiny_hw, tiny_workload, name)
    _, t2 = run(tiny_model, tiny_hw, tiny_workload, name)
    assert t1.equals(t2)


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_has_params_dataclass(name):
    import dataclasses

    params = entry(name).params
    assert dataclasses.is_dataclass(params) and params.__dataclass_params__.frozen


PLANNER_YAMLS = sorted(p.stem for p in (ROOT / "conf" / "planner").glob("*.yaml"))


def test_every_planner_has_its_config():
    assert set(PLANNERS) <= set(PLANNER_YAMLS)


@pytest.mark.parametrize("config", PLANNER_YAMLS)
def test_planner_config_runs_the_contract(config, tiny_model, tiny_hw, tiny_workload):
    """Each conf/planner YAML (ablation steps such as klotski_hot included) builds its params and
    keeps the contract with them."""
    d = conf("planner", config)
    spec = RunSpec(tiny_model, tiny_hw, tiny_workload, d["name"], d.get("params") or {})
    schedule = build_schedule(spec, random_routing(tiny_model, tiny_workload))
    start, end = simulate(schedule, CostModel(tiny_hw))
    check_contract(schedule, make_trace(schedule, start, end, "sim"), tiny_model, tiny_workload)


@pytest.mark.parametrize(
    "name, values, message",
    [
        ("klotski", {"disk_window": 1.5}, "planner.params.disk_window=1.5 must be an integer"),
        (
            "klotski",
            {"hot_prefetch": "maybe"},
            "planner.params.hot_prefetch='maybe' must be true or false",
        ),
        ("klotski", {"n": -5}, "planner klotski: planner.params.n=-5: must be an integer >= -1"),
        ("flexgen", {"sync": 1}, "planner.params.sync=1 must be true or false"),
        ("predictive_replication", {"ema_alpha": "half"}, "ema_alpha='half' must be a number"),
        ("fiddler", {"resident_share": 1.5}, "resident_share=1.5 must be in [0, 1]"),
        ("moe_infinity", {"history": -1}, "history=-1: must be a non-negative integer"),
        ("moe_infinity", {"cache_share": 0.0}, "cache_share=0.0 must be in (0, 1]"),
        ("mixtral_offloading", {"guess_k": -1}, "guess_k=-1: must be a non-negative integer"),
        ("mixtral_offloading", {"cache_share": 0}, "cache_share=0 must be in (0, 1]"),
    ],
)
def test_param_of_the_wrong_type_is_named(name, values, message):
    with pytest.raises(ConfigError) as e:
        make_params(name, values)
    assert str(e.value).startswith(f"planner {name}: ") and message in str(e.value)
    assert str(e.value).count(f"planner {name}") == 1
