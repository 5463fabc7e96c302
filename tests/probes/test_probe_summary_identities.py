"""A summary.json whose metrics disagree with the ones they are computed from was accepted by
collect, report and a rerun's reuse when its run dir had no files.sha256 (a run dir made or
edited by hand): `efficiency` 5, a lower bound past the makespan, a makespan of 0 for a run of
ops. core.trace.summarize computes each ratio from its parts, so no run writes them apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import raises_one_line


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder of one finished tiny run, without files.sha256 (nothing to check its
    files against: what they hold is checked by its own rules)."""
    from tests.probes.conftest import tiny_run

    root = tmp_path_factory.mktemp("sweep")
    tiny_run(root / "good")
    (root / "good" / "files.sha256").unlink()
    return root


def edited(finished: Path, tmp_path: Path, change: Any) -> tuple[Path, Path]:
    """A copy of the sweep with its run's summary changed by `change(summary)` -> updates (a
    key updated to None is left out)."""
    mine = tmp_path / "sweep"
    shutil.copytree(finished, mine)
    path = mine / "good" / "summary.json"
    summary = json.loads(path.read_text()) | change(json.loads(path.read_text()))
    path.write_text(json.dumps({k: v for k, v in summary.items() if v is not None}))
    return mine, path


def test_a_runs_own_summary_agrees_with_itself(finished: Path) -> None:
    from experiments.common.tables import collect

    df, problems = collect(finished)
    assert len(df) == 1 and not problems, problems


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("efficiency", lambda s: {"efficiency": 5}),
        ("efficiency", lambda s: {"lower_bound_s": 2 * s["makespan_s"]}),
        ("dag_efficiency", lambda s: {"dag_lower_bound_s": 3 * s["makespan_s"]}),
        ("throughput_tok_s", lambda s: {"throughput_tok_s": 2 * s["throughput_tok_s"]}),
        ("gpu_bubble_frac", lambda s: {"gpu_bubble_frac": min(1.0, s["gpu_bubble_frac"] + 0.1)}),
        ("decode_s", lambda s: {"decode_s": s["makespan_s"] + 1}),
        ("makespan_s", lambda s: {"makespan_s": 0}),
    ]
    + [(group, lambda s, g=group: {g: None}) for group in ("busy_s", "peak_bytes")],
)
def test_a_metric_apart_from_its_parts_is_not_a_runs(
    finished: Path, tmp_path: Path, key: str, change: Any
) -> None:
    from experiments.common.run_dir import finished as reusable
    from experiments.common.tables import collect

    mine, path = edited(finished, tmp_path, change)
    raises_one_line(lambda: collect(mine), str(path), f"{key} is", "not a run's")
    assert not reusable(mine / "good", (mine / "good" / "config.yaml").read_text())
