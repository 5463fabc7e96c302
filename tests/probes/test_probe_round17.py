"""Probe round 17 (issue 48): sweeps run twice at once, non-finite numbers, and the torchrun
launcher's loose ends.

Two sweeps into one sweep dir at once: the first said "0 run(s) finished" for the runs it ran,
the second's jobs having written their token over its own in each run dir's mark; each sweep's
token is kept now. A sweep under hydra/launcher=submitit_local stopped by Ctrl-C or SIGTERM
printed its line while its jobs (which ignore both) ran on and wrote their results after it:
they are killed before the line, as joblib's pool is.

`python -m experiments.torchrun`: SIGTERM to the launcher was said by rank 0 as its own ("rank
0 was stopped (SIGTERM)"), the run dir left behind; the launcher says the commands' "stopped by
SIGTERM; ..." and passes the signal on as SIGINT, so the ranks take their run dir away. `--help`
(--cfg, --info) of the launched command was printed by every rank; rank 0 alone prints it.
Probing the launcher's arguments: a --node_rank past --nnodes, or a --master_addr or
--local_addr no host has, waited for ever; --monitor-interval=inf and a LOGLEVEL logging does
not know were internal errors; --nnodes=abc, --redirects=9 and --tee=9 named no flag; a
--local-ranks-filter of no rank showed nothing. Each is one line naming the flag, before any
rank starts.

A non-finite value of a numeric option (inf, -inf, nan, 1e999, YAML's .inf and .nan, a quoted
'inf') said "must be a finite number" when Python reads it and "not a number" (or "not a whole
number") when YAML spells it: each says the key and "must be a finite number", as the specs'
own check does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


TASK = "import signal, time; signal.pthread_sigmask(signal.SIG_BLOCK, [2, 15]); time.sleep(60)"
CONTROLLER = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {TASK!r}])"


def test_a_stopped_sweeps_local_jobs_are_stopped_with_it() -> None:
    """submitit's local job: a controller (`submitit.local._local` in its command line) and
    its task, both deaf to Ctrl-C and SIGTERM, ran on after the sweep's line; the sweep's
    interrupt kills both, and they are gone once it returns."""
    import submitit.local.local  # noqa: F401  (the sweep's launcher has it loaded)

    from experiments.common.local_jobs import stop_local_jobs
    from experiments.common.rank_server import parent_of

    controller = subprocess.Popen([sys.executable, "-c", CONTROLLER, "submitit.local._local"])
    try:
        task = None
        while task is None and controller.poll() is None:
            task = next((p for p in _pids() if parent_of(p) == controller.pid), None)
        stop_local_jobs()
        assert controller.poll() is not None
        assert task is not None and _state(task) in ("gone", "Z")  # a zombie runs no more
    finally:
        controller.kill()


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").glob("[0-9]*")]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return "gone"


def test_sigterm_to_the_launcher_is_said_by_it_and_passed_on_as_sigint(
    monkeypatch: pytest.MonkeyPatch, capsys: Any, tmp_path: Path
) -> None:
    """The launcher's SIGTERM (torch's handler raises SignalException, and the agent passes the
    signal on to the ranks): rank 0, stopped by it, said the launch's line as its own."""
    import tempfile

    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from experiments import torchrun
    from experiments.common.cli import until_interrupted
    from experiments.common.launch_line import say_first

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launch's claim is made
    monkeypatch.setenv("LOGLEVEL", "WARNING")  # the test process's logging kept
    passed = []

    def signalled(args: Any) -> None:
        try:
            api._terminate_process_handler(signal.SIGTERM, None)
        except SignalException as e:
            passed.append(e.sigval)
            with monkeypatch.context() as rank0:  # rank 0, stopped, says its line if first
                rank0.setattr(os, "getppid", os.getpid)
                for name, value in (("RANK", "0"), ("WORLD_SIZE", "2")):
                    rank0.setenv(name, value)
                rank0.setenv("TORCHELASTIC_RUN_ID", "probe")
                say_first("error: rank 0 was stopped (SIGTERM); the run did not finish")
            raise

    monkeypatch.setattr("torch.distributed.run.run", signalled)
    with pytest.raises(SystemExit) as stop:
        until_interrupted(lambda: torchrun.main(["--nproc_per_node=2", "-m", "experiments.run"]))
    assert stop.value.code == 143 and passed == [signal.SIGINT]
    err = capsys.readouterr().err
    assert err == f"stopped by SIGTERM; {torchrun.STOPPED}\n", err
    assert list(tmp_path.iterdir()) == []  # the claim, gone with the launch


@pytest.mark.parametrize("flag", ["--help", "--cfg=job", "--info"])
def test_what_prints_in_place_of_a_run_is_printed_by_rank_0_alone(
    cli_here: Any, monkeypatch: pytest.MonkeyPatch, flag: str
) -> None:
    """`python -m experiments.torchrun --nproc_per_node=2 -m experiments.run --help`: the
    run's help once per rank."""
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # a rank's handlers, not pytest's
    monkeypatch.setenv("WORLD_SIZE", "2")
    printed = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        r = cli_here("experiments.run", flag, *TINY)
        assert r.returncode == 0, r.stderr
        printed.append(r.stdout)
    assert printed[0].strip() and printed[1] == "", printed


RUN = ["-m", "experiments.run", "executor=real"]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--nnodes=abc", *RUN], ["--nnodes=abc", "N or MIN:MAX"]),
        (["--nnodes=1", "--node_rank=5", *RUN], ["--node_rank=5", "--nnodes=1"]),
        (["--nnodes=2", "--node_rank=-1", *RUN], ["--node_rank=-1", "0 .. 1"]),
        (["--monitor-interval=inf", *RUN], ["--monitor-interval=inf", "seconds > 0"]),
        (["--redirects=9", *RUN], ["--redirects=9", "0:1,1:2"]),
        (["--tee=9", *RUN], ["--tee=9", "3 (both)"]),
        (["--nproc_per_node=2", "--local-ranks-filter=9", *RUN], ["--local-ranks-filter=9"]),
        (["--master_addr=nosuch.invalid", *RUN], ["--master_addr=nosuch.invalid", "no such"]),
        (["--local_addr=nosuch.invalid", *RUN], ["--local_addr=nosuch.invalid", "no such"]),
        # --rdzv_conf's numbers and flags: read by no backend (timeout) or late, in the agent
        (["--rdzv_conf=timeout=abc", *RUN], ["--rdzv_conf=timeout=abc", "positive integer"]),
        (["--rdzv_conf=read_timeout=0", *RUN], ["read_timeout=0", "positive integer"]),
        (["--rdzv_conf=is_host=maybe", *RUN], ["--rdzv_conf=is_host=maybe", "true or false"]),
        (["--rdzv_conf==x", *RUN], ["--rdzv_conf==x", "<key1>=<value1>"]),
    ],
)
def test_the_launchers_odd_arguments_are_one_line_naming_the_flag(
    argv: list[str], names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments import torchrun
    from tests.probes.conftest import raises_one_line

    monkeypatch.setenv("LOGLEVEL", "WARNING")  # the test process's logging kept
    raises_one_line(lambda: torchrun.main(argv), *names)


def test_a_loglevel_logging_does_not_know_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch sets its loggers to LOGLEVEL as torchrun's modules are imported."""
    from experiments import torchrun
    from tests.probes.conftest import raises_one_line

    monkeypatch.setenv("LOGLEVEL", "NOSUCH")
    raises_one_line(lambda: torchrun.main(["--nproc_per_node=2", *RUN]), "LOGLEVEL='NOSUCH'")


# --- a signal inside a library's `try`: said as the stop it was ---


def _failing_while_stopped() -> None:
    """Hydra's composition hit by SIGTERM: its `finally` fails on the half-built config, and its
    error handling turns that into an error of its own."""
    from experiments.common import cli

    try:
        try:
            raise cli.Stopped(signal.SIGTERM)
        finally:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
    except AttributeError as e:
        raise ValueError("hydra.job.config.override_dirname.exclude_keys: bad") from e


def test_an_error_raised_while_a_stop_unwound_is_said_as_the_stop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM 0.3 s into a run landed inside hydra's config composition, whose `finally` then
    failed on the half-built config ('NoneType' object has no attribute
    '_invalidate_flags_cache'): the run said that as a config error, exit 2, not "stopped by
    SIGTERM", exit 143. Any error raised while a stop or Ctrl-C unwound is said as that stop."""
    from experiments.common import cli

    with pytest.raises(SystemExit) as stop:
        cli.until_interrupted(_failing_while_stopped)
    err = capsys.readouterr().err
    assert stop.value.code == 143, err
    assert err.strip().startswith("stopped by SIGTERM; ") and "exclude_keys" not in err, err


def test_a_runs_error_raised_while_a_stop_unwound_is_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_here: Any
) -> None:
    """The same where a run's hydra app meets it (`app.hydra_main`, whose errors are one
    `error: ` line and status 2): "stopped by SIGTERM", exit 143, and no run folder."""
    import experiments.run

    monkeypatch.setattr(experiments.run, "task", lambda cfg: _failing_while_stopped())
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 143, r.stderr
    assert r.stderr.strip().startswith("stopped by SIGTERM; "), r.stderr
    assert "error" not in r.stderr and not (tmp_path / "run").exists(), r.stderr
