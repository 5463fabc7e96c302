"""`core.trace_table`: a simulated run's trace as numpy columns, summarised and written without
pandas, gives what its pandas frame gave, to the bit: pandas' compensated group sums, the
(resource, step) aggregates of the DAG bound, the summary, the trace.parquet bytes, the frame."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from core.schedule import Schedule
from core.trace import (
    bound_codes,
    busy_s,
    make_trace,
    sum_by_name,
    summarize,
    within,
    work_s,
)
from core.trace_table import TraceTable, group_sums, per_step, table_of
from experiments.common.pipeline import build_schedule, simulate_table, write_trace_parquet
from tests.conftest import random_routing
from tests.core.test_fast_paths import RUNS, jittered, run_spec
from tests.probes.conftest import ROOT


@pytest.fixture(scope="module")
def tables() -> list[tuple[Schedule, TraceTable, object]]:
    """Each of test_fast_paths' RUNS (every planner; pools, lanes) planned and simulated:
    (schedule, the run's columns, its workload)."""
    out = []
    for name, params in RUNS:
        spec = run_spec(name, params)
        schedule = build_schedule(spec, random_routing(spec.model, spec.workload))
        out.append((schedule, simulate_table(schedule, spec.hardware), spec.workload))
    return out


def hexes(values) -> list[str]:
    """Each float as its exact bits (-0.0 and 0.0 apart; every NaN one)."""
    return [float.hex(float(v)) for v in values]


def awkward(rng: np.random.Generator, n: int) -> np.ndarray:
    """Floats of 20 decades, signs mixed, with NaN and infinities among them."""
    x = rng.standard_normal(n) * 10.0 ** rng.integers(-10, 10, n)
    u = rng.random(n)
    x[u < 0.03] = np.nan
    x[(u > 0.03) & (u < 0.04)] = np.inf
    x[(u > 0.04) & (u < 0.05)] = -np.inf
    x[(u > 0.05) & (u < 0.06)] = -0.0
    return x


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # pandas' reduceat: inf - inf, overflow
@pytest.mark.parametrize("seed", range(40))
def test_group_sums_are_pandas_groupby_sums(seed):
    """`group_sums` is `Series.groupby(codes).sum()` to the bit: Kahan in row order (in Python),
    or where the rows come sorted by group and none is NaN numpy's `add.reduceat`, as pandas
    does; rows of no group (-1), groups without rows (0.0), NaN skipped, infinities."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(0, 3000))
    x = awkward(rng, n)
    codes = rng.integers(-1, 7, n)
    if seed % 4 >= 2:  # finite values: the loop without the checks for NaN
        x = np.nan_to_num(x, nan=1.5, posinf=1e300, neginf=-1e300)
    if seed % 2:  # rows in group order, none NaN: pandas takes numpy's reduceat
        codes, x = np.sort(codes), np.nan_to_num(x, nan=1.5)
    got = group_sums(x, codes, 8)
    ref = pd.Series(x).groupby(codes).sum()
    want = [float(ref.get(g, 0.0)) for g in range(8)]
    assert hexes(got) == hexes(want)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # pandas' reduceat: overflow
@pytest.mark.parametrize("seed", range(20))
def test_per_step_aggregates_are_pandas_groupby_aggs(seed):
    """The DAG bound's per (resource, step) least head and tail and summed work are
    `DataFrame.groupby([resource, step]).agg(min, sum, min)`'s, groups in sorted order, NaN
    left out of a least unless every value is one."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 2000))
    res, step = rng.integers(0, 4, n), rng.integers(0, 9, n).astype(np.int32)
    head, work, tail = awkward(rng, n), awkward(rng, n), awkward(rng, n)
    head[rng.random(n) < 0.3] = np.nan  # groups of NaN heads only, too
    if seed % 2:  # rows in group order, no NaN work: pandas' reduceat
        order = np.lexsort((step, res))
        res, step, head, tail = res[order], step[order], head[order], tail[order]
        work = np.nan_to_num(work[order], nan=2.5)
    r, s, (h, w, t) = per_step(res, step, head, work, tail)
    frame = pd.DataFrame({"resource": res, "step": step, "head": head, "dur": work, "tail": tail})
    per = frame.groupby(["resource", "step"], sort=True).agg(
        head=("head", "min"), dur=("dur", "sum"), tail=("tail", "min")
    )
    assert r.tolist() == per.index.get_level_values(0).tolist()
    assert s.tolist() == per.index.get_level_values(1).tolist()
    for got, col in ((h, "head"), (w, "dur"), (t, "tail")):
        assert hexes(got) == hexes(per[col]), col


def test_every_runs_columns_summarise_as_its_frame(tables):
    """The summary of a run's columns, and of them jittered (random launch and grant times),
    has the busy seconds, the busiest resource's bound and the bytes moved that pandas'
    groupbys of its frame gave; busy seconds and the DAG bound of a trace with ops that never
    ran, too."""
    for seed, (schedule, table, workload) in enumerate(tables):
        frame = table.frame()
        shaken = jittered(schedule, frame, seed, 0.0)
        for tr in (frame, shaken):
            got = summarize(schedule, table_of(tr), workload)
            work = work_s(tr, schedule)
            busy = sum_by_name(work, tr["resource"])
            assert got["busy_s"] == {k: float(v) for k, v in busy.items() if k != "none"}
            res, _ = bound_codes(schedule, tr)
            by = work[res >= 0].groupby(res[res >= 0]).sum()
            makespan = float(tr["end_s"].max())
            assert got["lower_bound_s"] == within(float(by.max()), makespan)
            sent = tr["bytes"] > 0
            moved = sum_by_name(tr["bytes"][sent], tr["resource"][sent])
            assert got["bytes_moved"] == {k: int(v) for k, v in moved.items()}
        for tr in (frame, shaken, jittered(schedule, frame, seed, 0.3)):
            cols = table_of(tr)
            ref = sum_by_name(work_s(tr, schedule), tr["resource"])
            ref_busy = {k: float(v) for k, v in ref.items() if k != "none"}
            assert list(busy_s(cols, schedule)) == list(ref_busy)
            assert hexes(busy_s(cols, schedule).values()) == hexes(ref_busy.values())


def test_columns_make_the_frame_and_the_table_pandas_would(tables, tmp_path):
    """A run's columns give `make_trace`'s frame, and its arrow table (types, pandas metadata)
    and trace.parquet's bytes are what pyarrow makes of that frame: without pandas, the same
    file, read back the same."""
    for i, (schedule, table, _) in enumerate(tables):
        frame = table.frame()
        ref = make_trace(
            schedule,
            table["start_s"],
            table["end_s"],
            "sim",
            table["sm_s"],
            table["launch_s"],
            table["alloc_s"],
        )
        pd.testing.assert_frame_equal(frame, ref, check_exact=True, check_categorical=True)
        assert table.arrow().equals(
            pa.Table.from_pandas(frame, preserve_index=False), check_metadata=True
        )
        write_trace_parquet(table, tmp_path / f"cols{i}.parquet")
        write_trace_parquet(frame, tmp_path / f"frame{i}.parquet")
        got = (tmp_path / f"cols{i}.parquet").read_bytes()
        assert got == (tmp_path / f"frame{i}.parquet").read_bytes()
        back = table_of(frame)
        assert back.names == table.names
        assert all(np.array_equal(back[c], table[c], equal_nan=True) for c in table)


@pytest.mark.parametrize("planner", ["flexgen", "klotski", "fiddler"])
def test_a_simulated_run_never_imports_pandas(tmp_path, planner):
    """The command's simulated run (plan, simulate, summary, trace.parquet, summary.json) with
    pandas and numpy.ma out of reach: it imported pandas, a quarter of a second of each run's
    CPU, to build the trace as a frame, sum it and write it, and numpy.ma (0.012 s) where
    np.unique asks whether an array is masked."""
    code = (
        "import runpy, sys\n"
        "sys.modules['pandas'] = sys.modules['numpy.ma'] = None  # importing them fails\n"
        "sys.argv = ['experiments.run', *sys.argv[1:]]\n"
        "runpy.run_module('experiments.run', run_name='__main__', alter_sys=True)\n"
    )
    args = ["model=tiny", "hardware=tiny", "workload=tiny", f"planner={planner}"]
    r = subprocess.run(
        [sys.executable, "-c", code, *args, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["ops"] == len(pd.read_parquet(tmp_path / "run" / "trace.parquet"))
