"""Contract every registered planner keeps: its schedule validates, is deterministic, runs in the
simulator with every op exactly once, never exceeds a tier's memory, and respects the bounds."""

from __future__ import annotations

import numpy as np
import pytest

from core.cost import CostModel
from core.trace import make_trace, summarize
from experiments.pipeline import RunSpec, build_schedule
from planners import planner_names
from planners.registry import entry
from sim.executor import simulate
from tests.conftest import random_routing

# Planners for other settings (expert parallelism) declare it with a `contract_hardware` attribute.
PLANNERS = planner_names()


def run(model, hw, wl, name):
    routing = random_routing(model, wl)
    spec = RunSpec(model, hw, wl, name, {})
    schedule = build_schedule(spec, routing)
    start, end = simulate(schedule, CostModel(hw))
    return schedule, make_trace(schedule, start, end, "sim")


@pytest.mark.parametrize("name", PLANNERS)
def test_planner_contract(name, tiny_model, tiny_hw, tiny_workload):
    schedule, trace = run(tiny_model, tiny_hw, tiny_workload, name)
    assert len(trace) == len(schedule.ops)
    assert trace["op_id"].is_unique and (trace["op_id"].to_numpy() == np.arange(len(trace))).all()
    # dependencies and stream order hold
    start, end = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
    for op in schedule.ops:
        for d in op.deps:
            assert start[op.id] >= end[d] - 1e-12, op.label()
    for _, g in trace.groupby("stream", observed=True):
        ids = g["op_id"].to_numpy()
        assert (np.diff(g["start_s"].to_numpy()[np.argsort(ids)]) >= -1e-12).all()
    s = summarize(schedule, trace, tiny_workload)
    for tier, peak in s["peak_bytes"].items():
        assert peak <= schedule.capacity_bytes[tier], tier
    assert s["makespan_s"] >= s["lower_bound_s"] - 1e-12
    # the schedule's own bound (deps + stream order) sits between the resource bound and the run
    assert s["lower_bound_s"] - 1e-12 <= s["dag_lower_bound_s"] <= s["makespan_s"] + 1e-9
    # the expert compute of every (step, layer) covers every routed token exactly once
    tokens = trace[trace["kind"] == "compute-expert"]["tokens"].sum()
    wl = tiny_workload
    expected = wl.n_sequences * wl.seq_positions * len(tiny_model.moe_layers) * tiny_model.top_k
    assert tokens == expected


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
