"""Shared by the commands: `key=value` argument parsing for the non-hydra ones (calibrate,
validate, bench), and printing a report or a user's mistake as one line.

Usage:
    opts = parse_kv(argv, {"checkpoint": None, "repeats": 3})   # MoepipeError on a bad argument
    print_or_exit(lambda: run(cfg))                               # report lines, or exit 2
    exit_on_unknown_choice(sys.argv[1:], CONF_DIR)                 # before a hydra main
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
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


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def unknown_choice(argv: Sequence[str], conf_dir: Path) -> str | None:
    """The first `group=name` override (a sweep's `group=a,b` too) whose conf/<group>/<name>.yaml
    does not exist, as one line naming the valid names; None when all exist. Hydra's own error
    for this is a screen of text; values it interprets (`glob(...)`, interpolations) pass."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        group = conf_dir / key
        if not sep or key.startswith(("-", "~")) or not group.is_dir():
            continue
        for name in value.split(","):
            if re.fullmatch(r"[\w.\-]+", name) and not (group / f"{name}.yaml").exists():
                valid = ", ".join(sorted(p.stem for p in group.glob("*.yaml")))
                return f"{key}={name}: no conf/{key}/{name}.yaml; valid: {valid}"
    return None


def exit_on_unknown_choice(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit 2 with one line on stderr when `unknown_choice` finds one."""
    problem = unknown_choice(argv, conf_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
