"""Hand-worked GPU bubble causes (core.bubbles) on the round machine: 1 GB/s links, 1 TFLOP/s
GPUs, 1 GB of GPU memory, no latency."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from core.bubbles import by_transfer, causes_tv, idle_causes, top_cause
from core.cost import CostModel
from core.ep_layout import EPLayout
from core.schedule import ScheduleBuilder, validate
from core.spec import Workload
from core.trace import make_trace, summarize
from core.types import OpKind, Resource, Tier
from experiments.common.pipeline import simulate_run
from sim.executor import simulate_times
from tests.planners.ep_common import tiny_spec
from tests.sim.test_pools import comm_hw, lanes_beside_a_transfer, pool_hw
from tests.sim.test_simulator import GB, hw, load

WL = Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)


def simulated(b: ScheduleBuilder, h):
    """The schedule and its trace as a run writes it (pool launches and work, memory grants)."""
    s = b.build()
    validate(s)
    cost = CostModel(h)
    parts = cost.pool_parts(s)
    start, end, granted = simulate_times(s, cost, parts)
    trace = make_trace(s, start, end, "sim", sm_s=parts[1], launch_s=parts[0], alloc_s=granted)
    return s, trace


def test_a_compute_waiting_for_its_weights_idles_on_the_load():
    """A 1 s load (1 GB at 1 GB/s), then the 1 s compute that needs it: the GPU idles 0 -> 1 s
    on the load."""
    b = ScheduleBuilder(hw().memory_bytes)
    w, c = b.stream("w", Resource.H2D), b.stream("c", Resource.GPU)
    b.add(OpKind.FFN, c, (load(b, w, GB),), flops=1e12)
    s, trace = simulated(b, hw())
    assert idle_causes(s, trace) == pytest.approx({"load@h2d": 1.0})


def test_a_load_waiting_for_memory_counts_as_memory():
    """1 GB of GPU memory. Load A (1 GB) 0 -> 1 s, compute A 1 -> 2 s, A's copy back to the
    host 2 -> 3 s frees it; load B (1 GB), ready at 1 s after A on the same stream, gets the
    memory at 3 s and runs 3 -> 4 s; compute B 4 -> 5 s. The GPU idles 0 -> 1 (load A) and
    2 -> 4: the second gap walks back from compute B to load B (3 -> 4 s) and to load B's
    wait for memory (2 -> 3 s: ready since 1 s, but the gap starts at 2). 3 s in all, the
    bubble (makespan 5 s, 2 s of compute)."""
    b = ScheduleBuilder(hw().memory_bytes)
    w, c, back = (
        b.stream(n, r)
        for n, r in (("w", Resource.H2D), ("c", Resource.GPU), ("back", Resource.D2H))
    )
    a = load(b, w, GB, alloc=True)
    ca = b.add(OpKind.FFN, c, (a,), flops=1e12)
    b.add(
        OpKind.LOAD,
        back,
        (ca,),
        src=Tier.GPU,
        dst=Tier.CPU,
        nbytes=GB,
        free_tier=Tier.GPU,
        free_bytes=GB,
    )
    lb = load(b, w, GB, alloc=True)
    b.add(OpKind.FFN, c, (lb,), flops=1e12, free_tier=Tier.GPU, free_bytes=GB)
    s, trace = simulated(b, hw())
    assert trace["end_s"].max() == pytest.approx(5.0)
    causes = idle_causes(s, trace)
    assert causes == pytest.approx({"load@h2d": 2.0, "memory@gpu": 1.0})
    assert sum(causes.values()) == pytest.approx(summarize(s, trace, WL)["gpu_bubble_s"])


def test_one_gpu_waits_for_the_others_compute_through_the_all_to_all():
    """GPU 0 computes 0 -> 1 s, sends its tokens to GPU 1 over the 1 GB/s link 1 -> 2 s, GPU 1
    computes 2 -> 3 s. GPU 1 idles 0 -> 2: 1 s on the dispatch, 1 s on GPU 0's compute before
    it; GPU 0 idles 1 -> 3 (the run's end): the dispatch, then GPU 1's compute. The mean over
    the two GPUs: 1 s each."""
    b = ScheduleBuilder({t: 1 << 40 for t in Tier})
    c0, c1 = b.stream("c0", Resource.GPU, 0), b.stream("c1", Resource.GPU, 1)
    x = b.add(OpKind.FFN, c0, flops=1e12)
    d = b.add(OpKind.DISPATCH, b.stream("a2a", Resource.P2P, 1), (x,), nbytes=GB)
    b.add(OpKind.FFN, c1, (d,), flops=1e12)
    s, trace = simulated(b, comm_hw(comm_sms=0))
    assert idle_causes(s, trace) == pytest.approx({"compute-ffn@gpu": 1.0, "dispatch@p2p": 1.0})


def test_shared_lanes_idle_their_gpu_through_kernel_launches():
    """Lanes sharing the SMs, 1 ms launch overhead per op, 1 ms of work each at the whole GPU
    (the simulator's test_pool_op_runs_its_overhead_on_its_stream_then_joins): A (lane 0)
    launches 0 -> 1, runs 1 -> 2; B (lane 1) waits for a 2 ms transfer, C (lane 0) for A; both
    launch 2 -> 3 and run 3 -> 5. No kernel runs 0 -> 1 and 2 -> 3: launches, 2 ms."""
    b = lanes_beside_a_transfer()
    b.ep = EPLayout(n_devices=2, lanes=True)  # two lanes of one GPU
    s, trace = simulated(b, pool_hw(sms=4, overhead_us=1000))
    assert idle_causes(s, trace) == pytest.approx({"launch": 2e-3})


def test_a_real_runs_late_starts_are_the_executors():
    """A real trace (times as measured): compute A starts at 0.5 s with nothing to wait for
    runs to 1.5; compute B, after A on the stream, starts at 2.0 (0.5 s after it was ready); the GPU
    idles 0 -> 0.5 and 1.5 -> 2.0."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    c = b.stream("c", Resource.GPU)
    b.add(OpKind.FFN, c, flops=1e12)
    b.add(OpKind.FFN, c, flops=1e12)
    s = b.build()
    trace = make_trace(s, np.array([0.5, 2.0]), np.array([1.5, 3.0]), source="real")
    assert idle_causes(s, trace) == pytest.approx({"late@gpu": 1.0})


@pytest.mark.parametrize(
    "layout",
    [
        {"lanes": True},
        {"lanes": True, "lane_sharing": "shared"},
        {"lanes": False},
        {"lanes": False, "micro_batches": 2},
    ],
)
@pytest.mark.parametrize("planner", ["ep_static", "predictive_replication"])
def test_expert_parallel_bubbles_add_up_and_name_the_all_to_all(planner, layout):
    """Every layout the replication planners run on: the causes add up to the summary's GPU
    bubble (on lanes the time no lane runs a kernel, on GPUs their mean idle time), and on G
    GPUs some of it waits on the all-to-all, which lanes do not have. Batch 4: two sequences a
    GPU, one a micro-batch."""
    params = {} if planner == "ep_static" else {"replica_slots": 1}
    spec = tiny_spec(planner, **layout, **params)
    spec = replace(spec, workload=spec.workload.with_(batch_size=4))
    s = simulate_run(spec).summary
    causes = s["gpu_idle_causes_s"]
    assert sum(causes.values()) == pytest.approx(s["gpu_bubble_s"], rel=1e-9)
    a2a = sum(v for k, v in causes.items() if k.split("@")[0] in ("dispatch", "combine"))
    assert (a2a > 0) == (not layout["lanes"])


def test_top_cause_and_how_far_two_splits_are():
    """Sim: 3 s on disk loads, 1 s late; real: 2 s disk, 2 s h2d. Shares 0.75/0.25/0 against
    0.5/0/0.5: total variation (0.25 + 0.25 + 0.5) / 2 = 0.5."""
    sim = {"load expert@disk": 3.0, "late@h2d": 1.0}
    real = {"load expert@disk": 2.0, "load expert@h2d": 2.0}
    assert top_cause(sim) == "load expert@disk 75%"
    assert causes_tv(sim, real) == pytest.approx(0.5)
    assert causes_tv(sim, sim) == 0.0
    assert top_cause({}) == "-" and np.isnan(causes_tv({}, real))


def test_a_transfers_two_ends_are_one_cause():
    """Sim: 2 s of dispatch, all on the receive (both ends end at once; the walk takes the
    first listed); real: 1 s on the receive, 1 s on the send. One cause: TV 0, where apart
    the splits would be (0.5 + 0.5) / 2 = 0.5 apart."""
    sim = {"dispatch@p2p": 2.0}
    real = {"dispatch@p2p": 1.0, "dispatch@p2p_out": 1.0}
    assert by_transfer(real) == {"dispatch@p2p": 2.0}
    assert causes_tv(sim, real) == 0.0
    assert causes_tv(sim, {"dispatch@p2p": 1.0, "combine@p2p_out": 1.0}) == pytest.approx(0.5)
