"""The real executor's interpreter on its own, with op work that only sleeps and records: streams
are FIFOs, deps and memory hold an op back, shared resources run one op at a time, and a
failing op stops the run with its error."""

import threading
import time

import pytest
import torch

from core.schedule import Op, ScheduleBuilder, StreamSpec
from core.types import OpKind, Resource, Tensor, Tier
from real.interpreter import Interpreter

CAP = {Tier.GPU: 100, Tier.CPU: 100, Tier.DISK: 100}


def run(builder: ScheduleBuilder, work_s: dict[int, float], fail: int | None = None):
    """Run the builder's ops; each sleeps `work_s[id]` (default 1 ms). (start, end) per op."""
    schedule = builder.build()

    def work(op: Op, spec: StreamSpec, _stream) -> None:
        if op.id == fail:
            raise RuntimeError(f"op {op.id} broke")
        time.sleep(work_s.get(op.id, 0.001))

    it = Interpreter(work, lambda op: None, torch.device("cpu"), CAP, lambda: {}, 5.0, None)
    for op in schedule.ops:
        it.add(op, schedule.streams[op.stream])
    it.finish_adding()
    it.execute()
    return schedule, it.start_s, it.end_s


def load(b: ScheduleBuilder, stream: str, deps=(), **kw) -> int:
    return b.add(OpKind.LOAD, stream, deps, tensor=Tensor.HIDDEN, src=Tier.CPU, dst=Tier.GPU, **kw)


def test_deps_fifo_and_resources():
    """a (h2d) and c (d2h) ops run side by side; b (also h2d) shares a's link, so b's op waits
    for a's 30 ms op although they are different streams; c1 waits for a0 (a dep); n1 waits
    for n0's 30 ms, the op before it on its stream."""
    b = ScheduleBuilder(CAP)
    a, b_, c = (
        b.stream("a", Resource.H2D),
        b.stream("b", Resource.H2D),
        b.stream("c", Resource.D2H),
    )
    a0 = load(b, a)
    a1 = load(b, a)
    b0 = load(b, b_)
    c0 = load(b, c)
    c1 = load(b, c, [a0])
    n = b.stream("n", Resource.NONE)  # no resource lock: only the stream orders its ops
    n0, n1 = load(b, n), load(b, n)
    schedule, start, end = run(b, {a0: 0.03, b0: 0.03, n0: 0.03})
    assert start[a1] >= end[a0] and start[n1] >= end[n0]  # FIFO
    assert start[c1] >= end[a0]  # dep
    assert start[c0] < end[a0]  # another resource: not held up by a0
    link = sorted((start[i], end[i]) for i in (a0, a1, b0))
    assert all(s >= e for (_, e), (s, _) in zip(link, link[1:], strict=False))  # one at a time


def test_an_allocation_waits_for_the_free_that_makes_room():
    """x takes 60 of the GPU's 100 B for 80 ms; y on another stream, after a 30 ms op there,
    wants 60 too and starts only once x has freed its bytes."""
    b = ScheduleBuilder(CAP)
    s1, s2 = b.stream("s1", Resource.H2D), b.stream("s2", Resource.D2H)
    x = load(b, s1, alloc_tier=Tier.GPU, alloc_bytes=60, free_tier=Tier.GPU, free_bytes=60)
    w = load(b, s2)
    y = load(b, s2, alloc_tier=Tier.GPU, alloc_bytes=60)
    _, start, end = run(b, {x: 0.08, w: 0.03})
    assert start[x] < end[w]  # (else the test shows nothing)
    assert start[y] >= end[x]


def test_a_failing_op_stops_the_run_with_its_error():
    """The error of the op that failed is raised; every worker thread ends."""
    b = ScheduleBuilder(CAP)
    s1, s2 = b.stream("s1", Resource.H2D), b.stream("s2", Resource.D2H)
    first = load(b, s1)
    load(b, s1, [first])
    load(b, s2, [first])
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="op 0 broke"):
        run(b, {}, fail=first)
    assert threading.active_count() == before
