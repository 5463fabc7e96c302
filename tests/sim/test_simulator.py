"""Hand-worked simulator cases on round numbers: 1 GB/s links, 1 TFLOP/s GPU, no latency."""

from __future__ import annotations

import numpy as np
import pytest

from core.cost import CostModel
from core.errors import ScheduleError
from core.hardware import HardwareSpec
from core.schedule import ScheduleBuilder, validate
from core.types import OpKind, Resource, Tier
from sim.executor import simulate

GB = 10**9


def hw(latency_us: float = 0.0, gpu_gb: float = 1.0) -> HardwareSpec:
    return HardwareSpec.from_dict(
        {
            "name": "round",
            "memory_gb": {"gpu": gpu_gb, "cpu": 4, "disk": 100},
            "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0},
            "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
            "links": {
                "h2d": {"gbps": 1.0, "latency_us": latency_us},
                "d2h": {"gbps": 1.0},
                "disk": {"gbps": 0.5},
            },
        }
    )


def run(b: ScheduleBuilder, h: HardwareSpec):
    s = b.build()
    validate(s)
    return simulate(s, CostModel(h))


def load(b: ScheduleBuilder, stream: str, nbytes: int, deps=(), alloc: bool = False) -> int:
    extra = dict(alloc_tier=Tier.GPU, alloc_bytes=nbytes) if alloc else {}
    return b.add(OpKind.LOAD, stream, deps, src=Tier.CPU, dst=Tier.GPU, nbytes=nbytes, **extra)


def test_one_load_takes_bytes_over_bandwidth_plus_latency():
    """0.5 GB over 1 GB/s with 100 us latency: 0.5 s + 0.0001 s."""
    h = hw(latency_us=100)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    load(b, "w", GB // 2)
    start, end = run(b, h)
    assert start[0] == 0.0
    assert end[0] == pytest.approx(0.5001)


def test_load_overlaps_compute_on_another_resource():
    """A 1 s load and a 1 s compute (1 TFLOP at 1 TFLOP/s) on different resources: makespan 1 s."""
    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("c", Resource.GPU)
    load(b, "w", GB)
    b.add(OpKind.FFN, "c", flops=1e12)
    start, end = run(b, h)
    assert end.max() == pytest.approx(1.0)
    assert start[1] == 0.0


def test_two_streams_on_one_link_serialize():
    """Two 1 GB loads on two streams sharing h2d: the second starts as the first ends (1 s, 2 s)."""
    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("weights", Resource.H2D)
    b.stream("experts", Resource.H2D)
    load(b, "weights", GB)
    load(b, "experts", GB)
    start, end = run(b, h)
    assert sorted(end) == pytest.approx([1.0, 2.0])
    assert max(start) == pytest.approx(1.0)


def _load_then_compute() -> tuple[np.ndarray, np.ndarray]:
    """A 1 s load on h2d, then a 0.5 s compute that depends on it: their start and end times."""
    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("c", Resource.GPU)
    a = load(b, "w", GB)
    b.add(OpKind.FFN, "c", deps=(a,), flops=0.5e12)
    return run(b, h)


def test_compute_waits_for_its_dependency():
    """compute depends on a 1 s load, takes 0.5 s: ends at 1.5 s."""
    start, end = _load_then_compute()
    assert (start[1], end[1]) == pytest.approx((1.0, 1.5))


def test_load_waits_for_memory():
    """GPU holds 1 GB. Load A (0.6 GB, 0.6 s) is freed by a 1 s compute; load B (0.6 GB) on another
    stream must wait for that free at 1.6 s, then takes 0.6 s: ends at 2.2 s."""
    h = hw(gpu_gb=1.0)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w1", Resource.H2D)
    b.stream("w2", Resource.H2D)
    b.stream("c", Resource.GPU)
    a = load(b, "w1", 6 * GB // 10, alloc=True)
    b.add(OpKind.FFN, "c", deps=(a,), flops=1e12, free_tier=Tier.GPU, free_bytes=6 * GB // 10)
    load(b, "w2", 6 * GB // 10, alloc=True)
    start, end = run(b, h)
    assert start[2] == pytest.approx(1.6)
    assert end[2] == pytest.approx(2.2)


def test_memory_deadlock_names_the_stuck_ops():
    """Stream w loads 0.6 GB twice; the first is freed only by a compute that needs the second."""
    h = hw(gpu_gb=1.0)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("c", Resource.GPU)
    a = load(b, "w", 6 * GB // 10, alloc=True)
    c = load(b, "w", 6 * GB // 10, alloc=True)
    b.add(OpKind.FFN, "c", deps=(a, c), flops=1e9, free_tier=Tier.GPU, free_bytes=12 * GB // 10)
    with pytest.raises(ScheduleError, match=r"op 1 load .* waits for 600000000 B of gpu"):
        validate(b.build())
    with pytest.raises(ScheduleError, match="op 2 compute-ffn"):
        simulate(b.build(), CostModel(h))


def test_a_double_free_is_an_error_not_free_memory():
    """Load A takes the whole 1 GB GPU and is freed twice: the second free would hand later
    loads 1 GB the GPU does not have (two 1 GB loads held at once, peak_bytes none the wiser).
    The simulator, which runs without the zero-time check, names the op."""
    h = hw(gpu_gb=1.0)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("mem", Resource.NONE)
    a = load(b, "w", GB, alloc=True)
    f1 = b.add(OpKind.FREE, "mem", (a,), free_tier=Tier.GPU, free_bytes=GB)
    f2 = b.add(OpKind.FREE, "mem", (f1,), free_tier=Tier.GPU, free_bytes=GB)
    x = load(b, "w", GB, deps=(f2,), alloc=True)
    load(b, "w", GB, deps=(x,), alloc=True)
    s = b.build()
    validate(s, check_finishes=False)
    with pytest.raises(ScheduleError, match=r"op 2 \(free\) frees 1000000000 B of gpu, more than"):
        simulate(s, CostModel(h))


def test_streams_of_one_gpu_are_all_in_its_pool_or_none():
    """A stream outside the pool on the pool's GPU would run beside the pool's ops on the same
    SMs (2 s of work in 1 s, a negative bubble): refused."""
    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("lane", Resource.GPU, pool="sms")
    b.stream("other", Resource.GPU)
    b.add(OpKind.FFN, "lane", (), flops=1e12)
    b.add(OpKind.FFN, "other", (), flops=1e12)
    with pytest.raises(ScheduleError, match=r"resource gpu: streams \['lane', 'other'\] mix pools"):
        validate(b.build())


def test_peak_memory_counts_an_allocation_from_its_grant():
    """Load W (1 GB, 1 s) holds h2d; load E takes 0.5 GB at 0 s and waits for the link until 1 s,
    while a 0.5 s compute holds the other 0.5 GB: the GPU is full during 0-0.5 s (a 0.1 GB load
    on d2h starts at 0.5 s), so the peak is 1 GB, not the 0.6 GB counted from E's start."""
    from core.trace import make_trace, peak_bytes
    from sim.executor import simulate_times

    h = hw(gpu_gb=1.0)
    b = ScheduleBuilder(h.memory_bytes)
    for name, res in (
        ("w", Resource.H2D),
        ("e", Resource.H2D),
        ("c", Resource.GPU),
        ("d", Resource.D2H),
    ):
        b.stream(name, res)
    load(b, "w", GB)
    b.add(
        OpKind.LOAD,
        "e",
        (),
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=GB // 10,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB // 2,
    )
    b.add(
        OpKind.FFN,
        "c",
        (),
        flops=0.5e12,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB // 2,
        free_tier=Tier.GPU,
        free_bytes=GB // 2,
    )
    b.add(
        OpKind.LOAD,
        "d",
        (),
        src=Tier.GPU,
        dst=Tier.CPU,
        nbytes=GB // 100,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB // 10,
    )
    s = b.build()
    validate(s)
    start, end, granted = simulate_times(s, CostModel(h))
    assert start[1] == pytest.approx(1.0) and granted[1] == 0.0 and start[3] == pytest.approx(0.5)
    assert np.isnan(granted[0])  # allocates nothing
    assert peak_bytes(s, make_trace(s, start, end, "sim", alloc_s=granted))["gpu"] == GB
    assert peak_bytes(s, make_trace(s, start, end, "sim"))["gpu"] == 6 * GB // 10  # from starts


def test_dag_bound_takes_a_pool_op_at_the_whole_gpu():
    """Pool ops A and B (1 s of the whole GPU each) share the SMs, so each ends at 2 s; a 1 s load
    after A then ends at 3 s. A alone first, then B beside the load, would end at 2 s: the bound
    is 2 s (A's chain at its whole-GPU time), not the 3 s of the shared run's durations."""
    from core.trace import dag_bound, make_trace

    h = hw()
    cost = CostModel(h)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("A", Resource.GPU, pool="sms")
    b.stream("B", Resource.GPU, pool="sms")
    b.stream("w", Resource.H2D)
    a = b.add(OpKind.FFN, "A", (), flops=1e12)
    b.add(OpKind.FFN, "B", (), flops=1e12)
    load(b, "w", GB, deps=(a,))
    s = b.build()
    parts = cost.pool_parts(s)
    start, end = simulate(s, cost, parts)
    assert end.tolist() == pytest.approx([2.0, 2.0, 3.0])
    trace = make_trace(s, start, end, "sim", sm_s=parts[1], launch_s=parts[0])
    assert dag_bound(s, trace)[0] == pytest.approx(2.0)


def test_same_schedule_same_times():
    h = hw(latency_us=3)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("c", Resource.GPU)
    prev = None
    for i in range(20):
        a = load(b, "w", (i + 1) * 10**7, deps=(prev,))
        prev = b.add(OpKind.FFN, "c", deps=(a,), flops=1e10 * (i % 3))
    s1, e1 = run(b, h)
    s2, e2 = run(b, h)
    assert (s1 == s2).all() and (e1 == e2).all()


def _traced(b: ScheduleBuilder, h: HardwareSpec):
    from core.trace import make_trace

    s = b.build()
    validate(s)
    return s, make_trace(s, *simulate(s, CostModel(h)), source="sim")


def test_dag_bound_adds_phases_the_resource_bound_takes_the_max_of():
    """Prefill compute 5 s (step 0), then a decode load of 4 s that needs it (transfer space)
    and a 1 s decode compute after the load: the busiest resource is busy 6 s, but the chain
    is 5 + 4 + 1 = 10 s, which the simulation takes and the DAG bound finds."""
    from core.trace import busy_s, dag_bound

    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("c", Resource.GPU)
    p = b.add(OpKind.FFN, "c", flops=5e12, step=0)
    ld = b.add(OpKind.LOAD, "w", (p,), src=Tier.CPU, dst=Tier.GPU, nbytes=4 * GB, step=1)
    b.add(OpKind.FFN, "c", (ld,), flops=1e12, step=1)
    s, trace = _traced(b, h)
    assert max(busy_s(trace).values()) == pytest.approx(6.0)
    bound, _ = dag_bound(s, trace)
    assert bound == pytest.approx(10.0) == pytest.approx(trace["end_s"].max())


def test_dag_bound_counts_one_resource_between_release_and_delivery():
    """Two 1 s loads on h2d, each released only after a 2 s compute chain (head 2 s), and a 1 s
    compute after each (tail 1 s): head 2 + 2 loads + tail 1 = 5 s >= any single chain (4 s);
    the simulation takes 5 s."""
    from core.trace import dag_bound

    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w1", Resource.H2D)
    b.stream("w2", Resource.H2D)
    b.stream("c1", Resource.GPU)
    b.stream("c2", Resource.CPU)
    a = b.add(OpKind.FFN, "c1", flops=2e12)
    c = b.add(OpKind.FFN, "c2", flops=0.2e12)  # cpu: 0.1 TFLOP/s -> 2 s
    l1 = b.add(OpKind.LOAD, "w1", (a,), src=Tier.CPU, dst=Tier.GPU, nbytes=GB)
    l2 = b.add(OpKind.LOAD, "w2", (c,), src=Tier.CPU, dst=Tier.GPU, nbytes=GB)
    b.add(OpKind.FFN, "c1", (l1,), flops=1e12)
    b.add(OpKind.FFN, "c2", (l2,), flops=0.1e12)
    s, trace = _traced(b, h)
    bound, binds = dag_bound(s, trace)
    assert bound == pytest.approx(5.0) == pytest.approx(trace["end_s"].max())
    assert binds.startswith("h2d")


@pytest.mark.parametrize("made_by", ["Environment.timeout", "Process.__init__"])
def test_a_run_makes_no_timeout_and_no_process(monkeypatch, made_by):
    """Each op's duration is one event the stream puts on simpy's queue itself (the run's most
    frequent event: simpy's `timeout` call costs two Python calls more), at the time, priority
    and order `env.timeout` would give; each stream's generator is resumed by a callback of its
    own (`sim.executor._start`), not by a simpy Process, whose resume takes several Python
    calls per event more. A 1 s load, then a 0.5 s compute after it, end at 1 s and 1.5 s,
    with no `env.timeout` and no Process made."""
    import simpy

    cls, name = made_by.split(".")
    made = []
    real = getattr(getattr(simpy, cls), name)
    monkeypatch.setattr(
        getattr(simpy, cls), name, lambda obj, *a, **k: made.append(a) or real(obj, *a, **k)
    )
    start, end = _load_then_compute()
    assert list(end) == pytest.approx([1.0, 1.5]) and list(start) == pytest.approx([0.0, 1.0])
    assert made == []


def test_each_event_resumes_its_streams_by_their_own_send(monkeypatch):
    """Each event a stream waits on (an op's run, a dep) calls the stream generator's own `send`
    (added by the generator itself), not a Python function around it, a frame less per event:
    a 1 s load and a 0.5 s compute after it end at 1 s and 1.5 s, and every callback of every
    event simpy runs is a generator's send."""
    import types

    import simpy

    seen = []
    real = simpy.Environment.step

    def step(env):
        if env._queue:  # (the last step finds it empty and ends the run)
            seen.extend(env._queue[0][3].callbacks)
        real(env)

    monkeypatch.setattr(simpy.Environment, "step", step)
    start, end = _load_then_compute()
    assert list(end) == pytest.approx([1.0, 1.5]) and list(start) == pytest.approx([0.0, 1.0])
    assert len(seen) == 5  # two starts, the load's run, the dep, the compute's run
    assert all(getattr(c, "__name__", "") == "send" for c in seen)
    assert all(isinstance(getattr(c, "__self__", None), types.GeneratorType) for c in seen)


def test_a_stream_runs_its_ops_on_one_event(monkeypatch):
    """A stream waits on one op's run at a time, so one event of its own stands for each run
    in turn, put back on simpy's queue (an object made per op was a tenth of the simulation):
    three 1 s loads on one stream end at 1, 2 and 3 s, queued as one event three times."""
    import sim.executor

    pushed = []
    real = sim.executor.heappush
    monkeypatch.setattr(sim.executor, "heappush", lambda q, e: pushed.append(e[3]) or real(q, e))
    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    for _ in range(3):
        load(b, "w", GB)
    start, end = run(b, h)
    assert list(end) == pytest.approx([1.0, 2.0, 3.0]) and list(start) == pytest.approx([0, 1, 2])
    assert len(pushed) == 3 and len({id(e) for e in pushed}) == 1


def test_done_flags_are_a_list_of_bools():
    """Whether each op is done, read once per dep (1.7 million reads in a 178k-op run), is a
    list of bools: a list's item reads faster than a bytearray's, which makes an int of it."""
    from sim.executor import _Run

    run = _Run(3, [])
    assert run.done == [False] * 3 and type(run.done) is list


@pytest.mark.parametrize("stuck", [False, True])
def test_a_run_leaves_nothing_for_the_cycle_collector(stuck):
    """Once the simulation ends, its schedule and its streams are freed with their last
    reference: no stream's generator, which never ends, is left in a cycle (its frame held its
    own `send`) that kept them till the collector's next pass. A run stuck on memory (a
    ScheduleError) lets them go as well."""
    import gc
    import weakref

    h = hw(gpu_gb=1.0 if stuck else 2.0)
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    load(b, "w", GB, alloc=True)
    load(b, "w", GB, alloc=True)  # the GPU holds one: stuck
    s = b.build()
    gone = weakref.ref(s)
    was = gc.isenabled()
    gc.disable()
    try:
        if stuck:
            with pytest.raises(ScheduleError):
                simulate(s, CostModel(h))
        else:
            simulate(s, CostModel(h))
        del s
        assert gone() is None
    finally:
        if was:
            gc.enable()


def test_a_run_kept_to_the_commands_end_keeps_its_streams_whole():
    """`keep` (a single run's command, which ends without freeing its memory): the streams go
    there as they are, none closed (freeing them costs a run's time for nothing)."""
    from sim.executor import simulate_times

    h = hw()
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("w", Resource.H2D)
    b.stream("x", Resource.H2D)
    load(b, "w", GB)
    load(b, "x", GB)
    keep: list[object] = []
    start, end, _ = simulate_times(b.build(), CostModel(h), keep=keep)
    assert end.tolist() == [1.0, 2.0]
    (streams,) = keep
    assert len(streams) == 2 and all(s.gi_frame is not None for s in streams)
