"""Shared by the commands: `key=value` argument parsing for the non-hydra ones (calibrate,
validate, bench), and printing a report or a user's mistake as one line.

Usage:
    opts = parse_kv(argv, {"checkpoint": None, "repeats": 3})   # MoepipeError on a bad argument
    print_or_exit(lambda: run(cfg))                               # report lines, or exit 2
    exit_on_unknown_choice(sys.argv[1:], CONF_DIR)                 # before a hydra main
    n = as_int("disk_mb", opts["disk_mb"], at_least=1)              # one line naming the key
    out = output_file(opts["out"], "out")                          # its folder made, writable
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from core.args import as_bool, as_float, as_int, output_dir, output_file
from core.errors import MoepipeError

__all__ = ["CONF_DIR", "as_bool", "as_float", "as_int", "exit_on_unknown_choice", "output_dir",
           "output_file", "parse_kv", "print_or_exit", "unknown_choice"]  # fmt: skip


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
    """The first `group=name` override (a sweep's `group=a,b` too) whose <group>/<name>.yaml is
    in neither `conf_dir` nor a `hydra.searchpath=[file://...]` folder, as one line naming the
    valid names; None when all exist. Hydra's own error for this is a screen of text; values it
    interprets (`glob(...)`, interpolations) and other search paths (pkg://) pass."""
    roots = [conf_dir]
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            paths = [p.strip() for p in value.strip("[]").split(",") if p.strip()]
            if any(not p.startswith("file://") for p in paths):
                return None
            roots += [Path(p.removeprefix("file://")) for p in paths]
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        groups = [r / key for r in roots if (r / key).is_dir()]
        if not sep or key.startswith(("-", "~")) or not (conf_dir / key).is_dir():
            continue
        for name in value.split(","):
            if re.fullmatch(r"[\w.\-]+", name) and not any(
                (g / f"{name}.yaml").exists() for g in groups
            ):
                valid = ", ".join(sorted({p.stem for g in groups for p in g.glob("*.yaml")}))
                return f"{key}={name}: no conf/{key}/{name}.yaml; valid: {valid}"
    return None


def exit_on_unknown_choice(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit 2 with one line on stderr when `unknown_choice` finds one."""
    problem = unknown_choice(argv, conf_dir)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
