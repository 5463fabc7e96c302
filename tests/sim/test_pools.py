"""The simulator's shared pools on round numbers: a GPU's SMs shared among the ops running on
it (lanes, their overheads), a link's bandwidth among its transfers, and the SMs collectives and
replica copies hold from the compute beside them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.cost import CostModel
from core.errors import ConfigError
from core.hardware import HardwareSpec
from core.schedule import ScheduleBuilder
from core.types import OpKind, Resource, Tensor, Tier
from sim.executor import simulate
from tests.sim.test_simulator import GB, hw, load, run


def sm_hw(
    name: str, links: dict | None = None, processes: dict | None = None, **gpu
) -> HardwareSpec:
    """The round machine (1 GB GPU, 1 TFLOP/s, 1000 GB/s, 1 GB/s host links) with these `gpu`
    fields (sms, overheads, held SMs), extra `links` and a `processes` block."""
    raw = {
        "name": name,
        "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
        "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0, **gpu},
        "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
        "links": {
            "h2d": {"gbps": 1.0},
            "d2h": {"gbps": 1.0},
            "disk": {"gbps": 0.5},
            **(links or {}),
        },
        "processes": processes or {},
    }
    return HardwareSpec.from_dict(raw)


def pool_hw(sms: int, sm_mem_bw_gbps: float = 0.0, overhead_us: float = 0.0) -> HardwareSpec:
    """The round machine with `sms` SMs (1 TFLOP/s, 1000 GB/s over them) and a per-op overhead."""
    return sm_hw("pool", sms=sms, overhead_us=overhead_us, sm_mem_bw_gbps=sm_mem_bw_gbps)


@pytest.mark.parametrize(
    "widths, ends_ms",
    [
        ([0, 0], [2.0, 2.0]),  # two 1 ms ops that fill the GPU: half each, both end at 2 ms
        ([1, 1], [4.0, 4.0]),  # 1 of 4 SMs each: a quarter each, the GPU half idle
        ([1, 0], [4.0, 4 / 3]),  # 1/4 and 3/4 until 4/3 ms; then the narrow one, 2/3 ms left at 1/4
        ([2, 2, 2], [3.0, 3.0, 3.0]),  # caps 1/2 sum past 1: a third each
        ([0], [1.0]),
    ],
)
def test_pool_shares_the_gpu_among_running_ops(widths, ends_ms):
    """Compute ops of 1 GFLOP (1 ms on the whole GPU) on streams of one pool, on a GPU of 4 SMs:
    each runs at most width / 4 of the GPU (0 = all of it), together at most the whole GPU."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    for i, w in enumerate(widths):
        b.add(OpKind.FFN, b.stream(f"lane{i}", Resource.GPU, i, pool="sms"), flops=1e9, width=w)
    _, end = run(b, pool_hw(sms=4))
    assert end * 1e3 == pytest.approx(ends_ms)


def lanes_beside_a_transfer() -> ScheduleBuilder:
    """Two lanes sharing the SMs: A (lane 0), a 2 ms transfer, B (lane 1) after it, C (lane 0)
    after A; each compute 1 GFLOP (1 ms at the whole GPU of `pool_hw`)."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    s0, s1 = (b.stream(f"lane{i}", Resource.GPU, i, pool="sms") for i in (0, 1))
    a = b.add(OpKind.FFN, s0, flops=1e9)
    t = load(b, b.stream("h2d", Resource.H2D), 2 * GB // 1000)
    b.add(OpKind.FFN, s1, (t,), flops=1e9)
    b.add(OpKind.FFN, s0, (a,), flops=1e9)
    return b


def test_pool_op_runs_its_overhead_on_its_stream_then_joins():
    """1 ms overhead per op, 1 ms of work each at the whole GPU. A (lane 0): overhead 0 -> 1, then
    alone 1 -> 2. B (lane 1) waits for a 2 ms transfer, C (lane 0) for A: both run their
    overheads 2 -> 3 on their own streams, then share the GPU, half each, 3 -> 5."""
    start, end = run(lanes_beside_a_transfer(), pool_hw(sms=4, overhead_us=1000))
    assert start * 1e3 == pytest.approx([0.0, 0.0, 2.0, 2.0])
    assert end * 1e3 == pytest.approx([2.0, 2.0, 5.0, 5.0])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 5), st.integers(0, 3)),  # width, GFLOP, lane
        min_size=1,
        max_size=8,
    )
)
def test_pool_never_exceeds_the_gpu_and_wastes_none_of_it(ops):
    """Random ops on 4 lanes of one pool (GPU of 4 SMs, 1 TFLOP/s, no overhead): no op ends
    sooner than its work at its cap; the lanes together never beat the whole GPU (makespan >=
    the sum of the work); and where every cap is 1 the GPU never idles while work is left, so
    the makespan is exactly the sum of the work."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    lanes = [b.stream(f"lane{i}", Resource.GPU, i, pool="sms") for i in range(4)]
    for width, gflop, lane in ops:
        b.add(OpKind.FFN, lanes[lane], flops=gflop * 1e9, width=width)
    start, end = run(b, pool_hw(sms=4))
    work = np.array([g * 1e-3 for _, g, _ in ops])  # seconds at the whole GPU
    caps = np.array([1.0 if w == 0 or w >= 4 else w / 4 for w, _, _ in ops])
    assert (end - start >= work / caps - 1e-12).all()
    assert end.max() >= work.sum() - 1e-12
    if (caps == 1).all():
        assert end.max() == pytest.approx(work.sum())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(
        st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4)), max_size=4),  # width, GFLOP
        min_size=1,
        max_size=5,
    ),
    st.sampled_from([0.0, 500.0]),
)
def test_pool_makespan_is_the_simulators(lanes, overhead_us):
    """`core.cost.pool_makespan_s`, which planners use to weigh a placement on shared lanes
    without building a schedule, gives the simulator's makespan of the same ops (8 SMs)."""
    from core.cost import pool_makespan_s

    h = pool_hw(sms=8, overhead_us=overhead_us)
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    cost, plain = CostModel(h), []
    for d, ops in enumerate(lanes):
        s = b.stream(f"lane{d}", Resource.GPU, d, pool="sms")
        for width, gflop in ops:
            b.add(OpKind.FFN, s, flops=gflop * 1e9, width=width)
        plain.append(
            [(overhead_us * 1e-6, g * 1e-3, cost.cap(Resource.GPU, g * 1e9, 0, w)) for w, g in ops]
        )
    if not b.ops:
        assert pool_makespan_s(plain) == 0.0
        return
    _, end = run(b, h)
    assert pool_makespan_s(plain) == pytest.approx(end.max(), abs=1e-12)


def test_pool_makespan_by_hand():
    from core.cost import pool_makespan_s

    assert pool_makespan_s([[(0.0, 1.0, 1.0)], [(0.0, 1.0, 1.0)]]) == pytest.approx(2.0)
    assert pool_makespan_s([[(1.0, 1.0, 0.25)]]) == pytest.approx(5.0)  # launch, then 1 / 0.25
    # lane 1 launches for 1 s while lane 0 has the GPU: 1 s of 2 done; then both at half
    assert pool_makespan_s([[(0.0, 2.0, 1.0)], [(1.0, 1.0, 1.0)]]) == pytest.approx(3.0)


@pytest.mark.parametrize("pool", ["", "h2d:0"])
def test_a_link_pool_shares_its_bandwidth(pool):
    """A 1 GB copy at 0, a 0.1 GB message at 0.2 s, over one 1 GB/s link with 10 ms latency.
    Streams that hold the link (no pool): the message waits for the copy, 0.2 -> 1.01 -> 1.12 s.
    In a pool: both run their latency on their own streams, then share the bandwidth, half
    each, from when the message's bytes start (0.21 s) until they are through (0.41 s); the
    copy, 0.2 GB through at 0.21 s and 0.1 GB more by 0.41 s, has 0.7 GB left at the whole
    link: it ends at 1.11 s, 0.1 s (the message's bytes) later than alone."""
    b = ScheduleBuilder({t: 1 << 40 for t in Tier})
    big, small = (b.stream(n, Resource.H2D, pool=pool) for n in ("copies", "all-to-all"))
    gate = b.add(OpKind.FFN, b.stream("gpu", Resource.GPU), flops=0.2e12)
    load(b, big, GB)
    load(b, small, GB // 10, deps=(gate,))
    start, end = run(b, hw(latency_us=10_000))
    if pool:
        assert end[1:] == pytest.approx([1.11, 0.41])
    else:
        assert start[2] == pytest.approx(1.01) and end[1:] == pytest.approx([1.01, 1.12])


def test_a_real_traces_link_pool_counts_each_transfers_share():
    """The pooled case above with no latency: the copy runs 0 -> 1.1 s, the message 0.2 -> 0.4 s
    at half the link. The simulator knows their work, 1.0 and 0.1 s of the whole link (`sm_s`).
    A real trace does not: it has their intervals only, and an even split of the overlap gives
    the copy 0.2 + 0.1 + 0.7 s and the message 0.1 s, the same work, so the bounds read 1.1 s
    (the link's busy time), not the 1.3 s the two durations add up to."""
    from core.spec import Workload
    from core.trace import make_trace, summarize, work_s

    b = ScheduleBuilder({t: 1 << 40 for t in Tier})
    big, small = (b.stream(n, Resource.H2D, pool="link") for n in ("copies", "all-to-all"))
    gate = b.add(OpKind.FFN, b.stream("gpu", Resource.GPU), flops=0.2e12)
    load(b, big, GB)
    load(b, small, GB // 10, deps=(gate,))
    s = b.build()
    cost = CostModel(hw())
    parts = cost.pool_parts(s)
    start, end = simulate(s, cost, parts)
    sim = make_trace(s, start, end, "sim", sm_s=parts[1], launch_s=parts[0])
    real = make_trace(s, start, end, "real")
    assert work_s(sim, s)[1:].to_numpy() == pytest.approx([1.0, 0.1])
    assert work_s(real, s)[1:].to_numpy() == pytest.approx([1.0, 0.1])
    assert work_s(real)[1:].to_numpy() == pytest.approx([1.1, 0.2])  # without the schedule
    w = Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)
    for trace in (sim, real):
        m = summarize(s, trace, w)
        assert m["lower_bound_s"] == pytest.approx(1.1) and m["busy_s"]["h2d"] == pytest.approx(1.1)
        assert m["lower_bound_s"] <= m["dag_lower_bound_s"] <= m["makespan_s"] + 1e-12


def comm_hw(comm_sms: int, sms: int = 4, copy_sms: int = 0) -> HardwareSpec:
    """The round machine with a 1 GB/s GPU<->GPU link, `comm_sms` of its 4 SMs held by a running
    collective and `copy_sms` by a running replica copy."""
    return sm_hw("comm", {"p2p": {"gbps": 1.0}}, sms=sms, comm_sms=comm_sms, copy_sms=copy_sms)


def copy_op(b: ScheduleBuilder, stream: str, deps=()) -> int:
    """A 2 ms replica copy (an expert's weights, GPU -> GPU)."""
    return b.add(
        OpKind.LOAD,
        stream,
        deps,
        src=Tier.GPU,
        dst=Tier.GPU,
        nbytes=2 * GB // 1000,
        tensor=Tensor.EXPERT,
    )


@pytest.mark.parametrize(
    "comm_sms, copy_sms, ends_ms",
    [
        # GPU 0's 4 ms GEMM runs at 3/4 while its 2 ms dispatch (and beside it, its 2 ms send:
        # one collective's SMs, not two) holds 1 SM: 1.5 ms of work by 2 ms, 2.5 ms after. GPU 1's
        # runs beside a replica copy into it, a copy engine's (copy_sms 0), and GPU 2's beside
        # nothing: neither is slowed
        (1, 0, [4.5, 4.0, 4.0, 2.0, 2.0, 2.0]),
        (0, 0, [4.0, 4.0, 4.0, 2.0, 2.0, 2.0]),  # collectives cost no compute
        (2, 0, [5.0, 4.0, 4.0, 2.0, 2.0, 2.0]),  # half the GPU: 1 ms of work by 2 ms
        (0, 1, [4.0, 4.5, 4.0, 2.0, 2.0, 2.0]),  # NCCL's p2p copy: 1 SM of GPU 1's
        (1, 1, [4.5, 4.5, 4.0, 2.0, 2.0, 2.0]),
    ],
)
def test_collectives_hold_sms_from_the_compute_beside_them(comm_sms, copy_sms, ends_ms):
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    link = {d: b.stream(f"dispatch{d}", Resource.P2P, d, pool=f"p2p:{d}") for d in (0, 1)}
    for d in range(3):
        b.add(OpKind.FFN, b.stream(f"compute{d or ''}", Resource.GPU, d), flops=4e9)
    b.add(OpKind.DISPATCH, link[0], nbytes=2 * GB // 1000)
    b.add(
        OpKind.DISPATCH,
        b.stream("send0", Resource.P2P_OUT, 0, pool="p2p_out:0"),
        nbytes=2 * GB // 1000,
    )
    copy_op(b, b.stream("replicas1", Resource.P2P, 1, pool="p2p:1"))
    _, end = run(b, comm_hw(comm_sms, copy_sms=copy_sms))
    assert end * 1e3 == pytest.approx(ends_ms)


def test_a_collective_and_a_copy_hold_their_sms_together():
    """Two communicators' kernels on one GPU: a 2 ms dispatch (1 SM of 4) and a 2 ms replica
    copy (1 SM) at once leave the GEMM half the GPU, 1 ms of its 4 by 2 ms: it ends at 5 ms. Two
    copies at once (in and out: one grouped p2p kernel) hold 1 SM, as one does."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    b.add(OpKind.FFN, b.stream("compute", Resource.GPU, 0), flops=4e9)
    b.add(
        OpKind.DISPATCH, b.stream("dispatch0", Resource.P2P, 0, pool="p2p:0"), nbytes=2 * GB // 1000
    )
    copy_op(b, b.stream("replicas_out0", Resource.P2P_OUT, 0, pool="p2p_out:0"))
    _, end = run(b, comm_hw(1, copy_sms=1))
    assert end[0] * 1e3 == pytest.approx(5.0)
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    b.add(OpKind.FFN, b.stream("compute", Resource.GPU, 0), flops=4e9)
    copy_op(b, b.stream("replicas0", Resource.P2P, 0, pool="p2p:0"))
    copy_op(b, b.stream("replicas_out0", Resource.P2P_OUT, 0, pool="p2p_out:0"))
    _, end = run(b, comm_hw(1, copy_sms=1))
    assert end[0] * 1e3 == pytest.approx(4.5)


def test_a_gemm_after_the_collective_runs_at_full_rate():
    """The GEMM starts once the 2 ms all-reduce is done: nothing holds SMs, 4 ms as ever."""
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    r = b.add(
        OpKind.ALL_REDUCE,
        b.stream("allreduce0", Resource.P2P, 0, pool="p2p:0"),
        nbytes=2 * GB // 1000,
    )
    b.add(OpKind.FFN, b.stream("compute", Resource.GPU, 0), (r,), flops=4e9)
    _, end = run(b, comm_hw(1))
    assert end * 1e3 == pytest.approx([2.0, 6.0])


@pytest.mark.parametrize("comm_sms, copy_sms, sms", [(4, 0, 4), (1, 0, 0), (2, 2, 4)])
def test_sms_held_outside_the_device_are_refused(comm_sms, copy_sms, sms):
    with pytest.raises(
        ConfigError,
        match=rf"hardware comm: comm_sms={comm_sms} and copy_sms={copy_sms} must be 0 .* sms={sms}",
    ):
        comm_hw(comm_sms, sms, copy_sms)


@pytest.mark.parametrize(
    "comm_sms, copy_sms, key", [(-1, 0, "comm_sms=-1"), (0, -1, "copy_sms=-1")]
)
def test_sms_held_below_0_are_refused(comm_sms, copy_sms, key):
    with pytest.raises(ConfigError, match=rf"gpu.{key}: must be a non-negative integer; set"):
        comm_hw(comm_sms, 4, copy_sms)


def test_an_op_of_g_processes_starts_its_kinds_delay_after_it_is_ready():
    """Two devices as processes, experts starting 0.5 s after they are ready (`processes.
    start_delay_us_by_kind`; the gate has none, and costs nothing here): after the gate at 0,
    device 0's 1 s expert (1 TFLOP) runs 0.5-1.5; the next, dep on it, 2.0-3.0; device 1's,
    dep on the first, 2.0-3.0 too. Without the processes layout (one device) the same ops run
    back to back: 0-1, 1-2."""
    from core.ep_layout import EPLayout

    h = sm_hw("procs", processes={"start_delay_us_by_kind": {"compute-expert": 500_000}})

    def schedule(g: int) -> ScheduleBuilder:
        b = ScheduleBuilder(h.memory_bytes)
        b.ep = EPLayout(n_devices=g, lanes=False)
        for dev in range(g):
            b.stream(f"compute{dev}", Resource.GPU, dev)
        gate = b.add(OpKind.GATE, "compute0", layer=0, batch=0)
        a = b.add(OpKind.EXPERT, "compute0", (gate,), layer=0, batch=0, flops=1e12)
        b.add(OpKind.EXPERT, "compute0", (a, gate), layer=0, batch=0, flops=1e12)
        if g > 1:
            b.add(OpKind.EXPERT, "compute1", (a, gate), layer=0, batch=0, flops=1e12)
        return b

    start, end = run(schedule(2), h)
    assert list(start) == pytest.approx([0.0, 0.5, 2.0, 2.0])
    assert list(end) == pytest.approx([0.0, 1.5, 3.0, 3.0])
    start, end = run(schedule(1), h)
    assert list(start) == pytest.approx([0.0, 0.0, 1.0])
    assert list(end) == pytest.approx([0.0, 1.0, 2.0])


@pytest.mark.parametrize("g, ends_ms", [(2, [4.5, 4.0, 2.0]), (1, [4.0, 4.0, 2.0])])
def test_a_copy_holds_its_processes_share_of_compute(g, ends_ms):
    """Devices as G processes of one machine (`processes.copy_share` 1/4): a 2 ms replica copy
    into GPU 0 slows its 4 ms GEMM to 3/4 meanwhile (1.5 ms of work by 2 ms: it ends at 4.5
    ms); GPU 1's GEMM, with no copy, is not slowed. The same schedule on one process (no
    processes layout) is not slowed either: the share is what G processes on one machine's
    cores cost, which `copy_sms` says for a GPU."""
    from core.ep_layout import EPLayout

    h = sm_hw("procs", {"p2p": {"gbps": 1.0}}, processes={"copy_share": 0.25})
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    b.ep = EPLayout(n_devices=g, lanes=False)
    for d in range(2):
        b.add(OpKind.FFN, b.stream(f"compute{d or ''}", Resource.GPU, d), flops=4e9)
    copy_op(b, b.stream("replicas0", Resource.P2P, 0, pool="p2p:0"))
    _, end = run(b, h)
    assert end * 1e3 == pytest.approx(ends_ms)


@pytest.mark.parametrize("share", [1.0, -0.1, float("nan")])
def test_a_processes_copy_share_outside_0_1_is_one_config_error(share):
    # NaN: named as not a finite number, before the range
    with pytest.raises(ConfigError, match=r"processes.copy_share must be (in \[0, 1\)|a finite)"):
        sm_hw("x", processes={"copy_share": share})
