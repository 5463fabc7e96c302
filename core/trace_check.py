"""What a trace.parquet must hold to be a run's trace (core.trace's schema), checked where one is
read back: every column a reader uses, of its type, with the values a run writes. A file that
breaks it is a TraceError naming the file and the column, not a reader's traceback or a figure of
wrong data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import TraceError
from core.lazy import lazy_module
from core.types import OpKind

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

# a trace.parquet's columns, in order: one row per op (`core.trace.make_trace`)
TRACE_COLUMNS = [
    "source",  # sim | real
    "op_id",
    "kind",
    "stream",
    "resource",
    "step",
    "layer",
    "batch",
    "micro",  # micro-batch of the batch (two-batch overlap), -1: the whole batch
    "batches",  # consecutive batches the op covers from `batch` (one attention over several)
    "expert",
    "tensor",
    "bytes",
    "tokens",
    "start_s",
    "end_s",
    # seconds of the whole GPU an op's work used, where it shared the GPU's SMs with other
    # streams' ops (a simulated pool: StreamSpec.pool; for a transfer in a link's pool, seconds
    # of the whole link); NaN where the op held its resource from start to end (its busy time is
    # end - start) and in real traces, which cannot see SMs
    "sm_s",
    # a pool op's launch: seconds from its start until its kernel runs (NaN elsewhere: there
    # the per-op overhead counts as device time)
    "launch_s",
    # when the op's allocation was granted, where that is before its start (the simulator: an
    # op holds its memory while it waits for a link another stream holds); NaN: at its start
    "alloc_s",
]

# columns added after the first traces (a trace read back may lack them); every other is required
LATER = ("micro", "batches", "sm_s", "launch_s", "alloc_s")
REQUIRED = tuple(c for c in TRACE_COLUMNS if c not in LATER)
_TEXT = ("source", "kind", "stream", "resource", "tensor")
_WHOLE = ("op_id", "step", "layer", "batch", "micro", "batches", "expert", "bytes", "tokens")
_COUNTS = ("op_id", "bytes", "tokens")  # never negative (the others use -1 for "none")
_SECONDS = ("start_s", "end_s", "sm_s", "launch_s", "alloc_s")
_OPTIONAL_SECONDS = ("sm_s", "launch_s", "alloc_s")  # NaN: not measured
_KINDS = frozenset(str(k) for k in OpKind)
REDO = "run that run again to rewrite it"


def check_trace(trace: pd.DataFrame, path: Path) -> None:
    """A TraceError naming `path` and the column when a parquet file is not a run's trace: a
    column missing or of another type (text where numbers belong, a fraction or a null in a
    whole-number column), an op kind no run writes, a resource that is not NAME or NAME:DEVICE,
    an op id given twice, a negative count, or times that are not finite or end before they
    start. Readers would fail on it deep inside, or draw it."""
    missing = [c for c in REQUIRED if c not in trace.columns]
    if missing:
        _fail(path, f"no column(s) {', '.join(missing)}")
    for col in (c for c in _TEXT if not _all_text(trace[c])):
        _fail(path, f"column {col} is not text in every row (a null or a number)")
    kinds = set(trace["kind"].astype(str)) - _KINDS
    if kinds:
        _fail(path, f"column kind holds {sorted(kinds)[0]!r}, no op kind of a run")
    resources = pd.Series(trace["resource"].astype(str).unique())
    named = resources.str.fullmatch(r"[A-Za-z][\w.-]*(:\d+)?")
    if not named.all():
        _fail(path, f"column resource holds {resources[~named].iloc[0]!r}, not NAME or NAME:GPU")
    for col in (c for c in _WHOLE if c in trace.columns):
        dtype = trace[col].dtype
        if not pd.api.types.is_integer_dtype(dtype) or pd.api.types.is_bool_dtype(dtype):
            _fail(path, f"column {col} is {dtype}, not integers")
        if trace[col].isna().any():
            _fail(path, f"column {col} has nulls")
    for col in (c for c in _COUNTS if (trace[c] < 0).any()):
        _fail(path, f"column {col} has a negative value")
    if trace["op_id"].duplicated().any():
        twice = trace["op_id"][trace["op_id"].duplicated()].iloc[0]
        _fail(path, f"op_id {twice} is given twice (a repeated row would count the op twice)")
    _check_seconds(trace, path)


def _all_text(values: pd.Series) -> bool:
    """Every value a string (a categorical's categories, which a run writes, checked once)."""
    if values.isna().any():
        return False
    if isinstance(values.dtype, pd.CategoricalDtype):
        values = pd.Series(values.cat.categories)
    return bool(values.map(lambda v: isinstance(v, str)).all())


def _check_seconds(trace: pd.DataFrame, path: Path) -> None:
    for col in (c for c in _SECONDS if c in trace.columns):
        dtype = trace[col].dtype
        number = pd.api.types.is_float_dtype(dtype) or pd.api.types.is_integer_dtype(dtype)
        if not number or pd.api.types.is_bool_dtype(dtype):
            _fail(path, f"column {col} is {dtype}, not numbers")
    start, end = trace["start_s"].to_numpy(np.float64), trace["end_s"].to_numpy(np.float64)
    bad = ~(np.isfinite(start) & np.isfinite(end) & (end >= start))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(
            path,
            f"op {trace['op_id'].iloc[i]} has start_s={start[i]}, end_s={end[i]} (times are "
            "finite and end >= start)",
        )
    for col in (c for c in _OPTIONAL_SECONDS if c in trace.columns):
        v = trace[col].to_numpy(np.float64)
        given = ~np.isnan(v)
        if (~np.isfinite(v[given]) | (v[given] < 0)).any():
            _fail(path, f"column {col} holds a negative or infinite time (NaN: not measured)")


def _fail(path: Path, what: str) -> None:
    raise TraceError(f"{path}: {what}; not a run's trace; {REDO}")
