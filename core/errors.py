"""Errors a user can fix. CLIs catch `MoepipeError` and print its one-line message, exit non-zero.

Each message names the field, file or op at fault and what would fix it.
"""

import difflib
import numbers
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar


class MoepipeError(Exception):
    """Base class: a mistake in the user's input, reported as one line."""


class ConfigError(MoepipeError, ValueError):
    """A config field has a bad value (names the field and the valid range)."""


class TraceError(MoepipeError):
    """A routing trace file is missing, corrupt, or disagrees with the model's shape."""


class ScheduleError(MoepipeError):
    """A schedule is malformed, or can never finish (names the stuck ops)."""


class ScheduleBug(ScheduleError):
    """A schedule that breaks the IR's own rules (ids, deps, streams, spans, gates, frees): a
    planner's or an executor's bug, which no config of the user's causes or fixes. The CLIs
    print it as an internal error, its traceback kept in a file, not as the user's mistake."""


class PlannerBug(ScheduleBug):
    """A ScheduleBug of a researcher's own planner (one the project does not ship): theirs to
    fix, so the CLIs print it as one line naming the planner, not as an internal error."""


class CapacityError(MoepipeError):
    """Something does not fit in memory (says what it needs and what there is). Raised by
    `capacity_error`, it keeps its parts: `cause`, and the keys whose lowering (`lower`) or
    raising (`more`) would fit it, so that a caller adding a fix of its own names each once."""

    cause: str = ""
    lower: tuple[str, ...] = ()
    more: tuple[str, ...] = ()


_C = TypeVar("_C", bound=CapacityError)
_E = TypeVar("_E", bound=BaseException)


def with_fixes(e: _C, cause: str, lower: tuple[str, ...], more: tuple[str, ...]) -> _C:
    """`e` with its cause and fixes (`CapacityError`) kept as data."""
    e.cause, e.lower, e.more = cause, lower, more
    return e


def reworded(e: _E, line: str) -> _E:
    """`e` saying `line`: its type and its parts (a CapacityError's fixes, a GpuEdgeError's
    `only_gpu`) kept, so that a wrapper that rewords an error leaves how the CLI handles it
    (a refusal, the user's mistake, a planner's bug) as it was, whichever command raised it."""
    new = type(e).__new__(type(e))
    new.args = (line,)
    new.__dict__.update(vars(e))
    return new


def without_fix(e: BaseException) -> str:
    """What `e` says went wrong, without its fix: for a warning of a run that worked around it
    (another n, a rerun), where the fix would ask the user to do what the run already did."""
    cause = getattr(e, "cause", "")
    return cause if isinstance(e, CapacityError) and cause else str(e).split("; ")[0]


def capacity_error(cause: str, lower: tuple[str, ...], more: tuple[str, ...]) -> CapacityError:
    """A CapacityError whose line is `cause`, then `fix_words(lower, more)`."""
    return with_fixes(CapacityError(f"{cause}; {fix_words(lower, more)}"), cause, lower, more)


def fix_words(lower: Iterable[str], more: Iterable[str], *first: str) -> str:
    """`first` fixes, then "lower A, B or C", then "raise X or Y", joined as one list."""
    parts = [*first]
    parts += [f"{verb} {_either(keys)}" for verb, keys in (("lower", lower), ("raise", more))]
    parts = [p for p in parts if not p.endswith(" ")]
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])}, or {parts[-1]}"


def _either(keys: Iterable[str]) -> str:
    keys = list(keys)
    return " or ".join(keys) if len(keys) < 3 else f"{', '.join(keys[:-1])} or {keys[-1]}"


def cannot_read(path: object, e: OSError) -> str:
    """One line for a file an OSError kept from being read, ending in its fix."""
    return f"{path}: cannot read it ({e.strerror or e}); check that it is a file you may read"


def quoted(name: object) -> str:
    """A name from a user's file or command line (a tensor, key, field or file) as a line shows
    it: as is where it reads back unambiguously, else in Python's quotes with its escapes, so
    that an empty name, a space or a control character in one shows (`tensor '' (1 such)`,
    where `tensor  (1 such)` hid it)."""
    text = str(name)
    plain = text and text.isprintable() and not any(c.isspace() or c in "'\"" for c in text)
    return text if plain else repr(text)


def did_you_mean(word: str, valid: Iterable[object]) -> str:
    """`did you mean 'X'? ` for the valid name nearest `word` (case ignored: `BATCH` is `batch`
    mistyped), else "": a message puts it before its list of valid names."""
    folded = {str(v).lower(): str(v) for v in valid}
    close = difflib.get_close_matches(str(word).lower(), list(folded), n=1, cutoff=0.5)
    return f"did you mean {folded[close[0]]!r}? " if close else ""


def in_chain(e: BaseException, kind: type[_E]) -> _E | None:
    """The first exception of `kind` in `e`'s chain of causes and contexts (`e` first); None
    if none."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, kind):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or stop (`Stopped`) an error was raised while handling, if any: a signal that
    lands inside a library's `try` (hydra composing its config) can leave its `finally` to fail
    on the half-built state, and that error, not the signal, reaches the command."""
    return in_chain(e, KeyboardInterrupt)


def raised_at(e: BaseException, root: str) -> str:
    """`, at FILE:LINE in FUNCTION` for the innermost frame of `e`'s traceback in a file under
    folder `root` (a researcher's own planner file, where the bug is theirs); "" if none, or
    for a check of ours (a ScheduleBug names its op or planner: the check's line is no news)."""
    if isinstance(e, MoepipeError):
        return ""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(Path(root).resolve()):
            return f", at {path.relative_to(Path(root).resolve())}:{frame.lineno} in {frame.name}"
    return ""


def integer_words(at_least: int) -> str:
    """The one wording of an integer field's lower bound, in every config and option: "a
    positive integer" (>= 1), "a non-negative integer" (>= 0), else "an integer >= N"."""
    named = {1: "a positive integer", 0: "a non-negative integer"}
    return named.get(at_least, f"an integer >= {at_least}")


def integer_below(key: str, value: object, at_least: int, note: str = "") -> str:
    """`KEY=VALUE: must be a positive integer (NOTE)`: the line of every integer field or
    option below its bound (`integer_words`), naming the field and its value."""
    return f"{key}={value}: must be {integer_words(at_least)}" + (f" ({note})" if note else "")


def integer_field(key: str, value: object, at_least: int, fix: str, note: str = "") -> int:
    """`value` of integer field `key`, read from a YAML or JSON file, at least `at_least`; else
    a ConfigError in `integer_below`'s line with what to do after it (`fix`). Only an integer
    is one: 2.5 was 2, `true` 1 and "8" 8 without a word under int(); 2.0 is refused as the
    hydra schema refuses it in the same YAML, and NaN and inf are no integer either."""
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not whole or int(value) < at_least:  # type: ignore[call-overload]
        raise ConfigError(f"{integer_below(key, repr(value), at_least, note)}; {fix}")
    return int(value)  # type: ignore[call-overload]


def gb_apart(*sizes_bytes: int) -> tuple[str, ...]:
    """Sizes in bytes as GB, to 3 significant digits, or to as many more as tell two different
    sizes apart: a refusal's "GPU memory A GB is smaller than the working set B GB" one byte
    short read "7e-05 GB is smaller than ... 7e-05 GB". Equal sizes read the same."""
    for digits in range(3, 18):
        shown = tuple(f"{b / 1e9:.{digits}g}" for b in sizes_bytes)
        if len(set(shown)) == len(set(sizes_bytes)):
            break
    return shown
