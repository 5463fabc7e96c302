"""The commands (`python -m experiments.<name>`) and their shared wiring (common/, bench/).

Started as a command, Ctrl-C while Python still imports it (torch, hydra: seconds) is one line
and exit 130, not an import's traceback; `common.cli.run_command` hands Ctrl-C back to Python's
KeyboardInterrupt (`command_started`) once the command runs.
"""

import os
import signal
import sys
from types import FrameType


def _interrupted_at_startup(signum: int, frame: FrameType | None) -> None:
    print("interrupted: the command had not started; nothing was written", file=sys.stderr)
    sys.stderr.flush()
    # Not SystemExit: raised inside an import, a library's bare `except:` can swallow it (the
    # command then ran on and exited 0). Nothing is open or written yet, so nothing is lost.
    os._exit(130)


def command_started() -> None:
    """Ctrl-C raises KeyboardInterrupt again (the command's own handling takes it from here)."""
    if signal.getsignal(signal.SIGINT) is _interrupted_at_startup:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# sys.argv[0] is "-m" only while `python -m experiments.<name>` locates the module (Python's
# docs): a command starting, not code (a test, a notebook) importing this package.
if sys.argv[:1] == ["-m"]:
    signal.signal(signal.SIGINT, _interrupted_at_startup)
