"""stdout whose reader may leave (`python -m experiments.run ... | head -1`) or whose disk is
full (`> /dev/full`).

Such a write to stdout failed in the middle of the command's work (a print() raised: routing_stats
wrote no out= file) or printed logging's "--- Logging error ---" traceback per log line.
`ReaderMayLeave` turns stdout into /dev/null then, so the command finishes its work and files:
the reader that left is no error (as `| head` expects), a failed write is one line and exit 2
once the work is done (`raise_stdout_failure`).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO


def _to_devnull(fd: int) -> None:
    """Point `fd` at /dev/null: what the stream still buffers, and every write after, goes
    there (children started later inherit it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


class ReaderMayLeave:
    """A stdout (or stderr: `fd` 2) whose write or flush, once its pipe's reader has left,
    drops the text instead of raising (every other attribute is the stream's own)."""

    def __init__(self, stream: TextIO, fd: int = 1) -> None:
        self._stream, self._fd = stream, fd
        self.failure: OSError | None = None  # the first failed write but a reader's leaving

    def _failed(self, e: OSError) -> None:
        if not isinstance(e, BrokenPipeError) and self.failure is None:
            self.failure = OSError(e.errno, e.strerror, "stdout" if self._fd == 1 else "stderr")
        _to_devnull(self._fd)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._failed(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._failed(e)
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Make sys.stdout a `ReaderMayLeave` (once), where it writes to fd 1, and so the stream of
    each log handler configured on it already (a sweep's worker: hydra set its job's logging
    up before the job ran)."""
    out = sys.stdout
    if out is None or isinstance(out, ReaderMayLeave):
        return
    try:
        if out.fileno() != 1:
            return
    except (OSError, ValueError, AttributeError):  # a test's capture, a closed stream
        return
    guarded = ReaderMayLeave(out)
    sys.stdout = guarded  # type: ignore[assignment]
    for logger in (logging.getLogger(), *logging.Logger.manager.loggerDict.values()):
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is out:
                handler.setStream(guarded)  # type: ignore[arg-type]


def bar_stream() -> TextIO:
    """stderr for a progress bar, whose write once stderr's reader has left (a sweep piped to a
    reader that stopped) drops the text instead of raising: tqdm writes holding its lock, and
    the error left the lock held, so the bar's close as the sweep's process ended waited on it
    forever (every point finished, the process never ended, deaf to Ctrl-C and SIGTERM)."""
    err = sys.stderr
    try:
        fd = err.fileno()
    except (OSError, ValueError, AttributeError):  # a test's capture: it has no reader to leave
        return err
    return ReaderMayLeave(err, fd) if fd == 2 else err  # type: ignore[return-value]


def raise_stdout_failure() -> None:
    """Raise the OSError, naming stdout, of a write to stdout that failed (not a reader's
    leaving) while the command ran."""
    out = sys.stdout
    if isinstance(out, ReaderMayLeave):
        out.flush()
        if out.failure is not None:
            raise out.failure
