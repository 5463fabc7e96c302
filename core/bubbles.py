"""Where a run's GPU bubbles come from: each gap in which a GPU runs no kernel is laid, second by
second, on the chain of ops that held up the kernel ending it, and each second is named after
the op that held it: `load expert@h2d` (a weight transfer), `dispatch@p2p` (the all-to-all),
`compute-attention@gpu` (another GPU's work), `memory@gpu` (ready, waiting for memory),
`launch` (a kernel's launch on shared lanes), `late@gpu` (ready, its resource free, yet started
later: the executor's own delay, a real run's host threads or driver; the simulator has none).

Usage:
    causes = idle_causes(schedule, trace)   # {cause: seconds, mean over the GPUs}
    top_cause(causes); causes_tv(sim_causes, real_causes)   # the main one; two runs' mixes apart
    by_transfer(causes)   # a transfer's send and receive ends as one cause
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from core.schedule import Schedule
from core.shown import short_of
from core.types import OpKind, Resource, Tensor, Tier

if TYPE_CHECKING:
    import pandas as pd

    from core.trace_table import TraceTable

_EPS = 1e-12


def _gpu_of(schedule: Schedule) -> dict[str, int]:
    """Each GPU compute stream's physical GPU: its device, or 0 for every lane of one GPU."""
    lanes = schedule.ep is not None and schedule.ep.lanes
    return {
        name: 0 if lanes else s.device
        for name, s in schedule.streams.items()
        if s.resource == Resource.GPU
    }


def idle_causes(schedule: Schedule, trace: pd.DataFrame | TraceTable) -> dict[str, float]:
    """Seconds each cause kept the GPUs idle, the mean over the GPUs (largest first); they add up
    to the time no kernel ran, the run's `gpu_bubble_s`.

    A GPU is idle from 0 to the run's end wherever none of its compute ops' kernels runs (a
    pool op's from the end of its launch). Each idle gap ends where a kernel starts, or at the
    run's end (then the op that ended last stands for it). The gap is walked back along that
    op's critical chain: of its predecessors (its deps, the op before it on its stream, the op
    that held its resource before it) the one that ended last, then that one's, and so on to
    the gap's start. Where an op of the chain ran, the time is that op's (`kind@resource`, a
    load's with what it moves: `load expert@h2d`; `kind@gpu` is another GPU's compute, or on
    lanes another lane's). Where an op was ready but had not started, it waited for memory
    until its allocation was granted (`memory@tier`; at `alloc_s`, else at its start: the
    simulator takes memory before the resource), then `late@resource`: its resource free, it
    started later all the same (the executor's own delay: a real run's host threads, driver),
    as does an op with no predecessor that starts after the gap began."""
    gpu_of = _gpu_of(schedule)
    if not schedule.ops or not gpu_of or not len(trace):
        return {}
    chain = _Chain(schedule, trace)
    gpus = sorted(set(gpu_of.values()))
    makespan = float(np.nanmax(chain.end))
    last = int(np.nanargmax(chain.end))
    stream_gpu = np.array([gpu_of.get(name, -1) for name in schedule.streams])
    op_gpu = np.where(np.isnan(chain.start), -1, stream_gpu[schedule.columns()["stream"]])
    for g in gpus:
        mine = np.flatnonzero(op_gpu == g)
        kstart = chain.start[mine] + chain.launch[mine]
        order = np.argsort(kstart, kind="stable")
        mine, kstart = mine[order], kstart[order]
        # before each kernel (in start order) the end of the kernels so far, from 0; an end
        # that is NaN counts as none (fmax)
        reach = np.fmax.accumulate(np.r_[0.0, chain.end[mine]])
        for i in np.flatnonzero(kstart > reach[:-1] + _EPS).tolist():  # the idle gaps
            chain.walk(int(mine[i]), float(reach[i]), float(kstart[i]), waiting=True)
        if makespan > reach[-1] + _EPS:
            chain.walk(last, float(reach[-1]), makespan, waiting=False)
    causes = sorted(chain.out.items(), key=lambda kv: -kv[1])
    return {k: float(v) / len(gpus) for k, v in causes if v > 0}


def small_unique(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(codes, return_inverse=True)` of non-negative integers of a small range (a
    run's few kind, tensor and stream combinations): the same sorted values and per-code
    indices, counted by `bincount` instead of sorting every op's code."""
    if not len(codes) or codes.min() < 0:
        return np.unique(codes, return_inverse=True)
    present = np.bincount(codes) > 0
    uniq = np.flatnonzero(present)
    return uniq.astype(codes.dtype), (np.cumsum(present) - 1)[codes]


def _label_of(kind: OpKind, tensor: Tensor, resource: str) -> str:
    """`kind@resource`; a weight load also names what it moves (`load expert@h2d`)."""
    what = f" {tensor}" if kind == OpKind.LOAD and tensor != Tensor.NONE else ""
    return f"{kind}{what}@{resource}"


class _Chain:
    """A run's ops as arrays, and the seconds laid on each cause so far."""

    def __init__(self, schedule: Schedule, trace: pd.DataFrame | TraceTable) -> None:
        n = len(schedule.ops)
        ids = np.asarray(trace["op_id"])
        self.start, self.end, launch, self.alloc = (np.full(n, np.nan) for _ in range(4))
        self.start[ids], self.end[ids] = np.asarray(trace["start_s"]), np.asarray(trace["end_s"])
        if "launch_s" in trace:
            launch[ids] = np.asarray(trace["launch_s"])
        if "alloc_s" in trace:
            self.alloc[ids] = np.asarray(trace["alloc_s"])
        # a GPU kernel's launch (a pool op's); a pooled transfer's latency is the transfer's
        on_gpu = np.array([s.resource == Resource.GPU for s in schedule.streams.values()])
        self.launch = np.where(on_gpu[schedule.columns()["stream"]], np.nan_to_num(launch), 0.0)
        cols = schedule.columns()
        sid = cols["stream"]
        # per op its label, resource and the tier it allocates (""), from the few combinations
        stream_res = [str(s.resource) for s in schedule.streams.values()]
        kinds, tensors, tiers = list(OpKind), list(Tensor), [str(t) for t in Tier]
        combo = (cols["kind"].astype(np.int64) * len(tensors) + cols["tensor"]) * len(
            stream_res
        ) + sid
        uniq, inverse = small_unique(combo)
        names = []
        for c in uniq.tolist():
            rest, st = divmod(c, len(stream_res))
            k, t = divmod(rest, len(tensors))
            names.append(_label_of(kinds[k], tensors[t], stream_res[st]))
        # per op an index into these names: the walk reads a few thousand ops' names, so they
        # are looked up as it goes, not made for every op. Per-op values stay numpy arrays (a
        # Python list of a million ints holds 36 MB of boxed ints; the walk reads few of them)
        self.labels, self.label_of = names, inverse
        self.resources, self.resource_of = stream_res, sid
        self.tiers = [*tiers, ""]  # -1: allocates nothing
        takes = (cols["alloc_tier"] >= 0) & (cols["alloc_bytes"] > 0)
        self.tier_of = np.where(takes, cols["alloc_tier"], -1)
        # of its predecessors that ran (deps, the op before on the same stream, the op that held
        # the same resource before it: a stream's transfer queued behind another stream's), the
        # first that ended last: the one the walk steps back to (`_pred`), found for the few
        # thousand ops the walk reaches, not for every op (the two per-op arrays read as it goes:
        # making lists of them took longer than the walk's reads)
        self.ops = schedule.ops
        self.prev = self._prev_on_stream(sid)
        self.held = self._held_before(schedule)
        self.ends = self.end.tolist()
        self.out: defaultdict[str, float] = defaultdict(float)

    @staticmethod
    def _prev_on_stream(sid: np.ndarray) -> np.ndarray:
        """Per op, the op before it on its stream (-1: none)."""
        prev = np.full(len(sid), -1)
        order = np.argsort(sid, kind="stable")  # each stream's ops in op order
        same = sid[order[1:]] == sid[order[:-1]]
        prev[order[1:][same]] = order[:-1][same]
        return prev

    def _pred(self, x: int) -> int:
        """Of op x's [*deps, the op before on its stream, the op that held its resource before
        it], the first that ran and ended last (-1: none ran)."""
        ends, best, who = self.ends, -np.inf, -1
        for c in (*self.ops[x].deps, int(self.prev[x]), int(self.held[x])):
            if c >= 0 and ends[c] > best:  # a NaN end (never ran) is never greater
                best, who = ends[c], c
        return who

    def _held_before(self, schedule: Schedule) -> np.ndarray:
        """Per op, the op that ran on its resource just before it (-1: none), where the resource
        runs one op at a time (not a pool's, whose ops share it)."""
        held = np.full(len(schedule.ops), -1)
        sid = schedule.columns()["stream"]
        one_at_a_time = np.array(
            [not s.pool and s.resource != Resource.NONE for s in schedule.streams.values()]
        )
        # each op's resource id as an index (integers compared, not strings)
        ids_of = [s.resource_id for s in schedule.streams.values()]
        rid = np.array([ids_of.index(r) for r in ids_of], dtype=np.int64)[sid]
        ok = one_at_a_time[sid] & ~np.isnan(self.start)
        for r in np.flatnonzero(np.bincount(rid[ok])).tolist():  # np.unique imports numpy.ma
            ids = np.flatnonzero(ok & (rid == r))
            ids = ids[np.lexsort((self.end[ids], self.start[ids]))]  # zero-length ops first
            held[ids[1:]] = ids[:-1]
        return held

    def walk(self, x: int, a: float, t: float, waiting: bool) -> None:
        """Lay idle time [a, t) on the chain that ends at op x: at x's kernel start where x
        ends the gap (`waiting`), else at x's end (x ran through t)."""
        while t > a + _EPS:
            kernel = self.start[x] + self.launch[x]
            if not waiting:  # x ran until t: its kernel's time is its own
                s = max(kernel, a)
                self.out[self.labels[self.label_of[x]]] += max(t - s, 0.0)
                t = min(t, s)
            s = max(self.start[x], a)  # before its kernel, its launch
            self.out["launch"] += max(t - s, 0.0)
            t = min(t, s)
            if t <= a + _EPS:
                return
            p = self._pred(x)
            if p < 0:
                self.out["late@" + self.resources[self.resource_of[x]]] += t - a
                return
            ready = max(float(self.end[p]), a)
            if ready < t:
                self._wait(x, ready, t)
                t = ready
            x, waiting = p, False

    def _wait(self, x: int, ready: float, t: float) -> None:
        """Op x, ready at `ready`, started at `t`: memory until its allocation was granted, then
        the executor's delay (`late`)."""
        mem = 0.0
        tier = self.tiers[self.tier_of[x]]
        if tier:
            granted = self.alloc[x] if not np.isnan(self.alloc[x]) else self.start[x]
            mem = min(max(float(granted), ready), t) - ready
            if mem > 0:
                self.out["memory@" + tier] += mem
        if t - ready - mem > 0:
            self.out["late@" + self.resources[self.resource_of[x]]] += t - ready - mem


def top_cause(causes: Mapping[str, float]) -> str:
    """The cause of most of a bubble and its part of it, `load expert@h2d 97%`; `-`: no bubble."""
    total = sum(causes.values())
    if total <= 0:
        return "-"
    name = max(causes, key=lambda k: causes[k])
    return f"{name} {short_of(causes[name] / total, '.0%', 0, 1)}"  # 99.5%, not 100%: not all


def by_transfer(causes: Mapping[str, float]) -> dict[str, float]:
    """The causes with a transfer's two ends as one: `dispatch@p2p_out` (the send out of one
    GPU) counts as `dispatch@p2p` (the receive into the other). The simulator ends both at
    once and the walk takes the first listed (the receive); a real run ends one a few
    microseconds after the other, whichever it is by chance."""
    out: dict[str, float] = defaultdict(float)
    for k, x in causes.items():
        out[k.replace(f"@{Resource.P2P_OUT}", f"@{Resource.P2P}")] += x
    return dict(out)


def causes_tv(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """How differently two runs' bubbles split over their causes: the total variation distance
    of the two splits (each cause's share of its bubble, a transfer's two ends as one:
    `by_transfer`), 0 the same mix, 1 none in common; NaN where either has no bubble."""
    a, b = by_transfer(a), by_transfer(b)
    ta, tb = sum(a.values()), sum(b.values())
    if ta <= 0 or tb <= 0:
        return float("nan")
    return 0.5 * sum(abs(a.get(k, 0.0) / ta - b.get(k, 0.0) / tb) for k in {*a, *b})
