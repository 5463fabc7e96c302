"""The values a command line's overrides gave, as typed (`disk_mb=1e300`), for a line to show
them so rather than as omegaconf or Python holds them (`1e+300`, `1e+09`): a user finds the
value in their command as they wrote it.

Usage:
    set_typed(overrides)  # once the command line is read (`app._checked_args`)
    line = with_typed(line)  # `scale=1e+308: ...` -> `scale=1e308: ...`
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

# its overrides' values as typed, by key (`disk_mb` -> `1e300`, omegaconf's `1e+300`)
TYPED: dict[str, str] = {}


def set_typed(overrides: Sequence[str]) -> None:
    """Keep `overrides`' values as the command line wrote them, for a line to show."""
    TYPED.clear()
    for o in overrides:
        key, sep, value = o.partition("=")
        if sep and not key.startswith("~"):
            TYPED[key.lstrip("+").strip()] = value


_NUMBER = r"[-+]?(?:inf|nan|\d[\d_]*\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?)"


def with_typed(line: str) -> str:
    """`line` with each number a typed override gave, where it names the key (or its last
    parts: `links.h2d.gbps=1e+308`), as the command line wrote it (`1e308`)."""
    for key, typed in TYPED.items():
        bare = typed.strip("'\"")
        try:
            number = float(bare)
        except ValueError:
            continue
        parts = key.split(".")
        for i in range(len(parts)):
            name = re.escape(".".join(parts[i:]))
            line = re.sub(rf"(?<![\w.])({name}=)({_NUMBER})(?![\w.])", _swap(bare, number), line)
    return line


def _swap(typed: str, number: float) -> Callable[[re.Match[str]], str]:
    """A substitution putting `typed` for a number equal to `number`."""
    return lambda m: m.group(1) + (typed if float(m.group(2)) == number else m.group(2))


def as_typed(key: str, value: str, at: str) -> str:
    """`value` of `key` as the command line typed it, where an override gave it (not a file:
    `at` names one, or a sweep's value: `1e300,2`); else as omegaconf holds it."""
    typed = TYPED.get(key)
    if at or typed is None:
        return value
    bare = typed.strip("'\"")
    try:
        same = bare == value or float(bare) == float(value)
    except ValueError:
        same = False
    return typed if same else value
