"""A stop (Ctrl-C, SIGTERM, SIGHUP) that comes once a command's work is done and on disk, in
Python's shutdown after it: the command ends at once, exit 0, no line and no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, user_env

# a command's `python -m` start (experiments sees "-m" as it is imported), its main done, then
# a stop while the interpreter would still shut down
_STOPPED_AFTER = """
import os, signal, sys, time
sys.argv[:1] = ["-m"]
import experiments
from experiments.common.cli import run_command
code = run_command(lambda: {code})
os.kill(os.getpid(), signal.{sig})
time.sleep(30)
print("ran on")
sys.exit(code)
"""


@pytest.mark.parametrize("sig, code", [("SIGINT", 0), ("SIGTERM", 0), ("SIGHUP", 0), ("SIGINT", 2)])
def test_a_stop_after_the_command_finished_ends_it_quietly(sig: str, code: int) -> None:
    """SIGTERM in the instant after the result was written ended the command by the signal
    (exit 143) with no line, and Ctrl-C raised a KeyboardInterrupt traceback in the shutdown,
    for a run whose result was whole. A command that failed keeps its status."""
    r = subprocess.run(
        [sys.executable, "-c", _STOPPED_AFTER.format(sig=sig, code=code)],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (r.returncode, r.stdout, r.stderr) == (code, "", "")
