"""The commands (experiments/*.py, experiments/bench/*.py) and their shared wiring (common/).

A command started with `python -m experiments...` takes Ctrl-C from its first import on: while
it is still importing (torch takes seconds), Ctrl-C ends it with one line and status 130, not a
traceback from inside an import; `experiments.common.cli.until_interrupted` takes over once the
command runs.
"""

import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    print("interrupted: stopped while starting; nothing was run", file=sys.stderr)
    sys.exit(130)


def _started_as_a_command() -> bool:
    argv = getattr(sys, "orig_argv", [])
    return any(
        a == "-m" and b.startswith("experiments.") for a, b in zip(argv, argv[1:], strict=False)
    )


if _started_as_a_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
