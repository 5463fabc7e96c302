"""Probe round 9 (issue 48): a FIFO in a run file's place, which hashing it against the run's
files.sha256 opened and blocked on, and two make_checkpoint into one folder at once, which
each reported success over a folder of one's config.json and the other's shards."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from experiments.trace_json import read_traces
from tests.probes.conftest import deadline, raises_one_line


def test_a_fifo_in_a_run_files_place_is_refused_at_once(tmp_path: Path, cli_here: Any) -> None:
    """trace_json hashed summary.json (a FIFO) against files.sha256 and hung until killed."""
    run = tmp_path / "run"
    assert cli_here("experiments.run", *_TINY, f"hydra.run.dir={run}").returncode == 0
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    with deadline(5):
        raises_one_line(lambda: read_traces(run), "summary.json", "not a regular file (a FIFO)")


_TINY = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]
