"""Reading a user's small file (a config.json, an index, a YAML): a regular file of bounded
size, its JSON objects without a key given twice. A plain read blocks forever on a FIFO and
never ends on /dev/zero; a JSON parser keeps the last of two equal keys without a word.

Usage:
    data = read_small(path)                 # bytes; ConfigError naming path, or an OSError
    fields = loads_json(data.decode(), where=str(path))
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import ConfigError, MoepipeError

log = logging.getLogger(__name__)

SMALL_FILE_BYTES = 16 * 2**20  # a config.json or index is KBs; a bigger one is not what it says


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words (from its stat's st_mode)."""
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"


def no_file_words(mode: int) -> str:
    """What a path of st_mode `mode` that is no regular file is, where a command reads a file,
    as a message's tail: 'a folder, where a file belongs', 'not a regular file (a FIFO)'."""
    if stat.S_ISDIR(mode):
        return "a folder, where a file belongs"
    return f"not a regular file ({file_kind(mode)})"


def broken_link(path: str | Path) -> str:
    """Where `path` is a symbolic link that leads nowhere, what it is as a message's tail
    (' (a symbolic link to X, which does not exist)', ' (a symbolic link that loops)'); else ''.
    A line saying only "not a folder" left the user looking at a name that looked right."""
    p = Path(path)
    if not p.is_symlink():
        return ""
    try:
        p.resolve(strict=True)
    except RuntimeError:  # Python 3.11: a loop
        return " (a symbolic link that loops)"
    except OSError as e:
        if e.errno == errno.ELOOP:  # as newer Pythons raise it
            return " (a symbolic link that loops)"
        return f" (a symbolic link to {os.readlink(p)}, which does not exist)"
    return ""


def not_regular(path: str | Path) -> str | None:
    """None where `path` (links followed) is a regular file or is missing; else what it is, as
    a message's tail (`no_file_words`)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # the caller's read reports it
    return None if stat.S_ISREG(mode) else no_file_words(mode)


def no_file_there(path: str | Path) -> str:
    """Why `path` is no file to read, as a message's words: what is there instead (a folder,
    a FIFO: `no_file_words`), or 'no such file' (with a broken link's words): a folder was
    called missing where a file belongs."""
    return not_regular(path) or f"no such file{broken_link(path)}"


def no_folder_there(path: str | Path) -> str:
    """Why `path` is no folder to read, as a message's words: 'a file, where a folder belongs',
    'not a folder (a FIFO)', or 'no such folder' (with a broken link's words): a file given
    where a folder belongs was called missing."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return f"no such folder{broken_link(path)}"
    if stat.S_ISREG(mode):
        return "a file, where a folder belongs"
    return "no such folder" if stat.S_ISDIR(mode) else f"not a folder ({file_kind(mode)})"


def read_small(path: str | Path, *, limit: int = SMALL_FILE_BYTES, fix: str = "") -> bytes:
    """`path`'s bytes. A ConfigError naming it where it is not a regular file or holds more than
    `limit` bytes (checked on the open file, which O_NONBLOCK keeps a FIFO from blocking);
    OSErrors (missing, no permission) are the caller's to word."""
    tail = f"; {fix}" if fix else ""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:  # a socket cannot be opened (ENXIO): say what it is, as for a FIFO
        kind = not_regular(path) if e.errno == errno.ENXIO else None
        if kind is None:
            raise
        raise ConfigError(f"{path}: {kind}{tail}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):  # checked before fdopen, which refuses a directory unnamed
        os.close(fd)
        raise ConfigError(f"{path}: {no_file_words(mode)}{tail}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)  # a file that grows while read stops here too
    if len(data) > limit:
        raise ConfigError(
            f"{path}: over {limit // 2**20} MiB, far larger than a file of its kind (left unread)"
            f"{tail}"
        )
    return data


class RepeatedKeyError(MoepipeError):
    """A JSON object gives one key twice (not a ValueError, so a caller's `except ValueError`
    for malformed JSON does not reword it)."""


def loads_json(text: str | bytes, where: str, repeated: Callable[[str], None] | None = None) -> Any:
    """`json.loads`, refusing an object that gives a key twice: a RepeatedKeyError naming
    `where` and the key (json keeps the last value without a word), or, given `repeated`, the
    last value kept as json keeps it and `repeated(key)` called; nesting past Python's
    recursion limit is a JSONDecodeError (a ValueError), as other malformed JSON is."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out and repeated is not None:
                repeated(key)
            elif key in out:
                raise RepeatedKeyError(
                    f"{where}: key {key!r} appears twice in one JSON object; keep one of them "
                    "(a JSON reader takes the last without a word)"
                )
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique)
    except RecursionError:  # json's parser recurses per bracket: no file of ours nests so
        raise json.JSONDecodeError("nested too deeply", "", 0) from None


def loads_json_as_owner(text: str | bytes, where: str, owner: str) -> Any:
    """`json.loads` as the format's `owner` reads it (e.g. "transformers takes the last value
    (json.loads)"): a key given twice keeps its last value, said once a process in one line
    naming `where`, the key and the owner's rule."""

    def repeated(key: str) -> None:
        note_once(
            f"{where}: key {key!r} appears twice in one JSON object; {owner}, and so does "
            "moepipe: keep one of them"
        )

    return loads_json(text, where, repeated)


# the owner's rule for a JSON file the commands write (summary.json): Python's json wrote it,
# and its json.loads keeps a repeated key's last value
PYTHON_JSON = "Python's json, which wrote it, takes the last value (json.loads)"
# for a checkpoint's JSON files (config.json, generation_config.json, the safetensors index),
# which transformers reads with json.load
TRANSFORMERS_JSON = "transformers takes the last value (json.loads)"


def read_summary_json(path: Path, fix: str = "") -> Any:
    """A summary.json a command wrote, read as Python's json reads it (`PYTHON_JSON`): a small
    regular file (`read_small`), UTF-8 JSON (UnicodeDecodeError, JSONDecodeError otherwise)."""
    return loads_json_as_owner(read_small(path, fix=fix).decode("utf-8"), str(path), PYTHON_JSON)


@functools.cache
def note_once(message: str) -> None:
    """Log `message` once a process: a command reads a file more than once."""
    log.warning(message)


def ulimits(*names: str) -> str:
    """This process's soft limits as the shell sets them: "ulimit -n 18" for "n" (open files),
    "ulimit -u 4096" for "u" (processes), "unlimited" where so; empty off POSIX."""
    try:
        import resource
    except ImportError:  # not POSIX
        return ""
    which = {"n": resource.RLIMIT_NOFILE, "u": resource.RLIMIT_NPROC}
    said = []
    for name in names:
        soft = resource.getrlimit(which[name])[0]
        said.append(f"ulimit -{name} {'unlimited' if soft == resource.RLIM_INFINITY else soft}")
    return ", ".join(said)


def os_error_fix(e: OSError) -> str:
    """What would fix an OSError, by its errno (a command's own line about a write it names)."""
    return {
        errno.ENOSPC: "free space on that disk, or write elsewhere",
        errno.EFBIG: "a file outgrew the limit on a file's size (the shell's ulimit -f, or "
        "the disk's file system): raise it, or make the output smaller",
        errno.EDQUOT: "free space on that disk, or write elsewhere",
        errno.EROFS: "choose a folder you can write to",
        errno.EACCES: "check its permissions, or choose another folder",
        errno.EPERM: "check its permissions, or choose another folder",
        errno.ENOENT: "check the path",
        errno.EISDIR: "move that folder away, or name another file",
        errno.ENAMETOOLONG: "a name in that path is over the file system's limit (255 "
        "bytes on most): shorten it",
        errno.ENOTDIR: "a folder in that path is a file: check the path",
        errno.EMFILE: f"this process is out of file descriptors ({ulimits('n')}): raise the "
        "limit (e.g. ulimit -n 4096) and run it again",
        errno.ENFILE: "the system's table of open files is full: close other programs' files "
        "(or raise fs.file-max) and run it again",
    }.get(e.errno or 0, "check the file and the disk")


def cannot_write(what: str, e: OSError, verb: str = "write it") -> str:
    """One line for an OSError while a command writes `what` (`out=PATH`): what failed, the
    system's reason, and what would fix it (`os_error_fix`)."""
    return f"{what}: cannot {verb} ({e.strerror or e}); {os_error_fix(e)}"


def plain_permissions(path: str | Path) -> None:
    """Give `path` the permissions a plain `open()` gives (0666 less the umask): safetensors'
    save_file leaves 0600, so a checkpoint or a run's tokens another user of a shared group
    reads, as every other output of the commands, was unreadable to them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


MOUNTS = "/proc/self/mounts"  # the kernel's table of this process's mounts
# filesystems whose files live in memory (or are made up by the kernel): a read from them
# times memory, not a disk
MEMORY_FILESYSTEMS = frozenset(
    {"tmpfs", "ramfs", "devtmpfs", "proc", "sysfs", "cgroup", "cgroup2", "debugfs", "hugetlbfs"}
)


def memory_filesystem(path: str | Path) -> str | None:
    """The type of the memory-backed or virtual filesystem `path` (existing or not) is on, or
    None for any other (or where the mount table cannot be read)."""
    real = os.path.realpath(path)
    try:
        lines = Path(MOUNTS).read_text(errors="replace").splitlines()
    except OSError:
        return None
    best, kind = -1, None
    for line in lines:  # the longest mount point over `real`; a later mount shadows an earlier
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].encode().decode("unicode_escape")  # "\040" is a space in a name
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best, kind = len(point), fields[2]
    return kind if kind in MEMORY_FILESYSTEMS else None


# what a staged write leaves while it runs: a folder `.partial-PID-HEX` (its files, before
# they move in), `.partial-PID-HEX-earlier` (the outputs they replace, set aside meanwhile) and
# a file `.STEM.partial-PID-HEX.SUFFIX` (one file written whole, then renamed over STEM.SUFFIX;
# the suffix kept, as a writer may choose its format by it)
_STAGING = re.compile(
    r"(?:\.(?P<stem>.+))?\.partial-(?P<pid>\d+)-[0-9a-f]{8}(?P<aside>-earlier)?(?:\.[^.]*)?"
)


def staging_dir(out: Path) -> Path:
    """A new hidden folder's name in `out` for a writer to stage its files in before they move
    in (not made yet). What writers killed outright (SIGKILL, out of memory) left there goes
    first (`clear_leftovers`). A live writer's, on this machine, stays."""
    clear_leftovers(out)
    return out / f".partial-{os.getpid()}-{secrets.token_hex(4)}"


def staging_file(path: Path) -> Path:
    """A new hidden name beside `path` for a file written whole, then renamed over it: one per
    writer (two writers of one file, as two calibrate runs of one profile, shared one name and
    each renamed the other's half), and one the next writer or reader knows for a dead one's."""
    clear_leftovers(path.parent)
    tag = f"partial-{os.getpid()}-{secrets.token_hex(4)}"
    return path.with_name(f".{path.stem}.{tag}{path.suffix}")


def clear_leftovers(folder: Path) -> None:
    """Remove from `folder` what writers killed outright (SIGKILL, out of memory) left half
    done: their staging folders and half-written files, which would pile up in a folder
    rewritten again and again (a run dir, a checkpoint's, a report's), their bytes counted
    against its disk. A killed writer's outputs set aside (`-earlier`) come back where no new
    one took their name, so a kill in the moment a report's files move in loses none. A
    writer's process still alive (on this machine) keeps its own; what cannot be removed (a
    folder not ours, read-only) stays, hidden, as every reader skips it."""
    try:
        names = [p for p in folder.iterdir() if p.name.startswith(".")]
    except OSError:
        return
    for old in sorted(names, key=lambda p: p.name.endswith("-earlier")):  # staging goes first
        m = _STAGING.fullmatch(old.name)
        if not m or _alive(int(m.group("pid"))):
            continue
        try:
            if m.group("aside") and old.is_dir() and not old.is_symlink():
                for p in old.iterdir():
                    if not (folder / p.name).exists() and not (folder / p.name).is_symlink():
                        os.replace(p, folder / p.name)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old)
            else:
                old.unlink()
        except OSError:
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; or not a pid at all
        return True
    return True


# in a folder a writer rewrites whole (a run dir, make_checkpoint's out): held (flock) while it
# writes (experiments.common.dir_lock), gone once it ends; a SIGKILLed writer's stays, unheld
WRITE_LOCK = ".run.lock"
HELD_HERE: set[str] = set()  # the folders (resolved) whose WRITE_LOCK this process holds


def being_written(folder: Path) -> bool:
    """Does a live process hold `folder`'s WRITE_LOCK? Asked without making the file (a
    reader may not write there): a folder without one, whose lock died with its writer
    (SIGKILL), or whose lock this process holds (its own writes), is not being written."""
    if str(folder.resolve()) in HELD_HERE:
        return False
    try:
        fd = os.open(folder / WRITE_LOCK, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a lock file flock cannot take (a FIFO, a folder by that name): no writer's
        return False
    finally:
        os.close(fd)
    return False


State = tuple[tuple[str, int, int, int], ...]  # (name, inode, size, mtime ns) of each file


def unwritten_state(folder: Path, what: str) -> State:
    """Each file of `folder` (a checkpoint) as (name, inode, size, mtime ns), for
    `unchanged_since` to tell that what was read of it is of one `what`. A folder whose writer
    holds its lock now (`being_written`; make_checkpoint) is refused: its files move in one by
    one, and a run read one checkpoint's config.json with another's shards."""
    if being_written(folder):
        raise ConfigError(
            f"{folder}: another process (make_checkpoint) is writing this {what} now (it holds "
            f"{WRITE_LOCK} there); run once it has ended"
        )
    try:
        files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError:  # no folder: the reader says so
        return ()
    state = []
    for p in files:
        try:
            st = p.stat()
        except OSError:  # gone meanwhile: the next state differs
            continue
        state.append((p.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(state)


def unchanged_since(folder: Path, what: str, before: State) -> None:
    """Refuse where `folder`'s files are not those `unwritten_state` saw (`before`): what was
    read may be of two of `what`."""
    if unwritten_state(folder, what) != before:
        raise ConfigError(
            f"{folder}: its files changed while they were read (another process rewrote the "
            f"{what}); run again once nothing writes it"
        )


def whole_csv(path: Path) -> Any:
    """The CSV file at `path` a command wrote (pandas' to_csv), read back as a DataFrame, whole:
    a file cut short (no final newline, a row of fewer fields than its header) raises pandas'
    ParserError, where read_csv fills a short row's missing fields with NaN without a word."""
    import csv
    import io

    import pandas as pd

    text = path.read_text(encoding="utf-8")
    rows = list(csv.reader(io.StringIO(text)))
    short = [i for i, r in enumerate(rows) if len(r) != len(rows[0])]
    if short:
        n, have = len(rows[0]), len(rows[short[0]])
        raise pd.errors.ParserError(f"row {short[0]} has {have} fields, its header {n}; cut short?")
    if text and not text.endswith("\n"):
        raise pd.errors.ParserError("no newline at its end: cut short")
    return pd.read_csv(io.StringIO(text))
