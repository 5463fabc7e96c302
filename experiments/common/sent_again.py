"""An interrupt Python could not raise where it landed, sent to this process again a moment
later from another thread (`send_later`): inside an import or code run from text
(`cli._raise_stopped`), or in a callback Python cannot raise from (`interrupt_again`, an
unraisable-exception hook). `cancel_unsent` takes back those not sent yet, for the command to
raise at once or drop once its line is said."""

from __future__ import annotations

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
_UNSENT_LOCK = threading.Lock()


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
