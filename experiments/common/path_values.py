"""Path-valued options on the command line (run and sweep dirs, checkpoints, traces, output
files and folders): a folder's name holding what hydra's override grammar reads as its own (a
comma as a sweep, `${` as an interpolation) is named with the fix that helps, the path quoted.

Usage:
    line = comma_in_path("hydra.run.dir", "/x/a,b", sweeping=False)  # quote it: one path
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Callable, Collection, Sequence

from core.errors import MoepipeError

# the last part of a key whose value is a path: a run's, a sweep's or an output's folder, a
# checkpoint, a trace folder, a model's config.json, an output file
_PATH_KEY = re.compile(
    r"(?:^|_)(?:dir|dirs|subdir|out|ckpt|checkpoint|hf_config|runs|src|file|filename|path|folder)$"
)


def is_path_key(key: str) -> bool:
    """Is `key` (an override's, dotted) one whose value is a path?"""
    return _PATH_KEY.search(key.lstrip("+~").rsplit(".", 1)[-1]) is not None


def quoted_path(key: str, value: str) -> str:
    """`key=value` with the value quoted as one string of hydra's grammar: in '...', in "..."
    where it holds a `'`, its `'` escaped (`\\'`) where it holds both kinds of quote."""
    if "'" not in value:
        return f"{key}='{value}'"
    if '"' not in value:
        return f'{key}="{value}"'
    escaped = value.replace("'", "\\'")
    return f"{key}='{escaped}'"


def shell_arg(arg: str) -> str:
    """`arg`, one command-line argument as the command must get it (hydra's quotes in it), as a
    line's fix shows it: pasted into a shell as it stands, the shell hands the command `arg`
    (`KEY='/x/a,b'` typed bare, the shell strips its quotes and hydra sees a sweep). Bare where
    nothing in it is the shell's; in "..." (its `"` and `\\` escaped) where it holds none of
    `$`, a backquote or `!`, which "..." expands; else in '...'."""
    if shlex.quote(arg) == arg:
        return arg
    if not any(c in arg for c in "$`!"):
        escaped = arg.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    return shlex.quote(arg)


# hydra's keys of a run's and a sweep's folder: one path each, never swept (hydra sets them
# once per sweep)
_HYDRAS_DIRS = ("hydra.run.dir", "hydra.sweep.dir")


def comma_in_path(key: str, value: str, *, sweeping: bool) -> MoepipeError | None:
    """The line for `key=value`, which hydra read as a sweep of values at its comma, where the
    value is one path: quoted, it is. One run's (`sweeping` False): a path key's value, or one
    holding a '/', unless each piece is a path of its own (`/ck/a,/ck/b`: a sweep meant, for
    -m). A sweep's: a folder hydra sets once per sweep (`hydra.sweep.dir`), or a path that is
    there whole and not in pieces, or whose later piece is no path (`/x/a,b`) where its pieces
    are not all there. None otherwise: a list, a sweep function, values that are not paths."""
    key = key.lstrip("+~")
    if "," not in value or value.lstrip()[:1] in ("[", "{") or re.match(r"\s*\w+\(", value):
        return None
    if not (is_path_key(key) or "/" in value):
        return None
    first, *rest = value.split(",")
    hydras = key in _HYDRAS_DIRS
    each_a_path = all("/" in p for p in rest) and "/" in first
    there = all(os.path.exists(p) for p in (first, *rest))
    whole = os.path.exists(value) and not there
    if sweeping and not (hydras or whole or ("/" in first and not each_a_path and not there)):
        return None  # (`cfgs/a.json,b.json`, both there: a sweep of two files)
    if not sweeping and each_a_path and not (hydras or whole):
        return None
    return MoepipeError(
        f"{key}={value}: a comma in a path must be quoted, or hydra reads it as a sweep of "
        f"values: pass {shell_arg(quoted_path(key, value))}"
    )


# an omegaconf line of an interpolation that could not be resolved
_INTERPOLATION = re.compile(r"Interpolation key '.*' not found|Unsupported interpolation type")


def literal_dollar(key: str | None, msg: str) -> str:
    """What a path key's failed interpolation (`${x}` in a folder's name) adds to its line:
    how to write the `${` as itself, or for hydra's own paths (which hydra resolves again, in
    its log file's path) that no folder of a run may hold it; "" for any other key or error."""
    if not key or not is_path_key(key) or not _INTERPOLATION.search(msg):
        return ""
    if key.startswith("hydra."):
        return (
            " (a run's or a sweep's folder cannot hold '${' as itself: hydra resolves its "
            "paths again; pass hydra.run.dir or hydra.sweep.dir a folder without it)"
        )
    fix = shell_arg(f'{key}=".../a\\${{x}}"')
    return f" (a path holding '${{' as itself writes it '\\${{', quoted: {fix})"


def comma_in_item(key: str, items: list[str]) -> MoepipeError | None:
    """The line for list option `key`, whose items hydra split at a comma inside one item, a
    folder's name (`runs=[/x/a,b]` read as `/x/a` and `b`): a run of neighbours that, joined by
    commas, is there where its pieces are not all there. None where no such run is."""
    if not (is_path_key(key) or any("/" in i for i in items)):
        return None
    return _split_item(key, items, os.path.exists, "path")


def comma_in_name(key: str, items: Sequence[str], valid: Collection[str]) -> MoepipeError | None:
    """The line for list option `key` of names, whose items hydra split at a comma inside one
    (replication's `variants=[predictive_replication[layer_corr,gate=none]]` quoted, a column's
    name): a run of neighbours that, joined by commas, is a name of `valid` where its pieces
    are not all. None where no such run is."""
    return _split_item(key, list(items), lambda p: p in valid, "item")


def _split_item(
    key: str, items: list[str], ok: Callable[[str], bool], what: str
) -> MoepipeError | None:
    for i in range(len(items) - 1):
        for j in range(len(items), i + 1, -1):  # the longest run first: `/x/a,b,c`
            joined = ",".join(items[i:j])
            if ok(joined) and not all(ok(p) for p in items[i:j]):
                fix = [_hydra_quoted(p) for p in [*items[:i], joined, *items[j:]]]
                arg = shell_arg(f"{key}=[{','.join(fix)}]")
                return MoepipeError(
                    f"{key}=[{','.join(items)}]: {joined} is one {what}, which hydra splits at "
                    f"its comma into items; quote it: pass {arg}"
                )
    return None


def _hydra_quoted(item: str) -> str:
    """`item`, a list's, as hydra's grammar takes it whole: as is where it holds only what an
    unquoted item may, else quoted (`quoted_path`'s quotes)."""
    if re.fullmatch(r"[\w./:+-]+", item, re.ASCII):
        return item
    return quoted_path("", item)[1:]


# a newline, a tab, a carriage return...: what bash's $'...' or a pasted line break puts in an
# argument; no key or value of the commands holds one, and no fix holding one pastes as one line
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}


def control_line(override: str, fix: Callable[[str], str] = lambda o: o) -> str | None:
    """The line for an override holding a control character (`$'model.name=a\\nb'`): which,
    and the override without them (as `fix` makes it one of hydra's grammar), quoted for the
    shell (a fix holding the newline, shown `\\n`, pasted as the two characters \\ and n);
    None where it holds none."""
    found = CONTROL.search(override)
    if found is None:
        return None
    char = found.group()
    name = CONTROL_NAMES.get(char, f"a control character ({char!r})")
    shown = CONTROL.sub(lambda m: repr(m.group())[1:-1], override)
    return (
        f"{shown}: holds {name}, which no option takes (bash's $'...' or a line break "
        f"pasted into the command); pass it on one line: "
        f"{shell_arg(fix(CONTROL.sub('', override)))}"
    )
