"""The per-op Python that the vectorised paths replaced (bubble causes, validate, the gate
causality check, the DAG bound, peak memory, prefill time, Schedule.columns, make_trace), kept
as references that tests/core/test_fast_paths.py compares the fast paths with, to the bit."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pandas as pd

from core.bubbles import _EPS, _gpu_of, _label_of
from core.errors import CapacityError, ScheduleBug
from core.schedule import (
    _ANY,
    Op,
    Schedule,
    _check_finishes,
    _ep_problem,
    _shape_problem,
)
from core.trace import TRACE_COLUMNS
from core.types import OpKind, Resource, Tier


def ref_idle_causes(schedule: Schedule, trace: pd.DataFrame) -> dict[str, float]:
    """core.bubbles.idle_causes with a Python list of predecessors per op."""
    gpu_of = _gpu_of(schedule)
    if not schedule.ops or not gpu_of or not len(trace):
        return {}
    chain = _RefChain(schedule, trace)
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


class _RefChain:
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
        self.label = [_label_of(o.kind, o.tensor, res[o.stream]) for o in schedule.ops]
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
        one_at_a_time = np.array(
            [not s.pool and s.resource != Resource.NONE for s in schedule.streams.values()]
        )
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


def ref_validate(schedule: Schedule, check_finishes: bool = True) -> None:
    """core.schedule.validate with a Python loop per op."""
    streams = schedule.streams
    for t in Tier:
        if schedule.resident_bytes.get(t, 0) > schedule.capacity_bytes[t]:
            raise CapacityError(
                f"resident {t} memory {schedule.resident_bytes[t] / 1e9:.3g} GB exceeds the "
                f"{t} capacity {schedule.capacity_bytes[t] / 1e9:.3g} GB"
            )
    pools: dict[str, set[str]] = {}  # resource -> the pools of its streams ("" for none)
    for spec in streams.values():
        pools.setdefault(spec.resource_id, set()).add(spec.pool)
    mixed = next((r for r, p in pools.items() if len(p) > 1), None)
    if mixed:
        raise ScheduleBug(
            f"resource {mixed}: streams "
            f"{sorted(s.name for s in streams.values() if s.resource_id == mixed)} "
            f"mix pools {sorted(pools[mixed])} (a stream outside the pool would run beside its ops "
            "on the same SMs): put every stream of one GPU in one pool, or none"
        )
    ops = schedule.ops
    for i, op in enumerate(ops):
        if op.id != i:
            raise ScheduleBug(f"{op.label()}: id must equal its position {i}")
        if op.deps and not (min(op.deps) >= 0 and max(op.deps) < i):
            raise ScheduleBug(f"{op.label()}: deps {op.deps} must name earlier ops")
    # Ops of one shape (kind, stream, tiers, memory effect) pass or fail together: check each
    # shape once, at its first op, in op order, so the error names the first bad op.
    first: dict[tuple[Any, ...], Op] = {}
    for o in ops:
        shape = (
            o.kind,
            o.stream,
            o.src,
            o.dst,
            o.alloc_tier,
            o.free_tier,
            o.alloc_bytes < 0
            or o.free_bytes < 0
            or (o.alloc_bytes > 0 and o.alloc_tier is None)
            or (o.free_bytes > 0 and o.free_tier is None),
        )
        first.setdefault(shape, o)
    for shape, op in first.items():
        problem = _shape_problem(shape, streams)
        if problem:
            raise ScheduleBug(f"{op.label()}: {problem}")
    ep = schedule.ep
    if ep is not None:  # an expert-parallel layout: G lanes of one GPU, or G GPUs
        problem = _ep_problem(first.values(), streams, ep.lanes)
        if problem:
            raise ScheduleBug(problem)
    cols = schedule.columns()
    for ti, tier in enumerate(Tier):
        room = schedule.capacity_bytes[tier] - schedule.resident_bytes.get(tier, 0)
        over = np.flatnonzero((cols["alloc_tier"] == ti) & (cols["alloc_bytes"] > room))
        if len(over):
            op = ops[int(over[0])]
            raise CapacityError(
                f"{op.label()}: allocates {op.alloc_bytes / 1e9:.3f} GB of {tier}, "
                f"only {room / 1e9:.3f} GB is not resident"
            )
    ref_gates_causal(schedule)
    if check_finishes:
        _check_finishes(schedule)


def ref_gates_causal(schedule: Schedule) -> None:
    """ref_validate's causality rule: each expert op depends on the gate ops of the batches
    it serves."""
    ops = schedule.ops
    # (step, layer) -> batch -> its gate ops (one, or one per device gating a share of the
    # batch), each with its micro-batch (-1: the whole batch)
    gates: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
    for op in ops:
        if op.kind == OpKind.GATE:
            gates.setdefault((op.step, op.layer), {}).setdefault(op.batch, []).append(
                (op.micro, op.id)
            )
    for op in schedule.ops:
        if op.kind != OpKind.EXPERT:
            continue
        layer_gates = gates.get((op.step, op.layer), {})
        mine = (
            [g for batch in layer_gates.values() for g in batch]
            if op.batch == _ANY
            else layer_gates.get(op.batch, [(_ANY, -1)])
        )
        # a micro-batch's experts need its own gates (and any over the whole batch); an op over
        # the whole batch needs every gate of it
        need = [g for micro, g in mine if op.micro == _ANY or micro in (_ANY, op.micro)]
        missing = [g for g in need if g not in op.deps]
        if not need or missing:
            raise ScheduleBug(
                f"{op.label()}: an expert compute must depend on the gate op(s) of the batches "
                f"it serves (planners are causal); missing {missing or 'gate'}"
            )


def ref_heads_tails(schedule: Schedule, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dag_bound's heads and tails as they were: every dep of every op."""
    n = len(schedule.ops)
    d = dur.tolist()
    head = [0.0] * n
    preds: list[tuple[int, ...]] = [()] * n
    last_in_stream: dict[str, int] = {}
    for o in schedule.ops:
        prev = last_in_stream.get(o.stream)
        ps = o.deps if prev is None else (*o.deps, prev)
        last_in_stream[o.stream] = o.id
        preds[o.id] = ps
        if ps:
            head[o.id] = max([head[p] + d[p] for p in ps])
    tail = [0.0] * n
    for i in range(n - 1, -1, -1):
        t = d[i] + tail[i]
        for p in preds[i]:
            if tail[p] < t:
                tail[p] = t
    return np.asarray(head), np.asarray(tail)


def ref_prefill_s(trace: pd.DataFrame) -> float:
    """prefill_s as it was: the step-0 spans sorted by start, their union summed span by span."""
    spans = trace.loc[
        (trace["step"] == 0) & (trace["end_s"] > trace["start_s"]), ["start_s", "end_s"]
    ]
    total, reach = 0.0, -np.inf
    for start, end in spans.sort_values("start_s").itertuples(index=False):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return float(total)


def ref_peak_bytes(schedule: Schedule, trace: pd.DataFrame) -> dict[str, int]:
    """peak_bytes as it was: each tier's allocations read op by op."""
    out: dict[str, int] = {}
    ops = schedule.ops
    granted = trace["alloc_s"] if "alloc_s" in trace else trace["start_s"]
    start = granted.fillna(trace["start_s"]).to_numpy()
    end = trace["end_s"].to_numpy()
    for tier in Tier:
        alloc = np.fromiter(
            (o.alloc_bytes if o.alloc_tier == tier else 0 for o in ops), np.int64, len(ops)
        )
        free = np.fromiter(
            (o.free_bytes if o.free_tier == tier else 0 for o in ops), np.int64, len(ops)
        )
        a, f = alloc > 0, free > 0
        times = np.concatenate([end[f], start[a]])
        deltas = np.concatenate([-free[f], alloc[a]])
        order = np.lexsort((deltas, times))
        live = np.cumsum(deltas[order]) if len(order) else np.zeros(1, np.int64)
        out[str(tier)] = int(
            schedule.resident_bytes.get(tier, 0) + max(0, int(live.max(initial=0)))
        )
    return out


def ref_columns(schedule: Schedule) -> dict[str, np.ndarray]:
    """Schedule.columns as it was: a row per op."""
    ops = schedule.ops
    stream_idx = {s: i for i, s in enumerate(schedule.streams)}
    tier_idx: dict[Any, int] = {None: -1, **{t: i for i, t in enumerate(Tier)}}
    kind_idx = {k: i for i, k in enumerate(OpKind)}
    rows = [
        (
            kind_idx[o.kind],
            stream_idx[o.stream],
            o.nbytes,
            o.flops,
            o.touch_bytes,
            tier_idx[o.alloc_tier],
            o.alloc_bytes,
            tier_idx[o.free_tier],
            o.free_bytes,
            o.width,
        )
        for o in ops
    ]
    arr = np.array(rows, dtype=np.float64).reshape(len(ops), 10)
    return {
        "kind": arr[:, 0].astype(np.int16),
        "stream": arr[:, 1].astype(np.int16),
        "nbytes": arr[:, 2].astype(np.int64),
        "flops": arr[:, 3],
        "touch_bytes": arr[:, 4],
        "alloc_tier": arr[:, 5].astype(np.int8),
        "alloc_bytes": arr[:, 6].astype(np.int64),
        "free_tier": arr[:, 7].astype(np.int8),
        "free_bytes": arr[:, 8].astype(np.int64),
        "width": arr[:, 9].astype(np.int64),
    }


def ref_make_trace(schedule: Schedule, start_s: np.ndarray, end_s: np.ndarray) -> pd.DataFrame:
    """core.trace.make_trace's columns from the ops, one Python object per op."""
    ops = schedule.ops
    res = {name: s.resource_id for name, s in schedule.streams.items()}
    nan = np.full(len(ops), np.nan)
    cols = {
        "source": pd.Categorical(["sim"] * len(ops)),
        "op_id": np.arange(len(ops), dtype=np.int64),
        "kind": pd.Categorical([str(o.kind) for o in ops]),
        "stream": pd.Categorical([o.stream for o in ops]),
        "resource": pd.Categorical([res[o.stream] for o in ops]),
        "step": np.fromiter((o.step for o in ops), np.int32, len(ops)),
        "layer": np.fromiter((o.layer for o in ops), np.int32, len(ops)),
        "batch": np.fromiter((o.batch for o in ops), np.int32, len(ops)),
        "micro": np.fromiter((o.micro for o in ops), np.int32, len(ops)),
        "batches": np.fromiter((o.batches for o in ops), np.int32, len(ops)),
        "expert": np.fromiter((o.expert for o in ops), np.int32, len(ops)),
        "tensor": pd.Categorical([str(o.tensor) for o in ops]),
        "bytes": np.fromiter((o.nbytes for o in ops), np.int64, len(ops)),
        "tokens": np.fromiter((o.tokens for o in ops), np.int64, len(ops)),
        "start_s": np.asarray(start_s, dtype=np.float64),
        "end_s": np.asarray(end_s, dtype=np.float64),
        "sm_s": nan,
        "launch_s": nan.copy(),
        "alloc_s": nan.copy(),
    }
    return pd.DataFrame(cols, columns=TRACE_COLUMNS)
