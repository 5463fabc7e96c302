"""`key=value` argument parsing shared by the non-hydra commands (calibrate, validate, bench).

Usage:
    opts = parse_kv(argv, {"checkpoint": None, "repeats": 3})   # MoepipeError on a bad argument
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from core.errors import MoepipeError


def parse_kv(argv: Sequence[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults overridden by `key=value` arguments; an unknown key or a bare word is an error."""
    opts = dict(defaults)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in opts:
            raise MoepipeError(f"argument {arg!r}: expected key=value with key in {sorted(opts)}")
        opts[key] = value
    return opts
