"""A command line checked before hydra reads it (its flags: flags.py): overrides
hydra would fail on or take in silence (`check_hydra_overrides`, `check_n_jobs`), and a sweep's
size and run dirs (`check_sweep`): each problem is one line naming the flag or the override."""

from __future__ import annotations

import os
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.errors import MoepipeError, integer_words
from experiments.common import hydra_errors
from experiments.common.argv_checks import refuse_values_twice
from experiments.common.hydra_errors import CONF_DIR
from experiments.common.launcher_checks import check_joblib
from experiments.common.path_values import (
    comma_in_path,
    control_line,
    is_path_key,
    quoted_path,
    shell_arg,
)
from experiments.common.sweep_points import (
    check_shared,
    check_subdirs,
    check_sweep_dir,
    check_sweep_values,
    composed,
    composing,
    first_point,
    is_glob,
    names_a_folder,
    names_fit,
    refuse_nested_sweeps,
    refuse_sweeps_of_one_result,
)


def check_sweep(conf_dir: Path, config_name: str, overrides: Sequence[str]) -> None:
    """Compose a sweep's config once per value of each swept override (`model=a,b`), the other
    overrides at their first value: a bad choice or key is one line before the sweep starts,
    not a worker's error under its progress bar; points that would share a run dir are refused
    (`check_subdirs`), and so is a bad value every point would fail on (`check_shared`). The
    sweep a config declares (an experiment's `hydra.sweeper.params`) counts towards its size,
    and a config's `hydra.launcher.n_jobs` is checked as the command line's is."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"), composing():
        # with the config loader, which lists a group's names for `planner=glob(klotski*)`
        parser = OverridesParser.create(config_loader=GlobalHydra.instance().config_loader())
        parsed = parser.parse_overrides(list(overrides))
        given = [o for o in parsed if o.is_sweep_override()]
        for o in given:  # a folder's comma, read as a sweep of its pieces
            key, _, value = o.input_line.partition("=")
            if (path := comma_in_path(key, value, sweeping=True)) is not None:
                raise path
        check_sweep_values(given)
        cfg = composed(config_name, first_point(parsed, given))
        check_joblib(cfg)
        names_fit(cfg)
        declared = _declared(cfg, parsed)
        everything = _with_declared(parser.parse_overrides(declared), parsed)
        swept = [o for o in everything if o.is_sweep_override()]
        check_sweep_dir(cfg, swept)
        if not swept:
            check_shared(config_name, everything, swept)  # a sweep of one point
            return
        check_sweep_values(swept)
        check_sweep_size(swept)  # before any check that lists each point's values
        refuse_values_twice(swept, cfg)  # a sweep's only: one run's `a,a` says to add -m
        refuse_sweeps_of_one_result(swept)  # the command line's, or a config's declared
        base = first_point(parsed, given)
        first = dict(zip([o.input_line for o in parsed], base, strict=True))
        for o in filter(names_a_folder, given):
            for value in o.sweep_string_iterator():
                point = [
                    f"{o.get_key_element()}={value}" if b == first[o.input_line] else b
                    for b in base
                ]
                names_fit(composed(config_name, point))
        check_shared(config_name, everything, swept)  # a bad value's line before its folder's
        check_subdirs(config_name, everything, swept)


def _declared(cfg: Any, parsed: Sequence[Any]) -> list[str]:
    """The sweep `cfg` declares (`hydra.sweeper.params`, as `key=values` overrides), its
    `hydra.launcher.n_jobs` checked where the command line does not set it."""
    keys = {o.get_key_element() for o in parsed}
    n_jobs = OmegaConf.select(cfg, "hydra.launcher.n_jobs", default=None)
    if n_jobs is not None and "hydra.launcher.n_jobs" not in keys:
        check_n_jobs(f"hydra.launcher.n_jobs={n_jobs} (set in a config file)", n_jobs)
    params = OmegaConf.select(cfg, "hydra.sweeper.params", default=None) or {}
    return [f"{k}={v}" for k, v in params.items()]


def _with_declared(declared: Sequence[Any], parsed: Sequence[Any]) -> list[Any]:
    """The overrides a sweep's points get, as hydra's basic sweeper makes them: the config's
    declared sweep first, a command-line override of the same key in its place."""
    out = {o.get_key_element(): o for o in declared}
    for o in parsed:
        out[o.get_key_element()] = o
    return list(out.values())


# The most points a sweep takes: each is a run dir of its own and a row of the sweep's table;
# a million (`range(1,1000000)`) took hours to enumerate before the first ran.
MAX_SWEEP_POINTS = 100_000


def check_sweep_size(swept: Sequence[Any]) -> None:
    """Refuse a sweep of more than MAX_SWEEP_POINTS points, counted without listing them (a
    range's length from its bounds), naming the override that makes it so large."""
    import math

    from hydra.core.override_parser.types import RangeSweep

    total = 1
    for o in swept:
        v = o.value()
        if isinstance(v, RangeSweep) and v.step:
            n = max(0, math.ceil((v.stop - v.start) / v.step))
        else:
            n = len(list(o.sweep_string_iterator()))
        total *= max(n, 1)
        if total > MAX_SWEEP_POINTS:
            raise MoepipeError(
                f"{o.input_line}: the sweep has {total:,} or more points; at most "
                f"{MAX_SWEEP_POINTS:,} (each is a run dir of its own): sweep fewer values"
            )


def check_hydra_overrides(
    overrides: Sequence[str], conf_dir: Path, file_groups: Sequence[str] = ()
) -> None:
    """Overrides hydra would fail on with an internal error, or take and misbehave: an empty key
    (`=5`), a config group set to null or a number (`hardware=null`), a launcher's n_jobs of
    0 or beyond what this machine's cores can run."""

    for o in overrides:
        control = control_line(o, _grammars)
        if control is not None:
            raise MoepipeError(control)
        key, sep, value = o.partition("=")
        if sep and not key.strip("+~"):
            raise MoepipeError(f"{o}: an override needs a key; pass key=value (see --help)")
    for o in map(_parsed, overrides):
        key = o.get_key_element().lstrip("+~")
        if o.is_delete():
            refuse_held_group(o.input_line, key, [])
            refuse_option_delete(o.input_line, key)
            continue
        refuse_nested_sweeps([o])
        group = (conf_dir / key).is_dir() or (CONF_DIR / key).is_dir() or key in file_groups
        if o.is_sweep_override():
            check_sweep_values([o])
        # a glob's values are a group's names, which take a config loader to list
        values = list(o.sweep_iterator()) if o.is_sweep_override() and not is_glob(o) else []
        values = values if o.is_sweep_override() else [o.value()]
        check_home(o.input_line, key, values)
        refuse_held_group(o.input_line, key, values)
        if group and not all(isinstance(v, str) for v in values):
            names = sorted({p.stem for d in (conf_dir, CONF_DIR) for p in (d / key).glob("*.yaml")})
            raise MoepipeError(
                f"{o.input_line}: {key} is a config group: pass one of its names "
                f"({', '.join(names)})" + (f" or {key}=FILE.yaml" if key in file_groups else "")
            )
        if key == "hydra.launcher.n_jobs":
            for v in values:
                check_n_jobs(o.input_line, v)
        if key == "hydra.searchpath":
            check_search_path(o.input_line, o.value())
        under = key.startswith("hydra.sweeper.params.")
        declared = any(x.lstrip("+").startswith("experiment=") for x in overrides)
        if key == "hydra.sweeper.params" or (under and (o.input_line[0] == "+" or not declared)):
            # the basic sweeper's params are null unless a config sets them: omegaconf fails
            # inside on a key under them, and a mapping given whole is a sweep of its own
            raise MoepipeError(
                f"{o.input_line}: sweep on the command line instead (-m KEY=a,b), or in an "
                "experiment file's hydra.sweeper.params"
            )
        if key == "hydra.sweeper.max_batch_size" and not (
            o.value() is None or (type(o.value()) is int and o.value() >= 1)
        ):
            raise MoepipeError(
                f"{o.input_line}: the points composed at a time; pass {integer_words(1)}, or "
                "null for all at once"
            )


def refuse_held_group(override: str, key: str, values: Sequence[Any]) -> None:
    """`KEY=VALUE` where KEY is also a group of hydra's config tree that no user picks (conf/
    command, ConfigStore's planner_params) or, on a command other than experiments.run, any
    group: hydra read it as that group's pick and failed inside on a number or null
    (`planner_params=5`), or named its defaults list, or a group this command takes no key
    of; `~KEY` looked for that pick to delete. The running command's schema says what KEY is:
    a key it lacks, or its mapping (`values`: empty where the override deletes it)."""
    from hydra.core.config_store import ConfigStore

    from experiments.common.command_options import taken_by
    from experiments.common.schema import RunSchema

    held = key == "command" or isinstance(ConfigStore.instance().repo.get(key), dict)
    group = held or (CONF_DIR / key).is_dir()
    if not hydra_errors.ROOT_SCHEMA or not group or key == "hydra":
        return
    root = hydra_errors.ROOT_SCHEMA[0]
    miss = schema_miss(root, [key])
    if miss is not None and (held or root is not RunSchema):
        where, valid = miss
        line = f"{where}: unknown key; {hydra_errors.nearest(where, valid)}"
        raise MoepipeError(line + taken_by(where))
    mapping = miss is None and typing.get_origin(field_type(root, key)) is dict
    if mapping and not all(isinstance(v, dict) for v in values):
        raise MoepipeError(
            f"{override}: {key} is a mapping of keys, not one value; pass +{key}.KEY=VALUE"
        )
    if mapping and not values:  # `~KEY`: hydra looked for the group's pick to delete
        raise MoepipeError(
            f"{override}: {key} is a mapping of keys, empty unless given; leave it out, or "
            f"pass +{key}.KEY=VALUE"
        )


def refuse_option_delete(override: str, key: str) -> None:
    """`~KEY` where KEY is one of the running command's own options with a default (run's
    `~trace_json`, validate's `~gen_len`): hydra deleted it and the command ran on its default
    without a word. A group's pick (`~model`) and a null option (hydra's "nothing to delete")
    are left to hydra's lines."""
    from dataclasses import MISSING

    root = hydra_errors.ROOT_SCHEMA[0] if hydra_errors.ROOT_SCHEMA else None
    option = next((f for f in fields(root) if f.name == key), None) if root else None
    if option is None or is_dataclass(field_type(root, key)):
        return
    default = option.default_factory() if option.default_factory is not MISSING else option.default
    if default is None or default is MISSING:
        return
    shown = OmegaConf.to_yaml({key: default}).strip().partition(": ")[2]
    raise MoepipeError(
        f"{override}: an option cannot be deleted (left out, it is its default, {shown}); pass "
        f"{key}=VALUE instead"
    )


def check_home(override: str, key: str, values: Sequence[Any]) -> None:
    """A path written `'~/runs'` (quoted: hydra's grammar takes no bare `~`): no shell expands
    it there, and a command made a folder named `~` in the current one, or read nothing from
    it, without a word. Refused, naming the key; strings in a list or mapping too."""

    def strings(v: Any) -> list[str]:
        if isinstance(v, str):
            return [v]
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return [s for x in items for s in strings(x)]

    for v in (s for value in values for s in strings(value)):
        if v == "~" or v.startswith(("~/", "~" + os.sep)) or re.fullmatch(r"~\w+(/.*)?", v):
            raise MoepipeError(
                f"{override}: {v!r} starts with '~', which only a shell expands, not {key}; "
                f"pass the path with $HOME or in full ({os.path.expanduser(v)})"
            )


def check_search_path(override: str, entries: Any) -> None:
    """Each entry of `hydra.searchpath=[...]` a folder (`file://DIR`) or an importable package
    (`pkg://NAME`) that exists: hydra warns over two lines of one it cannot find and runs
    without the configs the user meant it to add."""
    import importlib.util

    for entry in entries if isinstance(entries, list) else []:
        scheme, sep, where = str(entry).partition("://")
        if not sep:  # hydra reads a path without a scheme as a folder
            scheme, where = "file", str(entry)
        if scheme == "file":
            found = Path(where).is_dir()
        elif scheme == "structured":
            continue  # ConfigStore's, which hydra checks itself
        elif scheme != "pkg":  # hydra's internal error: "No config source registered for ..."
            raise MoepipeError(
                f"{override}: {entry}: hydra reads configs from file://, pkg:// and "
                "structured:// sources only; pass a folder as file:///path/to/conf"
            )
        else:
            try:
                found = importlib.util.find_spec(where.replace("/", ".")) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            what = "a folder" if scheme == "file" else "an importable package"
            raise MoepipeError(
                f"{override}: {entry} is not {what}; pass config folders that exist "
                f"(hydra.searchpath=[file:///path/to/conf])"
            )


def _ascii_quoted(value: str) -> str:
    """`value` with each item beyond ASCII quoted, as hydra's grammar needs: `é` -> `'é'`, a
    list's `[law,é]` -> `[law,'é']` (quoted whole, it would be one string), a sweep's `a,é`."""
    listed = value.startswith("[") and value.endswith("]")
    items = (value[1:-1] if listed else value).split(",")
    quoted = ",".join(i if i.isascii() else f"'{i.strip()}'" for i in items)
    return f"[{quoted}]" if listed else quoted


def _parsed(override: str) -> Any:
    """`override` parsed by hydra; one whose value holds an unquoted '=' (a sweep's run dir,
    `.../workload=tiny`), which hydra's grammar refuses with a parse error, is one line saying
    how to quote it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(override)
    except HydraException:  # its parse errors (OverrideParseException is one)
        key, _, value = override.partition("=")
        if not value.isascii() and "'" not in value and '"' not in value:
            raise MoepipeError(
                f"{override}: a value of characters beyond ASCII must be quoted: "
                f"{shell_arg(f'{key}={_ascii_quoted(value)}')}"
            ) from None
        call = re.fullmatch(r"\s*(\w+)\s*\(.*\)\s*", value, re.DOTALL)
        if call and call.group(1) in _SWEEP_FUNCTIONS:  # a keyword argument: hydra's own line
            return OverridesParser.create().parse_overrides([override])[0]
        if "=" in value and "'" not in value and '"' not in value:
            listed = value.startswith("[") and value.endswith("]")
            from experiments.common.run_dir_args import path_items

            paths = is_path_key(key) or "/" in value  # a sweep's run dirs: `a=1,b=2` one folder
            items = (path_items if paths else _items)(value[1:-1] if listed else value)
            if paths and not listed and not all("=" in i for i in items):  # one path's `a=b,c d`
                items = [value]
            quoted = ",".join(quoted_path("", i)[1:] for i in items)
            fix = f"[{quoted}]" if listed else quoted
            what = " (a sweep's run dir)" if paths else ""  # (replication's `eplb[interval=8]`)
            raise MoepipeError(
                f"{override}: a value holding '='{what} must be quoted: "
                f"{shell_arg(f'{key}={fix}')}"  # hydra's quotes, in the shell's
            ) from None
        quoted = _quoted(key, value)
        if quoted is not None:
            raise MoepipeError(quoted) from None
        return OverridesParser.create().parse_overrides([override])[0]  # hydra's own line


# hydra's grammar's functions, whose keyword arguments (`sort(1,2,reverse=true)`) hold '='
_SWEEP_FUNCTIONS = {"choice", "range", "interval", "sort", "shuffle", "tag", "glob", "extend_list"}
_SWEEP_FUNCTIONS |= {"int", "float", "str", "bool", "json_str"}
_UNQUOTABLE = "~\n\r;#&'\"%@`!^<>"  # what hydra's grammar refuses in an unquoted value
# what it refuses within an unquoted value, a path's folder name (a list, a dict and a sweep
# function take them at the value's start)
_GROUPING = "[]{}()"


def _quoted(key: str, value: str) -> str | None:
    """The line for a value hydra's grammar refuses only for a character it takes quoted (`~`,
    a newline, `;`, `#`, a bracket inside a path: `runs/a[1]`): which character, and the
    override quoted; None where quoting would not parse either (a bracket left open: hydra's
    own line says where)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    bad = next((c for c in value if c in _UNQUOTABLE), None)
    if bad is None and "/" in value and value[:1] not in "[{":  # a path's `a[1]`, `b(2)`
        bad = next((c for c in value if c in _GROUPING), None)
    if bad is None:
        return None
    mark = '"' if "'" in value else "'"
    if value.startswith("[") and value.endswith("]"):  # a list: each item quoted
        fix = f"{key}=[{','.join(f'{mark}{item}{mark}' for item in _items(value[1:-1]))}]"
    else:  # (both kinds of quote: its `'` escaped)
        fix = quoted_path(key, value)
    try:
        OverridesParser.create().parse_override(fix)
    except HydraException:
        return None
    first = value.lstrip("[").startswith("~")  # (not a folder's `a~b`, which no shell expands)
    home = " (~ is not expanded to your home folder: write the full path)" if first else ""
    shown = f"{key}={value}".replace("\n", "\\n").replace("\r", "\\r")
    fix = shell_arg(fix).replace("\n", "\\n").replace("\r", "\\r")
    return f"{shown}: a value holding {bad!r} must be quoted: {fix}{home}"


def _grammars(override: str) -> str:
    """`override` as hydra's grammar takes it: its value quoted where it holds a character
    hydra reads as its own (`#`, `;`, a quote), as `_quoted`'s fix has it."""
    key, sep, value = override.partition("=")
    if not sep or value.startswith("[") or not any(c in value for c in _UNQUOTABLE):
        return override
    return quoted_path(key, value)


def _items(text: str) -> list[str]:
    """`text` split at its commas outside brackets: `a[x=1,y=2],b` is two items (a replication
    variant's label holds brackets; stripping them all made the quoting shown a bad override)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


# a sweep's workers beyond this many per core only wait for a core (and for memory: each is a
# Python process with torch loaded)
MAX_JOBS_PER_CORE = 4


def check_n_jobs(override: str, n_jobs: Any) -> None:
    """joblib's n_jobs: N workers, or -k for all cores but k-1; 0, or more workers than the
    machine can run at once, is refused (1000 on 2 cores took minutes to start)."""
    cores = os.cpu_count() or 1
    top = MAX_JOBS_PER_CORE * cores
    if not isinstance(n_jobs, int) or isinstance(n_jobs, bool) or not -cores <= n_jobs <= top:
        raise MoepipeError(
            f"{override}: n_jobs must be an integer in [1, {top}] ({MAX_JOBS_PER_CORE} per core "
            f"of this machine's {cores}), or -1 for one worker per core; pass one of those"
        )
    if n_jobs == 0:
        raise MoepipeError(
            f"{override}: 0 workers run nothing; pass 1 to {top}, or -1 (one per core)"
        )


_BOOLS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def check_bool(override: str) -> None:
    """`key=2` where the running command's schema has a bool: omegaconf would read any number
    as true (`trace_json=2`, `quick=5`); refused in one line. Sweeps (`a=true,false`) are
    checked value by value."""
    key, sep, value = override.partition("=")
    if not sep or not hydra_errors.ROOT_SCHEMA or key.startswith(("hydra", "~")):
        return
    parts = key.lstrip("+").split(".")
    one_param = len(parts) > 2 and parts[:2] == ["planner", "params"]  # not params={...}
    typ: Any = _planner_param_type(parts[2]) if one_param else None
    if typ is None:
        typ = hydra_errors.ROOT_SCHEMA[0]
        for part in parts:
            if not is_dataclass(typ) or part not in {f.name for f in fields(typ)}:
                return
            typ = field_type(typ, part)
    if typ is not bool or "$" in value:
        return
    for v in value.split(","):
        if v.strip().strip("'\"").lower() not in _BOOLS:
            name = key.lstrip("+")
            raise MoepipeError(f"{name}={value}: not a boolean; pass {name}=true or {name}=false")


def check_scalar_parent(override: str) -> None:
    """`a.b=v` where the running command's schema makes `a` a value, not a mapping
    (bench.sim's `planner.params.n=2`, planner being a name): omegaconf's "Cannot convert
    'dict' to string" named no key."""
    key = override.partition("=")[0].lstrip("+~")
    if not hydra_errors.ROOT_SCHEMA or key.startswith("hydra"):
        return
    typ: Any = hydra_errors.ROOT_SCHEMA[0]
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        if not is_dataclass(typ) or part not in {f.name for f in fields(typ)}:
            return
        typ = field_type(typ, part)
        if typ in (str, int, float, bool):
            raise hydra_errors.not_a_mapping(key, parts[: i + 1], parts[i + 1 :], typ)


def _planner_param_type(name: str) -> Any:
    """The type of planner param `name` where every registered planner that has it agrees on
    one (planner.params is a free mapping in the schema: omegaconf would take `sync=2` as
    true); None otherwise."""
    from planners.registry import entry, param_names, planner_names

    types_ = {field_type(entry(p).params, name) for p in planner_names() if name in param_names(p)}
    return types_.pop() if len(types_) == 1 else None


def schema_miss(root: type, parts: list[str]) -> tuple[str, list[str]] | None:
    """Where the dotted key `parts` leaves `root`'s schema (the key so far, the valid names
    there); None when it is in the schema or under a free mapping (dict, Any). A mapping of
    dataclasses (`hardware.links`: name -> LinkSchema) takes any name, then that schema's keys:
    `+hardware.links.h2d.nosuch=1` was added unread."""
    import typing

    typ: Any = root
    for i, part in enumerate(parts):
        key_args = typing.get_args(typ) if typing.get_origin(typ) is dict else ()
        if len(key_args) == 2 and is_dataclass(key_args[1]):
            typ = key_args[1]  # `part` names an entry of the mapping, any name
            continue
        if not is_dataclass(typ):
            return None
        names = [f.name for f in fields(typ)]
        if part not in names:
            return ".".join(parts[: i + 1]), names
        typ = field_type(typ, part)
    return None


def field_type(cls: type, name: str) -> Any:
    """The type of dataclass `cls`'s field `name`, Optional unwrapped."""
    import typing

    t = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if typing.get_origin(t) in (typing.Union, types.UnionType) and args else t


def sweep_in_one_run(e: BaseException) -> MoepipeError | None:
    """Hydra's "Ambiguous value" (a comma in an override of one run) and its "Sweep parameters
    ... requires --multirun" (a range(), choice() or glob()) as one line: cut to the
    first of its three fixes, it offered a list and left out the sweep (-m) most meant; and
    with --help, which composes one run even under -m, the -m given was no fix at all."""
    swept = re.match(r"Sweep parameters '(.*)' requires --multirun", str(e))
    if swept is not None:  # range(), choice(), glob(): hydra's line named -m's long form alone
        return MoepipeError(
            f"{swept.group(1)}: a sweep of values, which one run cannot take: add -m to sweep "
            "them (--help, --cfg and --info show one run: pass one value)"
        )
    got = re.match(r"Ambiguous value for argument '(.*)'", str(e))
    if got is None:
        return None
    key, _, value = got.group(1).partition("=")
    if (path := comma_in_path(key, value, sweeping=False)) is not None:
        return path
    return MoepipeError(
        f"{got.group(1)}: a comma makes it a sweep of values, which one run cannot take: add "
        "-m to sweep them (--help, --cfg and --info show one run: pass one value), or pass "
        "key=[a,b] for a list or key='a,b' (quoted) for a string"
    )
