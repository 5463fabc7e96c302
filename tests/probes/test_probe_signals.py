"""Probe class: a run killed from outside, as a user or a failing machine kills it, in a
subprocess. SIGKILL (the OOM killer, `kill -9`) leaves the run dir's `.run.lock` and maybe a
half-written folder: the next run into the dir proceeds. Ctrl-C
(SIGINT to the process group) is one line, exit 130, no summary.json where there was none (and
no folder where there was none), and the previous result whole.

Each probe stops a run at a moment it waits for rather than at a guessed time: computing (it
holds the dir's lock, seen in /proc/locks) or writing its files (its `.partial-*` folder is
there). LONG is a simulator run of some 20 s on a 2-core machine, so it is still running then;
the writing moment is awaited in WRITING, an eighth of LONG's batches, whose files (trace.json
too) take some 3x LONG's time to write, so that moment comes sooner and lasts longer. The
runs before and after the stopped one (a finished result, the next run into the dir) run in the
test's process (tests.conftest.command_here): only the run stopped needs a process of its own.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from experiments.common.dir_lock import LOCK
from tests.conftest import spawned_ranks, started
from tests.probes.conftest import TINY, cli
from tests.probes.random_stops import handles_stops

LONG = [*TINY[:-1], "planner=sequential", "workload.n_batches=400", "workload.gen_len=128"]
WRITING = [
    *TINY[:-1],
    "planner=sequential",
    "workload.n_batches=50",
    "workload.gen_len=128",
    "trace_json=true",
]
RESULT = ("summary.json", "config.yaml", "code_version.txt", "trace.parquet")


def _start(run: Path, *args: str) -> subprocess.Popen:
    """`python -m experiments.run args` into `run`, in a session of its own (a terminal's
    Ctrl-C reaches every process of the foreground group)."""
    return started(
        "experiments.run",
        *args,
        f"hydra.run.dir={run}",
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _past_pythons_start(p: subprocess.Popen, after_s: float) -> None:
    """Wait `after_s` from `p`'s start, and at least till the command's start-up handler is set:
    before it Python starts itself (its site .pth files), which the command cannot act in and
    which, on a loaded machine, took longer than 0.3 s (exit -15, no line)."""
    start = time.monotonic()
    while not handles_stops(p.pid) and p.poll() is None and time.monotonic() - start < 60:
        time.sleep(0.01)
    time.sleep(max(0.0, after_s - (time.monotonic() - start)))


def _holds_lock(p: subprocess.Popen, run: Path) -> bool:
    """`p` holds the flock of `run`'s lock file (/proc/locks: pid and inode)."""
    try:
        ino = os.stat(run / LOCK).st_ino
    except FileNotFoundError:
        return False
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()  # e.g. 1: FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> 0 EOF
        ours = "FLOCK" in fields and str(p.pid) in fields
        if ours and any(f.endswith(f":{ino}") for f in fields):
            return True
    return False


def _writing(p: subprocess.Popen, run: Path) -> bool:
    """`p` is writing its files (the hidden folder it replaces the result from is there)."""
    try:
        return any(run.glob(".partial-*"))
    except FileNotFoundError:  # the dir went as the glob read it: the run failed, said next
        return False


MOMENTS: dict[str, Callable[[subprocess.Popen, Path], bool]] = {
    "computing": _holds_lock,
    "writing": _writing,
}
# the run each moment is awaited in
RUNS = {"computing": LONG, "writing": WRITING}


def _stop_when(
    p: subprocess.Popen, run: Path, moment: str, sig: int, group: bool = True
) -> tuple[int, str]:
    """Send `sig` to `p`'s process group (or, `group=False`, to `p` alone) once `moment` holds
    (a second into computing, to be past the lock; at once when writing); (its exit status,
    its stderr)."""
    deadline = time.time() + 240
    while not MOMENTS[moment](p, run):
        assert p.poll() is None, ("ended before it was stopped", p.communicate())
        assert time.time() < deadline, "never reached the moment"
        time.sleep(0.005)
    if moment == "computing":
        time.sleep(1.0)
    assert p.poll() is None, f"ended before it was stopped: RUNS[{moment!r}] is too short"
    if group:
        os.killpg(p.pid, sig)
    else:
        p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    return p.returncode, err


def _result(run: Path) -> dict[str, bytes]:
    return {f: (run / f).read_bytes() for f in RESULT if (run / f).exists()}


def _finished(run: Path, cli_here: Callable[..., subprocess.CompletedProcess]) -> dict[str, bytes]:
    """A finished tiny run into `run` (in this process: only the run stopped is a subprocess)."""
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    return _result(run)


def _consistent(run: Path, planner: str) -> None:
    """`run` holds one run's result, whole: summary, config and trace of `planner`."""
    summary = json.loads((run / "summary.json").read_text())
    assert summary["planner"] == planner
    assert f"planner:\n  name: {planner}" in (run / "config.yaml").read_text()
    assert (run / "trace.parquet").exists()


def summaries(sweep: Path) -> list[Path]:
    """The sweep's summary.json files; walked again where a run's folder was renamed (its
    `.partial-*` made whole) during the walk."""
    while True:
        try:
            return list(sweep.rglob("summary.json"))
        except FileNotFoundError:
            continue


def _whole_and_the_next_run_proceeds(
    run: Path, before: dict[str, bytes], cli_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    """After a stopped run of `sequential` into `run`: the earlier result as it was, or (stopped
    the moment its files went in) the new one whole; no half-written folder; and the next run
    (flexgen) into the dir finishes."""
    if _result(run) != before:
        _consistent(run, "sequential")
    assert not list(run.glob(".partial-*"))
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    _consistent(run, "flexgen")


# the computing moment of SIGKILL starts three runs for 2 s: the slow suite (writing's stays)
@pytest.mark.parametrize("moment", [pytest.param("computing", marks=pytest.mark.slow), "writing"])
def test_sigkill_leaves_the_lock_and_the_next_run_proceeds(
    moment: str, tmp_path: Path, cli_here: Any
) -> None:
    """A finished run, then a longer one of another planner into the same dir killed with
    SIGKILL while computing or while writing its files: `.run.lock` stays (a killed process
    cannot remove it) and the first result is there as it was (the kill came before the new
    one was whole) or the new one whole; the next run into the dir proceeds (flock dies with
    its holder), exits 0, and leaves its own whole result and no half-written folder."""
    run = tmp_path / "run"
    before = _finished(run, cli_here)
    code, err = _stop_when(_start(run, *RUNS[moment]), run, moment, signal.SIGKILL)
    assert code == -signal.SIGKILL, err
    assert (run / LOCK).exists()
    if _result(run) != before:  # killed in the moment its files went in: the new one, whole
        _consistent(run, "sequential")
    r = cli_here("experiments.run", *TINY[:-1], "planner=layer_prefetch", f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    _consistent(run, "layer_prefetch")
    assert not list(run.glob(".partial-*"))


# each point starts two or three runs, 2 s: two of the four in the slow suite, each moment and
# each kind of folder keeping one in the default suite
@pytest.mark.parametrize(
    "moment, earlier",
    [
        pytest.param("computing", True, marks=pytest.mark.slow),
        ("writing", True),
        ("computing", False),
        pytest.param("writing", False, marks=pytest.mark.slow),
    ],
    ids=["rerun-computing", "rerun-writing", "fresh-computing", "fresh-writing"],
)
def test_ctrl_c_is_one_line_and_keeps_the_previous_result(
    moment: str, earlier: bool, tmp_path: Path, cli_here: Any
) -> None:
    """Ctrl-C while a run computes or writes its files: one line on stderr (`interrupted: `,
    saying the run did not finish), exit 130, no traceback; no summary.json in a dir that had
    none, the previous result there whole and unchanged in one that had one (or, where Ctrl-C
    came in the moment the new files went in, the new result whole: see the next test), and no
    half-written folder. A run after it into the dir proceeds."""
    run = tmp_path / "run"
    before = _finished(run, cli_here) if earlier else {}
    code, err = _stop_when(_start(run, *RUNS[moment]), run, moment, signal.SIGINT)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 130, err
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), err
    assert "did not finish" in lines[0], lines[0]
    if not earlier and not (run / "summary.json").exists():  # no folder that looks like a run
        assert not run.exists(), sorted(run.rglob("*"))
    _whole_and_the_next_run_proceeds(run, before, cli_here)


@pytest.mark.parametrize("after_s", [0.3, 1.0])
def test_ctrl_c_while_the_command_starts_is_one_line(after_s: float, tmp_path: Path) -> None:
    """Ctrl-C in the command's first second, while Python imports torch and hydra (or, on a
    fast machine, a moment later): one line, exit 130, no traceback and no summary.json (before,
    the import's KeyboardInterrupt traceback and exit -2)."""
    run = tmp_path / "run"
    p = _start(run, *LONG)
    _past_pythons_start(p, after_s)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGINT)
    _, err = p.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 130, err
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), err
    assert not (run / "summary.json").exists()


def test_ctrl_c_while_waiting_for_the_lock_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """Ctrl-C while the run waits for another run's lock on the dir: it said it waits (on
    stdout) and wrote nothing into the dir meanwhile; one line, exit 130, and the other run's
    files untouched."""
    run = tmp_path / "run"
    before = _finished(run, cli_here)
    log = tmp_path / "stdout"
    with open(run / LOCK, "w") as lock, open(log, "w") as out:
        fcntl.flock(lock, fcntl.LOCK_EX)
        listed = sorted(p.relative_to(run) for p in run.rglob("*"))
        p = started(
            "experiments.run",
            *LONG,
            f"hydra.run.dir={run}",
            text=True,
            stdout=out,
            stderr=subprocess.PIPE,
        )
        deadline = time.time() + 240
        while "waiting for it to end" not in log.read_text():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.05)
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == listed
        os.killpg(p.pid, signal.SIGINT)
        _, err = p.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode == 130, (log.read_text(), err)
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), err
    assert _result(run) == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_the_result_goes_in_waits_for_it(
    sig: int, tmp_path: Path, monkeypatch
) -> None:
    """Ctrl-C or SIGTERM in the moment a finished run's files replace the old ones (after the
    old summary.json went, between two renames) comes once the new result is whole: the dir
    never holds some files of each run and no summary. Timing cannot aim at that moment from
    outside, so the signal is sent from the first rename."""
    from experiments.common import run_dir as pipeline
    from experiments.common import stops

    run = tmp_path / "run"
    pipeline.replace_run(run, {"planner": "old"}, lambda tmp: _write(tmp, "old"))
    rename = os.replace
    sent = []

    def replace_and_signal(src: os.PathLike, dst: os.PathLike) -> None:
        rename(src, dst)
        if not sent:
            sent.append(dst)
            os.kill(os.getpid(), sig)

    monkeypatch.setattr(pipeline.os, "replace", replace_and_signal)
    # the command's own handlers, whatever an earlier test in this process left set
    handler, raised = (
        (signal.default_int_handler, KeyboardInterrupt)
        if sig == signal.SIGINT
        else (stops._raise_stopped, stops.Stopped)
    )
    previous = signal.signal(sig, handler)
    try:
        with pytest.raises(raised):
            pipeline.replace_run(run, {"planner": "new"}, lambda tmp: _write(tmp, "new"))
    finally:
        signal.signal(sig, previous)
    assert sent
    assert json.loads((run / "summary.json").read_text())["planner"] == "new"
    assert {(run / f).read_text() for f in ("config.yaml", "trace.parquet")} == {"new"}
    assert not list(run.glob(".partial-*"))


def _write(folder: Path, text: str) -> None:
    for name in ("config.yaml", "trace.parquet"):
        (folder / name).write_text(text)


# SIGQUIT's case (SIGTERM's path, another signal: 7 s of two ranks): the slow suite
@pytest.mark.parametrize(
    "sig",
    [signal.SIGTERM, pytest.param(signal.SIGQUIT, marks=pytest.mark.slow)],
    ids=["SIGTERM", "SIGQUIT"],
)
def test_sigterm_of_a_distributed_run_stops_its_ranks(
    sig: int, tmp_path: Path, tiny_ckpt: Path
) -> None:
    """`kill` (SIGTERM) of the command that started G rank processes ended it alone: the ranks
    ran on as orphans. They stop with it, and no result is left. Ctrl-backslash (SIGQUIT to
    the terminal's group, the ranks too) dumped core, exit 131 and no line: the same now."""
    run = tmp_path / "run"
    p = _start(
        run,
        "executor=real",
        "executor.distributed=true",
        "hardware=h200-hgx8",
        "workload=tiny",
        "planner=eplb",
        "+planner.params.n_devices=2",
        f"checkpoint={tiny_ckpt}",
        "workload.n_batches=40",
        "workload.gen_len=40",
    )
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = spawned_ranks(p.pid)
    assert len(ranks) == 2, p.communicate()
    if sig == signal.SIGTERM:
        p.terminate()
    else:
        os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == STOPS[sig], err
    assert len(err.splitlines()) == 1 and "did not finish" in stop_line(err, sig)
    gone = time.monotonic() + 2  # the ranks' stop takes them within 2 s of the command's end
    while [k for k in ranks if Path(f"/proc/{k}").exists()] and time.monotonic() < gone:
        time.sleep(0.02)
    assert not [k for k in ranks if Path(f"/proc/{k}").exists()], "ranks left running"
    assert not (run / "summary.json").exists()


# SIGTERM (`kill`, `timeout`, a scheduler: to the command alone, or to its group) and SIGHUP (a
# closed terminal: to the group) stop a command as Ctrl-C does, with one line naming the signal
# ("stopped by SIGTERM; " and what Ctrl-C's line would say), exit 128 + its number.
STOPS = {signal.SIGTERM: 143, signal.SIGHUP: 129, signal.SIGQUIT: 131}


def stop_line(err: str, sig: int) -> str:
    """The stopped command's stderr: no traceback, and its last line (a progress bar's lines
    may come before it) saying which signal stopped it."""
    assert "Traceback" not in err, err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"stopped by {signal.Signals(sig).name}; "), err
    return lines[-1]


@pytest.mark.parametrize(
    "sig, moment, group",
    [
        pytest.param(signal.SIGTERM, "computing", False, marks=pytest.mark.slow),  # 2.5 s
        (signal.SIGTERM, "writing", False),
        (signal.SIGHUP, "computing", True),
    ],
    ids=["SIGTERM-computing", "SIGTERM-writing", "SIGHUP-computing"],
)
def test_sigterm_and_sighup_stop_a_run_as_ctrl_c_does(
    sig: int, moment: str, group: bool, tmp_path: Path, cli_here: Any
) -> None:
    """`kill` (SIGTERM) of a run while it computes or writes its files, or a closed terminal
    (SIGHUP to its group): it ended silently with status -15 or -1. Now one line that names the
    signal and says the run did not finish, exit 143 or 129, the previous result whole (or, at
    the moment the new one went in, the new one whole), no half-written folder, and its lock
    released: the next run into the dir proceeds."""
    run = tmp_path / "run"
    before = _finished(run, cli_here)
    p = _start(run, *RUNS[moment])
    code, err = _stop_when(p, run, moment, sig, group=group)
    assert code == STOPS[sig], err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert "did not finish" in stop_line(err, sig)
    _whole_and_the_next_run_proceeds(run, before, cli_here)


def test_sigterm_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """SIGTERM while Python still imports torch and hydra: one line, exit 143, nothing written
    (it ended silently, -15)."""
    run = tmp_path / "run"
    p = _start(run, *LONG)
    _past_pythons_start(p, 0.3)
    assert p.poll() is None
    p.terminate()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert len(err.splitlines()) == 1, err
    stop_line(err, signal.SIGTERM)
    assert not (run / "summary.json").exists()


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_a_sweep_stopped_by_sigterm_resumes(tmp_path: Path) -> None:
    """SIGTERM to a `-m` sweep's process group (a scheduler's stop) once one point finished:
    one last line naming the sweep folder and the `hydra.sweep.dir=` that resumes it, exit 143,
    no traceback (the pool's workers and joblib's resource tracker ignore it: the sweep stops
    them), no worker left; that command reuses the finished point and runs the other."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *TINY[:-1],
        "planner=sequential",
        "workload.n_batches=2,400",
        "workload.gen_len=128",
        f"hydra.sweep.dir={sweep}",
    ]
    p = started("experiments.run", *args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not summaries(sweep):
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    assert p.poll() is None, "the sweep ended before it could be stopped"
    workers = _descendants(p.pid)
    os.killpg(p.pid, signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-2000:]
    here = sweep.resolve()
    assert stop_line(err, signal.SIGTERM) == (
        f"stopped by SIGTERM; finished runs are kept in {here}; to resume, run the same "
        f"command with hydra.sweep.dir={here}"
    )
    time.sleep(1.0)
    assert not [k for k in workers if _running(k)], "workers left running"
    assert len(summaries(sweep)) == 1
    r = cli("experiments.run", *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "already finished" in r.stdout + r.stderr
    assert len(summaries(sweep)) == 2


def _descendants(pid: int) -> list[int]:
    kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    found = [int(k) for k in kids.stdout.split()]
    return found + [g for k in found for g in _descendants(k)]


def _running(pid: int) -> bool:
    """`pid` is there and not a zombie (an ended child its parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _start_command(module: str, *args: str, err: Path) -> subprocess.Popen:
    return started(module, *args, stdout=subprocess.DEVNULL, stderr=err.open("w"))


def _await(p: subprocess.Popen, ready: Callable[[], bool], what: str) -> None:
    deadline = time.time() + 240
    while not ready():
        assert p.poll() is None, f"ended before {what}"
        assert time.time() < deadline, f"never {what}"
        time.sleep(0.05)


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_sigterm_stops_reproduce_klotski_and_it_resumes(tmp_path: Path) -> None:
    """SIGTERM to reproduce_klotski (its pool of 2 workers running the grid) once a run
    finished: one line, exit 143, no worker left; the same command again reuses that run (and
    is stopped again, by SIGTERM to its group this time, with the same line)."""
    out, err = tmp_path / "k", tmp_path / "err.txt"
    args = ("quick=true", f"out={out}", "jobs=2")
    p = _start_command("experiments.reproduce_klotski", *args, err=err)
    _await(p, lambda: bool(list(out.glob("runs/*/summary.json"))), "a run finished")
    workers = _descendants(p.pid)
    p.terminate()
    p.wait(timeout=120)
    assert p.returncode == 143, err.read_text()
    line = stop_line(err.read_text(), signal.SIGTERM)
    assert line.endswith("finished runs are kept; run the same command again to resume"), line
    time.sleep(1.0)
    assert not [k for k in workers if _running(k)], "workers left running"
    done = len(list(out.glob("runs/*/summary.json")))
    p = _start_command("experiments.reproduce_klotski", *args, err=err)
    _await(p, lambda: "already done" in err.read_text(), "it found the finished runs")
    workers = _descendants(p.pid)
    assert f"{done} of " in err.read_text()
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=120)
    assert p.returncode == 143, err.read_text()
    stop_line(err.read_text(), signal.SIGTERM)
    time.sleep(1.0)
    assert not [k for k in workers if _running(k)], "workers left running"


@pytest.mark.slow  # calibrate in a fresh process: .ci/run's slow suite
def test_sigterm_stops_calibrate_and_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM to calibrate while it measures: one line, exit 143, no hardware yaml written and
    no disk probe file left."""
    out, disk, err = tmp_path / "x.yaml", tmp_path / "d", tmp_path / "err.txt"
    args = ("hardware.name=x", f"out={out}", f"disk_dir={disk}", "disk_mb=64")
    p = _start_command("experiments.calibrate", *args, err=err)
    _await(p, disk.exists, "it started measuring")
    time.sleep(1.0)
    p.terminate()
    p.wait(timeout=120)
    assert p.returncode == 143, err.read_text()
    assert len(err.read_text().splitlines()) == 1, err.read_text()
    assert "did not finish" in stop_line(err.read_text(), signal.SIGTERM)
    assert not out.exists()
    assert not disk.exists()  # its probe file gone, and the folder made for it


def test_sigterm_stops_a_real_run(tmp_path: Path, tiny_ckpt: Path, cli_here: Any) -> None:
    """SIGTERM to a run of the real executor while it computes (it holds the dir's lock): one
    line, exit 143, no summary.json, and the lock released (a run after it proceeds)."""
    run = tmp_path / "run"
    args = [
        "executor=real",
        f"checkpoint={tiny_ckpt}",
        "hardware=tiny",
        "workload=tiny",
        "planner=sequential",
        "workload.n_batches=400",
        "workload.gen_len=64",
    ]
    p = _start(run, *args)
    code, err = _stop_when(p, run, "computing", signal.SIGTERM, group=False)
    assert code == 143, err
    assert len(err.splitlines()) == 1, err
    assert "did not finish" in stop_line(err, signal.SIGTERM)
    assert not (run / "summary.json").exists()
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
