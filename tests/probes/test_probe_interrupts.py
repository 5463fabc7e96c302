"""Probe class: Ctrl-C and stops met where the command does not expect them: the handlers put
back after an in-process command, an interrupt lost in a __del__, a sweep's pool workers that
die with their killed parent or die themselves, and a stop before any run finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import alive, started, user_env
from tests.probes.conftest import ROOT, TINY
from tests.probes.test_probe_signals import STOPS, stop_line, summaries


def test_until_interrupted_leaves_the_handlers_as_it_found_them(capsys) -> None:
    """In-process (a test, a notebook): SIGTERM's and SIGHUP's handlers are back as they were
    after the command, and a `Stopped` is the one line and 128 + its number."""
    from experiments.common.cli import Stopped, until_interrupted

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, *STOPS)}
    assert until_interrupted(lambda: 7) == 7

    def stopped() -> None:
        raise Stopped(signal.SIGHUP)

    with pytest.raises(SystemExit) as e:
        until_interrupted(stopped)
    assert e.value.code == 129
    assert capsys.readouterr().err.startswith("stopped by SIGHUP; ")
    assert {s: signal.getsignal(s) for s in before} == before


def test_ctrl_c_lost_in_a_del_still_stops_the_command(capsys) -> None:
    """Ctrl-C whose KeyboardInterrupt lands in a `__del__` (which Python cannot raise from: it
    prints "Exception ignored" and runs on) still stops the command: one line, exit 130, not a
    run that goes on to exit 0 (seen once in a full test run, from the hook's own re-raise)."""
    from experiments.common.cli import until_interrupted

    class Dies:
        def __del__(self) -> None:
            raise KeyboardInterrupt

    def main() -> str:
        Dies()  # gone at once: its KeyboardInterrupt is unraisable
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "ran on"

    with pytest.raises(SystemExit) as stop:
        until_interrupted(main)
    assert stop.value.code == 130
    assert capsys.readouterr().err.startswith("interrupted: ")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_an_interrupt_lost_in_a_del_as_the_command_ends_still_stops_it(signum, capsys) -> None:
    """The same, where the command ends right after the `__del__`, before the hook's signal is
    sent again: it ended with exit 0 and nothing said (a SIGHUP in a full test run). It stops
    as the signal says, and nothing is sent to the process afterwards."""
    from experiments.common import stops
    from experiments.common.cli import Stopped, until_interrupted

    class Dies:
        def __del__(self) -> None:
            raise Stopped(signum) if signum != signal.SIGINT else KeyboardInterrupt

    def main() -> str:
        Dies()
        return "finished"

    with pytest.raises(SystemExit) as stop:
        until_interrupted(main)
    assert stop.value.code == (130 if signum == signal.SIGINT else 129)
    err = capsys.readouterr().err
    assert err.startswith("interrupted: " if signum == signal.SIGINT else "stopped by SIGHUP; ")
    assert stops._UNSENT == []
    time.sleep(0.1)  # past the hook's moment: its timer was cancelled, no signal arrives


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_inside_an_import_waits_for_the_import(
    signum: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A stop that lands while a module loads is raised once the import is done: torch's C++
    modules run Python as they load, and a `Stopped` raised there ended a real run in C++'s
    `terminate` (exit 134, "pybind11::error_already_set") in a full test run. The module loads
    whole, then the one line and 128 + the signal's number."""
    from experiments.common.cli import until_interrupted

    name = f"loads_while_stopped_{signum}"
    (tmp_path / f"{name}.py").write_text(
        f"import os, time\nos.kill(os.getpid(), {int(signum)})\ntime.sleep(0.2)\nLOADED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def main() -> str:
        __import__(name)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)
        return "ran on"

    try:
        with pytest.raises(SystemExit) as stop:
            until_interrupted(main)
        assert sys.modules[name].LOADED
    finally:
        sys.modules.pop(name, None)
    assert stop.value.code == 128 + signum
    said = "interrupted: " if signum == signal.SIGINT else "stopped by SIGTERM; "
    assert capsys.readouterr().err.startswith(said)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_pool_worker_dies_with_its_killed_parent(tmp_path: Path) -> None:
    """A sweep's process killed with SIGKILL left its loky workers running (ignoring Ctrl-C and
    SIGTERM, by design) for minutes; a worker now asks the kernel to kill it with its parent."""
    pid_file = tmp_path / "child.pid"
    child_py, parent_py = tmp_path / "child.py", tmp_path / "parent.py"
    child_py.write_text(
        "import os, time\n"
        "from experiments.common.pool import die_with_parent\n"
        "die_with_parent()\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "time.sleep(120)\n"
    )
    parent_py.write_text(
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, {str(child_py)!r}])\n"
        "time.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, str(parent_py)], cwd=ROOT, env=user_env())
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.05)
    child = int(pid_file.read_text())
    p.kill()
    p.wait()
    deadline = time.time() + 10
    while alive(child):
        assert time.time() < deadline, "the worker outlived its killed parent"
        time.sleep(0.05)


def test_a_dead_sweep_worker_is_one_line_saying_how_to_resume() -> None:
    """joblib's TerminatedWorkerError (a worker killed, or out of memory) was an internal error
    cut off mid-word; it says what happened and that the sweep resumes."""
    from experiments.common.cli import error_line

    class TerminatedWorkerError(RuntimeError):  # joblib.externals.loky's, by name
        pass

    e = TerminatedWorkerError(
        "A worker process managed by the executor was unexpectedly terminated. This could be "
        "caused by a segmentation fault while calling the function or by an excessive memory "
        "usage causing the Operating System to kill the worker.\n\nThe exit codes of the "
        "workers are {SIGKILL(-9)}"
    )
    line = error_line(e)
    assert line is not None and "\n" not in line
    assert "worker process of the sweep died" in line and "run the same command again" in line
    assert "exit code -9" in line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGQUIT], ids=["SIGTERM", "SIGQUIT"])
def test_a_stop_before_any_run_finished_says_nothing_was_kept(sig: int, tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) in a sweep's first seconds said 'finished runs are kept in DIR' for a
    folder the sweep then removed (it held no run). Ctrl-backslash (SIGQUIT to the group, the
    pool's workers too) dumped core, exit 131 and no line: the same line now."""
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY[:-1], "planner=sequential", "workload.n_batches=400"]
    args += ["workload.gen_len=128", f"hydra.sweep.dir={sweep}"]
    p = started("experiments.run", *args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not (sweep / "multirun.yaml").exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    assert not summaries(sweep), "a run finished before the sweep could be stopped"
    os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == STOPS[sig], err[-2000:]
    assert stop_line(err, sig) == (
        f"stopped by {signal.Signals(sig).name}; no run of the sweep had finished; nothing was kept"
    )
    assert not sweep.exists()


# A module-level object of the finished command's __main__, deleted as Python tears its modules
# down: by then Python has put the signals' default actions back.
_LATE_STOP = """
import os, signal, sys, time
sys.argv = ["-m"]  # as `python -m experiments.<name>` starts: a command, not an import
import experiments
from experiments.common.cli import until_interrupted

class StoppedInTeardown:
    def __del__(self):
        os.kill(os.getpid(), signal.{name})
        time.sleep(0.2)

until_interrupted(lambda: 0)
late = StoppedInTeardown()
"""


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_stop_while_a_finished_command_tears_down_keeps_its_status(
    name: str, tmp_path: Path
) -> None:
    """A stop that landed after the exit handlers, while Python freed the modules (a tenth of a
    short run's time), ended a finished command by the signal with no line (exit -15), its
    results whole. It now exits with the command's status."""
    script = tmp_path / "late.py"
    script.write_text(_LATE_STOP.format(name=name))
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=user_env(),
    )
    assert (done.returncode, done.stderr) == (0, "")
