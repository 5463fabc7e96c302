"""Shared by the commands: `key=value` argument parsing for the non-hydra ones (calibrate,
validate, bench), and printing a report or a user's mistake as one line.

Usage:
    opts = parse_kv(argv, {"checkpoint": None, "repeats": 3})   # MoepipeError on a bad argument
    print_or_exit(lambda: run(cfg))                               # report lines, or exit 2
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
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


def print_or_exit(report: Callable[[], list[str]]) -> None:
    """Prints the lines `report` returns; a MoepipeError (a mistake in the user's input) becomes
    one line on stderr and exit status 2."""
    try:
        print("\n".join(report()))
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
