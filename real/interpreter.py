"""The real executor's interpreter: a schedule's streams on worker threads, its deps, memory,
resources and clock, with no knowledge of what an op does (`real.ops` says that). Its rules
(one worker per stream, waits and wake-ups, stalls that raise): docs/architecture.md#executors.

Usage:
    it = Interpreter(work, release, device, capacity, reserves)
    it.add(op, spec)  # for each op, before or during `it.execute()`
    it.execute(); it.start_s, it.end_s   # seconds from the run's start
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from core.errors import MoepipeError, ScheduleBug, ScheduleError
from core.schedule import Op, Schedule, StreamSpec, stuck_error
from core.types import OpKind, Resource, Tier

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting thread re-checks for errors (errors also wake it)
_MAIN_POLL_S = 0.2  # how often the main thread checks for stalls

# an op's work: (op, its stream, the worker's CUDA stream or None)
Work = Callable[[Op, StreamSpec, "torch.cuda.Stream | None"], None]


class _Stop(Exception):
    """Raised inside a waiting thread once another thread has failed."""


@functools.cache  # one measurement per process: a machine's load, not a run's
def cpu_compute_threads(reps: int = 5) -> int:
    """Torch intra-op threads of a CPU-only run, measured, not assumed: the count among every
    core, every core but one, and one that runs a small expert-shaped FFN fastest (median of
    `reps` interleaved timings, about 0.1-0.5 s). The device-pool "GPU" is the CPU itself, and
    whether a core is free for it depends on what else runs: on the 2-core VM here, idle, every
    core was fastest; shared with other work (load 14), two OpenMP threads took 8x one's time
    (146 against 19 ms), a descheduled thread holding up every op. The transfer workers need
    little CPU beside compute (O_DIRECT reads wait on DMA). `experiments.calibrate` times
    compute with the count this picks."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    counts = sorted({cores, max(1, cores - 1), 1}, reverse=True)
    if len(counts) == 1:
        return cores
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((64, 512), (1536, 512), (512, 1536)))
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        with torch.inference_mode():
            for _ in range(reps):
                for n in counts:
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    torch.nn.functional.silu(x @ w1.T) @ w2.T
                    times[n].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return min(counts, key=lambda n: (sorted(times[n])[reps // 2], -n))


@functools.cache  # process-wide, once: glibc's allocator settings are the process's
def cache_freed_memory() -> bool:
    """On a CPU-only run, keep freed blocks of up to 32 MiB in the process heap for reuse, as
    CUDA's caching allocator keeps a GPU's (glibc `mallopt`; True if set). The RAM device pool
    allocates a unit's buffer at each load and drops it at its free: by default glibc maps each
    block over 128 KiB fresh (page faults, zeroed pages) and unmaps it on free, which stalls the
    freeing thread on TLB shoot-downs while the compute threads run on the other cores (up to
    13 ms per free on the 2-core VM, the largest part of `late@gpu`). Reused blocks take no new
    memory beyond the pool's own peak: what is kept was in use. Also called by
    `experiments.calibrate`, whose timings must see the allocator a run sees.

    Also bounds oneDNN's primitive cache (where the user has not set it), before the first
    kernel reads it: it keeps one primitive, with its buffers, per matmul shape, and an expert's
    token count differs from op to op. At its default of 1024 it held about 170 MB of a run's
    peak (OLMoE, 8 layers, n = 31), and 16 ran no slower on the 2-core VM."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc: its allocator keeps its own policy
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 64 << 20))


@dataclass(eq=False)
class _Worker:
    """One stream's thread, its queue, and what it waits for while blocked."""

    name: str
    spec: StreamSpec
    cond: threading.Condition  # on the interpreter's lock
    lock: threading.Lock | None  # its physical resource's, or None (a pool, no resource)
    queue: deque[Op] = field(default_factory=deque)
    ready: Callable[[], bool] | None = None  # set while it waits: true once it may go on
    running: tuple[int, float] | None = None  # (op id, monotonic start) while an op's work runs
    thread: threading.Thread | None = None
    set_up: threading.Event = field(default_factory=threading.Event)  # ready for the clock


class Interpreter:
    """Runs ops on per-stream worker threads; `work` does an op, `release` applies its end-of-op
    memory effect to the weights (after its kernels finished)."""

    def __init__(
        self,
        work: Work,
        release: Callable[[Op], None],
        device: torch.device,
        capacity: Mapping[Tier, int],
        reserves: Callable[[], Mapping[Tier, int]],
        stall_timeout_s: float = 120.0,
        compute_threads: int | None = None,
    ) -> None:
        """`reserves`: the bytes each tier holds before the first op (read when it arrives: a live
        planner makes its reserves before it emits ops)."""
        self.work, self.release, self.device = work, release, device
        self.cuda = device.type == "cuda"
        self.capacity, self.reserves = dict(capacity), reserves
        self.stall_timeout_s, self.compute_threads = stall_timeout_s, compute_threads
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)  # the main thread, planner and peers wait here
        self.free: dict[Tier, int] | None = None  # set when the first op arrives
        self.room: dict[
            Tier, int
        ] = {}  # each tier's bytes beside the reserved ones (the most free)
        self.ops: list[Op] = []
        self.done: list[bool] = []
        self.n_done = 0
        self.start_s: list[float] = []
        self.end_s: list[float] = []
        self.streams: dict[str, StreamSpec] = {}
        self.error: BaseException | None = None
        self.planner_done = False
        self.started = False
        self.t0 = 0.0
        self._workers: dict[str, _Worker] = {}
        self._go = threading.Event()  # the clock runs: workers set up before it start their ops
        self._locks: dict[str, threading.Lock] = {}
        if self.cuda:
            # blocking events: a worker waiting on one sleeps instead of spinning a CPU core,
            # which the disk reader and CPU experts need
            self._t0_event = torch.cuda.Event(enable_timing=True, blocking=True)

    # ---- building ---------------------------------------------------------------------------
    def add(self, op: Op, spec: StreamSpec, local: bool = True) -> None:
        """Queue an op (ids in order). `local=False`: another process runs it; it counts as done
        here (a dep on it is honoured by the transfer op that brings its data)."""
        with self.lock:
            if self.free is None:
                res = self.reserves()
                self.free = {t: self.capacity[t] - res.get(t, 0) for t in Tier}
                self.room = dict(self.free)
            assert op.id == len(self.ops), "ops arrive in id order"
            self.ops.append(op)
            self.done.append(not local)
            self.start_s.append(0.0)
            self.end_s.append(0.0)
            self.streams.setdefault(op.stream, spec)
            if not local:
                self.n_done += 1
                self._wake()
                self.cv.notify_all()
                return
            w = self._workers.get(op.stream) or self._new_worker(op.stream, spec)
            w.queue.append(op)
            if w.ready is not None and w.ready():
                w.cond.notify()
            self.cv.notify_all()  # a peer's listener may wait for the op to exist

    def _new_worker(self, name: str, spec: StreamSpec) -> _Worker:
        rid = spec.resource_id
        if rid not in self._locks:
            self._locks[rid] = threading.Lock()
        # a pool's streams share their resource (a GPU's SMs, a link) with no lock, as in the
        # simulator
        lock = None if spec.resource == Resource.NONE or spec.pool else self._locks[rid]
        w = self._workers[name] = _Worker(name, spec, threading.Condition(self.lock), lock)
        w.thread = threading.Thread(
            target=self._worker, args=(w,), name=f"stream-{name}", daemon=True
        )
        if self.started:
            w.thread.start()
        return w

    def finish_adding(self) -> None:
        """No more ops: workers with empty queues end."""
        with self.lock:
            self.planner_done = True
            for w in self._workers.values():
                w.cond.notify()
            self.cv.notify_all()

    # ---- waiting ----------------------------------------------------------------------------
    def fail(self, e: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = e
            for w in self._workers.values():
                w.cond.notify()
            self.cv.notify_all()

    def wait(self, ready: Callable[[], bool]) -> None:
        """Wait (holding `self.cv`) until ready(); raise _Stop if another thread failed. For
        threads other than the workers (a live planner, a peer's listener): woken by
        `cv.notify_all`, and by polling."""
        while not ready():
            if self.error is not None:
                raise _Stop
            self.cv.wait(timeout=_POLL_S)
        if self.error is not None:
            raise _Stop

    def _block(self, w: _Worker, ready: Callable[[], bool]) -> None:
        """A worker's wait (holding the lock) until ready(): `_wake` notifies it once it is."""
        while not ready():
            if self.error is not None:
                raise _Stop
            w.ready = ready
            try:
                w.cond.wait(timeout=_POLL_S)
            finally:
                w.ready = None
        if self.error is not None:
            raise _Stop

    def _wake(self) -> None:
        """(Holding the lock, after a state change.) Wake each worker whose wait is over."""
        for w in self._workers.values():
            if w.ready is not None and w.ready():
                w.cond.notify()

    # ---- running ----------------------------------------------------------------------------
    def execute(self, before_start: Callable[[], None] | None = None) -> None:
        """Run every op added (and those added while it runs, until `finish_adding`); raise the
        first worker's error. `before_start`: called once the threads are set, before the clock
        starts (a G-process run's barrier)."""
        grad_before = torch.is_grad_enabled()  # restored on return: the caller's autograd state
        torch.set_grad_enabled(False)
        threads_before = torch.get_num_threads()
        if self.compute_threads is not None:
            torch.set_num_threads(self.compute_threads)
        with self.lock:
            self.started = True
            workers = list(self._workers.values())
        try:
            # a thread's start and set-up (a CUDA stream, OpenMP threads) are not the run's time
            for w in workers:
                assert w.thread is not None
                w.thread.start()
            for w in workers:
                w.set_up.wait(timeout=self.stall_timeout_s)
            if before_start is not None:
                before_start()
            if self.cuda:
                torch.cuda.synchronize(self.device)
                self._t0_event.record(torch.cuda.current_stream(self.device))  # the run's device
                self._t0_event.synchronize()  # elapsed_time needs both events complete
            self.t0 = time.perf_counter()
            self._go.set()
            self._watch()
        except BaseException as e:  # a failed start (a peer lost at the barrier): end the workers
            self.fail(e)
            raise
        finally:
            self.started = False
            self._go.set()  # a failed start: the workers see the error and end
            with self.lock:
                threads = [w.thread for w in self._workers.values() if w.thread is not None]
            for t in threads:
                if t.is_alive():
                    t.join(timeout=max(5.0, self.stall_timeout_s))
            torch.set_num_threads(threads_before)
            torch.set_grad_enabled(grad_before)
            if self.cuda:  # after a failure too: no queued copy reads or writes host slabs after
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError:
                    if self.error is None:
                        raise
        if self.error is not None:
            raise self.error

    def _finished(self) -> bool:
        return self.planner_done and self.n_done == len(self.ops)

    def _watch(self) -> None:
        """The main thread: wait for the end, an error, or a stall (which becomes the error)."""
        last_progress, last_time = -1, time.monotonic()
        while True:
            with self.lock:
                self.cv.wait(timeout=_MAIN_POLL_S)
                if self.error is not None or self._finished():
                    return
                now = time.monotonic()
                running = [w.running for w in self._workers.values()]
                running = [r for r in running if r is not None]
                if self.n_done != last_progress or running:
                    last_progress, last_time = self.n_done, now
                stall = self._stall(running, now, last_time)
                if stall is not None:
                    self.error = stall
                    for w in self._workers.values():
                        w.cond.notify()
                    return

    def _stall(
        self, running: list[tuple[int, float]], now: float, last_time: float
    ) -> ScheduleError | None:
        """The error of a run stuck for `stall_timeout_s`: an op running that long (a hung read
        or collective), or no op running and none finishing."""
        if running:  # something runs: a stall only if it runs too long
            oid, since = min(running, key=lambda r: r[1])
            if now - since > self.stall_timeout_s:
                return ScheduleError(
                    f"real run: {self.ops[oid].label()} has run for "
                    f"{now - since:.0f} s (stall_timeout_s={self.stall_timeout_s:g}); "
                    "a hung disk read or collective? check the disk and the other ranks, then "
                    "run it again"
                )
        elif now - last_time > self.stall_timeout_s:
            free = self.free or {t: 0 for t in Tier}
            stuck = Schedule(self.ops, dict(self.streams), self.capacity, {}, {})
            # memory a tier lacks: the user's to raise; ops waiting on each other: a bug
            what = f"real run made no progress for {self.stall_timeout_s:g} s"
            return stuck_error(stuck, self.done, free, what)
        return None

    def _worker(self, w: _Worker) -> None:
        cuda_stream = torch.cuda.Stream(self.device) if self.cuda else None
        torch.set_grad_enabled(False)
        if self.compute_threads is not None:  # OpenMP's thread count is per calling thread
            torch.set_num_threads(self.compute_threads)
        lock = w.lock
        w.set_up.set()
        self._go.wait()
        try:
            while True:
                with self.lock:
                    op = self._next(w)
                    if op is None:
                        return
                use_lock = lock is not None and op.kind != OpKind.FREE
                if use_lock:
                    assert lock is not None
                    while not lock.acquire(timeout=_POLL_S):
                        if self.error is not None:
                            raise _Stop
                w.running = (op.id, time.monotonic())
                try:
                    start, end = self._timed(op, w.spec, cuda_stream)
                finally:
                    w.running = None
                    if use_lock:
                        assert lock is not None
                        lock.release()
                with self.lock:
                    self._end_op(op, start, end)
        except _Stop:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            # re-raised there with this thread's frames: the command's one line (an expected
            # failure: out of memory) or its traceback file (a bug). Logged, the traceback went
            # to the console and run.log above that line, out of memory's too.
            if not isinstance(e, MoepipeError | OSError):
                log.debug("stream %s failed", w.name, exc_info=True)
            self.fail(e)

    def _next(self, w: _Worker) -> Op | None:
        """(Holding the lock.) The stream's next op once its deps are done and its allocation
        taken; None once the stream has no more ops."""
        q, done = w.queue, self.done
        self._block(w, lambda: bool(q) or self.planner_done)
        if not q:
            return None
        op = q.popleft()
        if not all(done[d] for d in op.deps):
            self._block(w, lambda: all(done[d] for d in op.deps))
        if op.alloc_bytes:
            free, tier, n = self.free, op.alloc_tier, op.alloc_bytes
            assert free is not None and tier is not None
            if free[tier] < n:
                self._block(w, lambda: free[tier] >= n)
            free[tier] -= n
        return op

    def _end_op(self, op: Op, start: float, end: float) -> None:
        """(Holding the lock.) The op's memory effect, its times, and the wake-ups it causes."""
        if op.free_bytes:
            assert self.free is not None and op.free_tier is not None
            self.free[op.free_tier] += op.free_bytes
            if self.free[op.free_tier] > self.room[op.free_tier]:
                raise ScheduleBug(  # as the simulator's check (sim/executor.py)
                    f"{op.label()} frees {op.free_bytes} B of {op.free_tier}, more "
                    "than the ops before it hold: each free must match an "
                    "allocation still held"
                )
        self.start_s[op.id], self.end_s[op.id] = start, end
        self.done[op.id] = True
        self.n_done += 1
        self._wake()
        if self._finished():
            self.cv.notify_all()

    def _timed(
        self, op: Op, spec: StreamSpec, cuda_stream: torch.cuda.Stream | None
    ) -> tuple[float, float]:
        """Run one op and its memory effect (`release`); its (start, end) in seconds from the
        run's start (CUDA: from events)."""
        if cuda_stream is None:
            start = time.perf_counter() - self.t0
            self.work(op, spec, None)
            end = time.perf_counter() - self.t0
            self.release(op)
            return start, end
        ev_start = torch.cuda.Event(enable_timing=True)
        ev_end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(cuda_stream):
            ev_start.record(cuda_stream)
            self.work(op, spec, cuda_stream)
            ev_end.record(cuda_stream)
        ev_end.synchronize()  # the op's data is ready for every other stream once marked done
        # Only now drop what the op frees: its kernels have read the weights. Freed earlier, the
        # caching allocator could hand their block (allocated on a load stream) to the next load
        # on that stream while this op's kernels still read it.
        self.release(op)
        return (
            self._t0_event.elapsed_time(ev_start) / 1e3,
            self._t0_event.elapsed_time(ev_end) / 1e3,
        )
