"""A stop that comes while the command already stops (Ctrl-C pressed again as the first one's
line is said and its clean-up runs, a scheduler's SIGTERM sent twice): the second is that same
stop, taken quietly, where a KeyboardInterrupt raised in the clean-up was a traceback; a third,
or a second past `GRACE_S`, ends the command at once, for a clean-up that hangs (a pool's worker
that does not exit) left only `kill -9`. `begin` at the first stop, `again` at each later one."""

from __future__ import annotations

import contextlib
import os
import sys
import time

# The seconds a second stop waits on the first's clean-up: a clean-up that works takes less
# (joining a pool's workers, closing a progress bar); a later press means it hangs.
GRACE_S = 3.0
UNDONE = (
    "stopped again: ended at once, its clean-up left undone (a sweep's workers, its temporary "
    "files in /tmp or /dev/shm may be left)"
)

# the first stop's exit status, when it came (time.monotonic), and the stops since
_FIRST: list[float] = []


def begin(code: int) -> None:
    """The command stops, its exit status `code`; a stop from now on is `again`."""
    _FIRST[:] = [code, time.monotonic(), 0]


def again() -> None:
    """A later stop: the second within `GRACE_S` of the first is taken quietly; a third, or a
    second after it, ends the command now with the first's status and `UNDONE`'s line."""
    if not _FIRST:
        return
    code, since, seen = _FIRST
    _FIRST[2] = seen + 1
    if seen < 1 and time.monotonic() - since <= GRACE_S:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a write this stop interrupted
            stream.flush()
    with contextlib.suppress(OSError):  # a terminal gone: the status still says it
        os.write(2, f"{UNDONE}\n".encode())
    os._exit(int(code))
