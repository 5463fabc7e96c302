"""Probe round 18d (issue 48): round 18a's and 18b's leftovers.

A result file written whole (`written_whole`: prefetch_eval's table, reproduce_klotski's
results, the figures) on a disk that filled while pandas or matplotlib wrote it raised an
OSError that named no file: it names the file now, and nothing half-written stays.
reproduce_klotski's three result files are replaced all together or none (a full disk at the
last left the first new beside the earlier others).

A run's result that could not be written (a full disk) said "the earlier result there is kept"
where there was none (a first run into a fresh folder): it says so only where there was one.

`convert_traces out=/dev/full` wrote `/dev/full.npz` (`.npz` goes onto a name without it): an
`out` that is a device, a FIFO or a folder is refused in one line.

`+hydra.job_logging.root.nosuch=1` (a logger's, formatter's or filter's key alike) was skipped by
Python's logging, unsaid: the key is refused in one line naming it and the keys it takes.

`experiments.bench.real` stopped (Ctrl-C) while it calibrated left `.calib-cut` beside its
checkpoint: the cut goes on every way out, as the profile written needs none.

A sweep whose every point's schedule would need more RAM than the machine has
(`-m planner=flexgen,sequential workload.n_batches=100000000`) started, and each point failed
under the progress bar with its own failed.txt: the before-sweep check passed every size. The
RAM checks that need no plan run there too: the single run's one line, before any folder.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest

from core.args import written_whole
from experiments import reproduce_klotski
from experiments.bench import real as bench_real
from experiments.common.run_dir import replace_run
from tests.probes.conftest import TINY, one_line


def test_a_whole_write_that_names_no_file_names_its_file(tmp_path):
    """pandas' to_csv on a full disk: ENOSPC with no filename; the earlier file stays whole."""
    out = tmp_path / "results.csv"
    out.write_text("earlier\n")
    with pytest.raises(OSError) as info, written_whole(out) as tmp:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.filename == str(out)
    assert out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]


def _full_disk(tmp: Path) -> None:
    (tmp / "trace.parquet").write_text("half")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_says_an_earlier_result_is_kept_only_where_there_was_one(tmp_path):
    """reproduce_klotski's first run into a fresh folder, on a full disk, said "the earlier
    result there is kept"; there was none. A second run's line still says it is kept."""
    run = tmp_path / "run"
    with pytest.raises(OSError) as info:
        replace_run(run, {"planner": "new"}, _full_disk)
    assert "no result is left there" in str(info.value) and "earlier" not in str(info.value)
    assert not run.exists()

    replace_run(run, {"planner": "old"}, lambda tmp: (tmp / "trace.parquet").write_text("old"))
    with pytest.raises(OSError) as info:
        replace_run(run, {"planner": "new"}, _full_disk)
    assert "the earlier result there is kept" in str(info.value)
    assert (run / "trace.parquet").read_text() == "old"


def test_convert_traces_refuses_an_out_it_would_append_npz_to(tmp_path, cli_here):
    """out=/dev/full wrote /dev/full.npz: `.npz` went onto a device's name. A FIFO stands in
    for the device here; the trace is never converted and nothing lands beside it."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    r = cli_here("experiments.convert_traces", f"src={tmp_path / 'nosuch'}", f"out={fifo}")
    one_line(r, f"out={fifo}", "FIFO", "pass out= a file path")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


@pytest.mark.parametrize(
    ("arg", "names"),
    [
        ("+hydra.job_logging.root.nosuch=1", ["hydra.job_logging.root.nosuch", "valid: filters"]),
        ("+hydra.hydra_logging.root.levle=INFO", ["root.levle", "did you mean 'level'"]),
        ("+hydra.job_logging.loggers.core.nosuch=1", ["loggers.core.nosuch", "propagate"]),
        ("+hydra.job_logging.formatters.simple.fmt=x", ["formatters.simple.fmt", "format"]),
        ("+hydra.job_logging.filters.mine.nmae=core", ["filters.mine.nmae", "'name'"]),
    ],
)
def test_a_logging_entrys_unknown_key_is_one_line(cli_here, tmp_path, arg, names):
    """Python's logging skips a key it does not read in a root, logger or formatter entry: the
    run went on as if it were not there. No run folder is left."""
    run = tmp_path / "run"
    one_line(cli_here("experiments.run", arg, *TINY, f"hydra.run.dir={run}"), *names)
    assert not run.exists()


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_a_bench_calibration_stopped_leaves_no_cut(tmp_path, monkeypatch, stop):
    """bench.real stopped (Ctrl-C) or failing while calibrate ran left `.calib-cut`, a hidden
    folder of links and a config, beside its checkpoint."""

    def stopped(cmd):
        raise stop()

    monkeypatch.setattr(bench_real, "_run_child", stopped)
    spec = bench_real.reduced_spec("mixtral-tiny")
    ckpt = bench_real.ensure_checkpoint(spec, tmp_path / "m")
    opts = bench_real.BenchRealOptions(
        model="mixtral-tiny", budget_gb=0.008, hardware="no-such-profile", calib_layers=1
    )
    with pytest.raises(stop):
        bench_real._calibrate_if_missing(opts, spec, ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_reproduce_klotski_replaces_its_results_all_or_none(tmp_path, monkeypatch, cli_here):
    """A full disk at report.md, after results.csv was written whole, left the new
    results.csv beside the earlier report.md: none is replaced now, and the line names the
    file the disk stopped."""
    out = tmp_path / "rk"
    out.mkdir()
    (out / "results.csv").write_text("table\nauto_n\n")
    monkeypatch.setattr(reproduce_klotski, "run_resumable", lambda *a: ([{"planner": "x"}], 1))
    monkeypatch.setattr(reproduce_klotski, "report", lambda df: "the report")
    write_text = Path.write_text

    def full_at_report(self: Path, text: str, *a: Any, **kw: Any) -> int:
        if self.parent == out and self.name.startswith(".report"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full_at_report)
    r = cli_here("experiments.reproduce_klotski", "only=[auto_n]", f"out={out}")
    one_line(r, str(out / "report.md"), "No space left")
    assert sorted(p.name for p in out.iterdir()) == ["results.csv"]
    assert (out / "results.csv").read_text() == "table\nauto_n\n"


def test_a_sweep_every_point_of_which_outgrows_ram_is_refused_up_front(
    cli_here, tmp_path, monkeypatch
):
    """Each point's ops need more RAM than the machine has: one line, no sweep folder. A planner
    that sizes its own group (Klotski's `n: 0`) is not judged by the workload's n_batches."""
    from dataclasses import replace

    from core.spec import Workload
    from experiments.common import pipeline, run_checks
    from tests.conftest import hardware_from_conf, model_from_conf

    monkeypatch.setattr(pipeline, "_available_ram_bytes", lambda: 10**9)
    sweep = tmp_path / "sweep"
    many = "workload.n_batches=10000000"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY[:3],
        "planner=flexgen,sequential",
        many,
        f"hydra.sweep.dir={sweep}",
    )
    one_line(r, "n_batches=10000000", "GB of RAM", "lower gen_len or n_batches")
    assert not sweep.exists()
    wl = Workload(batch_size=2, n_batches=10**7, prompt_len=8, gen_len=3)
    spec = pipeline.RunSpec(
        model_from_conf("tiny"), hardware_from_conf("tiny"), wl, "klotski", {"n": 0}
    )
    run_checks.check_sizes_fit(spec)  # Klotski chooses its n: one batch's sizes are checked
    with pytest.raises(Exception, match="GB of RAM"):
        run_checks.check_sizes_fit(replace(spec, planner="flexgen", params={}))
