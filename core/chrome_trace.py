"""A trace as Chrome/Perfetto JSON (chrome://tracing, ui.perfetto.dev): one process per device
(or rank), one thread per stream, written column by column (`write_chrome`). The parquet trace
(core.trace) stays the canonical one; this is its on-demand view (`experiments.trace_json`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.balance import device_of
from core.lazy import lazy_module
from core.trace import TRACE_COLUMNS, factorize

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")


def to_chrome(traces: Iterable[pd.DataFrame]) -> dict[str, Any]:
    """Chrome trace-event JSON: one process per source, one thread per stream, op fields in args.

    Opens in ui.perfetto.dev. Zero-length ops (frees) are instant events.
    """
    events: list[dict[str, Any]] = []
    for pid, df in enumerate(traces, start=1):
        if df.empty:
            continue
        source = str(df["source"].iloc[0])
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": source}})
        streams = list(dict.fromkeys(df["stream"].astype(str)))
        tids = {s: i + 1 for i, s in enumerate(streams)}
        for s, tid in tids.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": s}}
            )
        recs = df.to_dict("records")
        for r in recs:
            name = r["kind"] if r["tensor"] == "none" else f"{r['kind']} {r['tensor']}"
            args = {
                k: _jsonable(r[k])
                for k in TRACE_COLUMNS
                if k not in ("start_s", "end_s") and k in r and not _missing(r[k])
            }
            ts = r["start_s"] * 1e6
            dur = (r["end_s"] - r["start_s"]) * 1e6
            ev = {
                "name": name,
                "cat": r["kind"],
                "pid": pid,
                "tid": tids[str(r["stream"])],
                "ts": ts,
                "args": args,
            }
            if dur > 0:
                ev.update(ph="X", dur=dur)
            else:
                ev.update(ph="i", s="t")
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _missing(v: Any) -> bool:
    """NaN (no value; JSON has none)."""
    return isinstance(v, float) and v != v


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    return v if isinstance(v, int | float | str) else str(v)


CHROME_START = b'{"traceEvents": ['  # how every file write_chrome writes begins


def write_chrome(path: str | Path, traces: Iterable[pd.DataFrame]) -> None:
    """`to_chrome(traces)` as JSON text, written column by column (the same document, built
    without a dict per op: a run's 178k ops take a fraction of a second)."""
    parts: list[str] = []
    for pid, df in enumerate(traces, start=1):
        if not df.empty:
            parts.extend(_chrome_events(pid, df))
    with open(path, "w") as f:
        f.write(CHROME_START.decode())
        f.write(", ".join(parts))
        f.write('], "displayTimeUnit": "ms"}')


def chrome_parts(trace: pd.DataFrame, processes: int = 0) -> list[pd.DataFrame]:
    """The traces trace.json shows as processes: the run's one, or, of a run on G processes,
    one per device (`source` named `real:gpu<d>` there only)."""
    if processes <= 0 or trace.empty:
        return [trace]
    dev = device_of(trace["resource"])
    src = trace["source"].iloc[0]
    return [trace[dev == d].assign(source=f"{src}:gpu{d}") for d in range(processes)]


def _chrome_events(pid: int, df: pd.DataFrame) -> list[str]:
    """The JSON text of one trace's events (as `to_chrome` makes them, in its order)."""
    dumps = json.dumps
    source = str(df["source"].iloc[0])
    out = [dumps({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": source}})]
    streams = list(dict.fromkeys(df["stream"].astype(str)))
    tids = {s: i + 1 for i, s in enumerate(streams)}
    out += [
        dumps({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": s}})
        for s, tid in tids.items()
    ]
    n = len(df)
    # each arg column as `"key": value` fragments, "" where the value is missing (NaN)
    frags = []
    for k in TRACE_COLUMNS:
        if k in ("start_s", "end_s") or k not in df:
            continue
        frags.append(_arg_fragments(k, df[k]))
    args = [", ".join(filter(None, row)) for row in zip(*frags, strict=True)] if frags else [""] * n
    # the event's name and category, from the few (kind, tensor) pairs there are
    kc, kinds = factorize(df["kind"])
    tc, tensors = factorize(df["tensor"]) if "tensor" in df else (np.zeros(n, np.int64), ["none"])
    pair = kc * len(tensors) + tc
    heads = {
        int(p): f'{{"name": {dumps(k if t == "none" else f"{k} {t}")}, "cat": {dumps(k)}, '
        f'"pid": {pid}, "tid": '
        for p, k, t in (
            (p, kinds[p // len(tensors)], tensors[p % len(tensors)])
            for p in np.unique(pair).tolist()
        )
    }
    named = [heads[c] for c in pair.tolist()]
    sc, snames = factorize(df["stream"])
    # a categorical keeps the categories of the trace it was cut from (one device's part of a
    # run on G processes): streams with no op here have no thread and no event to name
    stid = [str(tids.get(s, 0)) for s in snames]
    tid = [stid[c] for c in sc.tolist()]
    start = df["start_s"].to_numpy(np.float64)
    ts = _json_floats(start * 1e6)
    dur_arr = (df["end_s"].to_numpy(np.float64) - start) * 1e6
    dur = _json_floats(dur_arr)
    tails = [
        '"ph": "X", "dur": ' + d + "}" if p else '"ph": "i", "s": "t"}'
        for d, p in zip(dur, (dur_arr > 0).tolist(), strict=True)
    ]
    out += [
        f'{h}{t}, "ts": {x}, "args": {{{a}}}, {e}'
        for h, t, x, a, e in zip(named, tid, ts, args, tails, strict=True)
    ]
    return out


def _json_floats(arr: np.ndarray) -> list[str]:
    """Floats as json.dumps writes them."""
    if np.isfinite(arr).all():
        return list(map(float.__repr__, arr.tolist()))
    return [_json_float(v) for v in arr.tolist()]


def _json_float(x: float) -> str:
    """A float as json.dumps writes it (NaN and infinities as its non-strict names)."""
    if x != x:
        return "NaN"
    if x in (np.inf, -np.inf):
        return "Infinity" if x > 0 else "-Infinity"
    return float.__repr__(x)


def _arg_fragments(key: str, col: pd.Series) -> list[str]:
    """`"key": value` per row of one trace column, as `to_chrome`'s args hold it; "" where the
    value is NaN (left out)."""
    head = json.dumps(key) + ": "
    if not pd.api.types.is_numeric_dtype(col.dtype):
        codes, uniq = factorize(col)
        lookup = [head + json.dumps(v) for v in uniq]
        return [lookup[c] for c in codes.tolist()]
    arr = col.to_numpy()
    if np.issubdtype(arr.dtype, np.integer) or arr.dtype == bool:
        if arr.dtype == bool:
            return [head + ("true" if v else "false") for v in arr.tolist()]
        return [head + str(v) for v in arr.tolist()]
    arr = arr.astype(np.float64)
    text = _json_floats(arr)
    return [head + v if ok else "" for v, ok in zip(text, (arr == arr).tolist(), strict=True)]
