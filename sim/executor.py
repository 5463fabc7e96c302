"""Discrete-event simulator: runs a schedule on simpy with one process per stream.

Streams are FIFO; an op waits for its deps, then for the memory it allocates, then for its
physical resource (shared by every stream mapped onto it, first come first served), runs for
the cost model's duration, and frees memory at its end. Deterministic.
A compute op on a stream in a shared pool (`StreamSpec.pool`: CUDA streams on one GPU) instead
runs its overhead on its stream, then its work alongside the pool's other running ops, at a
share of the GPU that changes as they start and end (`_Fluid`); a transfer in a link's pool
likewise runs its latency, then its bytes at a share of the link's bandwidth.
Where the GPU's collectives hold SMs (`gpu.comm_sms`), a GPU's running dispatch, combine or
all-reduce (`COLLECTIVES`) takes that share of it from start to end, and its compute ops run
their work in the rest: at full rate while none runs, slower beside one (as NCCL's or DeepEP's
kernels take SMs from the GEMMs they overlap). Replica copies, the copy engines', take none.

Usage:
    start_s, end_s = simulate(schedule, CostModel(hardware))
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from heapq import heappush
from itertools import repeat
from operator import itemgetter
from typing import Any

import numpy as np
import simpy
from simpy.events import NORMAL, URGENT, Timeout

from core.cost import CostModel, as_processes, water_fill
from core.errors import ScheduleBug
from core.schedule import Op, Schedule, stuck_error
from core.types import COLLECTIVES, COMPUTE_KINDS, COPY_LINKS, OpKind, Resource, Tensor, Tier

_TIERS = list(Tier)


class _Lock:
    """A resource that runs one op at a time; waiters are served in arrival order."""

    __slots__ = ("busy", "queue")

    def __init__(self) -> None:
        self.busy = False
        self.queue: deque[simpy.Event] = deque()


class _Pool:
    """Free bytes of one memory tier. An allocation that fits is granted at once; blocked ones
    are granted in arrival order, each as soon as it fits (a smaller later one may pass a larger
    earlier one, as in `core.schedule.validate`'s check)."""

    __slots__ = ("free", "room", "waiting")

    def __init__(self, free: int) -> None:
        self.free = self.room = free  # room: the tier's bytes beside its resident ones
        self.waiting: deque[tuple[int, simpy.Event]] = deque()

    def release(self, nbytes: int) -> bool:
        """Give back `nbytes`; False if that frees more than the ops hold (a double free,
        which would let later ops over-commit the tier)."""
        self.free += nbytes
        if self.free > self.room:
            return False
        if not self.waiting:
            return True
        still: deque[tuple[int, simpy.Event]] = deque()
        for amount, ev in self.waiting:
            if amount <= self.free:
                self.free -= amount
                ev.succeed()
            else:
                still.append((amount, ev))
        self.waiting = still
        return True


class _Fluid:
    """Processor sharing of one GPU (or one link) among its pool's running ops: each op runs at
    rate min(cap, level), the level chosen so the rates sum to 1 (water-filling; all at their
    caps if those sum to less). An op of `work` seconds at the whole GPU ends when its rate
    integrated over time reaches `work`. Re-planned whenever an op joins or ends."""

    __slots__ = ("env", "jobs", "t", "gen", "held", "holders")

    def __init__(self, env: simpy.Environment, held: tuple[float, ...] = ()) -> None:
        self.env = env
        self.jobs: dict[int, list[Any]] = {}  # op id -> [work left, cap, rate, event]
        self.t = 0.0  # when the work left was last brought up to date
        self.gen = 0  # the wake-up that is current; older ones are stale
        self.held = held  # per kind of holder (`hold`), the share its running ops hold
        self.holders = [0] * len(held)  # per kind, its ops running now

    def hold(self, kind: int, delta: int) -> None:
        """An op of holder kind `kind` (the GPU's collectives, its replica copies) starts (+1) or
        ends (-1). While some of a kind run, they hold its share, once: the collectives of one
        GPU are one communicator's kernel, its copies another's (`_sm_holds`); the jobs share
        what the running kinds leave."""
        self._advance()
        self.holders[kind] += delta
        self._plan()

    def run(self, op_id: int, work: float, cap: float) -> simpy.Event:
        self._advance()
        ev = self.env.event()
        self.jobs[op_id] = [work, cap, 0.0, ev]
        self._plan()
        return ev

    def _advance(self) -> None:
        dt = self.env.now - self.t
        for job in self.jobs.values():
            job[0] -= job[2] * dt
        self.t = self.env.now

    def _plan(self) -> None:
        if not self.jobs:
            return
        jobs = list(self.jobs.values())
        total = 1.0 - sum(h for h, n in zip(self.held, self.holders, strict=True) if n)
        for job, rate in zip(jobs, water_fill([j[1] for j in jobs], total), strict=True):
            job[2] = rate
        first = min(self.jobs, key=lambda i: self.jobs[i][0] / self.jobs[i][2])
        self.gen += 1
        gen, dt = self.gen, max(self.jobs[first][0] / self.jobs[first][2], 0.0)
        self.env.timeout(dt).callbacks.append(lambda _: self._wake(gen, first))

    def _wake(self, gen: int, first: int) -> None:
        if gen != self.gen:
            return
        self._advance()
        scale = max(1.0, *(abs(j[0]) for j in self.jobs.values()))
        done = [i for i, j in self.jobs.items() if i == first or j[0] <= 1e-12 * scale]
        for i in done:
            self.jobs.pop(i)[3].succeed()
        self._plan()


def _sm_holds(
    schedule: Schedule,
    cost: CostModel,
    env: simpy.Environment,
    durations: np.ndarray,
    pooled: np.ndarray,
    stream_of: list[int],
) -> tuple[dict[int, _Fluid], list[tuple[_Fluid, int] | None], np.ndarray, np.ndarray]:
    """Where `gpu.comm_sms` or `gpu.copy_sms` is set: a fluid per GPU (by device) running
    collectives (holder kind 0) or replica copies to or from another GPU (kind 1, on its p2p
    link's streams) that hold SMs; per op, the fluid and kind it holds SMs of (else None); and
    per op the overhead and work of each compute op on such a GPU's own (not pooled) streams,
    NaN for the others. Those run their work at rate 1 in the fluid: as fast as ever unless a
    holder runs."""
    n = len(schedule.ops)
    over, work = np.full(n, np.nan), np.full(n, np.nan)
    holding: list[tuple[_Fluid, int] | None] = [None] * n
    # a copy's share: its SMs on a GPU (copy_sms), or on G processes of one machine its memcpy
    # on the cores that compute (`processes.copy_share`)
    copy_share = cost.hw.gpu.copy_share or (
        cost.hw.processes.copy_share if as_processes(schedule) else 0.0
    )
    shares = (cost.hw.gpu.comm_share, copy_share)
    if not any(shares):
        return {}, holding, over, work
    specs = list(schedule.streams.values())
    kinds = list(OpKind)
    kind, st = schedule.columns()["kind"], np.asarray(stream_of, dtype=np.int64)
    link = np.array([s.resource in COPY_LINKS for s in specs], dtype=bool)
    copy = np.zeros(n, dtype=bool)
    if shares[1]:  # an expert's weights moved over a GPU's link: a replica copy
        copy = link[st] & np.array([o.tensor == Tensor.EXPERT for o in schedule.ops], dtype=bool)
        copy &= kind == kinds.index(OpKind.LOAD)
    holder = [np.isin(kind, [kinds.index(k) for k in COLLECTIVES]) & (shares[0] > 0), copy]
    devices = sorted({specs[s].device for h in holder for s in set(st[h].tolist())})
    holds = {d: _Fluid(env, shares) for d in devices}
    for k, h in enumerate(holder):
        for i in np.flatnonzero(h).tolist():
            holding[i] = (holds[specs[st[i]].device], k)
    if not holds:
        return holds, holding, over, work
    gpu_st = np.array(
        [s.resource == Resource.GPU and not s.pool and s.device in holds for s in specs]
    )
    comp = np.isin(kind, [kinds.index(k) for k in COMPUTE_KINDS]) & gpu_st[st] & ~pooled
    for i in np.flatnonzero(comp).tolist():
        over[i] = cost.overhead_s(Resource.GPU, kinds[kind[i]])
        work[i] = max(float(durations[i]) - over[i], 0.0)
    return holds, holding, over, work


def simulate(
    schedule: Schedule,
    cost: CostModel,
    pool_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Simulate; return per-op start and end times in seconds. Raises ScheduleError if stuck.
    pool_parts: `cost.pool_parts(schedule)`, where the caller has it already."""
    start, end, _ = simulate_times(schedule, cost, pool_parts)
    return start, end


def simulate_times(
    schedule: Schedule,
    cost: CostModel,
    pool_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    keep: list[object] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`simulate`, and when each op's allocation was granted (NaN for an op that allocates
    nothing): an op takes its memory, then waits for its resource. `keep`: where a command
    that ends without freeing its memory keeps the run's objects; the streams go there as they
    are, not closed (freeing them took 0.02-0.06 s of a 178k-op run)."""
    env = simpy.Environment()
    n = len(schedule.ops)
    pools = [_Pool(schedule.capacity_bytes[t] - schedule.resident_bytes.get(t, 0)) for t in _TIERS]
    run = _Run(n, pools)
    streams = [
        _run_stream(env, run, schedule, ops)
        for ops in _stream_rows(schedule, cost, env, pool_parts)
        if ops
    ]
    try:
        for stream in streams:
            _start(env, stream)
        env.run()
        if not all(run.done):
            free = {t: pools[i].free for i, t in enumerate(_TIERS)}
            raise stuck_error(
                schedule, run.done, free, "simulation stopped with ops left (deadlock)"
            )
        return np.asarray(run.start), np.asarray(run.end), np.asarray(run.granted)
    finally:
        # A stream's generator never ends (`_run_stream`), and its frame holds its own `send`:
        # a cycle that kept the schedule and the run alive till the cycle collector's next
        # pass, which walked them all (a quarter of a second after a 178k-op run, in a sweep's
        # worker or a test). Closed, their frames let them go with their last reference.
        if keep is not None:
            keep.append(streams)
        else:
            for stream in streams:
                stream.close()


class _Run:
    """What the stream processes of one simulation share: per op its start, end and grant
    times, whether it is done and the event its waiters wait on; the tiers' memory pools."""

    __slots__ = ("start", "end", "granted", "done", "waiters", "pools")

    def __init__(self, n: int, pools: list[_Pool]) -> None:
        self.start = [0.0] * n
        self.end = [0.0] * n
        self.granted = [np.nan] * n
        self.done = [False] * n  # (a list reads faster than a bytearray: 1.7 million reads)
        self.waiters: list[simpy.Event | None] = [None] * n  # events of ops someone waits for
        self.pools = pools


# an op's deps, read at C level (a generator's frame per op cost a tenth of `_stream_rows`)
_deps_of = itemgetter(Op._fields.index("deps"))


def _stream_rows(
    schedule: Schedule,
    cost: CostModel,
    env: simpy.Environment,
    pool_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
) -> list[list[tuple[Any, ...]]]:
    """Per stream, its ops in program order, flattened into tuples once (attribute access on
    dataclasses dominates otherwise): (id, deps, alloc tier and bytes, free tier and bytes,
    the lock of its resource, its duration, its share of a fluid, the SMs it holds, how long
    after it is ready it starts)."""
    n = len(schedule.ops)
    locks = {name: _Lock() for name in {s.resource_id for s in schedule.streams.values()}}
    cols = schedule.columns()
    stream_of = cols["stream"].tolist()
    specs = list(schedule.streams.values())
    # A resource only one stream uses needs no lock: the stream's FIFO already serialises it.
    users: dict[str, int] = {}
    for s in specs:
        users[s.resource_id] = users.get(s.resource_id, 0) + 1
    stream_locks = [
        None
        if s.resource == Resource.NONE or s.pool or users[s.resource_id] == 1
        else locks[s.resource_id]
        for s in specs
    ]
    durations, shared, holding = _shared_work(schedule, cost, env, pool_parts, stream_of)
    free_kind = list(OpKind).index(OpKind.FREE)
    # per op its stream's lock (a free takes none), picked at C level: [ops] object
    lock_of = np.array([*stream_locks, None], dtype=object)[
        np.where(cols["kind"] == free_kind, -1, cols["stream"])
    ].tolist()
    per_stream: list[list[tuple[Any, ...]]] = [[] for _ in specs]
    delays = cost.start_delays(schedule)
    for row in zip(
        range(n),
        map(_deps_of, schedule.ops),
        cols["alloc_tier"].tolist(),
        cols["alloc_bytes"].tolist(),
        cols["free_tier"].tolist(),
        cols["free_bytes"].tolist(),
        lock_of,
        durations.tolist(),
        shared,
        holding,
        delays.tolist() if delays.any() else repeat(0.0, n),  # (none: no float made per op)
        strict=True,
    ):
        per_stream[stream_of[row[0]]].append(row)
    return per_stream


def _shared_work(
    schedule: Schedule,
    cost: CostModel,
    env: simpy.Environment,
    pool_parts: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
    stream_of: list[int],
) -> tuple[np.ndarray, list[tuple[_Fluid, float, float] | None], list[tuple[_Fluid, int] | None]]:
    """Each op's duration on its stream, and for an op that shares a fluid (a pool's stream,
    or compute beside collectives holding SMs) the fluid, its work and its cap (its duration
    is then its overhead); per op the fluid and holder kind it holds SMs of (`_sm_holds`)."""
    n = len(schedule.ops)
    specs = list(schedule.streams.values())
    durations = cost.durations(schedule)
    # ops on pool streams: (pool, work, cap); their `durations` entry becomes the overhead
    fluids = {s.pool: _Fluid(env) for s in specs if s.pool}
    over, work, caps = (
        pool_parts if pool_parts is not None else cost.pool_parts(schedule, durations)
    )
    pooled = ~np.isnan(work)
    pool_of = [fluids[s.pool] if s.pool else None for s in specs]
    # collectives holding SMs: each GPU with one gets a fluid its compute ops run their work in
    # (their trace keeps sm_s NaN: such an op holds its GPU from start to end, slowed or not)
    holds, holding, sm_over, sm_work = _sm_holds(schedule, cost, env, durations, pooled, stream_of)
    if holds:
        held = ~np.isnan(sm_work)
        over, work = np.where(held, sm_over, over), np.where(held, sm_work, work)
        caps, pooled = np.where(held, 1.0, caps), pooled | held
    durations = np.where(pooled, over, durations)
    shared: list[tuple[_Fluid, float, float] | None] = [None] * n
    for i in np.flatnonzero(pooled).tolist():
        fluid = pool_of[stream_of[i]] or holds.get(specs[stream_of[i]].device)
        assert fluid is not None
        shared[i] = (fluid, float(work[i]), float(caps[i]))
    return durations, shared, holding


def _start(env: simpy.Environment, stream: Generator[simpy.Event, Any, None]) -> None:
    """Run a stream's generator as simpy's `env.process` would, at the same instants and in
    the same order (its start an URGENT event of time 0, as simpy's `Initialize`). Each event
    it waits on calls the generator's own `send`, which the generator adds to the event's
    callbacks itself (`_run_stream`): one C-level call per event, no Python frame around it.
    The streams' ops wait only on events that succeed (no failure to throw in) and not yet
    processed, and nothing waits on a stream's end (simpy's Process event, which it schedules
    when the generator ends, is left out: the other events keep their order). Primed here and
    handed its `send`, the generator waits at its second `yield` for the start event."""
    resume: Any = stream.send  # a callback: what it returns, simpy drops
    next(stream)
    stream.send(resume)
    init = simpy.Event(env)
    init.callbacks, init._ok, init._value = [resume], True, None
    env.schedule(init, URGENT)


def _run_stream(
    env: simpy.Environment, run: _Run, schedule: Schedule, ops: list[tuple[Any, ...]]
) -> Generator[simpy.Event, Any, None]:
    """One stream's process: each op in turn waits for its deps, its memory and its resource,
    runs, and frees its memory. It adds `resume` (its own `send`, from `_start`'s priming) to
    each event it waits on, then yields the event (simpy's loop ignores it; a Process would
    wait on it); at its end it waits on an event that never triggers (no StopIteration)."""
    resume = yield env.event()
    yield env.event()  # from here at the start event
    timeout, event, queue, eid = env.timeout, env.event, env._queue, env._eid
    ran = object.__new__(Timeout)  # an op's run (`dur` below)
    ran.env, ran.callbacks, ran._value, ran._delay, ran._ok = env, [], None, 0, True
    start, end, granted = run.start, run.end, run.granted
    done, waiters, pools = run.done, run.waiters, run.pools
    for op_id, deps, a_tier, a_bytes, f_tier, f_bytes, lock, dur, fluid, sm, delay in ops:
        for d in deps:
            if not done[d]:
                ev = waiters[d]
                if ev is None:
                    ev = waiters[d] = event()
                ev.callbacks.append(resume)
                yield ev
        if a_bytes:
            pool = pools[a_tier]
            if pool.free >= a_bytes:
                pool.free -= a_bytes
            else:
                ev = event()
                pool.waiting.append((a_bytes, ev))
                ev.callbacks.append(resume)
                yield ev
            granted[op_id] = env._now
        if delay > 0:  # the host's work before it (G processes: `CostModel.start_delays`)
            ev = timeout(delay)
            ev.callbacks.append(resume)
            yield ev
        if lock is not None:
            if lock.busy:
                ev = event()
                lock.queue.append(ev)
                ev.callbacks.append(resume)
                yield ev  # the releaser hands the lock over: busy stays True
            else:
                lock.busy = True
        start[op_id] = now = env._now
        if sm is not None:
            sm[0].hold(sm[1], 1)
        if dur > 0:
            # `timeout(dur)`, inlined (simpy's Timeout.__init__ and Environment.schedule): one
            # per op, the run's most frequent event; the same (time, priority, id) in the
            # queue. The stream's one event, made again ready: it waits on one at a time, and
            # simpy has popped the last one from its queue by the time the stream goes on
            ran.callbacks = [resume]
            heappush(queue, (now + dur, NORMAL, next(eid), ran))
            yield ran
            now = env._now
        if fluid is not None and fluid[1] > 0:
            ev = fluid[0].run(op_id, fluid[1], fluid[2])
            ev.callbacks.append(resume)
            yield ev
            now = env._now
        end[op_id] = now
        if sm is not None:
            sm[0].hold(sm[1], -1)
        if lock is not None:
            if lock.queue:
                lock.queue.popleft().succeed()
            else:
                lock.busy = False
        if f_bytes and not pools[f_tier].release(f_bytes):
            raise ScheduleBug(
                f"op {op_id} ({schedule.ops[op_id].kind}) frees {f_bytes} B of "
                f"{_TIERS[f_tier]}, more than the ops before it hold: each free must match "
                "an allocation still held"
            )
        done[op_id] = True
        ev = waiters[op_id]
        if ev is not None:
            ev.succeed()
    yield event()
