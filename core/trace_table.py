"""A trace's columns as numpy arrays (`TraceTable`): what a simulated run builds, summarizes and
writes, so that a run needs no pandas (a quarter of a second to import). `frame()` is the pandas
DataFrame of `core.trace.make_trace`, `arrow()` the table pyarrow makes of that frame (the same
trace.parquet bytes), `group_sums` pandas' group sums, to the bit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    import pyarrow as pa


@dataclass(frozen=True, eq=False)
class TraceTable:
    """One row per op, in op order: each of `core.trace_check.TRACE_COLUMNS` as an array; a text
    column (source, kind, stream, resource, tensor) as codes into its sorted `names`, in the
    integer type pandas gives a categorical of that many names."""

    cols: dict[str, np.ndarray]  # column -> [ops]; a text column's codes
    names: dict[str, list[str]]  # text column -> its names (categories), sorted

    def __len__(self) -> int:
        return len(self.cols["op_id"])

    def __contains__(self, column: object) -> bool:
        return column in self.cols

    def __iter__(self) -> Iterator[str]:
        return iter(self.cols)

    def __getitem__(self, column: str) -> np.ndarray:
        return self.cols[column]

    def frame(self) -> pd.DataFrame:
        """The trace as pandas' DataFrame: a text column categorical."""
        import pandas as pd

        data = {
            c: pd.Categorical.from_codes(v, categories=pd.Index(self.names[c]))
            if c in self.names
            else v
            for c, v in self.cols.items()
        }
        return pd.DataFrame(data, columns=list(self.cols))

    def arrow(self) -> pa.Table:
        """`pa.Table.from_pandas(self.frame(), preserve_index=False)`, without pandas: the same
        columns, types and pandas metadata (read back, the same frame)."""
        from importlib.metadata import version

        import pyarrow as pa

        arrays, columns = [], []
        for c, v in self.cols.items():
            if c in self.names:
                arrays.append(pa.DictionaryArray.from_arrays(_arrow(v), _arrow_text(self.names[c])))
                meta: dict[str, Any] | None = {
                    "num_categories": len(self.names[c]),
                    "ordered": False,
                }
                kind = "categorical"
            else:
                arrays.append(_arrow(v))
                meta, kind = None, str(v.dtype)
            columns.append(
                {
                    "name": c,
                    "field_name": c,
                    "pandas_type": kind,
                    "numpy_type": str(v.dtype),
                    "metadata": meta,
                }
            )
        pandas_meta = {
            "index_columns": [],
            "column_indexes": [],
            "columns": columns,
            "attributes": {},
            "creator": {"library": "pyarrow", "version": pa.__version__},
            "pandas_version": version("pandas"),  # pandas.__version__, without pandas
        }
        return pa.Table.from_arrays(
            arrays, names=list(self.cols), metadata={b"pandas": json.dumps(pandas_meta).encode()}
        )


def _arrow(values: np.ndarray) -> pa.Array:
    """`pa.array(values, from_pandas=True)` (a NaN is null), from the array's own buffer:
    pyarrow imports pandas to convert a numpy array."""
    import pyarrow as pa

    values = np.ascontiguousarray(values)
    nan = np.isnan(values) if values.dtype.kind == "f" else np.zeros(len(values), bool)
    valid = pa.py_buffer(np.packbits(~nan, bitorder="little")) if nan.any() else None
    kind = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(
        kind, len(values), [valid, pa.py_buffer(values)], null_count=int(nan.sum())
    )


def _arrow_text(names: list[str]) -> pa.Array:
    """`pa.array(names, pa.large_string())` (pandas' str), from its offsets and UTF-8 bytes."""
    import pyarrow as pa

    data = [n.encode() for n in names]
    offsets = np.r_[0, np.cumsum([len(d) for d in data], dtype=np.int64)].astype(np.int64)
    return pa.Array.from_buffers(
        pa.large_string(), len(names), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(data))]
    )


def table_of(trace: pd.DataFrame | TraceTable) -> TraceTable:
    """`trace` as a TraceTable (itself if it is one): a frame's text columns, categorical or not,
    as codes into their names as str, sorted; a row without one (NaN) has code -1, as grouping by
    the names as str leaves it out."""
    if isinstance(trace, TraceTable):
        return trace
    import pandas as pd

    cols, names = {}, {}
    for c in trace.columns:
        col = trace[c]
        if isinstance(col.dtype, pd.CategoricalDtype):
            codes = col.cat.codes.to_numpy(np.int64)
            labels = [str(x) for x in col.cat.categories]
        elif pd.api.types.is_numeric_dtype(col.dtype):
            cols[c] = col.to_numpy()
            continue
        else:
            codes, uniq = pd.factorize(col.astype(str))
            codes, labels = codes.astype(np.int64), [str(u) for u in uniq]
        cols[c], names[c] = text_codes(codes, labels)
    return TraceTable(cols, names)


def code_type(n_names: int) -> type[np.signedinteger[Any]]:
    """The integer type of a pandas categorical's codes with `n_names` categories."""
    for t in (np.int8, np.int16, np.int32):
        if n_names < np.iinfo(t).max:
            return t
    return np.int64


def text_codes(codes: np.ndarray, names: list[str]) -> tuple[np.ndarray, list[str]]:
    """Codes into `names` as codes into the names that occur, sorted (several codes may share a
    name: streams of one resource), in `code_type`: `pd.Categorical([names[c] for c in
    codes])`'s codes and categories; -1: none."""
    present = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(names)))
    cats = sorted({names[i] for i in present.tolist()})
    at = {name: i for i, name in enumerate(cats)}
    remap = np.array([at.get(name, -1) for name in names] + [-1], dtype=code_type(len(cats)))
    return remap[codes], cats  # code -1 (none) stays -1: remap's last


def group_sums(values: np.ndarray, codes: np.ndarray, n_groups: int) -> list[float]:
    """Per group 0 .. n_groups - 1, the sum of `values` (float64) of its rows (`codes`, the
    groups in sorted order; -1: in none) as pandas' `Series.groupby(codes).sum()` makes it, to
    the bit, 0.0 for a group without rows. pandas adds each group's values in row order with
    Kahan's compensation (NaN skipped); only where the rows come in group order already (the
    -1s first) and none is NaN, it takes numpy's `add.reduceat` (pairwise: other last bits)."""
    values = np.asarray(values, np.float64)
    codes = np.asarray(codes, np.int64)
    if not in_row_order(values, codes):
        lead = int(np.searchsorted(codes, 0))  # the rows of no group, first
        if lead < len(codes):
            rest = codes[lead:]
            starts = np.flatnonzero(np.r_[True, rest[1:] != rest[:-1]])
            out = np.zeros(n_groups)
            with np.errstate(all="ignore"):  # inf - inf: NaN, as pandas' sum gives
                out[rest[starts]] = np.add.reduceat(values[lead:], starts)
            return out.tolist()
    order = np.argsort(codes, kind="stable")
    cuts = np.searchsorted(codes[order], np.arange(n_groups + 1), "left").tolist()
    ordered = values[order]
    add = _kahan_finite if np.isfinite(ordered).all() else _kahan  # its checks: a third more
    listed = ordered.tolist()
    return [add(listed[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def in_row_order(values: np.ndarray, codes: np.ndarray) -> bool:
    """Whether `group_sums` adds each group's values one by one in row order (Kahan): unless
    the rows come in group order and none is NaN."""
    in_order = len(codes) and (codes[1:] >= codes[:-1]).all()
    return not in_order or bool(np.isnan(values).any())


def _kahan(values: list[float]) -> float:
    """pandas' `group_sum` of one group's values, in order."""
    total = comp = 0.0
    for v in values:
        if v != v:  # NaN: skipped
            continue
        y = v - comp
        t = total + y
        comp = t - total - y
        if comp != comp:  # an infinite value made it NaN: the sum stays infinite
            comp = 0.0
        total = t
    return total


def _kahan_finite(values: list[float]) -> float:
    """`_kahan` of finite values (neither check can hold)."""
    total = comp = 0.0
    for v in values:
        y = v - comp
        t = total + y
        comp = t - total - y
        total = t
    return total


def per_step(
    res: np.ndarray, step: np.ndarray, head: np.ndarray, work: np.ndarray, tail: np.ndarray
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Per (resource, step) of the rows, sorted: the resource, the step and [the least head,
    the summed work, the least tail], as pandas' `groupby([resource, step]).agg` gives them:
    the sums compensated in row order (`group_sums`), a NaN left out of a least unless all are."""
    order = np.lexsort((step, res))  # stable: each group's rows in row order
    r, st = res[order], step[order]
    new = np.r_[True, (r[1:] != r[:-1]) | (st[1:] != st[:-1])] if len(r) else np.zeros(0, bool)
    starts = np.flatnonzero(new)
    group = np.empty(len(order), np.int64)
    group[order] = np.cumsum(new) - 1
    sums = np.array(group_sums(work, group, len(starts)), np.float64)
    if not len(starts):
        return r, st, [np.zeros(0), sums, np.zeros(0)]
    least = [np.fmin.reduceat(head[order], starts), sums, np.fmin.reduceat(tail[order], starts)]
    return r[starts], st[starts], least


def int_group_sums(values: np.ndarray, codes: np.ndarray, n_groups: int) -> np.ndarray:
    """Per group, the int64 sum of its rows' `values` (`codes`; -1: in none)."""
    keep = codes >= 0
    out = np.zeros(n_groups, np.int64)
    np.add.at(out, codes[keep], np.asarray(values, np.int64)[keep])
    return out
