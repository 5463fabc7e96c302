"""Faults of a distributed real run's rank processes (experiments/common/dist_run.py): each
ends the run with one line naming the rank, or is the command's to handle (Ctrl-C, a killed
launcher), never a rank's own traceback or a rank running on without its command."""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path
from typing import Any

from experiments.common.dist_run import _as_rank, _spawn


def _signal_state(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says how it handles Ctrl-C and SIGHUP, and what kills it with its parent."""

    def state() -> dict[str, Any]:
        death = ctypes.c_int(0)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG
        return dict(
            ignored=[signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGHUP)],
            blocked=sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            death=death.value,
        )

    _as_rank(rank, tmp, state)


def test_a_rank_leaves_ctrl_c_to_the_command_and_dies_with_it() -> None:
    """Ctrl-C at the terminal while a rank still imported torch printed the rank's
    KeyboardInterrupt traceback (and a second one from its handler's import) before the
    command's line; a launcher killed with SIGKILL left its ranks running the run to its end.
    A rank now ignores Ctrl-C and SIGHUP from its first instruction (they are blocked from
    before exec until then) and is killed with its parent."""
    got = _spawn(1, _signal_state, ())
    assert got == dict(ignored=[True, True], blocked=[], death=signal.SIGKILL)
