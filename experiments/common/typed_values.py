"""The values a command line's overrides gave, as typed (`disk_mb=1e300`), for a line to show
them so rather than as omegaconf or Python holds them (`1e+300`, `1e+09`): a user finds the
value in their command as they wrote it. A sweep's values (`scale=1e300,2`) are each shown as
typed in a point's line, in a worker process too (they travel in MOEPIPE_TYPED).

Usage:
    set_typed(overrides)  # once the command line is read (`app._checked_args`)
    line = with_typed(line)  # `scale=1e+308: ...` -> `scale=1e308: ...`
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Sequence

# its overrides' values as typed, by key (`disk_mb` -> `1e300`, omegaconf's `1e+300`)
TYPED: dict[str, str] = {}
_ENV = "MOEPIPE_TYPED"  # TYPED, for a sweep's worker processes (joblib's)


def set_typed(overrides: Sequence[str]) -> None:
    """Keep `overrides`' values as the command line wrote them, for a line to show."""
    TYPED.clear()
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and not key.startswith("~"):
            TYPED[key.lstrip("+").strip()] = value
    os.environ[_ENV] = json.dumps(TYPED)


def _typed() -> dict[str, str]:
    """TYPED, or in a sweep's worker (a process of its own) the command's, from MOEPIPE_TYPED."""
    if not TYPED and os.environ.get(_ENV):
        with contextlib.suppress(ValueError):  # not ours: none
            TYPED.update(json.loads(os.environ[_ENV]))
    return TYPED


def _items(typed: str) -> list[str]:
    """The values `typed` gives, bare: one, or each of a sweep's `a,b` (not a list's or a
    function's, `[a,b]`, `range(1,3)`, which hold no number a line shows as typed)."""
    bare = typed.strip("'\"")
    if bare[:1] in "[{" or "(" in bare:
        return [bare]
    return [item.strip().strip("'\"") for item in bare.split(",")]


_NUMBER = r"[-+]?(?:inf|nan|\d[\d_]*\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"


def with_typed(line: str) -> str:
    """`line` with each number a typed override gave, where it names the key (or its last
    parts: `links.h2d.gbps=1e+308`), as the command line wrote it (`1e308`)."""
    for key, typed in _typed().items():
        for bare in _items(typed):
            try:
                number = float(bare)
            except ValueError:
                continue
            parts = key.split(".")
            for i in range(len(parts)):
                name = re.escape(".".join(parts[i:]))
                pattern = rf"(?<![\w.])({name}=)({_NUMBER})(?![\w.])"
                line = re.sub(pattern, _swap(bare, number), line)
    return line


_WHOLE = re.compile(r"[-+]?\d+")


def _swap(typed: str, number: float) -> Callable[[re.Match[str]], str]:
    """A substitution putting `typed` for a number equal to `number`, but for a whole number a
    line's fix holds where `typed` is no whole number's text (`pass top_k=2` for a typed 2.0,
    `pass n=1000000000` for a typed 1e9: the fix is that form)."""

    def swap(m: re.Match[str]) -> str:
        held = m.group(2)
        fix = _WHOLE.fullmatch(held) is not None and _WHOLE.fullmatch(typed) is None
        return m.group(1) + (typed if float(held) == number and not fix else held)

    return swap


def as_typed(key: str, value: str, at: str) -> str:
    """`value` of `key` as the command line typed it, where an override gave it (or one point
    of a sweep's `1e300,2`; not a file's: `at` names one); else as omegaconf holds it."""
    typed = _typed().get(key)
    if at or typed is None:
        return value
    for bare in _items(typed):
        try:
            same = bare == value or float(bare) == float(value)
        except ValueError:
            same = False
        if same:
            return typed if "," not in typed.strip("'\"") else bare
    return value
