"""Checked values and output paths for the commands' `key=value` arguments: a bad one is a
MoepipeError naming the key (one line for the user), and an output path is made and checked
before the work whose results it would hold. Plain Python, so real/'s entry points use it too.

Usage:
    n = as_int("disk_mb", opts["disk_mb"], at_least=1)
    out = output_file(opts["out"], "out")   # its folder made and writable
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core.errors import MoepipeError, integer_words
from core.files import broken_link, not_regular, staging_file

# The largest count of repeats a command takes: each is a whole run or measurement, and a
# count past this one would run for days with no word, where a typo (1e12) is the likely cause.
MAX_REPEATS = 1000
REPEATS_WHY = "each repeat is a whole run; more would take days"
# The largest workload dimension a real-run command takes (batch size, prompt or generated
# length, batches): beyond it the tensors alone outgrow any machine's memory.
MAX_TOKENS = 1 << 20
TOKENS_WHY = "beyond it the activations outgrow any machine's memory"
# The largest size, in MB, any size option of a command takes (a shard, a probe file, a margin,
# a budget): 1 TiB is past any one machine's memory, where a typo (1e300) is the likely cause.
# a peer's run stopped after this many times moepipe's makespan (bench.accelerate, bench.real):
# past it the bench waits days for a row it then bounds no better
PEER_LIMIT = 1000.0
PEER_LIMIT_WHY = "times moepipe's makespan; 0 = never stopped"
MAX_SIZE_MB = 1 << 20
SIZE_WHY = "a size in MB; 1 TiB is past any one machine"


def as_int(
    key: str, value: Any, *, at_least: int | None = None, at_most: int | None = None, why: str = ""
) -> int:
    """`value` of argument `key` as an int (a string like "8", or an int); a MoepipeError naming
    `key` when it is not an integer, is below `at_least` or above `at_most` (`why`: the
    reason for that bound, said in the line)."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, float | str) and not isinstance(value, bool):
        try:  # "8", or a whole number written as a float: 1e9, 8.0
            n = int(value.strip()) if isinstance(value, str) and value.strip().isdigit() else None
            x = float(value) if n is None else float(n)
            # past 2**63 only where a bound says the range (1e300 is a whole number, too large)
            big = abs(x) < 2**63 or at_most is not None
            n = int(x) if n is None and x.is_integer() and big else n
        except ValueError:
            n = None
    example = f"{key}={max(at_least if at_least is not None else 1, 1)}"
    if n is None and non_finite(value):  # inf, nan: in the words of every other number's check
        raise MoepipeError(f"{key} must be a finite number, got {value}; pass e.g. {example}")
    word = "an integer" if at_least is None else integer_words(at_least)
    if at_least is not None and at_most is not None:  # its whole range, as a size's `[1, ..]`
        word = f"an integer in [{at_least}, {at_most}]" + (f" ({why})" if why else "")
    if n is None or (at_least is not None and n < at_least):
        raise MoepipeError(f"{key}={value}: must be {word}; pass e.g. {example}")
    if at_least is not None and at_most is not None and n > at_most:
        raise MoepipeError(f"{key}={value}: must be {word}; pass a smaller one")
    _check_at_most(key, value, n, at_most, why)
    return n


def non_finite(value: Any) -> bool:
    """Does `value` spell infinity or NaN: a float, or a string as Python reads it (inf, 1e999,
    nan) or as YAML writes it (.inf, -.Inf, .NaN), which hydra's override parser keeps as a
    string? Every check of a number says such a value in one wording, "KEY must be a finite
    number, got VALUE"."""
    if isinstance(value, bool):
        return False
    if isinstance(value, str) and re.fullmatch(r"[+-]?\.inf|\.nan", value.strip(), re.I):
        return True
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def _check_at_most(key: str, value: Any, x: float, at_most: float | None, why: str) -> None:
    if at_most is not None and x > at_most:
        reason = f" ({why})" if why else ""
        top = f"{int(at_most)}" if float(at_most).is_integer() else f"{at_most:g}"
        raise MoepipeError(f"{key}={value}: must be <= {top}{reason}; pass a smaller one")


def as_float(
    key: str,
    value: Any,
    *,
    at_least: float | None = None,
    positive: bool = False,
    at_most: float | None = None,
    why: str = "",
    low_why: str = "",
) -> float:
    """`value` of argument `key` as a finite float; a MoepipeError naming `key` when it is not a
    number, is below `at_least` (`low_why`: the reason for that bound), (with `positive`) is not
    above 0, or is above `at_most` (`why`: the reason for that bound)."""
    x: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        x = float(value)
    elif isinstance(value, str):
        try:
            x = float(value.strip())
        except ValueError:
            x = None
    if x is None or not math.isfinite(x):
        raise MoepipeError(f"{key}={value}: not a finite number; pass a number, e.g. {key}=1")
    if positive and x <= 0:
        raise MoepipeError(f"{key}={value}: must be > 0; pass a positive number, e.g. {key}=1")
    if at_least is not None and x < at_least:
        since = f" ({low_why})" if low_why else ""
        raise MoepipeError(
            f"{key}={value}: must be >= {at_least:g}{since}; pass e.g. {key}={at_least:g}"
        )
    _check_at_most(key, value, x, at_most, why)
    return x


def as_size_mb(
    key: str, value: Any, *, at_least: float = 0, whole: bool = True, low_why: str = ""
) -> float:
    """`value` of size option `key`, in MB, in [`at_least`, MAX_SIZE_MB] (`whole`: an integer);
    `as_int`'s or `as_float`'s line below the range or for a value not a number, and a line
    naming the whole range above it (`shard_mb=1e300` was taken, and planned a single shard)."""
    low = f"{int(at_least)}" if float(at_least).is_integer() else f"{at_least:g}"
    if whole:  # (as_int's line names the whole range)
        return as_int(key, value, at_least=int(at_least), at_most=MAX_SIZE_MB, why=SIZE_WHY)
    why = f"a size in MB is in [{low}, {MAX_SIZE_MB}], 1 TiB: past any one machine"
    return as_float(key, value, at_least=at_least, low_why=low_why, at_most=MAX_SIZE_MB, why=why)


def as_share(key: str, value: Any, at_most: float, why: str) -> float:
    """`value` of argument `key` as a share in (0, `at_most`] (`why`: of what): a MoepipeError
    naming `key` and the whole range for a number on either side of it, `as_float`'s line for
    one that is not a number."""
    x = as_float(key, value)
    if not 0 < x <= at_most:
        top = f"{int(at_most)}" if float(at_most).is_integer() else f"{at_most:g}"
        raise MoepipeError(f"{key}={value}: must be in (0, {top}] ({why}); pass one in that range")
    return x


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def as_bool(key: str, value: Any) -> bool:
    """`value` of argument `key` as a bool (true/false, yes/no, on/off, 1/0, any case); a
    MoepipeError naming `key` otherwise (a bare `bool("maybe")` would be True)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise MoepipeError(f"{key}={value}: not a boolean; pass {key}=true or {key}=false")


def _not_empty(path: str | Path, key: str) -> Path:
    """`path` as a Path; an empty one is refused (Path("") is the current folder, where a
    command would write unasked: `out=''` put a checkpoint in the repository's root)."""
    if not str(path).strip():
        raise MoepipeError(f"{key}={str(path)!r}: an empty path; pass {key}=<a path>")
    return Path(path)


def not_a_folder(folder: Path, e: OSError) -> str:
    """Why `folder` could not be made (`e`, mkdir's error): the file or the dangling link in
    its way, else the error's own words."""
    return _in_the_way(folder) or e.strerror or str(e)


def _in_the_way(folder: Path) -> str | None:
    """The dangling link, else the file, in `folder`'s path, as a message's words; None."""
    block = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    link = next((p for p in (folder, *folder.parents) if broken_link(p)), None)
    if link is not None:
        return f"{link} is {broken_link(link)[2:-1]}"
    return f"{block} is a file, not a folder" if block is not None else None


def blocked_folder(folder: Path) -> str | None:
    """Why a run's `folder` could not be made or written, seen without making it: a file or a
    dangling link in its path, or the nearest folder of it that is there is not writable;
    None where nothing is in the way. A command that writes many runs checks every run's
    folder with this before the first run, not one as it reaches it, minutes in."""
    in_way = _in_the_way(folder)
    if in_way is not None:
        return in_way
    there = next(p for p in (folder, *folder.parents) if p.exists())
    if not os.access(there, os.W_OK | os.X_OK):
        return f"{there} is not writable"
    return None


def check_run_folders(folders: Sequence[Path]) -> None:
    """A MoepipeError naming the first of `folders` (each a run's, of one command) that
    `blocked_folder` finds blocked, and how many are, before any run."""
    blocked = [(f, why) for f in folders if (why := blocked_folder(f)) is not None]
    if blocked:
        (first, why), more = blocked[0], len(blocked) - 1
        others = f" ({more} other run folder(s) of the {len(folders)} too)" if more else ""
        raise MoepipeError(
            f"{first}: cannot make the run's folder ({why}){others}; move that away and run "
            "again (checked before any run)"
        )


def _writable_folder(folder: Path, key: str, given: Any) -> None:
    """Create `folder` (and its parents) and check a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = not_a_folder(folder, e)
        raise MoepipeError(
            f"{key}={given}: cannot create folder {folder} ({why}); pass {key}= a path under a "
            "writable folder"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise MoepipeError(
            f"{key}={given}: cannot write in folder {folder} ({e.strerror or e}); pass {key}= a "
            "path under a writable folder"
        ) from None


# the files a run dir's result is (experiments.common.run_dir), its summary and sha256 list
# first: another command's output written over one of them lost the run
RUN_FILES = ("summary.json", "files.sha256", "config.yaml", "trace.parquet", "code_version.txt")


# the tables a validation writes last into its folder (experiments.validate, validate_lanes)
VALIDATION_FILES = ("validate.csv", "validate_lanes.csv")


def not_a_run_folder(
    path: str | Path, key: str, own: tuple[str, ...] = (), checkpoint: bool = False
) -> None:
    """A MoepipeError where `path`, the folder a command writes its outputs into (argument
    `key`), is a run's or a validation's: it holds a run's summary.json or files.sha256, or a
    validation's table, whose files the outputs would mix with (a report's page and plots, a
    checkpoint's weights beside a run's trace); or, unless the command writes checkpoints
    (`checkpoint`), a checkpoint's (`checkpoint_folder`). `own`: the command's own table,
    which an earlier run of it left (validate's validate.csv)."""
    names = [f for f in (*RUN_FILES[:2], *VALIDATION_FILES) if f not in own]
    held = next((f for f in names if (Path(path) / f).is_file()), None)
    if held is not None:
        whose = "a validation's" if held in VALIDATION_FILES else "a run's"
        raise MoepipeError(
            f"{key}={path}: {whose} folder (its {held}), whose files this command's outputs "
            "would mix with; pass out= another folder"
        )
    if not checkpoint and checkpoint_folder(path):
        raise MoepipeError(checkpoint_folder_line(path, key, "this command's outputs"))


def checkpoint_folder(path: str | Path) -> bool:
    """Whether `path` holds a Hugging Face checkpoint: its config.json beside safetensors
    weights (a file of them, or their index). A run dir holds no config.json."""
    p = Path(path)
    if not (p / "config.json").is_file():
        return False
    return (p / "model.safetensors.index.json").is_file() or any(p.glob("*.safetensors"))


def checkpoint_folder_line(path: str | Path, key: str, whose: str) -> str:
    """The line refusing output folder `path` (argument `key`) that holds a checkpoint."""
    return (
        f"{key}={path}: a checkpoint's folder (its config.json beside its weights), whose files "
        f"{whose} would mix with; pass {key}= another folder"
    )


def output_file(path: str | Path, key: str, suffix: str = "", starts: bytes = b"") -> Path:
    """`path`, a file a command will write under argument `key`, once its folder exists and can
    be written (created if missing): checked before long work, so that a bad path does not lose
    its results. A MoepipeError naming `key` when the folder cannot be made or written, or the
    path is a folder, empty, a run dir's own file (`RUN_FILES`), (given `suffix`, the
    format's) named for another format, or (given `starts`, how the command's files begin) a
    file the command did not write: a checkpoint's config.json went under trace_json's and
    routing_stats' JSON without a word."""
    p = _not_empty(path, key)
    if p.is_dir():
        raise MoepipeError(f"{key}={path}: is a folder; pass {key}= a file path")
    special = not_regular(p)  # a FIFO, a socket, a device: the user's, which a replace would drop
    if special:
        raise MoepipeError(f"{key}={path}: {special}, where a file goes; pass {key}= a file path")
    if p.name in RUN_FILES and any((p.parent / f).exists() for f in RUN_FILES[:2]):
        raise MoepipeError(
            f"{key}={path}: a file of the run in {p.parent} (its result would be lost); pass "
            f"{key}= another path"
        )
    if suffix and p.suffix.lower() != suffix:  # JSON went into conf/config.yaml, unasked
        raise MoepipeError(
            f"{key}={path}: the file is written as {suffix[1:].upper()}; pass {key}=FILE{suffix}"
        )
    refuse_theirs(p, key, starts)
    # a link is written through (`written_whole`): the folder of the file it names
    _writable_folder(Path(os.path.realpath(p)).parent if p.is_symlink() else p.parent, key, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise MoepipeError(f"{key}={path}: the file is not writable; pass {key}= another path")
    return p


# moepipe's PNGs say so in a text chunk ahead of the image (matplotlib's `savefig(...,
# metadata=PNG_METADATA)`): "begins as a PNG" took a user's plot for the command's own
PNG_METADATA = {"Software": "moepipe"}
PNG_START = b"\x89PNG\r\n\x1a\n"
PNG_OURS = b"tEXtSoftware\x00moepipe"
_HEAD_BYTES = 4096  # where a mark (`holds`) must be: a PNG's text chunks precede its image


def refuse_theirs(
    path: Path, key: str, starts: bytes | tuple[bytes, ...], holds: bytes = b""
) -> None:
    """A MoepipeError naming `key` where a file at `path`, which a command is to replace, does
    not begin with `starts` (how the command's own files begin; any of several) or lacks the
    mark `holds` near its start: another's, which it would lose."""
    if starts and path.is_file() and not _begins(path, starts, holds):
        raise MoepipeError(
            f"{key}={path}: a file this command did not write (it would be lost); pass {key}= "
            "another path, or move that file away first"
        )


def refuse_their_png(path: Path, key: str) -> None:
    """`refuse_theirs` for a plot: a PNG moepipe did not write (`PNG_OURS`), or a folder, at
    `path` is the user's."""
    if path.is_dir():
        raise MoepipeError(
            f"{key}={path}: a folder, where the command writes its plot {path.name}; pass {key}= "
            "another folder, or move that one away first"
        )
    refuse_theirs(path, key, PNG_START, PNG_OURS)


def _begins(path: Path, starts: bytes | tuple[bytes, ...], holds: bytes = b"") -> bool:
    """Whether the file at `path` begins with `starts` and holds `holds` in its first
    `_HEAD_BYTES` (an unreadable one does not)."""
    prefixes = (starts,) if isinstance(starts, bytes) else starts
    try:
        with path.open("rb") as f:
            head = f.read(max(*map(len, prefixes), _HEAD_BYTES if holds else 0))
    except OSError:
        return False
    return head.startswith(prefixes) and holds in head


def not_the_checkpoint(path: str | Path, key: str, ckpt: str | Path) -> None:
    """Refuse an output folder `path` (argument `key`) that is the checkpoint's own folder: a
    command's files would go in among the weights (a run refuses its run dir there alike)."""
    if Path(path).expanduser().resolve() == Path(ckpt).resolve():
        raise MoepipeError(
            f"{key}={path}: the folder of checkpoint={ckpt}, whose weights this command's files "
            f"would mix with; pass {key}= another folder"
        )


def output_dir(path: str | Path, key: str) -> Path:
    """`path`, a folder a command will write into under argument `key`, created and checked to
    be writable (see `output_file`)."""
    p = _not_empty(path, key)
    _writable_folder(p, key, path)
    return p


@contextmanager
def written_whole(path: str | Path) -> Iterator[Path]:
    """A path beside `path` (the same folder, the same suffix) to write the output file to; it
    replaces `path` once the block ends, and is removed if the block fails (a full disk, an
    interrupt): `path` is the earlier file, whole, or the new one, never one cut short. A
    symbolic link at `path` is written through: the file it names is replaced, not the link.
    An OSError that names no file (pandas' to_csv, matplotlib's savefig on a full disk) names
    `path`, as `atomic_write_text`'s does.

    Usage:
        with written_whole(out / "results.csv") as tmp:
            df.to_csv(tmp)
    """
    path = Path(path)
    if path.is_symlink():  # the rename would put a file where the user's link was
        path = Path(os.path.realpath(path))
    tmp = staging_file(path)
    try:
        with naming(path):
            yield tmp
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """An OSError raised in the block that names no file (a write's: pandas' to_csv,
    pyarrow's, matplotlib's savefig on a full disk) names `path`: where a block writes two
    files (`written_together`), each write names its own, not the last one entered."""
    try:
        yield
    except OSError as e:
        if e.filename:
            raise
        raise type(e)(e.errno, e.strerror, str(path)) from None
