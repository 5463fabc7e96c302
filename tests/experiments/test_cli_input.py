"""Bad input to the trace, stats and sweep-reading commands (routing_stats, collect, report) is
one line naming the file or argument, exit 2, no traceback; Ctrl-C in any of them (and in
convert_traces and calibrate) is one line and exit 130, as in experiments.run."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from experiments import calibrate, collect, convert_traces, report, routing_stats
from experiments.common import tables
from tests.experiments.test_bad_input import one_error
from tests.probes.conftest import deadline


def _counts_dir(root: Path, counts: np.ndarray) -> Path:
    """A trace dir holding only the OLMoE repository's Mixtral counts file."""
    (root / "olmoe-aggregates").mkdir(parents=True)
    np.savez(root / "olmoe-aggregates" / "olmoe_mixtral_counts.npz", mixtral_counts_topk=counts)
    return root


def test_routing_stats_checks_the_seed_first(tmp_path, capsys):
    """seed=-1 failed in numpy after the statistics were computed."""
    argv = ["seed=-1", f"trace_dir={tmp_path / 'none'}", f"out={tmp_path / 'o'}"]
    assert routing_stats.main(argv) == 2
    one_error(capsys, "seed=-1", "an integer in [0, 9223372036854775807]")


@pytest.mark.parametrize(
    "counts, names",
    [
        (np.zeros((5, 3, 8), np.int64), ["counts no tokens at domain 0, layer 0"]),
        (np.ones(7, np.int64), ["has shape (7,)", "[domains, layers, 8]"]),
        (np.ones((5, 3, 6), np.int64), ["has shape (5, 3, 6)"]),
        (-np.ones((5, 3, 8), np.int64), ["negative"]),
    ],
)
def test_routing_stats_names_a_bad_counts_file(counts, names, tmp_path, capsys):
    """All-zero counts said 'counts must be non-negative' naming no file; a [7] array was fitted
    as if it were Mixtral's."""
    d = _counts_dir(tmp_path / "traces", counts)
    assert routing_stats.main([f"trace_dir={d}", f"out={tmp_path / 'rs.json'}"]) == 2
    one_error(capsys, "olmoe_mixtral_counts.npz", "mixtral_counts_topk", *names)
    assert not (tmp_path / "rs.json").exists()


def test_routing_stats_accepts_the_shipped_counts():
    shipped = Path(__file__).resolve().parents[3] / "shared" / "traces"
    if not (shipped / "olmoe-aggregates" / "olmoe_mixtral_counts.npz").exists():
        pytest.skip("../shared/traces is absent")
    assert routing_stats.mixtral_counts(str(shipped)).shape == (5, 3, 8)


def _sweep(root: Path, n: int = 2) -> Path:
    """`n` finished runs: a config.yaml and a summary.json each."""
    for i in range(n):
        run = root / f"run{i}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(f"planner:\n  name: p{i}\nworkload:\n  batch_size: 2\n")
        (run / "summary.json").write_text(
            json.dumps(
                {
                    "planner": f"p{i}",
                    "model": "m",
                    "makespan_s": 1.0,
                    "throughput_tok_s": 1.0 + i,
                    "routing_fields": {"source": "synthetic"},
                }
            )
        )
    return root


def test_report_default_folder_that_is_a_file_is_one_line(tmp_path, capsys):
    """<sweep>/report a file: FileExistsError traceback (an explicit out= was checked)."""
    sweep = _sweep(tmp_path / "s")
    (sweep / "report").write_text("not a folder")
    assert report.main([f"dir={sweep}"]) == 2
    one_error(capsys, "out=", str(sweep / "report"), "is a file")
    assert (sweep / "report").read_text() == "not a folder"


def test_report_default_folder_in_a_read_only_sweep_is_one_line(tmp_path, capsys, monkeypatch):
    """A sweep folder the user may not write in. Root writes into read-only folders (CI runs
    as root), so there the refusal the kernel gives everyone else is played by Path.mkdir."""
    sweep = _sweep(tmp_path / "s")
    if os.geteuid() == 0:
        mkdir = Path.mkdir

        def refuse(self: Path, *args: object, **kwargs: object) -> None:
            if self.parent == sweep:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            mkdir(self, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(Path, "mkdir", refuse)
    sweep.chmod(0o555)
    try:
        assert report.main([f"dir={sweep}"]) == 2
    finally:
        sweep.chmod(0o755)
    one_error(capsys, "out=", str(sweep / "report"), "Permission denied")
    assert not (sweep / "report").exists()


def test_collect_results_path_that_is_a_folder_is_one_line(tmp_path, capsys):
    """results.parquet a folder: IsADirectoryError traceback."""
    sweep = _sweep(tmp_path / "s")
    (sweep / "results.parquet").mkdir()
    assert collect.main([f"dir={sweep}"]) == 2
    one_error(capsys, str(sweep / "results.parquet"), "is a folder", "out=")
    assert not (sweep / "results.csv").exists()


def test_collect_skips_a_run_whose_config_is_not_utf8(tmp_path, capsys):
    """A non-UTF-8 config.yaml: UnicodeDecodeError traceback. Now it is reported and skipped,
    as an unreadable summary.json is, and the other runs are collected."""
    sweep = _sweep(tmp_path / "s", n=3)
    (sweep / "run1" / "config.yaml").write_bytes(b"planner: \xff\xfe\n")
    assert collect.main([f"dir={sweep}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [f"skipped {sweep / 'run1'}: config.yaml unreadable (not UTF-8 text)"]
    df, problems = tables.collect(sweep)
    assert list(df["run_dir"]) == ["run0", "run2"] and len(problems) == 1


@pytest.mark.parametrize("module", [collect, report], ids=["collect", "report"])
def test_one_torn_summary_among_good_runs_is_one_skipped_line(module, tmp_path, capsys, swept):
    """A summary.json cut short (a run killed while writing it) among finished tiny runs (a
    copy of the session's tiny sweep, tests/experiments/conftest.py): the others are read, and
    one line names that run's folder, the file and the fix."""
    sweep = tmp_path / "s"
    shutil.copytree(swept, sweep)
    torn = sweep / "tiny_tiny_fiddler_bs2_n2_g8" / "workload=tiny"
    path = torn / "summary.json"
    path.write_text(path.read_text()[:40])
    assert module.main([f"dir={sweep}", f"out={tmp_path / 'o'}"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"skipped {torn}: summary.json unreadable (not JSON")
    assert "delete it and run the sweep again" in err[0]


@pytest.mark.parametrize("module", [collect, report], ids=["collect", "report"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_sweep_of_only_unreadable_summaries_is_one_error_line(module, n, tmp_path, capsys):
    """No run readable: one `error: ` line naming the first bad file and the fix (it was a
    `skipped` line per run and then an error line), exit 2, nothing written."""
    sweep = _sweep(tmp_path / "s", n=n)
    for i in range(n):
        (sweep / f"run{i}" / "summary.json").write_bytes(b"\xff\xfe")
    assert module.main([f"dir={sweep}", f"out={tmp_path / 'o'}"]) == 2
    more = [f"and {n - 1} more"] if n > 1 else []
    names = [f"no finished run under {sweep}", str(sweep / "run0"), "summary.json", "not UTF-8"]
    one_error(capsys, *names, "delete it", *more)
    assert not (tmp_path / "o").exists()


def test_collect_skips_a_run_whose_files_are_folders(tmp_path, capsys):
    sweep = _sweep(tmp_path / "s", n=3)
    (sweep / "run1" / "config.yaml").unlink()
    (sweep / "run1" / "config.yaml").mkdir()
    (sweep / "run2" / "summary.json").unlink()
    (sweep / "run2" / "summary.json").mkdir()
    df, problems = tables.collect(sweep)
    assert list(df["run_dir"]) == ["run0"]
    assert problems[0].startswith("run1: config.yaml unreadable (")
    assert problems[1].startswith("run2: summary.json unreadable (")


def test_collect_skips_a_run_whose_files_are_a_fifo_or_dev_zero(tmp_path):
    """A FIFO summary.json blocked collect forever; config.yaml on /dev/zero read without end."""
    sweep = _sweep(tmp_path / "s", n=3)
    (sweep / "run1" / "config.yaml").unlink()
    (sweep / "run1" / "config.yaml").symlink_to("/dev/zero")
    (sweep / "run2" / "summary.json").unlink()
    os.mkfifo(sweep / "run2" / "summary.json")
    with deadline(20):
        df, problems = tables.collect(sweep)
    assert list(df["run_dir"]) == ["run0"]
    assert problems[0].startswith(
        "run1: config.yaml unreadable (not a regular file (a character device); delete it"
    )
    assert problems[1].startswith("run2: summary.json unreadable (not a regular file (a FIFO); ")


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def exit_code(main: Callable[[], object]) -> object:
    """The status `main` exits with; a KeyboardInterrupt escaping it (a traceback for the
    user) fails the test rather than stopping pytest."""
    try:
        main()
    except SystemExit as e:
        return e.code
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped as a KeyboardInterrupt traceback")
    pytest.fail("returned instead of exiting")


@pytest.mark.parametrize(
    "module, work, argv",
    [
        (convert_traces, "convert_esft", ["src={tmp}/src", "out={tmp}/o.npz"]),
        (collect, "load_sweep", ["dir={tmp}"]),
        (report, "load_sweep", ["dir={tmp}"]),
        (calibrate, "calibrate", ["hardware.name=t", "out={tmp}/x.yaml", "disk_dir={tmp}/d"]),
        (routing_stats, "output_file", ["out={tmp}/rs.json"]),
    ],
    ids=["convert_traces", "collect", "report", "calibrate", "routing_stats"],
)
def test_ctrl_c_is_one_line_and_exit_130(module, work, argv, tmp_path, monkeypatch, capsys):
    """Ctrl-C during a command's work printed a long traceback."""
    monkeypatch.setattr(module, work, _interrupt)
    assert exit_code(lambda: module.main([a.format(tmp=tmp_path) for a in argv])) == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: "), err
