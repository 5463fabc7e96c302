"""Property tests: random models, hardware and workloads; the executor invariants hold for every
registered planner."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.cost import CostModel
from core.errors import CapacityError
from core.spec import HardwareSpec, ModelSpec, Workload
from core.trace import make_trace, summarize
from experiments.pipeline import RunSpec, build_schedule
from planners import planner_names
from sim.executor import simulate
from tests.conftest import random_routing


@st.composite
def setups(draw):
    n_experts = draw(st.integers(2, 8))
    n_layers = draw(st.integers(1, 3))
    moe = tuple(i for i in range(n_layers) if draw(st.booleans()) or i == 0)
    model = ModelSpec(
        name="rand", family="mixtral", n_layers=n_layers, moe_layers=moe,
        hidden_size=draw(st.sampled_from([32, 64])), expert_ffn_size=draw(st.sampled_from([32, 128])),
        n_experts=n_experts, top_k=draw(st.integers(1, min(3, n_experts))), n_heads=2, n_kv_heads=1,
        head_dim=16, vocab_size=64, dense_ffn_size=64, shared_ffn_size=draw(st.sampled_from([0, 32])),
    )  # fmt: skip
    gpu_mb = draw(st.sampled_from([1, 2, 8, 64]))
    hw = HardwareSpec.from_dict(
        {
            "name": "rand",
            "memory_gb": {"gpu": gpu_mb / 1000, "cpu": draw(st.sampled_from([0.0005, 0.01, 1.0])), "disk": 10},
            "gpu": {"tflops": draw(st.sampled_from([0.01, 1.0])), "mem_bw_gbps": 100, "overhead_us": draw(st.sampled_from([0, 5]))},
            "cpu": {"tflops": 0.01, "mem_bw_gbps": 10},
            "links": {k: {"gbps": draw(st.sampled_from([0.1, 1.0])), "latency_us": draw(st.sampled_from([0, 10]))}
                      for k in ("h2d", "d2h", "disk", "disk_write")},
        }
    )  # fmt: skip
    wl = Workload(
        batch_size=draw(st.integers(1, 3)), n_batches=draw(st.integers(1, 3)),
        prompt_len=draw(st.integers(1, 6)), gen_len=draw(st.integers(1, 3)),
    )  # fmt: skip
    return model, hw, wl, draw(st.sampled_from(planner_names()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_invariants_hold(setup):
    model, hw, wl, name = setup
    routing = random_routing(model, wl, seed=1)
    try:
        schedule = build_schedule(RunSpec(model, hw, wl, name, {}), routing)
    except CapacityError:
        return  # a clear refusal is a valid answer for a machine too small
    start, end = simulate(schedule, CostModel(hw))
    trace = make_trace(schedule, start, end, "sim")
    # every op ran exactly once, after its deps
    assert len(trace) == len(schedule.ops) and np.isfinite(end).all()
    for op in schedule.ops:
        assert all(start[op.id] >= end[d] - 1e-12 for d in op.deps)
    s = summarize(schedule, trace, wl)
    for tier, peak in s["peak_bytes"].items():
        assert peak <= schedule.capacity_bytes[tier]
    assert s["makespan_s"] >= s["lower_bound_s"] - 1e-12
    start2, end2 = simulate(schedule, CostModel(hw))
    assert (start2 == start).all() and (end2 == end).all()
