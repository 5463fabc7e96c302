"""Probe class: the exit status after the interrupt's one line. Python can end a command by
the signal after it said its line (exit -2, not 130): an interrupt sent again after the line,
or a KeyboardInterrupt that once left code run from text (`exec` of a string), which Python
takes for the whole process's however it was handled. Both keep the line's status."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, default_signals, user_env


@pytest.mark.parametrize(("stop", "code"), [(KeyboardInterrupt(), 130), (None, 143)])
def test_an_interrupt_sent_again_after_the_line_keeps_its_status(
    stop: KeyboardInterrupt | None, code: int, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Ctrl-C during an import is sent again from a timer a moment later; one that fired as
    the line was said landed in Python's teardown, where SIGINT's action is the default again,
    and the command ended by the signal (exit -2, once in a full CI run) after its line. Once
    the line is said, another signal exits with the line's status."""
    import experiments
    from experiments.common import stops

    monkeypatch.setattr(experiments, "AS_COMMAND", True)
    monkeypatch.setattr(experiments, "FINISHED", [])
    exits: list[int] = []
    monkeypatch.setattr(stops.os, "_exit", exits.append)
    # every signal `finished` sets (SIGQUIT's left set ended a later test's process, exit 143)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, *experiments.STOP_SIGNALS)}
    try:
        with pytest.raises(SystemExit) as e:
            stops._say_interrupted(stop or stops.Stopped(signal.SIGTERM))
        assert e.value.code == code
        assert list(experiments.FINISHED) == [code]
        handler = signal.getsignal(signal.SIGINT)
        assert callable(handler) and handler is not signal.default_int_handler
        handler(signal.SIGINT, None)  # the signal sent again
        assert exits == [code]
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert capsys.readouterr().err.count("\n") == 1


EXEC_INTERRUPTED = """
import os, signal
import multiprocessing.util
import experiments.common.launch_line, experiments.common.pool
from experiments.common.cli import run_command

def main():
    exec("import os, signal\\nos.kill(os.getpid(), signal.SIGINT)\\nfor i in range(10**6): pass")
    return 0

run_command(main)
"""


def test_ctrl_c_in_code_run_from_text_keeps_its_status(tmp_path: Path) -> None:
    """Ctrl-C landing in code Python runs from text (`exec` of a string: dataclasses' methods,
    namedtuple's), the KeyboardInterrupt handled, the line said: Python had marked the
    interrupt as the process's own and ended it by SIGINT (exit -2) after the line (once in a
    full CI run); it is raised once that code is done, and the status is 130."""
    (tmp_path / "exec_interrupted.py").write_text(EXEC_INTERRUPTED)
    env = {**user_env(), "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "exec_interrupted"],
        cwd=tmp_path,
        env=env,
        preexec_fn=default_signals,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 130, r.stderr
    assert r.stderr.startswith("interrupted: ") and r.stderr.count("\n") == 1, r.stderr


def test_a_stop_as_the_result_goes_in_says_the_run_had_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A stop that comes while a single run's files replace the old ones waits till the new
    result is whole (`interrupt_deferred`), then said "the run ... did not finish" beside that
    new result (round 25e's random stops, a SIGHUP at 0.9 s): it now says the run had
    finished, with the stop's status."""
    import json
    import os

    from experiments.common import run_dir, stops

    run = tmp_path / "run"
    run_dir.replace_run(run, {"planner": "old"}, lambda tmp: (tmp / "a.txt").write_text("old"))
    monkeypatch.setattr(stops, "_ON_INTERRUPT", ["", ""])
    stops.on_interrupt("the run did not finish", written="the run had finished")
    rename, sent = os.replace, []

    def replace_and_stop(src: Any, dst: Any) -> None:
        rename(src, dst)
        if not sent:
            sent.append(dst)
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run_dir.os, "replace", replace_and_stop)
    previous = signal.signal(signal.SIGTERM, stops._raise_stopped)
    try:
        with pytest.raises(stops.Stopped) as stop:
            run_dir.replace_run(run, {"planner": "new"}, lambda t: (t / "a.txt").write_text("new"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    with pytest.raises(SystemExit) as code:
        stops._say_interrupted(stop.value)
    assert code.value.code == 143
    assert capsys.readouterr().err == "stopped by SIGTERM; the run had finished\n"
    assert json.loads((run / "summary.json").read_text())["planner"] == "new"
