"""The one rule for a command's warnings: they print once its plan is accepted; a refused run
prints only its refusal (a checkpoint's notes, a rerun's reason, said first, read as if the run
went on); any other failure prints them before its error line, which they may explain.

Every command holds them through its shared entry (`cli.run_command`, and each hydra job in
`app.hydra_main`); a command says where its plan is accepted, and the error path settles them.

Usage:
    plan_accepted()   # the plan is accepted: the warnings held are logged, later ones at once
    settle(e)         # just before the one line of `e`: dropped for a refusal, else logged
    say_line(e)       # a command's own line for `e`, settled first
    with warnings_held():
        ...           # (the shared entry's) held while inside, nested holds inside it
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from core.errors import CapacityError, MoepipeError, ScheduleBug

Held = list[tuple[logging.Logger, logging.LogRecord]]
# the open holds, outermost first; an entry is None once its plan was accepted (it holds no more)
_OPEN: list[Held | None] = []
_CALL_HANDLERS = logging.Logger.callHandlers


def _holding(logger: logging.Logger, record: logging.LogRecord) -> None:
    """`Logger.callHandlers` while a hold is open: a WARNING record is kept by the innermost
    hold, once (every handler, lastResort included, then sees it on release), if it holds."""
    held = next(reversed(_OPEN), None)  # (another thread may close the last meanwhile)
    if held is None or record.levelno != logging.WARNING:
        _CALL_HANDLERS(logger, record)
        return
    held.append((logger, record))


def _log(held: Held) -> None:
    for logger, record in held:
        _CALL_HANDLERS(logger, record)


def refused(e: BaseException) -> bool:
    """`e` is a refusal: its one line is all a refused run says."""
    return isinstance(e, CapacityError)


def plan_accepted() -> None:
    """The run's plan is accepted: what every open hold keeps is logged, in order, and they
    hold no more (a hold opened later, a sweep's next point, holds again)."""
    for i, held in enumerate(_OPEN):
        if held is not None:
            _OPEN[i] = None
            _log(held)


def drop_held() -> None:
    """A refusal said as a result (a sweep's infeasible point): what the innermost hold keeps
    is dropped, as the refusal's line would drop it."""
    if _OPEN and _OPEN[-1] is not None:
        _OPEN[-1].clear()


def say_line(e: BaseException | str) -> None:
    """A command's own one line for `e` (its text, or the text given) on stderr, what is held
    settled first (`settle`: a refusal's warnings dropped, else said before it)."""
    settle(e if isinstance(e, BaseException) else MoepipeError(e))
    print(f"error: {e}", file=sys.stderr)


def settle(e: BaseException) -> None:
    """Just before the one line of `e`: a refusal drops what every hold keeps, any other
    failure logs it first (it may explain the error); either way they hold no more."""
    if refused(e):
        _OPEN[:] = [None] * len(_OPEN)
    else:
        plan_accepted()


@contextmanager
def warnings_held(refusals: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Inside, WARNING records are held (`plan_accepted`, `settle` end that). Held when the block
    ends: dropped where it raises a refusal (or one of `refusals`: validate's planner refused,
    whose warnings leaked into the next planner's; never a bug of ours, which they may
    explain); else passed to the hold around it where that one still holds (logged with it, in
    order, never twice), logged where none does."""
    if not _OPEN:
        logging.Logger.callHandlers = _holding  # type: ignore[method-assign]
    held: Held = []
    _OPEN.append(held)
    depth = len(_OPEN)
    try:
        yield
    except BaseException as e:
        dropped = refused(e) or (isinstance(e, refusals) and not isinstance(e, ScheduleBug))
        _close(depth, None if dropped else held)
        raise
    _close(depth, held)


def _close(depth: int, held: Held | None) -> None:
    """Close the hold at `depth` (and any left open inside it): `held` (None: dropped) goes to
    the hold around it where that one holds, else is logged."""
    kept = _OPEN[depth - 1] is not None and held is not None
    del _OPEN[depth - 1 :]
    outer = _OPEN[-1] if _OPEN else None
    if kept and held:
        if outer is not None:
            outer.extend(held)
        else:
            _log(held)
    if not _OPEN:
        logging.Logger.callHandlers = _CALL_HANDLERS  # type: ignore[method-assign]


def _forget() -> None:
    """A forked child (a pool's worker) holds nothing of its parent's: the parent says what it
    held, and the child, which never reaches the parent's `plan_accepted`, logs at once."""
    _OPEN.clear()
    logging.Logger.callHandlers = _CALL_HANDLERS  # type: ignore[method-assign]


os.register_at_fork(after_in_child=_forget)
