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

import math
import os
import re
import sys
import tempfile
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


# ---- checked values and output paths (added for the commands' bad-input handling) -----------


def as_int(key: str, value: Any, *, at_least: int | None = None) -> int:
    """`value` of argument `key` as an int (a string like "8", or an int); a MoepipeError naming
    `key` when it is not a whole number or is below `at_least`."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        try:
            n = int(value.strip())
        except ValueError:
            n = None
    bound = "" if at_least is None else f" >= {at_least}"
    example = f"{key}={max(at_least if at_least is not None else 1, 1)}"
    if n is None:
        raise MoepipeError(f"{key}={value}: not a whole number; pass one{bound}, e.g. {example}")
    if at_least is not None and n < at_least:
        raise MoepipeError(f"{key}={value}: must be{bound}; pass e.g. {example}")
    return n


def as_float(
    key: str, value: Any, *, at_least: float | None = None, positive: bool = False
) -> float:
    """`value` of argument `key` as a finite float; a MoepipeError naming `key` when it is not a
    number, is below `at_least`, or (with `positive`) is not above 0."""
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
        raise MoepipeError(f"{key}={value}: must be >= {at_least:g}; pass e.g. {key}={at_least:g}")
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


def _writable_folder(folder: Path, key: str, given: Any) -> None:
    """Create `folder` (and its parents) and check a file can be written in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        block = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        why = f"{block} is a file, not a folder" if block else (e.strerror or str(e))
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


def output_file(path: str | Path, key: str) -> Path:
    """`path`, a file a command will write under argument `key`, once its folder exists and can
    be written (created if missing): checked before long work, so that a bad path does not lose
    its results. A MoepipeError naming `key` when the folder cannot be made or written, or the
    path is a folder."""
    p = Path(path)
    if p.is_dir():
        raise MoepipeError(f"{key}={path}: is a folder; pass {key}= a file path")
    _writable_folder(p.parent, key, path)
    if p.exists() and not os.access(p, os.W_OK):
        raise MoepipeError(f"{key}={path}: the file is not writable; pass {key}= another path")
    return p


def output_dir(path: str | Path, key: str) -> Path:
    """`path`, a folder a command will write into under argument `key`, created and checked to
    be writable (see `output_file`)."""
    p = Path(path)
    _writable_folder(p, key, path)
    return p
