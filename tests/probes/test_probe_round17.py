"""Probe round 17 (issue 48): sweeps run twice at once, non-finite numbers, and the torchrun
launcher's loose ends.

A non-finite value of a numeric option (inf, -inf, nan, 1e999, YAML's .inf and .nan, a quoted
'inf') said "must be a finite number" when Python reads it and "not a number" (or "not a whole
number") when YAML spells it: each says the key and "must be a finite number", as the specs'
own check does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize(
    "override",
    [
        "hardware.links.h2d.gbps=.inf",
        "hardware.links.h2d.gbps=-.Inf",
        "hardware.memory_gb.gpu=.nan",
        "hardware.links.h2d.gbps=1e999",
        "hardware.links.h2d.gbps='inf'",
        "workload.gen_len=1e999",
        "workload.batch_size=.inf",
        "workload.seed=nan",
    ],
)
def test_a_non_finite_number_is_said_in_one_wording(
    cli_here: Any, tmp_path: Path, override: str
) -> None:
    r = cli_here("experiments.run", *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    key = override.split("=")[0].removeprefix("hardware.")
    one_line(r, key, "must be a finite number, got")
    assert not (tmp_path / "run").exists()


def test_two_sweeps_at_once_each_count_the_runs_they_ran(tmp_path: Path) -> None:
    """Two sweeps into one sweep dir at once: the second's jobs wrote their token over the
    first's in each run dir's mark, and the first said "0 run(s) finished" for runs it ran.
    Each sweep's mark is kept: the first counts the runs it ran, the second those it found
    finished (reused) or ran after the first's."""
    from experiments.common.callbacks import finished_runs, mark_run
    from experiments.common.run_dir import atomic_write_text

    runs = [tmp_path / "0", tmp_path / "1"]
    for run in runs:
        run.mkdir()
        mark_run(run, "first")
        mark_run(run, "second")  # its job started before the first's run wrote its result
    atomic_write_text(runs[0] / "summary.json", "{}")  # the first's run of point 0
    mark_run(runs[1], "second")  # a job of the second again, as the first's had run point 1
    atomic_write_text(runs[1] / "summary.json", "{}")
    assert finished_runs(tmp_path, "first") == (2, 0)
    assert finished_runs(tmp_path, "second") == (2, 0)
    mark_run(runs[0], "third")  # a third sweep, after both: it reuses their results
    assert finished_runs(tmp_path, "third") == (1, 1)
    assert finished_runs(tmp_path, "first") == (2, 0)
