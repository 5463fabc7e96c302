"""The one trace schema both executors write, and run metrics (Chrome/Perfetto export:
core.chrome_trace).

A trace is a pandas DataFrame with one row per op (`TRACE_COLUMNS`). `summarize` turns a
schedule + trace into the `summary.json` metrics of DESIGN.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.balance import balance_metrics, copy_waits
from core.bubbles import idle_causes
from core.errors import TraceError
from core.files import not_regular
from core.lazy import lazy_module
from core.schedule import Schedule
from core.spec import Workload
from core.trace_check import TRACE_COLUMNS, check_trace
from core.trace_table import (
    TraceTable,
    group_sums,
    in_row_order,
    int_group_sums,
    per_step,
    table_of,
    text_codes,
)
from core.types import OpKind, Tensor, Tier

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")


def make_trace(
    schedule: Schedule,
    start_s: np.ndarray,
    end_s: np.ndarray,
    source: str,
    sm_s: np.ndarray | None = None,
    launch_s: np.ndarray | None = None,
    alloc_s: np.ndarray | None = None,
) -> pd.DataFrame:
    """One row per op, in op order; sm_s, launch_s, alloc_s: see TRACE_COLUMNS (None: NaN)."""
    return trace_table(schedule, start_s, end_s, source, sm_s, launch_s, alloc_s).frame()


def trace_table(
    schedule: Schedule,
    start_s: np.ndarray,
    end_s: np.ndarray,
    source: str,
    sm_s: np.ndarray | None = None,
    launch_s: np.ndarray | None = None,
    alloc_s: np.ndarray | None = None,
) -> TraceTable:
    """`make_trace`'s rows as columns, without pandas."""
    ops = schedule.ops
    assert len(start_s) == len(end_s) == len(ops)
    assert all(a is None or len(a) == len(ops) for a in (sm_s, launch_s, alloc_s))
    n = len(ops)
    nan = np.full(n, np.nan)
    sc = schedule.columns()
    streams = list(schedule.streams)
    text = {
        "source": text_codes(np.zeros(n, np.int64), [source]),
        "kind": text_codes(sc["kind"], [str(k) for k in OpKind]),
        "stream": text_codes(sc["stream"], streams),
        "resource": text_codes(sc["stream"], [schedule.streams[s].resource_id for s in streams]),
        "tensor": text_codes(sc["tensor"], [str(t) for t in Tensor]),
    }
    cols: dict[str, np.ndarray] = {
        "op_id": np.arange(n, dtype=np.int64),
        "step": sc["step"].astype(np.int32),
        "layer": sc["layer"].astype(np.int32),
        "batch": sc["batch"].astype(np.int32),
        "micro": sc["micro"].astype(np.int32),
        "batches": sc["batches"].astype(np.int32),
        "expert": sc["expert"].astype(np.int32),
        "bytes": sc["nbytes"].astype(np.int64),
        "tokens": sc["tokens"].astype(np.int64),
        "start_s": np.asarray(start_s, dtype=np.float64),
        "end_s": np.asarray(end_s, dtype=np.float64),
        "sm_s": nan if sm_s is None else np.asarray(sm_s, np.float64),
        "launch_s": nan.copy() if launch_s is None else np.asarray(launch_s, np.float64),
        "alloc_s": nan.copy() if alloc_s is None else np.asarray(alloc_s, np.float64),
    }
    cols.update((c, codes) for c, (codes, _) in text.items())
    return TraceTable(
        {c: cols[c] for c in TRACE_COLUMNS}, {c: names for c, (_, names) in text.items()}
    )


def factorize(col: pd.Series) -> tuple[np.ndarray, list[str]]:
    """Codes into the column's distinct values as strings (a categorical's own codes)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        return col.cat.codes.to_numpy(np.int64), [str(c) for c in col.cat.categories]
    codes, uniq = pd.factorize(col)
    return codes.astype(np.int64), [str(u) for u in uniq]


def read_trace(path: Path) -> pd.DataFrame:
    """A run's trace.parquet; a file that is not one (cut short, overwritten) is a TraceError
    naming it, not pyarrow's traceback."""
    redo = "run that run again to rewrite it"
    kind = not_regular(path)  # pyarrow reads a folder as an empty dataset, blocks on a FIFO
    if kind:
        raise TraceError(f"{path}: {kind}; {redo}")
    try:
        trace = pd.read_parquet(path)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TraceError(
            f"{path}: not a readable trace ({why[:120]}); run that run again to rewrite it"
        ) from None
    check_trace(trace, path)
    if trace.empty:  # a run writes one row per op, and every run has ops
        raise TraceError(f"{path}: no ops (0 rows); not a run's trace; {redo}")
    twice = int(trace.duplicated().sum())
    if twice:  # each op is one row: a copy would count its time and bytes twice
        raise TraceError(f"{path}: {twice} of {len(trace)} rows repeat another row whole; {redo}")
    return trace


def shares_s(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each interval [start, end)'s even share of the time it overlaps the others: the integral
    over it of 1 / k, k the number of intervals open at that instant (processor sharing, as the
    simulator's pool shares a GPU or a link). The shares add up to the seconds the union covers."""
    start, end = np.asarray(start, np.float64), np.asarray(end, np.float64)
    if not len(start):
        return np.zeros(0)
    times = np.unique(np.r_[start, end])
    open_ = np.searchsorted(np.sort(start), times, "right") - np.searchsorted(
        np.sort(end), times, "right"
    )  # intervals open on [times[i], times[i + 1])
    per = np.diff(times) / np.maximum(open_[:-1], 1) * (open_[:-1] > 0)
    acc = np.r_[0.0, np.cumsum(per)]
    return acc[np.searchsorted(times, end)] - acc[np.searchsorted(times, start)]


def work_s(trace: pd.DataFrame, schedule: Schedule | None = None) -> pd.Series:
    """Seconds of its resource each op takes: its duration, or for an op of a shared pool
    (CUDA streams sharing a GPU's SMs, the streams of one link, whose ops run at once) its
    seconds of work at the whole GPU or link (`sm_s`; the launch overhead before it holds
    none). A real trace cannot see that work: given the `schedule`, a pool op without `sm_s`
    takes its even share of the time it overlapped the pool's other such ops (`shares_s`), so
    the pool's ops add up to the time some of them ran, not to their summed durations."""
    return pd.Series(_work(table_of(trace), schedule), index=trace.index)


def _work(trace: TraceTable, schedule: Schedule | None = None) -> np.ndarray:
    """`work_s` as an array."""
    dur = trace["end_s"] - trace["start_s"]
    sm = trace.cols.get("sm_s")
    out = dur if sm is None else np.where(np.isnan(sm), dur, sm)
    if schedule is None or not any(s.pool for s in schedule.streams.values()):
        return out
    pooled = {name for name, s in schedule.streams.items() if s.pool}
    names = trace.names["stream"]
    codes = trace["stream"].astype(np.int64)
    blind = np.array([n in pooled for n in names] + [False])[codes]  # code -1: the last
    if sm is not None:
        blind &= np.isnan(sm)
    if not blind.any():
        return out
    out = out.astype(np.float64)  # a copy
    key = _bound_keys(schedule)
    keys = sorted({key[n] for n in names if n in pooled})
    of_stream = np.array([keys.index(key[n]) if n in pooled else -1 for n in names] + [-1])
    group = of_stream[codes[blind]]
    start, end = trace["start_s"][blind], trace["end_s"][blind]
    share = np.zeros(len(group))
    for g in range(len(keys)):
        idx = np.flatnonzero(group == g)
        share[idx] = shares_s(start[idx], end[idx])
    out[np.flatnonzero(blind)] = share
    return out


def busy_s(
    trace: pd.DataFrame | TraceTable,
    schedule: Schedule | None = None,
    work: pd.Series | np.ndarray | None = None,
) -> dict[str, float]:
    """Seconds each resource spends running ops (one op at a time, or a pool's work: `work_s`,
    or `work` where the caller has it), in pandas' compensated sums (`group_sums`)."""
    table = table_of(trace)
    work = _work(table, schedule) if work is None else np.asarray(work, np.float64)
    names = table.names["resource"]
    sums = group_sums(work, table["resource"], len(names))
    return {k: v for k, v in zip(names, sums, strict=True) if k != "none"}


def sum_by_name(values: pd.Series, names: pd.Series) -> pd.Series:
    """`values.groupby(names.astype(str)).sum()`: pandas' (compensated) sums, by name in sorted
    order. A trace's categorical column of names is grouped by its codes, the same rows in the
    same order: casting 178k rows to str took six times as long as the sums."""
    cats = names.cat.categories if isinstance(names.dtype, pd.CategoricalDtype) else None
    if cats is None or not all(isinstance(c, str) for c in cats) or (names.cat.codes < 0).any():
        return values.groupby(names.astype(str), observed=True).sum()
    out = values.groupby(names, observed=True).sum()
    out.index = out.index.astype(str)
    return out.sort_index()


def bound_resource(schedule: Schedule, trace: pd.DataFrame) -> np.ndarray:
    """Per trace row, the resource its work counts against in the bounds: its stream's resource
    id, or one name for all streams of a pool (lanes sharing one GPU's SMs, each lane under its
    own device id `gpu`, `gpu:1` ...), whose ops together get at most the whole GPU."""
    codes, names = factorize(trace["stream"])
    key = _bound_keys(schedule)
    return np.array([key.get(s, np.nan) for s in names], dtype=object)[codes]


def _bound_keys(schedule: Schedule) -> dict[str, str]:
    """`bound_resource`'s name of each stream."""
    return {
        name: f"{s.resource} (pool {s.pool})" if s.pool else s.resource_id
        for name, s in schedule.streams.items()
    }


def bound_codes(
    schedule: Schedule, trace: pd.DataFrame | TraceTable
) -> tuple[np.ndarray, list[str]]:
    """`bound_resource` as codes into its names, sorted; -1 where it is `none` or a stream the
    schedule lacks (no bound counts those). Grouping by the codes takes the same rows in the
    same order as by the names, without pandas' inference of a string column (0.03 s of a
    177,874-op run's summary)."""
    table = table_of(trace)
    codes, names = table["stream"].astype(np.int64), table.names["stream"]
    key = _bound_keys(schedule)
    per = [key.get(s, "none") for s in names]
    out = sorted(set(per) - {"none"})
    at = {r: i for i, r in enumerate(out)}
    return np.array([at.get(r, -1) for r in per] + [-1], dtype=np.int64)[codes], out


def link_bandwidth(traces: Iterable[pd.DataFrame], resource: str, latency_s: float) -> float | None:
    """Bytes/s a link delivered in `traces`: the bytes of its transfers over their summed time
    net of the per-transfer `latency_s` (transfers no longer than that left out). The aggregate,
    not a median per transfer, because a run's makespan adds durations up, slow ones included.
    None when the traces have no such transfer."""
    nbytes = took = 0.0
    for tr in traces:
        dur = (tr["end_s"] - tr["start_s"]).to_numpy()
        sel = (tr["resource"].astype(str) == resource).to_numpy() & (dur > latency_s)
        nbytes += float(tr["bytes"].to_numpy()[sel].sum())
        took += float((dur[sel] - latency_s).sum())
    return nbytes / took if took > 0 and nbytes > 0 else None


def dag_bound(
    schedule: Schedule,
    trace: pd.DataFrame | TraceTable,
    work: pd.Series | np.ndarray | None = None,
) -> tuple[float, str]:
    """A lower bound on the makespan of this schedule (its ops, deps and stream order) with the
    trace's op durations: no executor can run it faster, whatever it does with the resources.

    The resource bound (`lower_bound_s`, the busiest resource's busy time) ignores that the
    schedule's ops depend on each other; this one does not. For a set S of ops on one resource
    (one op at a time): no op of S starts before the smallest head of S (the longest chain of
    durations that must finish before it), S takes the sum of its durations (of a pool's ops,
    their work: they share the GPU, at most all of it), and after the last
    one at least the smallest tail (the longest chain after it) remains, so
    makespan >= min head + sum + min tail (the one-machine relaxation with release and delivery
    times; memory is relaxed too). S ranges over each resource's ops of steps >= s and of steps
    <= s, for every step s: a prefill bound by compute and a decode bound by a link add up here,
    where the resource bound takes only the larger. Also >= the critical path (S = one op).
    `work`: `work_s(trace, schedule)`, where the caller has it. Returns (seconds, what binds).
    """
    n = len(schedule.ops)
    if not n:
        return 0.0, ""
    table = table_of(trace)
    ids = table["op_id"]
    dur = np.zeros(n)
    # the least time each op could take: its duration, or for a pool op (slowed by the others)
    # its launch and its work at the whole GPU or link, which alone it could have had
    work = _work(table, schedule) if work is None else np.asarray(work, np.float64)
    launch = table["launch_s"] if "launch_s" in table else np.zeros(len(ids))
    dur[ids] = work + np.where(np.isnan(launch), 0.0, launch)
    h_arr, t_arr = _heads_tails(schedule, dur)
    # a resource's ops take their work of it (a pool's run side by side, at most the whole GPU)
    res, res_names = bound_codes(schedule, table)
    keep = np.flatnonzero(res >= 0)
    best = float((h_arr + dur + t_arr).max())  # the critical path
    where = "critical path"
    # per (resource, step), in that order: the least head and tail, the (compensated) sum of
    # the work, as pandas' groupby gave them
    rcodes, steps_all, cols = per_step(
        res[keep], table["step"][keep], h_arr[ids[keep]], work[keep], t_arr[ids[keep]]
    )
    cuts = [0, *(np.flatnonzero(rcodes[1:] != rcodes[:-1]) + 1).tolist(), len(rcodes)]
    for a, z in zip(cuts[:-1], cuts[1:], strict=True) if len(rcodes) else ():
        name, steps = res_names[int(rcodes[a])], steps_all[a:z]
        h, b, t = (c[a:z] for c in cols)
        up = np.minimum.accumulate(h) + np.cumsum(b) + np.minimum.accumulate(t)  # steps <= s
        down = (
            np.minimum.accumulate(h[::-1]) + np.cumsum(b[::-1]) + np.minimum.accumulate(t[::-1])
        )[::-1]
        for vals, rel in ((up, "<="), (down, ">=")):
            i = int(np.argmax(vals))
            if vals[i] > best:
                best, where = float(vals[i]), f"{name}, steps {rel} {int(steps[i])}"
    return best, where


def _heads_tails(schedule: Schedule, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per op, the longest chain of `dur` that must end before it starts (its deps and the op
    before it on its stream, transitively: its head) and after it ends (its tail).

    Of an op's predecessors on one stream only the last counts for its head (it ends no earlier
    than the others, which precede it on that stream), and of its successors on one stream only
    the first for its tail: the same maxima over a few edges per op in place of every dep. The
    two passes run one after the other, each with only its own edges as Python lists: together
    they were a third of a million-op run's peak memory."""
    cols = schedule.columns()
    n = len(schedule.ops)
    # int32 edges: as long as the deps, a run's largest arrays
    ptr, deps, sid = (
        cols["dep_ptr"],
        cols["dep_idx"].astype(np.int32),
        cols["stream"].astype(np.int32),
    )
    dst = np.repeat(np.arange(n, dtype=np.int32), np.diff(ptr))
    order = np.argsort(sid, kind="stable").astype(np.int32)  # each stream's ops in op order
    same = sid[order[1:]] == sid[order[:-1]]
    src = np.r_[deps, order[:-1][same]]  # deps, then the op before on the stream
    dst = np.r_[dst, order[1:][same]]
    del deps, order, same
    d = dur.tolist()
    if not (np.isfinite(dur).all() and (dur >= 0).all()):  # the reduction needs durations >= 0
        pred_ptr, pred = _csr(dst, src, n)
        head = _heads(d, _plus_zero(dur), np.diff(pred_ptr), pred)
        del pred_ptr, pred
        succ_ptr, succ = _csr(src, dst, n)
        return head, _tails(d, _plus_zero(dur), np.diff(succ_ptr), succ)
    n_streams = len(schedule.streams)
    # per (op, stream of its predecessor) the last predecessor; per (op, stream of its
    # successor) the first successor
    key = dst * np.int32(n_streams) + sid[src]
    last = np.full(n * n_streams, -1, np.int32)
    np.maximum.at(last, key, src)
    keep = np.flatnonzero(last >= 0)
    pred_ptr, pred = _csr(keep // n_streams, last[keep], n)
    del key, last, keep
    head = _heads(d, _plus_zero(dur), np.diff(pred_ptr), pred)
    del pred_ptr, pred
    key = src * np.int32(n_streams) + sid[dst]
    first = np.full(n * n_streams, n, np.int32)
    np.minimum.at(first, key, dst)
    keep = np.flatnonzero(first < n)
    del key, src, dst
    succ_ptr, succ = _csr(keep // n_streams, first[keep], n)
    del first, keep
    return head, _tails(d, _plus_zero(dur), np.diff(succ_ptr), succ)


def _plus_zero(dur: np.ndarray) -> list[float]:
    """Each duration + 0.0 (a -0.0 made 0.0), as a list: `[x + 0.0 for x in dur.tolist()]`,
    the same IEEE sums, added in numpy."""
    return (dur + 0.0).tolist()


def _heads(d: list[float], fin: list[float], n_pred: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """`_heads_tails`' pass over ops in id order, given each op's predecessors (`n_pred` of
    them, grouped by op in `pred`). Per op, `fin` (head + duration; on entry each duration
    + 0.0, `_plus_zero`: head 0.0 where no op comes before) is kept, added as the per-edge
    sums were, and an op with one to three predecessors, most of them, takes their maximum as
    max() would, without building a list."""
    n = len(d)
    pl = pred.tolist()
    head = [0.0] * n
    a = 0
    for i, c in enumerate(n_pred.tolist()):
        if c == 1:
            h = fin[pl[a]]
            a += 1
        elif c == 2:  # most of them (a dep and the op before on its stream): max() unrolled
            h, x = fin[pl[a]], fin[pl[a + 1]]
            if x > h:  # max() keeps the first of equals, and a NaN first
                h = x
            a += 2
        elif c == 3:  # the most of the rest (an op waiting on three streams): the same
            h, x, y = fin[pl[a]], fin[pl[a + 1]], fin[pl[a + 2]]
            if x > h:
                h = x
            if y > h:
                h = y
            a += 3
        elif c:
            b = a + c
            h = max([fin[p] for p in pl[a:b]])
            a = b
        else:
            continue
        head[i] = h
        fin[i] = h + d[i]
    return np.asarray(head)


def _tails(d: list[float], after: list[float], n_succ: np.ndarray, succ: np.ndarray) -> np.ndarray:
    """`_heads_tails`' pass over ops in reverse id order, given each op's successors: per op,
    `after` (duration + tail; on entry each duration + 0.0), as `_heads` keeps `fin`."""
    n = len(d)
    sl = succ.tolist()
    tail = [0.0] * n
    cs = n_succ.tolist()
    b = len(sl)
    for i in range(n - 1, -1, -1):
        c = cs[i]
        if c == 1:
            b -= 1
            t = after[sl[b]]
            t = t if t > 0.0 else 0.0  # max(0.0, t): a NaN counts as none
        elif c == 2:  # max([0.0, x, y]) unrolled
            b -= 2
            t, x = after[sl[b]], after[sl[b + 1]]
            t = t if t > 0.0 else 0.0
            if x > t:
                t = x
        elif c == 3:
            b -= 3
            t, x, y = after[sl[b]], after[sl[b + 1]], after[sl[b + 2]]
            t = t if t > 0.0 else 0.0
            if x > t:
                t = x
            if y > t:
                t = y
        elif c:
            a = b - c
            t = max([0.0, *[after[s] for s in sl[a:b]]])
            b = a
        else:
            continue
        tail[i] = t
        after[i] = d[i] + t
    return np.asarray(tail)


def _csr(row: np.ndarray, col: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Row pointers and the columns of edges (row, col), grouped by row."""
    order = np.argsort(row, kind="stable")
    return np.r_[0, np.cumsum(np.bincount(row, minlength=n))], col[order]


def peak_bytes(schedule: Schedule, trace: pd.DataFrame | TraceTable) -> dict[str, int]:
    """Peak memory per tier: resident + the allocations live at any instant, each from when it
    was granted (`alloc_s`, else the op's start) to its free's end.

    At equal times frees come first, as in both executors (an allocation waits for the free).
    """
    out: dict[str, int] = {}
    cols = schedule.columns()
    start = np.asarray(trace["start_s"], np.float64)
    if "alloc_s" in trace:
        granted = np.asarray(trace["alloc_s"], np.float64)
        start = np.where(np.isnan(granted), start, granted)
    end = np.asarray(trace["end_s"])
    for ti, tier in enumerate(Tier):
        alloc = np.where(cols["alloc_tier"] == ti, cols["alloc_bytes"], 0)
        free = np.where(cols["free_tier"] == ti, cols["free_bytes"], 0)
        a, f = alloc > 0, free > 0
        times = np.concatenate([end[f], start[a]])
        deltas = np.concatenate([-free[f], alloc[a]])
        order = np.lexsort((deltas, times))  # frees (negative) before allocs at equal time
        live = np.cumsum(deltas[order]) if len(order) else np.zeros(1, np.int64)
        out[str(tier)] = int(
            schedule.resident_bytes.get(tier, 0) + max(0, int(live.max(initial=0)))
        )
    return out


def prefill_s(trace: pd.DataFrame | TraceTable) -> float:
    """Seconds during which some prefill (step-0) op runs: the union of their intervals. A
    schedule that runs every batch's prefill first ends its prefill there; one that runs batch
    by batch (prefill, decode, next batch) has one prefill span per batch, and the decode
    steps between them are not prefill. Time no op runs (a real run's start, idle gaps) counts
    as decode, and where one batch's prefill overlaps another's decode, as prefill."""
    start, end = np.asarray(trace["start_s"]), np.asarray(trace["end_s"])
    ran = (np.asarray(trace["step"]) == 0) & (end > start)
    start, end = start[ran], end[ran]
    order = np.argsort(start, kind="quicksort")  # the spans in sort_values' order, ties too
    start, end = start[order], end[order]
    # each span's part past the ends before it, added in start order (cumsum adds one by one)
    reach = np.r_[-np.inf, np.maximum.accumulate(end)[:-1]]
    grows = end > reach
    part = end[grows] - np.maximum(start[grows], reach[grows])
    return float(np.cumsum(part)[-1]) if len(part) else 0.0


def within(bound_s: float, makespan_s: float) -> float:
    """A lower bound on the makespan, no more than the makespan where it is past it only by
    rounding: a resource busy the whole run sums its ops' times to 1e-16 s past the makespan,
    an efficiency of 1.0000000000000002. One past it by more is left as it is, to be seen."""
    if bound_s > makespan_s and bound_s - makespan_s <= 1e-9 * makespan_s:
        return makespan_s
    return bound_s


def _bound_sums(
    schedule: Schedule,
    table: TraceTable,
    work: np.ndarray,
    busy: dict[str, float],
    res: np.ndarray,
    res_names: list[str],
) -> list[float]:
    """Per resource of the bounds (`bound_codes`: `res`, `res_names`), its rows' work summed
    as pandas sums it: `busy`'s sums where they are of the same rows, added the same way (no
    pool: each row's bound resource its resource, but `none`; `in_row_order` both)."""
    counted = res >= 0
    codes, names = table["resource"], table.names["resource"]
    at = [res_names.index(n) if n in res_names else -1 for n in names]
    same = (
        not any(s.pool for s in schedule.streams.values())
        and in_row_order(work, codes)
        and in_row_order(work[counted], res[counted])
        and np.array_equal(np.array([*at, -1])[codes], res)
    )
    if same:
        return [busy[n] for n in res_names]
    return group_sums(work[counted], res[counted], len(res_names))


def summarize(
    schedule: Schedule,
    trace: pd.DataFrame | TraceTable,
    workload: Workload,
    **labels: Any,
) -> dict[str, Any]:
    """The metrics of summary.json. `labels` (planner, executor, model, hardware ...) come first.
    A frame or its columns give the same, to the bit: pandas' group sums (`group_sums`)."""
    table = table_of(trace)
    makespan = float(np.fmax.reduce(table["end_s"])) if len(table) else 0.0
    prefill = prefill_s(table)
    work = _work(table, schedule)  # a real trace's pool shares: computed once
    busy = busy_s(table, work=work)
    gpu_busy = busy.get("gpu", 0.0)
    # the busiest resource, a pool's lanes counted as the one GPU they share
    res, res_names = bound_codes(schedule, table)
    by = _bound_sums(schedule, table, work, busy, res, res_names)
    lower = within(float(np.fmax.reduce(by)) if by else 0.0, makespan)
    dag, dag_binds = dag_bound(schedule, table, work)
    dag = within(max(dag, lower), makespan)
    sent = np.flatnonzero(table["bytes"] > 0)
    codes, names = table["resource"][sent], table.names["resource"]
    moved = int_group_sums(table["bytes"][sent], codes, len(names))
    has = np.bincount(codes[codes >= 0], minlength=len(names)) > 0
    tokens = workload.tokens_generated
    ep = schedule.ep  # expert-parallel runs: balance and utilisation (core/balance.py)
    frame = table.frame() if ep and isinstance(trace, TraceTable) else trace
    balance = balance_metrics(frame, ep.n_devices, ep.lanes, ep.copy_kernels) if ep else {}
    if ep and balance and "op_id" in trace:  # were the replica copies prefetched in time?
        balance.update(copy_waits(schedule, frame, ep.n_devices))
    # the GPUs' idle time: on G GPUs their mean; on lanes the time no lane runs a kernel
    if ep and balance:
        gpu_busy = makespan * balance["gpu_load" if ep.lanes else "utilisation"]
    # a GPU busy the whole run sums its ops' times to the makespan give or take rounding
    # (-8e-22 s seen): no idle time, not a negative one
    bubble = max(0.0, makespan - gpu_busy)
    return {
        **labels,
        "batch_size": workload.batch_size,
        "n_batches": workload.n_batches,
        "prompt_len": workload.prompt_len,
        "gen_len": workload.gen_len,
        "tokens_generated": tokens,
        "makespan_s": makespan,
        "prefill_s": prefill,
        "decode_s": makespan - prefill,
        "throughput_tok_s": tokens / makespan if makespan > 0 else 0.0,
        "busy_s": busy,
        "gpu_bubble_s": bubble,
        "gpu_bubble_frac": bubble / makespan if makespan > 0 else 0.0,
        # what the GPUs' idle time waited for (core/bubbles.py); adds up to gpu_bubble_s
        "gpu_idle_causes_s": idle_causes(schedule, table),
        "lower_bound_s": lower,
        "efficiency": lower / makespan if makespan > 0 else 0.0,
        "dag_lower_bound_s": dag,
        "dag_bound_binds": dag_binds if dag > lower else "busiest resource",
        "dag_efficiency": dag / makespan if makespan > 0 else 0.0,
        "bytes_moved": {k: int(v) for k, v, h in zip(names, moved, has, strict=True) if h},
        "peak_bytes": peak_bytes(schedule, table),
        "ops": len(table),
        **balance,
    }
