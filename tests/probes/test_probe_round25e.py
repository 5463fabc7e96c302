"""Round 25e of issue 48: commands stopped at a random moment (tests/probes/random_stops.py),
SIGINT, SIGTERM, SIGHUP or SIGQUIT to the process group, once or twice, over every command.

Class found: a stop in the command's first moments, while `experiments` imported what it checks
the environment with (load_env: subprocess, locale; 0.05 s, more under load), before it set its
start-up handler: Ctrl-C was an import's traceback and SIGTERM an end without a line. The handler
is now set first. (Earlier still, while Python starts and runs its site .pth files, no code of
the command runs: a stop there is Python's own.)

The deterministic cases run here; a sample of random stops with a fixed seed in the slow suite.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, default_signals, user_env

# a command starting (`-m`), stopped by `sig` as `experiments` imports load_env: the first
# import of the package's start-up after its own few of the standard library
STOPPED_IN_STARTUP = """
import os, sys
sys.argv = ["-m"]

class StopThere:
    def find_spec(self, name, path=None, target=None):
        if name == "experiments.common.load_env":
            os.kill(os.getpid(), {sig})
            for _ in range(10**6): pass
        return None

sys.meta_path.insert(0, StopThere())
import experiments
print("ran on", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_as_the_package_starts_is_one_line(sig: signal.Signals) -> None:
    """Stopped while `experiments` imported its environment checks: a KeyboardInterrupt's
    traceback from the import, or SIGTERM's silent end (exit -15); now the start-up's line,
    "the command had not started", and exit 128 + the signal."""
    r = subprocess.run(
        [sys.executable, "-c", STOPPED_IN_STARTUP.format(sig=int(sig))],
        cwd=ROOT,
        env=user_env(),
        preexec_fn=default_signals,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 128 + sig, r.stderr
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and "the command had not started" in r.stderr, r.stderr
