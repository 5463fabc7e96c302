"""One run at a time per run dir: an flock on the dir's `.run.lock`, taken before hydra writes
anything there and held while a failed or interrupted run takes away what it made
(`run_dir.remove_unused`), the dir itself included.

The file lives in the dir, so runs on other machines that share the folder (a cluster's
filesystem) are kept apart too. A second run into the dir makes the dir and its lock file if
they are not there, then waits. The holder unlinks the file as it lets go (and may have removed
the whole dir before): a waiter that then gets the lock on the unlinked file sees that the path
names another file, or none, and tries again (the usual way to remove an flock's file safely).
A process killed with SIGKILL leaves the file, whose lock died with it. A stop (SIGINT,
SIGTERM) leaves none, wherever it comes: each lock's open is inside the block that lets it
go, and a file a stop made before its fd was kept is unlinked where it is free.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.errors import MoepipeError
from core.files import HELD_HERE as _HELD
from core.files import WRITE_LOCK

LOCK = WRITE_LOCK  # in a run dir: held (flock) by the run writing it, gone once it ends


@contextmanager
def dir_locked(out_dir: Path, busy: str = "another run is writing this run dir") -> Iterator[None]:
    """Hold `out_dir`'s lock for the block, making the dir where it is not there; a block
    inside another that holds it already (this process's) just runs. While another process
    holds it, say so once (`busy`, on stdout, where hydra logs) and wait."""
    key = str(Path(out_dir).resolve())
    if key in _HELD:
        yield
        return
    held: list[int] = []  # the lock file's fd, put there before its flock is taken
    try:
        _acquire(out_dir, busy, held)
        _HELD.add(key)
        yield
    finally:
        _HELD.discard(key)
        _let_go(out_dir / LOCK, held)  # unlinked before the lock goes: a waiter then retries


@contextmanager
def held_if_free(out_dir: Path) -> Iterator[bool]:
    """Inside: True while holding `out_dir`'s lock where no process held it (the lock file a
    run killed with SIGKILL left is free), False where a process does, this one included, or
    `out_dir` is not there. Never waits, and never makes the dir: a sweep stopped takes away
    its points' dirs that hold no result, but not one another sweep's run is writing."""
    path, held = out_dir / LOCK, []
    if str(out_dir.resolve()) in _HELD or not out_dir.is_dir():
        yield False
        return
    try:  # the open inside: a stop as it returned left a lock file no one unlinked
        try:
            _open_into(path, held)
            fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = os.stat(path).st_ino == os.fstat(held[0]).st_ino
        except OSError:  # the dir went or cannot be written, the lock is held (BlockingIOError)
            free = False  # or its holder unlinked the file as it let go
        yield free
    finally:
        _let_go(path, held)  # unlinked where it was free (then ours); left to its holder


def _acquire(out_dir: Path, busy: str, held: list[int]) -> None:
    """`held` = [an fd of `out_dir`'s lock file holding its flock, the path still naming that
    file]. The fd is in `held` from its open on (before its flock), so that a stop at any
    point leaves the caller what it must let go (`_let_go`)."""
    path, told = out_dir / LOCK, False
    while True:
        out_dir.mkdir(parents=True, exist_ok=True)
        try:
            _open_into(path, held)
        except FileNotFoundError:  # the dir went (its holder removed it) since the mkdir
            continue
        fd = held[0]
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not told:
                print(f"{out_dir}: {busy}; waiting for it to end", flush=True)
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return
        except FileNotFoundError:  # its holder unlinked it, or removed the dir, as it let go
            pass
        held.clear()
        os.close(fd)


def _open_into(path: Path, held: list[int]) -> None:
    """Open (making it) the lock file `path` into `held`. A stop (SIGINT, SIGTERM) comes
    between bytecodes: one as `os.open` returned, before its fd was kept, made a lock file no
    one would unlink; that one, free, goes (`_unlink_if_free`)."""
    try:
        held[:] = [os.open(path, os.O_RDWR | os.O_CREAT, 0o644)]
    except OSError:
        raise
    except BaseException:
        if not held:
            _unlink_if_free(path)
        raise


def _let_go(path: Path, held: list[int]) -> None:
    """Let the lock file `path` go, `held` its fd where it was opened: unlinked where this
    process holds its lock or none does (a stop as the lock was taken), then closed; one
    another process holds is left to it."""
    if not held:
        _unlink_if_free(path)
        return
    fd = held.pop()
    try:
        _unlink_if_held(path, fd)
    finally:
        os.close(fd)


@contextmanager
def output_locked(out: str | Path, key: str, command: str) -> Iterator[None]:
    """Hold the lock of `out`, a file the command (`command`) writes whole, for the block: a
    second command writing the same file meanwhile is refused in one line (the last to end
    replaced the first's file, unsaid). The lock, `.<name>.lock` beside `out`, goes as the
    block ends; one a killed command left is free. Where the folder cannot hold it (not there,
    read-only, a file), the command's own write says so. A folder not there yet is made first,
    as the write would (two writers into it were not kept apart), and taken away again where
    the block left nothing in it."""
    path = Path(out)
    lock = path.parent / f".{path.name}.lock"
    made, held = _made_folders(path.parent), []
    try:  # the open inside: a stop as it returned left a lock file no one unlinked
        try:
            _open_into(lock, held)
        except OSError:
            held.clear()
        try:
            if held:
                fcntl.flock(held[0], fcntl.LOCK_EX | fcntl.LOCK_NB)
            mine = not held or os.stat(lock).st_ino == os.fstat(held[0]).st_ino
        except OSError:  # held (BlockingIOError), or unlinked by its holder as it let go
            mine = False
        if not mine:
            raise MoepipeError(
                f"{key}={out}: another {command} is writing this file now (it holds "
                f"{lock.name} beside it); run once it has ended, or pass another {key}="
            )
        yield
    finally:
        _let_go(lock, held)  # unlinked before the lock goes, as dir_locked's
        _remove_empty(made)


def _made_folders(folder: Path) -> list[Path]:
    """Make `folder` where it is not there: the folders made, deepest first ([] where it was
    there, or cannot be made: a read-only parent, a file in the way)."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        _remove_empty(missing)  # those made before the one that failed
        return []
    return missing


def _remove_empty(made: list[Path]) -> None:
    """Take away the folders `_made_folders` made, deepest first, while each is empty: those
    the block wrote into stay."""
    for p in made:
        try:
            p.rmdir()
        except OSError:  # a file in it (the command's output), or gone already
            return


def _unlink_if_free(path: Path) -> None:
    """Unlink the lock file `path` where no process holds its lock: one a stop left as it was
    made, before its fd was kept (an open file of no lock holds none)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # not there (or not ours to open): nothing to take away
        return
    try:
        _unlink_if_held(path, fd)
    finally:
        os.close(fd)


def _unlink_if_held(path: Path, fd: int) -> None:
    """Unlink the lock file `fd` is open on where this process holds (or can take) its lock:
    a command stopped as it took the lock (SIGTERM) left `.run.lock` in its output folder.
    One another process holds is left to it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            path.unlink()
    except OSError:  # held by another (BlockingIOError), or gone already
        pass
