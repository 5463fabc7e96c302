"""Where a run's GPU bubbles come from: each gap in which a GPU runs no kernel is laid, second by
second, on the chain of ops that held up the kernel ending it, and each second is named after
the op that held it: `load expert@h2d` (a weight transfer), `dispatch@p2p` (the all-to-all),
`compute-attention@gpu` (another GPU's work), `memory@gpu` (ready, waiting for memory),
`launch` (a kernel's launch on shared lanes), `late@gpu` (ready, its resource free, yet started
later: the executor's own delay, a real run's host threads or driver; the simulator has none).

Usage:
    causes = idle_causes(schedule, trace)   # {cause: seconds, mean over the GPUs}
    top_cause(causes); causes_tv(sim_causes, real_causes)   # the main one; two runs' mixes apart
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import numpy as np
import pandas as pd

from core.schedule import Op, Schedule
from core.types import OpKind, Resource, Tensor

_EPS = 1e-12


def _gpu_of(schedule: Schedule) -> dict[str, int]:
    """Each GPU compute stream's physical GPU: its device, or 0 for every lane of one GPU."""
    ep = schedule.meta.get("ep") or {}
    lanes = bool(ep.get("lanes"))
    return {
        name: 0 if lanes else s.device
        for name, s in schedule.streams.items()
        if s.resource == Resource.GPU
    }


def idle_causes(schedule: Schedule, trace: pd.DataFrame) -> dict[str, float]:
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
        reach = 0.0  # the end of the kernels so far
        for i in np.argsort(kstart, kind="stable"):
            if kstart[i] > reach + _EPS:
                chain.walk(int(mine[i]), reach, float(kstart[i]), waiting=True)
            reach = max(reach, float(chain.end[mine[i]]))
        if makespan > reach + _EPS:
            chain.walk(last, reach, makespan, waiting=False)
    causes = sorted(chain.out.items(), key=lambda kv: -kv[1])
    return {k: float(v) / len(gpus) for k, v in causes if v > 0}


def _label(op: Op, resource: str) -> str:
    """`kind@resource`; a weight load also names what it moves (`load expert@h2d`)."""
    what = f" {op.tensor}" if op.kind == OpKind.LOAD and op.tensor != Tensor.NONE else ""
    return f"{op.kind}{what}@{resource}"


class _Chain:
    """A run's ops as arrays, and the seconds laid on each cause so far."""

    def __init__(self, schedule: Schedule, trace: pd.DataFrame) -> None:
        n = len(schedule.ops)
        ids = trace["op_id"].to_numpy()
        self.start, self.end, launch, self.alloc = (np.full(n, np.nan) for _ in range(4))
        self.start[ids], self.end[ids] = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
        if "launch_s" in trace:
            launch[ids] = trace["launch_s"].to_numpy()
        if "alloc_s" in trace:
            self.alloc[ids] = trace["alloc_s"].to_numpy()
        # a GPU kernel's launch (a pool op's); a pooled transfer's latency is the transfer's
        on_gpu = np.array([s.resource == Resource.GPU for s in schedule.streams.values()])
        self.launch = np.where(on_gpu[schedule.columns()["stream"]], np.nan_to_num(launch), 0.0)
        res = {name: str(s.resource) for name, s in schedule.streams.items()}
        self.label = [_label(o, res[o.stream]) for o in schedule.ops]
        self.resource = [res[o.stream] for o in schedule.ops]
        self.tier = [str(o.alloc_tier) if o.alloc_bytes > 0 else "" for o in schedule.ops]
        # predecessors that ran: deps, the op before on the same stream, and the op that held
        # the same resource before it (a stream's transfer queued behind another stream's)
        ran = (~np.isnan(self.end)).tolist()
        held = self._held_before(schedule)
        self.preds: list[list[int]] = []
        prev: dict[str, int] = {}
        for o in schedule.ops:
            ps = [*o.deps, prev.get(o.stream, -1), held[o.id]]
            self.preds.append([d for d in ps if d >= 0 and ran[d]])
            prev[o.stream] = o.id
        self.out: defaultdict[str, float] = defaultdict(float)

    def _held_before(self, schedule: Schedule) -> list[int]:
        """Per op, the op that ran on its resource just before it (-1: none), where the resource
        runs one op at a time (not a pool's, whose ops share it)."""
        held = np.full(len(schedule.ops), -1)
        sid = schedule.columns()["stream"]
        one_at_a_time = np.array([not s.pool and s.resource != Resource.NONE
                                  for s in schedule.streams.values()])  # fmt: skip
        rid = np.array([s.resource_id for s in schedule.streams.values()])[sid]
        ok = one_at_a_time[sid] & ~np.isnan(self.start)
        for r in np.unique(rid[ok]):
            ids = np.flatnonzero(ok & (rid == r))
            ids = ids[np.lexsort((self.end[ids], self.start[ids]))]  # zero-length ops first
            held[ids[1:]] = ids[:-1]
        return held.tolist()

    def walk(self, x: int, a: float, t: float, waiting: bool) -> None:
        """Lay idle time [a, t) on the chain that ends at op x: at x's kernel start where x
        ends the gap (`waiting`), else at x's end (x ran through t)."""
        while t > a + _EPS:
            kernel = self.start[x] + self.launch[x]
            if not waiting:  # x ran until t: its kernel's time is its own
                s = max(kernel, a)
                self.out[self.label[x]] += max(t - s, 0.0)
                t = min(t, s)
            s = max(self.start[x], a)  # before its kernel, its launch
            self.out["launch"] += max(t - s, 0.0)
            t = min(t, s)
            if t <= a + _EPS:
                return
            ps = self.preds[x]
            if not ps:
                self.out["late@" + self.resource[x]] += t - a
                return
            p = max(ps, key=lambda d: self.end[d])
            ready = max(float(self.end[p]), a)
            if ready < t:
                self._wait(x, ready, t)
                t = ready
            x, waiting = p, False

    def _wait(self, x: int, ready: float, t: float) -> None:
        """Op x, ready at `ready`, started at `t`: memory until its allocation was granted, then
        the executor's delay (`late`)."""
        mem = 0.0
        if self.tier[x]:
            granted = self.alloc[x] if not np.isnan(self.alloc[x]) else self.start[x]
            mem = min(max(float(granted), ready), t) - ready
            if mem > 0:
                self.out["memory@" + self.tier[x]] += mem
        if t - ready - mem > 0:
            self.out["late@" + self.resource[x]] += t - ready - mem


def top_cause(causes: Mapping[str, float]) -> str:
    """The cause of most of a bubble and its part of it, `load expert@h2d 97%`; `-`: no bubble."""
    total = sum(causes.values())
    if total <= 0:
        return "-"
    name = max(causes, key=lambda k: causes[k])
    return f"{name} {causes[name] / total:.0%}"


def causes_tv(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """How differently two runs' bubbles split over their causes: the total variation distance
    of the two splits (each cause's share of its bubble), 0 the same mix, 1 none in common;
    NaN where either has no bubble."""
    ta, tb = sum(a.values()), sum(b.values())
    if ta <= 0 or tb <= 0:
        return float("nan")
    return 0.5 * sum(abs(a.get(k, 0.0) / ta - b.get(k, 0.0) / tb) for k in {*a, *b})
