"""Probe class: integrity of a run dir. A run holds its dir's lock while it writes (a second run
into it waits, so no summary sits beside another run's trace); a new result replaces an old
one only once whole (a failed or killed re-run keeps the finished result)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from experiments.common.dir_lock import LOCK
from experiments.common.run_dir import replace_run
from tests.probes.conftest import ROOT, TINY, one_line


def test_a_second_run_into_a_locked_dir_waits(tmp_path: Path) -> None:
    """While another run holds the dir's lock, a run into it says it waits and writes nothing
    there (not hydra's record or log); once the lock is free it runs, its summary, config and
    trace are all its own, and it takes the lock file away."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "stdout"
    run.mkdir()
    with open(run / LOCK, "w") as lock, open(log, "w") as out:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.Popen(
            [sys.executable, "-m", "experiments.run", *TINY, f"hydra.run.dir={run}"],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=out,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.time() + 120
            while "another run is writing this run dir" not in log.read_text():
                assert p.poll() is None and time.time() < deadline, p.communicate()
                time.sleep(0.2)
            assert [p.name for p in run.iterdir()] == [LOCK]
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
        _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    s = json.loads((run / "summary.json").read_text())
    assert (
        s["planner"] == "flexgen"
        and "planner:\n  name: flexgen" in (run / "config.yaml").read_text()
    )
    assert not (run / LOCK).exists()


def _finished(cli_here: Any, run: Path, planner: str, *args: str) -> dict:
    """A finished run into `run` (in this process: its tests are not of a process's own)."""
    how = [*TINY[:-1], f"planner={planner}", *args, f"hydra.run.dir={run}"]
    r = cli_here("experiments.run", *how)
    assert r.returncode == 0, r.stderr
    return json.loads((run / "summary.json").read_text())


def test_rerun_of_another_config_replaces_only_when_whole(tmp_path: Path, cli_here: Any) -> None:
    """A re-run that fails or is interrupted while writing keeps the old result whole and
    consistent (summary, config.yaml, traces); one that finishes replaces all of them. Both
    runs write trace.json too (`trace_json=true`: it is written on demand)."""
    run = tmp_path / "run"
    first = _finished(cli_here, run, "flexgen", "trace_json=true")
    files = ("summary.json", "config.yaml", "code_version.txt", "trace.parquet", "trace.json")
    before = {f: (run / f).read_bytes() for f in files}

    for stop in (OSError(28, "No space left on device"), KeyboardInterrupt()):

        def half_written(tmp: Path, stop: BaseException = stop) -> None:
            (tmp / "trace.parquet").write_bytes(b"half")
            (tmp / "config.yaml").write_text("another config")
            raise stop

        with pytest.raises(type(stop)):
            replace_run(run, {"planner": "other"}, half_written)
        assert {f: (run / f).read_bytes() for f in files} == before
        assert not list(run.glob(".partial-*"))

    second = _finished(cli_here, run, "sequential", "trace_json=true")
    assert second["planner"] == "sequential" != first["planner"]
    assert "name: sequential" in (run / "config.yaml").read_text()
    assert (run / "trace.parquet").read_bytes() != before["trace.parquet"]


def test_half_written_folders_of_a_killed_run_are_removed(tmp_path: Path, cli_here: Any) -> None:
    run = tmp_path / "run"
    (run / ".partial-abc").mkdir(parents=True)
    (run / ".partial-abc" / "summary.json").write_text("{}")
    _finished(cli_here, run, "flexgen")
    assert not (run / ".partial-abc").exists()


@pytest.mark.slow  # a sweep and its rerun: .ci/run's slow suite
def test_a_failed_rerun_keeps_the_results_hydra_record(tmp_path: Path, cli_here: Any) -> None:
    """hydra rewrites a run dir's .hydra/ (config, hydra.yaml, overrides) when any run starts
    there, before the run can act: a rerun that fails in a finished run's dir puts the record
    of the result it kept back, alone and as a sweep's point; one that finishes replaces it."""
    run = tmp_path / "run"

    def finished(planner: str, *args: str) -> None:
        r = cli_here(
            "experiments.run", *TINY[:-1], f"planner={planner}", *args, f"hydra.run.dir={run}"
        )
        assert r.returncode == 0, r.stderr

    finished("klotski")
    record = {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")}
    assert "overrides.yaml" in record
    bad = [*TINY[:-1], "planner=klotski", "planner.params.warmup_sequences=99999"]
    sweep_dir = [f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=run"]  # one point, in run
    for how in (["-m", *bad, *sweep_dir], [*bad, f"hydra.run.dir={run}"]):
        r = cli_here("experiments.run", *how, "skip_finished=false")
        failed = run / "failed.txt"  # a sweep's point: its line is there (its worker's stderr)
        said = r.stderr + (failed.read_text() if failed.exists() else "")
        assert r.returncode != 0 and "warmup_sequences=99999" in said, said
        assert {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")} == record
        assert (run / "summary.json").is_file()
    finished("sequential", "skip_finished=false")
    assert b"sequential" in (run / ".hydra" / "overrides.yaml").read_bytes()


def test_a_run_whose_gpu_never_idles_is_collected(tmp_path: Path, cli_here: Any) -> None:
    """A GPU busy for the whole run summed its ops to a hair past the makespan (-8e-22 s of
    bubble), and collect then refused the run's own summary.json as not a run's."""
    from experiments.common.tables import check_metrics

    run = tmp_path / "run"
    r = cli_here("experiments.run", *TINY[:-1], "planner=klotski", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert summary["gpu_bubble_s"] >= 0 and summary["gpu_bubble_frac"] >= 0
    check_metrics(summary, run / "summary.json")


@pytest.mark.parametrize(
    "subdir, names",
    [
        ("", ["hydra.sweep.subdir=:", "the sweep dir itself"]),
        pytest.param(  # a sweep with its pool: the slow suite
            "same", ["hydra.sweep.subdir=same", "both write same"], marks=pytest.mark.slow
        ),
        ("${workload.n_batches}", ["workload.batch_size=1 and workload.batch_size=2"]),
    ],
    ids=["empty", "constant", "a key the sweep does not change"],
)
def test_a_sweep_whose_points_share_a_run_dir_is_refused(
    tmp_path: Path, cli_here: Any, subdir: str, names: list[str]
) -> None:
    """Each point wrote the same folder, the second replacing the first's result with only a
    warning in run.log, and the sweep said "1 run(s) finished" with exit 0. Now nothing runs;
    a template of a swept key runs both points."""
    sweep = tmp_path / "s"
    args = [*TINY, "workload.batch_size=1,2", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", "-m", *args, f"hydra.sweep.subdir={subdir}")
    one_line(r, *names)
    assert not sweep.exists()
    if subdir == "same":  # once: a template of a swept key runs both points
        subdir_of_bs = "hydra.sweep.subdir=bs${workload.batch_size}"
        serial = "hydra.launcher.n_jobs=1"  # both points in this process: no pool of fresh workers
        r = cli_here("experiments.run", "-m", *args, subdir_of_bs, serial)
        assert r.returncode == 0, r.stderr
        assert {p.parent.name for p in sweep.rglob("summary.json")} == {"bs1", "bs2"}


@pytest.mark.parametrize(
    "extra, names",
    [
        (["hydra.sweep.subdir=../out${workload.batch_size}"], ["must stay under the sweep dir"]),
        (["hydra.sweep.subdir=/out${workload.batch_size}"], ["must stay under the sweep dir"]),
        (
            [
                "hydra.sweep.subdir=${hydra.job.override_dirname}",
                "hydra.job.config.override_dirname.exclude_keys=[workload.batch_size]",
            ],
            ["workload.batch_size are left out of hydra.job.override_dirname"],
        ),
    ],
    ids=["up and out", "absolute", "swept key excluded"],
)
def test_a_sweep_whose_points_leave_it_or_share_a_dir_by_exclusion_is_refused(
    tmp_path: Path, cli_here: Any, extra: list[str], names: list[str]
) -> None:
    """A subdir of `..` or `/` wrote the points outside the sweep dir, and the sweep said
    "0 run(s) finished" with exit 0; one of override_dirname with the swept key excluded from it
    wrote both points into one folder, the second replacing the first ("1 run(s) finished")."""
    sweep = tmp_path / "s"
    args = [*TINY, "workload.batch_size=1,2", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", "-m", *args, *extra)
    one_line(r, *names)
    assert not sweep.exists() and not (tmp_path / "out1").exists()


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (hidden ones too), with a file's bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("refused", ["summary.json", ".summary.partial-", "trace.parquet"])
def test_a_rerun_whose_swap_is_refused_leaves_the_earlier_result_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A summary.json that cannot be moved aside (immutable, `chattr +i`), a new summary that
    cannot take its place, a new file that cannot move in: the rerun fails in one line naming
    the file, and the dir holds the earlier result exactly, where an empty `.previous` (or the
    earlier files inside it, with no summary.json in the dir) was left behind."""
    from experiments.common import run_dir

    run = tmp_path / "run"
    replace_run(run, {"planner": "old"}, lambda tmp: (tmp / "trace.parquet").write_text("old"))
    before = _tree(run)
    real = os.replace

    def refuse(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(refused):
            raise PermissionError(1, "Operation not permitted", str(src))
        real(src, dst)

    monkeypatch.setattr(run_dir.os, "replace", refuse)
    with pytest.raises(OSError) as info:
        replace_run(run, {"planner": "new"}, lambda tmp: (tmp / "trace.parquet").write_text("new"))
    assert "earlier result there is kept" in str(info.value) and info.value.filename
    assert _tree(run) == before


def test_outputs_whose_swap_is_refused_stay_as_they_were(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command's outputs (a report page, validate's tables) replaced in one swap: one new file
    that cannot move in puts the earlier outputs back, where they had been deleted already."""
    from experiments.common import run_dir

    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.csv", "b.csv", "index.html"):
        (out / name).write_text(f"old {name}")
    before = _tree(out)
    real = os.replace

    def refuse(src: Any, dst: Any) -> None:
        staged = Path(src).parent.name.startswith(".partial-")  # not the earlier ones, set aside
        if Path(src).name == "index.html" and staged and "-earlier" not in str(src):
            raise PermissionError(1, "Operation not permitted", str(src))
        real(src, dst)

    monkeypatch.setattr(run_dir.os, "replace", refuse)
    with pytest.raises(PermissionError), run_dir.staged_outputs(out, last="index.html") as tmp:
        for name in ("a.csv", "b.csv", "index.html"):
            (tmp / name).write_text(f"new {name}")
    assert _tree(out) == before


def test_a_failed_sweeps_clean_up_keeps_every_result(tmp_path: Path) -> None:
    """A sweep that fails removes its points' dirs that hold nothing of a run (what hydra put
    there, its mark, a killed run's half-staged `.partial-*`), and nothing else: a finished
    point, a failed one's failed.txt, the earlier result a replacing run set aside stay, and so
    does the sweep's dir that holds them."""
    from experiments.common.callbacks import SWEEP_MARK, remove_if_no_runs

    sweep = tmp_path / "new" / "s"
    points = {
        "done/a": ["summary.json", SWEEP_MARK],
        "failed/b": ["failed.txt", SWEEP_MARK],
        "staging/c/.partial-1-earlier": [],
        "empty/d": [SWEEP_MARK, "run.log", ".hydra/config.yaml"],
        "killed/e/.partial-2": [],
    }
    for point, files in points.items():
        (sweep / point).mkdir(parents=True)
        for name in files:
            (sweep / point / name).parent.mkdir(exist_ok=True)
            (sweep / point / name).write_text("x")
    (sweep / "multirun.yaml").write_text("x")
    remove_if_no_runs(sweep, tmp_path / "new")
    assert not (sweep / "empty").exists() and not (sweep / "killed").exists()
    for point in ("done/a", "failed/b", "staging/c/.partial-1-earlier"):
        assert sorted(p.name for p in (sweep / point).iterdir()) == sorted(
            n.split("/")[0] for n in points[point]
        )
    remove_if_no_runs(tmp_path / "absent", None)  # a sweep whose dir was never made


def test_the_run_dir_check_leaves_a_folder_another_run_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run checks that its fresh run dir can be made by making it, then takes it away again.
    Another run into the same dir, started at the same moment, may have made it too and taken
    its lock there meanwhile: the check took the whole folder away under it (rmtree). Now only
    empty folders go; an empty one of its own still does."""
    import experiments.common.argv_checks as cli_mod

    run = tmp_path / "new" / "run"
    checked = cli_mod.output_dir

    def and_another_run_locks_it(value: str, key: str) -> Path:
        out = checked(value, key)
        (out / LOCK).touch()  # the other run's lock, taken between the check and its removal
        return out

    monkeypatch.setattr(cli_mod, "output_dir", and_another_run_locks_it)
    cli_mod.exit_on_unwritable_dir([f"hydra.run.dir={run}"], ("hydra.run.dir",))
    assert (run / LOCK).exists()
    monkeypatch.setattr(cli_mod, "output_dir", checked)
    other = tmp_path / "other" / "run"
    cli_mod.exit_on_unwritable_dir([f"hydra.run.dir={other}"], ("hydra.run.dir",))
    assert not (tmp_path / "other").exists()
