"""One run at a time per run dir, with a lock that lives outside the dir.

The lock is an flock on a file in the temp dir named by the dir's resolved path, so a run can
hold it before hydra makes the dir and still hold it while a failed or interrupted run takes
away what it made (`run_dir.remove_unused`): a second run into the same dir waits before hydra
writes anything there, and never finds its folder removed under it. The holder unlinks the file
as it lets go; a waiter that then gets the lock on the unlinked file sees that the path names
another file (or none) and tries again (the usual way to remove an flock's file safely). A
process killed with SIGKILL leaves the file, whose lock died with it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_HELD: set[str] = set()  # the dirs (resolved) whose lock this process holds


def lock_file(out_dir: Path) -> Path:
    """The file whose flock guards `out_dir`: the same for every path that names the dir."""
    key = hashlib.sha256(str(Path(out_dir).resolve()).encode()).hexdigest()[:32]
    return Path(tempfile.gettempdir()) / f"moepipe-locks-{os.getuid()}" / f"{key}.lock"


@contextmanager
def dir_locked(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir`'s lock for the block; a block inside another that holds it already (this
    process's) just runs. While another process holds it, say so once (on stdout, where hydra
    logs) and wait."""
    key = str(Path(out_dir).resolve())
    if key in _HELD:
        yield
        return
    path = lock_file(out_dir)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    fd = _acquire(path, out_dir)
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        path.unlink(missing_ok=True)  # before the lock goes: a waiter then retries (above)
        os.close(fd)


def _acquire(path: Path, out_dir: Path) -> int:
    """An fd of `path` holding its flock, `path` still naming that file."""
    told = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    print(
                        f"{out_dir}: another run is writing this run dir; waiting for it to end",
                        flush=True,
                    )
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:  # its holder unlinked it as it let go
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
