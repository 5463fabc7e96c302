"""An interrupt Python could not raise where it landed, sent to this process again a moment
later from another thread (`send_later`): inside an import or code run from text
(`cli._raise_stopped`), in a callback Python cannot raise from (`interrupt_again`, an
unraisable-exception hook), or raised and then swallowed by a library (`Interrupt`).
`cancel_unsent` takes back those not sent yet, for the command to raise at once or drop once
its line is said; `lost` names those raised that never reached the command."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
from collections.abc import Callable
from typing import Any


def interrupt_again(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An unraisable-exception hook: Ctrl-C's KeyboardInterrupt, when it lands in a callback
    Python cannot raise from (a weakref callback of the import machinery, a `__del__`), was
    printed as "Exception ignored" and lost, and the command ran on to exit 0. It is raised
    again, as a signal sent from another thread a moment later: raised from the hook itself,
    its handler ran inside the hook, where the KeyboardInterrupt was lost the same way (seen in
    a full test run); sent later, it reaches the main thread once the hook has returned."""

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        if isinstance(e, KeyboardInterrupt):
            send_later(getattr(e, "signum", signal.SIGINT))  # a `cli.Stopped`'s, or Ctrl-C's
            return
        previous(unraisable)

    return hook


class Interrupt(KeyboardInterrupt):
    """Ctrl-C's KeyboardInterrupt (and `cli.Stopped`, a stop's) as a signal's handler raised it
    (`raised`): a library that catches and drops it (one did as a sweep's pool started its
    workers: the sweep ran its run to the end and exited 0 with no line) loses it no more. Gone
    while the command that got it runs on with that handler set (its line not said), it is sent
    again, to be raised where the command is then; kept, it is raised as the command returns
    (`lost`)."""

    signum: int = signal.SIGINT
    raised_by: Any = None  # the handler that raised it; None for one the code raised itself
    token = 0  # its entry in _RAISED while the command that got it runs

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # Python's teardown: the modules half gone
            with _UNSENT_LOCK:
                mine = _RAISED.pop(self.token, None) is not None
            if mine:
                send_later(self.signum)


def raised(e: Interrupt, handler: Any) -> Interrupt:
    """`e`, which the signal `handler` raises: where the code it lands in drops it, it is sent
    again (or raised as the command returns: `lost`)."""
    e.raised_by = handler
    with _UNSENT_LOCK:
        if _WATCHED:
            e.token = next(_TOKENS)
            _RAISED[e.token] = e.signum
    return e


def watched(on: bool) -> None:
    """A command starts (`on`) or ends (`until_interrupted`): the interrupts `raised` while one
    runs are its own, until it says its line (`lost`, which forgets them)."""
    with _UNSENT_LOCK:
        if on:
            _WATCHED.append(True)
        elif _WATCHED:
            _WATCHED.pop()
    lost()


def lost() -> list[int]:
    """The signals raised by their handler (`raised`) since the last call, neither gone nor
    sent again: at the command's normal return, the code it ran swallowed and kept each one.
    The command calls it as it starts and ends, so an earlier command's are none of its own."""
    with _UNSENT_LOCK:
        signals = list(_RAISED.values())
        _RAISED.clear()
    return signals


def send_later(signum: int) -> None:
    """Send `signum` to this process a moment later, from another thread (starting a thread
    waits for it, where a signal it sent at once would be handled here, again too early)."""
    later = threading.Timer(0.05, _send_again, (signum,))
    later.daemon = True
    with _UNSENT_LOCK:
        _UNSENT.append((later, signum))
    later.start()


# the unraisable hook's interrupts not sent again yet: (its timer, the signal)
_UNSENT: list[tuple[threading.Timer, int]] = []
# the signals `raised` since the command last asked (`lost`), by their Interrupt's token
_RAISED: dict[int, int] = {}
_TOKENS = itertools.count(1)
_WATCHED: list[bool] = []  # one per command running (nested: a command run by another)
# reentrant: an `Interrupt` freed by the garbage collector, which may run inside the lock
_UNSENT_LOCK = threading.RLock()


def _send_again(signum: int) -> None:
    with _UNSENT_LOCK:
        _UNSENT[:] = [(t, s) for t, s in _UNSENT if t is not threading.current_thread()]
    os.kill(os.getpid(), signum)


def cancel_unsent() -> list[tuple[threading.Timer, int]]:
    """The unraisable hook's interrupts not sent again yet, their timers cancelled."""
    with _UNSENT_LOCK:
        unsent, _UNSENT[:] = list(_UNSENT), []
    for timer, _ in unsent:
        timer.cancel()
    return unsent
