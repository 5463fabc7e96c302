"""A spawned rank's standard error (`dist_run._spawn`): each rank writes it to a file in its run's
folder, not the command's terminal. Native code in a rank writes there past Python: gloo aborting
a rank inside its listener printed C++'s `terminate called after throwing an instance of
'gloo::EnforceNotMet'` and its `what():` line above the command's one line. The command reads
the file instead: the last line a rank that died by a signal wrote goes into the one line that
names it (`died_line`), and what ranks of a run that succeeded wrote (a warning) reaches the
terminal after the run, once per distinct line (`relay`)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from pathlib import Path

from core.files import ulimits

SAID_CHARS = 200  # of the line a rank's native code wrote last, in the command's one line
# `what():  [enforce fail at /path/file.cc:123] ...` -> `...`; `[/path/file.cc:45] ...` too
_SOURCE = re.compile(r"^(what\(\):\s*)?(\[(enforce fail at )?[^\]]*\.(cc|cpp|h):\d+\]\s*)?")
_NO_DESCRIPTORS = ("Too many open files", "EMFILE")


def path(rank: int, tmp: Path) -> Path:
    return tmp / f"rank{rank}.stderr"


def capture(rank: int, tmp: Path) -> None:
    """Point this process's standard error (descriptor 2, so native code's too) at rank's file.
    Where it cannot be opened (no descriptor left, the folder full) stderr stays the command's:
    the rank still runs, and its error still goes to its `.err` file."""
    try:
        fd = os.open(path(rank, tmp), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os.dup2(fd, 2)
    os.close(fd)


def _lines(rank: int, tmp: Path) -> list[str]:
    try:
        text = path(rank, tmp).read_bytes()[-65536:].decode("utf-8", "replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


def last_said(rank: int, tmp: Path) -> str:
    """The last line rank wrote to its standard error, without a C++ source location; empty
    where it wrote none."""
    lines = _lines(rank, tmp)
    if not lines:
        return ""
    said = _SOURCE.sub("", lines[-1]).strip() or lines[-1]
    return said if len(said) <= SAID_CHARS else said[: SAID_CHARS - 3] + "..."


def died_line(rank: int, code: int | None, tmp: Path | None) -> str:
    """One line for a rank that died with exit code `code` (negative: by that signal) and left no
    error of its own; the file `capture` wrote adds what its native code said last."""
    how = f"exit code {code}"
    if code is not None and code < 0:
        try:
            how = f"signal {-code}, {signal.Signals(-code).name}"
        except ValueError:
            how = f"signal {-code}"
    said = last_said(rank, tmp) if tmp is not None else ""
    if said:
        how += f": {said}"
    if any(s in said for s in _NO_DESCRIPTORS):
        return (
            f"rank {rank} died ({how}); the run stopped: raise the limit on open files "
            f"({ulimits('n')}; e.g. ulimit -n 4096) and run it again"
        )
    return f"rank {rank} died ({how}); the run stopped"


def relay(world: int, tmp: Path) -> None:
    """What the ranks of a run that ended wrote to their standard error, to the command's, each
    distinct line once (G ranks print the same warning G times)."""
    seen: set[str] = set()
    for rank in range(world):
        for line in _lines(rank, tmp):
            if line not in seen:
                seen.add(line)
                print(line, file=sys.stderr)
