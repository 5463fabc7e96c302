"""Probe class: a run's trace.parquet or summary.json read back by trace_json, report and
collect, of another schema or edited since the run: one line naming the file (and the column),
never an internal error deep in a reader, never a table or figure of the edited data."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from core.trace import read_trace
from experiments.common.tables import collect
from tests.probes.conftest import one_line, raises_one_line, tiny_run

Edit = Callable[[pd.DataFrame], pd.DataFrame]


def _set(col: str, values: Callable[[pd.DataFrame], Any]) -> Edit:
    return lambda df: df.assign(**{col: values(df)})


# (case, edit of a run's trace, words the line must hold); each was drawn or tabulated, or an
# internal error (IndexError in trace_json, KeyError or NaN axis limits in report's timeline)
SCHEMA: list[tuple[str, Edit, str]] = [
    ("kind a number", _set("kind", lambda df: np.arange(len(df))), "column kind"),
    ("kind no op's", _set("kind", lambda df: ["bogus"] * len(df)), "'bogus'"),
    ("stream null", _set("stream", lambda df: [None] * len(df)), "column stream"),
    ("source null", _set("source", lambda df: [None] * len(df)), "column source"),
    ("resource garbage", _set("resource", lambda df: ["gpu:x"] * len(df)), "'gpu:x'"),
    ("op_id negative", _set("op_id", lambda df: -1 - np.arange(len(df))), "op_id"),
    ("op_id twice", _set("op_id", lambda df: np.zeros(len(df), int)), "op_id 0"),
    ("op_id fractions", _set("op_id", lambda df: np.full(len(df), 0.5)), "op_id"),
    (
        "layer nulls",
        _set("layer", lambda df: pd.array([None] * len(df), dtype="Int32")),
        "column layer",
    ),
    ("bytes negative", _set("bytes", lambda df: -np.ones(len(df), int)), "column bytes"),
    ("no step", lambda df: df.drop(columns=["step"]), "no column(s) step"),
    ("start_s bool", _set("start_s", lambda df: np.zeros(len(df), bool)), "column start_s"),
    ("sm_s negative", _set("sm_s", lambda df: -np.ones(len(df))), "column sm_s"),
    ("launch_s inf", _set("launch_s", lambda df: np.full(len(df), np.inf)), "column launch_s"),
]


@pytest.fixture(scope="module")
def a_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (one subprocess for the module); tests change a copy."""
    return tiny_run(tmp_path_factory.mktemp("sweep") / "a")


@pytest.fixture
def sweep(a_run: Path, tmp_path: Path) -> Path:
    shutil.copytree(a_run, tmp_path / "sweep" / "a")
    return tmp_path / "sweep"


@pytest.mark.parametrize("case, edit, words", SCHEMA, ids=[c[0] for c in SCHEMA])
def test_a_trace_of_another_schema_is_named(
    a_run: Path, tmp_path: Path, case: str, edit: Edit, words: str
) -> None:
    path = tmp_path / "trace.parquet"
    edit(pd.read_parquet(a_run / "trace.parquet")).to_parquet(path)
    raises_one_line(lambda: read_trace(path), str(path), words)


def test_a_trace_edited_since_its_run_is_not_drawn(sweep: Path, cli_here: Any) -> None:
    """Half a run's ops, or its times shifted, are a valid trace of no run: trace_json drew
    it (exit 0) and report's timeline failed on NaN axis limits (an internal error). The run's
    files.sha256 says it is not the file the run wrote."""
    run = sweep / "a"
    trace = run / "trace.parquet"
    df = pd.read_parquet(trace)
    out = f"out={sweep / 'x.json'}"
    for edited in (df.iloc[: len(df) // 2], df.assign(start_s=df.start_s + 1, end_s=df.end_s + 1)):
        edited.to_parquet(trace)
        one_line(cli_here("experiments.trace_json", f"runs='{run}'", out), str(trace), "sha256")
        one_line(cli_here("experiments.report", f"dir={sweep}"), str(trace), "sha256")
    assert not (sweep / "x.json").exists()


def test_a_summary_edited_since_its_run_is_not_collected(sweep: Path, cli_here: Any) -> None:
    """A throughput typed into a finished run's summary.json was tabulated as the run's."""
    path = sweep / "a" / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps(summary | {"throughput_tok_s": 9e9}))
    df, problems = collect(sweep)
    assert df.empty and len(problems) == 1
    assert str(path) in problems[0] and "files.sha256" in problems[0]
    one_line(cli_here("experiments.collect", f"dir={sweep}"), str(path))


def test_a_run_dir_without_files_sha256_is_still_collected(sweep: Path) -> None:
    """A run dir made by hand (a summary and a config) has nothing to check against: kept."""
    (sweep / "a" / "files.sha256").unlink()
    df, problems = collect(sweep)
    assert len(df) == 1 and not problems
