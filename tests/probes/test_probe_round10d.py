"""Probe round 10's leftovers: a deletion of a key the config needs (`~hydra.run.dir`,
`~workload.routing`), whose line was omegaconf's or hydra's own ("HydraConfig was not set",
"does not support deletion"), and a group's YAML file that holds no fields, whose line named a
missing key but not the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import overridden
from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize(
    "deleted", ["~hydra.run.dir", "~workload.routing", "~workload.routing.skew"]
)
def test_deleting_a_key_the_config_needs_is_one_line_with_the_fix(
    deleted: str, tmp_path: Path, cli_here: Any
) -> None:
    # the run's folder is the deleted key itself for ~hydra.run.dir (a key given once)
    run = overridden([f"hydra.run.dir={tmp_path / 'run'}"], deleted)
    r = cli_here("experiments.run", *TINY, *run)
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    name = deleted.lstrip("~")
    assert line.startswith(f"error: {deleted}: cannot be deleted"), line
    assert f"{name}=..." in line
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("text", ["", "# a comment, no fields\n", "\n\n"])
@pytest.mark.parametrize("group", ["hardware", "model", "workload"])
def test_a_group_file_without_fields_is_named(
    group: str, text: str, tmp_path: Path, cli_here: Any
) -> None:
    f = tmp_path / "mine.yaml"
    f.write_text(text)
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={f}", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith(f"error: {group}={f}: the file holds no fields"), line
    assert f"conf/{group}/" in line


@pytest.mark.parametrize("lanes", ["1", "0"])
def test_bench_lanes_needs_two_lanes(lanes: str, cli_here: Any) -> None:
    """bench.lanes lanes=1 ran and printed an overlap of 1, which one lane has by definition
    (validate_lanes refuses it): refused, as validate_lanes does."""
    one_line(cli_here("experiments.bench.lanes", f"lanes={lanes}", "device=cpu"), "lanes=", ">= 2")


def test_collect_counts_no_trace_where_a_folder_has_its_name(tmp_path: Path, cli_here: Any) -> None:
    """A folder named trace.parquet in a run counted as the run's trace in collect's has_trace,
    so report drew its figures from it (and failed there) instead of leaving the run out of
    them with its warning."""
    from experiments.common.tables import collect

    run = tmp_path / "sweep" / "run"
    assert cli_here("experiments.run", *TINY, f"hydra.run.dir={run}").returncode == 0
    (run / "trace.parquet").unlink()
    (run / "trace.parquet").mkdir()
    df, _ = collect(tmp_path / "sweep")
    assert df["has_trace"].tolist() == [False]


def test_a_sweep_folder_given_to_a_single_run_is_refused(tmp_path: Path, cli_here: Any) -> None:
    """hydra.sweep.dir=X without -m ran the single run into outputs/<date>/ and left X unused:
    the mirror of hydra.run.dir in a sweep, which is refused too."""
    sweep = tmp_path / "sweep"
    r = cli_here("experiments.run", *TINY, f"hydra.sweep.dir={sweep}")
    one_line(r, f"hydra.sweep.dir={sweep}", f"hydra.run.dir={sweep}", "-m")
    assert not sweep.exists()


@pytest.mark.parametrize("value", ["0", "-5", "1e300"])
def test_the_rendezvous_timeout_has_one_range_line(
    value: str, tmp_path: Path, cli_here: Any
) -> None:
    """rendezvous_timeout_s=0 said "must be > 0", 1e300 "must be in [1, 86400]": two bounds for
    one range. Either side now gives the range."""
    run = tmp_path / "run"
    r = cli_here(
        "experiments.run", *TINY, f"executor.rendezvous_timeout_s={value}", f"hydra.run.dir={run}"
    )
    one_line(r, "executor.rendezvous_timeout_s=", "[1, 86400]")
    assert not run.exists()


def test_calibrate_leaves_no_empty_disk_dir_it_made(tmp_path: Path, cli_here: Any) -> None:
    """calibrate made disk_dir (runs/.calib by default) for its probe file and left it behind,
    empty, once the file was gone: a folder of its own in every place it ran from."""
    scratch = tmp_path / "new" / "calib"
    out = tmp_path / "mine.yaml"
    r = cli_here("experiments.calibrate", f"disk_dir={scratch}", "disk_mb=8", f"out={out}")
    assert r.returncode == 0, r.stderr
    assert out.is_file() and not (tmp_path / "new").exists()
