"""How a command's process ends (`experiments.common.cli.exit_command`): its status, what
atexit's functions and the flushed streams leave behind, and no teardown of its modules."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.probes.conftest import ROOT

# a command whose work registers an exit function (a file written), prints without a newline
# and maybe leaves a thread running; it returns status 3. `os._exit` says when it ends the
# process (no teardown of the modules)
COMMAND = """
import atexit, os, sys, threading, time
from pathlib import Path
from experiments.common.cli import exit_command

end = os._exit
os._exit = lambda status: (os.write(2, b"no teardown"), end(status))

def main():
    atexit.register(lambda: Path(sys.argv[1], "atexit").write_text("ran"))
    if sys.argv[2] == "thread":
        threading.Thread(
            target=lambda: (time.sleep(0.2), Path(sys.argv[1], "thread").write_text("ran"))
        ).start()
    print("no newline", end="")
    return 3

exit_command(main)
"""


@pytest.mark.parametrize("thread", [False, True])
def test_a_command_ends_with_its_status_exit_functions_and_output(tmp_path, thread):
    """Status 3, the output flushed and the exit function run, as `sys.exit(3)` gives them; the
    modules' objects are not freed one by one (that teardown cost every command 0.03-0.07 s
    of CPU), unless a thread still runs: then the exit waits for it, as `sys.exit` does."""
    r = subprocess.run(
        [sys.executable, "-c", COMMAND, str(tmp_path), "thread" if thread else "-"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (r.returncode, r.stdout) == (3, "no newline")
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").exists() == thread
    assert r.stderr == ("" if thread else "no teardown")
