"""Warnings a run holds back until its plan is accepted: a run the plan then refuses prints only
its refusal (a checkpoint's notes, a rerun's reason, said first, read as if the run went on);
a run that fails otherwise prints them before its error, which they may explain.

Usage:
    with warnings_held() as said:
        ...  # read the config and the checkpoint, plan
        said()  # the plan is accepted: the warnings held are logged, and later ones at once
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.errors import CapacityError


class _Hold(logging.Filter):
    """A root handler's filter that keeps WARNING records back, once each, while `on`."""

    def __init__(self) -> None:
        super().__init__()
        self.on = True
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.on or record.levelno != logging.WARNING:
            return True
        if not any(r is record for r in self.held):  # each root handler sees it
            self.held.append(record)
        return False


@contextmanager
def warnings_held() -> Iterator[Callable[[], None]]:
    """Inside, the warnings that reach the root logger's handlers are held; the callable it
    yields logs them, in order, and stops holding. Held when the block ends: dropped where it
    raises a refusal (a CapacityError: its one line is all a refused run says), else logged,
    before any other error (they may explain it) or where it ends normally."""
    hold = _Hold()
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(hold)

    def stop() -> list[logging.LogRecord]:
        hold.on = False
        for handler in handlers:
            handler.removeFilter(hold)
        return hold.held

    def said() -> None:
        if hold.on:
            for record in stop():
                logging.getLogger(record.name).handle(record)

    try:
        yield said
    except CapacityError:
        stop()
        raise
    except BaseException:
        said()
        raise
    said()
