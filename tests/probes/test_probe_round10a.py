"""Probe round 10a (issue 48): a folder in a run file's place, which the reading commands
called missing or "no column(s)", not a folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from core.trace import read_trace
from experiments.common.cli import error_line
from experiments.common.tables import collect
from experiments.trace_json import read_traces
from tests.probes.conftest import TINY, cli, raises_one_line

FOLDER = "a folder, where a file belongs"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("round10a") / "run"
    r = cli("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.parametrize("name", ["trace.parquet", "summary.json"])
def test_a_folder_in_a_run_files_place_is_said_to_be_one(
    finished_run: Path, tmp_path: Path, name: str
) -> None:
    """trace_json said "no trace.parquet there" and report "no column(s) source, ..." (pyarrow
    reads a folder as an empty dataset) for a trace.parquet that is a folder; collect said
    "not a regular file (a directory)" of summary.json with nothing to do about it."""
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    (run / name).unlink()
    (run / name).mkdir()
    raises_one_line(lambda: read_traces(run), f"{run / name}", FOLDER, "run that run again")
    if name == "trace.parquet":
        raises_one_line(lambda: read_trace(run / name), name, FOLDER, "run that run again")
    else:
        _, problems = collect(tmp_path)
        assert len(problems) == 1 and name in problems[0], problems
        assert FOLDER in problems[0] and "run the sweep again" in problems[0]


def test_an_oserror_on_a_folder_says_it_is_one(tmp_path: Path) -> None:
    """open() of a folder: "Is a directory; check the file and the disk"."""
    with pytest.raises(IsADirectoryError) as info:
        open(tmp_path)  # noqa: SIM115 (the error is the point)
    line = error_line(info.value)
    assert line is not None and str(tmp_path) in line and FOLDER in line
    assert "move that folder away" in line
