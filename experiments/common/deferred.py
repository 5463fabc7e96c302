"""Work a stop must not cut in two: a block run whole under Ctrl-C, SIGTERM and SIGHUP
(`interrupt_deferred`), and the files of one result replaced all together (`written_together`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType

from core.args import written_whole
from experiments import STOPS


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Run the block whole under Ctrl-C, SIGTERM and SIGHUP: one that comes meanwhile acts once
    it ends, as it would have (KeyboardInterrupt, `Stopped`, or whatever handler was set). Off
    the main thread, which cannot set a handler, the block runs as is; so does a signal whose
    handler was set outside Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []
    previous = {}
    for signum in STOPS:
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = signal.signal(
                signum, lambda signum, frame: pending.append((signum, frame))
            )
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: its default action
                os.kill(os.getpid(), signum)


@contextmanager
def written_together(*paths: Path) -> Iterator[list[Path]]:
    """A path beside each of `paths` to write it to (`written_whole`); once the block ends,
    every one replaces its file, under deferred interrupts (`interrupt_deferred`): the files
    of one result are all the new ones or all the earlier ones. collect stopped (SIGTERM)
    between its two left the new results.parquet beside the earlier results.csv."""
    files = ExitStack()
    with files:
        tmps = [files.enter_context(written_whole(p)) for p in paths]
        yield tmps
        with interrupt_deferred():
            files.close()
