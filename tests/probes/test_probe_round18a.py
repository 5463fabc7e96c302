"""Probe round 18a (issue 48): the simulated and analysis commands, by class of failure.

A sweep stopped (Ctrl-C, SIGTERM) under joblib or submitit_local left each point that had not
finished a folder holding `.run.lock`, `.sweep.json`, `run.log` and `.hydra`, no result: its
job was killed with SIGKILL and its lock file stayed. Such a folder goes now, under its lock
(one a live run holds stays), and the same command still resumes every point once.

Two sweeps into one sweep dir at once both marked a point's dir as their jobs started, before
either run took its lock, and the second to run counted the result the first had just written
as one it ran: the run marks its dir again under its lock, so the result named there is the one
it reuses.

A non-finite planner param said its planner's own range ("must be a finite number >= 0",
"must be an integer", "must be in (0, 1]"): every numeric param of every planner says "KEY must
be a finite number, got VALUE", the wording of every other number's check.

Probing hydra's own syntax and flags: an override hydra cannot parse named no cause ("Error
parsing override"), a sweep function's keyword argument was taken for a run dir's '=',
range()/choice()/glob() in one run said hydra's "--multirun" line, --resolve without --cfg was
an internal error and --package without it was ignored, --cfg --resolve named no key,
`hydra/job_logging=nosuch` was said as `hydra=job_logging/nosuch`, and a logging level logging
does not know or a numeric hydra.verbose was an internal error: each is one line with its cause.
A value of the wrong type in a user's `hydra.sweeper.params` said hydra's "Error merging
override" words; it is said as on the command line.

A run of millions of ops that fits the machine's RAM (`workload.n_batches=100000` on the tiny
model: 8e6 ops, 12 GB) planned and simulated for minutes with nothing said: one line up front
says its ops, RAM, that Ctrl-C stops it and how to shorten it.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import time
import typing
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import started
from tests.probes.conftest import TINY, cli, one_line, raises_one_line
from tests.probes.test_probe_signals import summaries

HYDRA = (".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml")


def _point(sweep: Path, name: str, *files: str) -> Path:
    run = sweep / name / "workload=tiny"
    for f in (*HYDRA, ".sweep.json", "run.log", *files):
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    return run


# what a point's dir held as its sweep stopped, and whether it goes (no result, no live run)
POINTS = {
    "killed_while_computing": ((".run.lock",), True),
    "killed_while_its_result_was_staged": ((".run.lock", ".partial-12-ab/summary.json"), True),
    "never_locked": ((), True),
    "finished": (("summary.json", "trace.parquet"), False),
    "failed_on_bad_input": (("failed.txt", ".run.lock"), False),
    "an_earlier_result_moving_back": ((".previous/summary.json", ".run.lock"), False),
    "a_users_own_file": (("notes.txt",), False),
}


def test_a_stopped_sweeps_points_without_a_result_leave_no_folder(tmp_path: Path) -> None:
    """The folders a stopped sweep's killed jobs left (lock, mark, log, hydra's record, a
    half-staged result) go; a finished or failed point's, one holding an earlier result or a
    user's file, and one whose lock a live run holds (another sweep's, into the same dir) stay,
    as does the sweep dir itself."""
    from experiments.common.callbacks import remove_if_no_runs

    sweep = tmp_path / "sweep"
    runs = {name: _point(sweep, name, *files) for name, (files, _) in POINTS.items()}
    live = _point(sweep, "another_sweeps_live_run", ".run.lock")
    fd = os.open(live / ".run.lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: flock keeps it from this one too
    try:
        remove_if_no_runs(sweep)
    finally:
        os.close(fd)
    for name, (_, goes) in POINTS.items():
        assert runs[name].parent.exists() != goes, name
    assert (live / ".run.lock").exists() and (live / "run.log").exists()


SWEEP = ["-m", *TINY[:-1], "planner=sequential", "workload.n_batches=2,400", "workload.gen_len=128"]


@pytest.mark.slow  # end to end: a sweep stopped and resumed, 15 s a case
@pytest.mark.parametrize(
    ("launcher", "sig"),
    [("joblib", signal.SIGINT), ("submitit_local", signal.SIGTERM), ("basic", signal.SIGINT)],
)
def test_a_stopped_sweep_leaves_no_unfinished_point_and_resumes(
    tmp_path: Path, launcher: str, sig: int
) -> None:
    """Stopped once its first point finished: the sweep's line, and no folder of the point it
    was running; the same command reuses the first point and runs the other, once."""
    sweep = tmp_path / "sweep"
    args = [*SWEEP, f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}"]
    p = started("experiments.run", *args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not summaries(sweep):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=120)
    assert "Traceback" not in err and p.returncode == 128 + sig, err
    assert "to resume, run the same command" in err.splitlines()[-1], err
    # (submitit keeps its jobs' logs in .submitit, a finished sweep's too)
    points = [d.name for d in sweep.iterdir() if d.name != "multirun.yaml" and d.name[0] != "."]
    assert points == ["tiny_tiny_sequential_bs2_n2_g128"], points
    r = cli("experiments.run", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 run(s) finished (1 already finished, reused)" in r.stderr
    assert len(summaries(sweep)) == 2


@pytest.mark.slow  # end to end: two sweeps at once, 10 s
def test_two_sweeps_started_together_run_each_point_once(tmp_path: Path) -> None:
    """Two sweeps of the same two points into one sweep dir, started together: each point is
    run by one and reused by the other, so their lines together say two reused."""
    sweep = tmp_path / "sweep"
    args = [*SWEEP[:-2], "workload.gen_len=8,16", "hydra/launcher=basic"]
    pipes = {"text": True, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    ps = [started("experiments.run", *args, f"hydra.sweep.dir={sweep}", **pipes) for _ in "ab"]
    errs = [p.communicate(timeout=240)[1] for p in ps]
    assert [p.returncode for p in ps] == [0, 0], errs
    reused = [int(n) for err in errs for n in re.findall(r"\((\d+) already finished", err)]
    assert sum(reused) == 2, errs
    assert len(summaries(sweep)) == 2


def test_two_sweeps_marking_a_point_before_either_runs_count_it_once(tmp_path: Path) -> None:
    """Both sweeps' jobs marked the point at their start; the first to take the lock runs it,
    the second then finds its result: the second counts it as reused, where it counted it as
    a run of its own (both said "1 run(s) finished", neither "already finished")."""
    import experiments.common.callbacks as callbacks
    from experiments.common.run_dir import atomic_write_text
    from experiments.run import locked

    run = tmp_path / "sweep" / "0"
    run.mkdir(parents=True)
    callbacks.mark_run(run, "first")
    callbacks.mark_run(run, "second")
    for token in ("first", "second"):  # each job's run, one after the other under the lock
        callbacks._JOB_SWEEP[:] = [token]
        try:
            with locked(run):
                if not (run / "summary.json").exists():
                    atomic_write_text(run / "summary.json", "{}")
        finally:
            callbacks._JOB_SWEEP.clear()
    assert callbacks.finished_runs(run.parent, "first") == (1, 0)
    assert callbacks.finished_runs(run.parent, "second") == (1, 1)


def _numeric_params() -> list[tuple[str, str]]:
    from planners.registry import entry, planner_names

    found = []
    for name in planner_names():
        for key, hint in typing.get_type_hints(entry(name).params).items():
            options = typing.get_args(hint) or (hint,)
            if int in options or float in options:
                found.append((name, key))
    return found


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), ".inf", "-.Inf"])
def test_every_planners_non_finite_param_is_said_in_one_wording(value: object) -> None:
    """Every numeric param of every registered planner (prior_weight said "must be a finite
    number >= 0", an integer param "must be an integer", a share "must be in (0, 1]")."""
    from planners.registry import make_params

    params = _numeric_params()
    assert len(params) > 20
    for name, key in params:
        raises_one_line(
            lambda n=name, k=key: make_params(n, {k: value}),
            f"planner {name}: planner.params.{key} must be a finite number, got {value}",
        )


@pytest.mark.parametrize(
    ("args", "names"),
    [
        # hydra's parse error: its cause, not "Error parsing override" alone
        (["-m", "workload.seed=choice()"], ["empty choice is not legal"]),
        (["-m", "workload.seed=shuffle(1,2,seed=1)"], ["unexpected keyword argument 'seed'"]),
        (["-m", "workload.seed=nosuchfn(1)"], ["Unknown function 'nosuchfn'", "choice"]),
        # a keyword argument's '=' is not a run dir's: no quoting offered
        (["-m", "workload.seed=sort(reverse=true,1,2)"], ["positional argument follows keyword"]),
        # range(), choice(), glob() in one run: -m named, as a comma's sweep says it
        (["workload.seed=range(1,3)"], ["workload.seed=range(1,3)", "add -m"]),
        (["workload.seed=choice(1,2)"], ["add -m"]),
        # --resolve and --package change --cfg's print: alone, an internal error or ignored
        (["--resolve"], ["--resolve", "add --cfg job"]),
        (["--package", "workload"], ["--package", "add --cfg job"]),
        (["-p", "workload"], ["-p: changes what --cfg prints"]),
        # a group of hydra's own named as typed, not as `hydra=job_logging/nosuch`
        (["hydra/job_logging=nosuch"], ["hydra/job_logging=nosuch", "valid: default"]),
        (["hydra/launcher=nosuch"], ["hydra/launcher=nosuch", "joblib"]),
        # a logging config logging refuses, hydra.verbose hydra asserts on: internal errors
        (["hydra.job_logging.root.level=NOPE"], ["hydra.job_logging", "Unknown level: 'NOPE'"]),
        (["hydra.hydra_logging.root.level=NOPE"], ["hydra.hydra_logging", "hydra/hydra_logging"]),
        (["hydra.verbose=123"], ["hydra.verbose=123", "hydra.verbose=true"]),
        # --cfg --resolve of a value that does not resolve: the key named
        (["--cfg", "job", "--resolve", "workload.seed=${nosuch.key}"], ["workload.seed: Interp"]),
    ],
)
def test_hydras_own_syntax_and_flags_are_one_line_naming_the_cause(
    cli_here: Any, tmp_path: Path, args: list[str], names: list[str]
) -> None:
    """Each was a line naming no cause, a wrong cause, the wrong key, an internal error, or
    (--package alone) a run as if the flag were not there; no folder is left."""
    run = tmp_path / "run"
    r = cli_here("experiments.run", *args, *TINY, f"hydra.run.dir={run}", f"hydra.sweep.dir={run}")
    one_line(r, *names)
    assert not run.exists()


def test_a_sweeper_params_value_of_the_wrong_type_is_said_as_on_the_command_line(
    cli_here: Any, tmp_path: Path
) -> None:
    """`hydra.sweeper.params` in a user's experiment file, a list (or '') for a whole number: it
    said hydra's "Error merging override ...; Value ... could not be converted to Integer"; it
    says what the command line's `workload.gen_len=[2,3]` does."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine18a.yaml").write_text(
        "# @package _global_\nhydra:\n  sweeper:\n    params:\n      workload.gen_len: [2, 3]\n"
    )
    sweep = tmp_path / "sweep"
    args = [f"hydra.searchpath=[file://{tmp_path}]", "experiment=mine18a"]
    r = cli_here("experiments.run", "-m", *TINY, *args, f"hydra.sweep.dir={sweep}")
    one_line(r, "workload.gen_len=[2, 3]", "must be an integer in [1, 16777215]")
    assert not sweep.exists()


def test_a_run_of_millions_of_ops_that_fits_says_so_up_front(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """workload.n_batches=100000 on the tiny model: about 8e6 ops, 12 GB, under this machine's
    RAM, so not refused; it planned and simulated for minutes with nothing said. One line says
    its ops, RAM and how to shorten it, and that Ctrl-C stops it; a small run says nothing."""
    from types import SimpleNamespace

    from experiments.common import pipeline

    monkeypatch.setattr(pipeline, "_available_ram_bytes", lambda: 10**15)
    model = SimpleNamespace(n_experts=4, top_k=2, n_layers=2)
    said = []
    for n_batches in (100000, 2):
        caplog.clear()
        workload = SimpleNamespace(batch_size=2, gen_len=3, n_batches=n_batches)
        spec: Any = SimpleNamespace(model=model, workload=workload)  # what the check reads
        pipeline.check_ops_fit(spec)
        said.append([r.getMessage() for r in caplog.records if "ops)" in r.getMessage()])
    assert len(said[0]) == 1 and not said[1], said
    assert "about 8e+06 ops" in said[0][0] and "Ctrl-C stops it" in said[0][0]
    assert "lower gen_len or n_batches" in said[0][0]
