"""Every command is a hydra app: `key=value` overrides checked against a schema, `--help` from
the module's docstring, a mistyped key refused in one line naming the nearest valid one.

A command declares a dataclass of its options and conf/command/<name>.yaml, and ends with
`command(name, Options, run, __doc__)` (docs/commands.md; experiments/collect.py is the short
example). experiments.run keeps its own config (conf/config.yaml) and calls `hydra_main` for
the same argument handling; run takes `hardware=FILE.yaml` (`group_files`)."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, Field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

import experiments.common.schema  # noqa: F401  registers the schemas
from core.errors import MoepipeError, interrupt_behind
from experiments.common import hydra_errors, sweep_points
from experiments.common.argv_checks import refuse_group_as_config, refuse_hydras_own
from experiments.common.bool_values import strict_bools
from experiments.common.callbacks import name_config_write_errors
from experiments.common.cli import (
    before_line,
    error_line,
    key_given_twice,
    on_interrupt,
    print_or_exit,
    user_conf_dirs,
)
from experiments.common.command_options import taken_by
from experiments.common.conf_files import check_conf_dirs, check_planner_files, group_files
from experiments.common.flags import VALUE_FLAGS, check_flags
from experiments.common.held_warnings import settle, warnings_held
from experiments.common.hydra_errors import CONF_DIR, nearest, one_line, with_key
from experiments.common.hydra_hooks import (
    groups_on_demand,
    mode_unset,
    package_checked,
    validate_each_value_once,
)
from experiments.common.launch_line import printed_once, say_error
from experiments.common.overrides import (
    check_bool,
    check_hydra_overrides,
    check_scalar_parent,
    check_sweep,
    field_type,
    schema_miss,
)
from experiments.common.path_values import comma_in_item
from experiments.common.plugin_keys import check_plugin_keys
from experiments.common.run_dir import remove_empty, remove_unused, run_dirs_made, topmost_missing
from experiments.common.run_dir_args import quoted_run_dirs
from experiments.common.typed_values import set_typed

# The commands' own configs: a folder apart from conf/'s groups, so that a command's option named
# like a group (validate's hardware=, a name or a file) is a plain option
COMMAND_DIR = CONF_DIR / "command"
# Hydra settings of a command that writes no run dir of hydra's own (all but experiments.run):
# no .hydra folder, no log file, logging left as the command sets it.
PLAIN = [
    "hydra.run.dir=.",
    "hydra.output_subdir=null",
    "hydra/job_logging=none",
    "hydra/hydra_logging=none",
    "hydra/help=command",
]
HELP = """\
${hydra.help.header}

== Options (key=value), with their defaults ==
$CONFIG
${hydra.help.footer}
"""
FOOTER = """\
Options are key=value (hydra's override syntax: a list is [a,b], a string with spaces is
quoted); a key the schema lacks, or a value of the wrong type, is refused in one line.
--cfg job prints the composed config without running."""
_HELP: dict[str, str] = {}  # the running command's --help header
USER_FILES: dict[str, str] = {}  # the running command's group=FILE.yaml: copy's path -> FILE


def _help_header() -> str:
    return _HELP.get("doc", "").strip().replace("$", "$$")  # string.Template escapes


OmegaConf.register_new_resolver("command_help", _help_header, replace=True)
# --help of every command: its module docstring (what it does, what it writes), its options
ConfigStore.instance().store(
    group="hydra/help",
    name="command",
    node={
        "app_name": "${hydra.job.name}",
        "header": "${command_help:}",
        "footer": FOOTER,
        "template": HELP,
    },
)
# experiments.run's groups a user picks (conf/ holds internal ones too: command, planner_params,
# replication_row)
RUN_GROUPS = ("model", "hardware", "workload", "planner", "executor", "experiment")


def _run_groups() -> str:
    """--help of experiments.run: each group a user picks, with its choices."""
    return "\n".join(
        f"{g}: {', '.join(sorted(p.stem for p in (CONF_DIR / g).glob('*.yaml')))}"
        for g in RUN_GROUPS
    )


def _run_keys() -> str:
    """--help of experiments.run: its own keys (not a group's), with their defaults. Read from
    the schema's fields, not its config: hydra's composition of every run evaluates this (as it
    merges the help's template), and the schema as a config took 0.013 s of CPU to make."""
    import yaml

    from experiments.common.schema import RunSchema

    own = {f.name: field_default(f) for f in fields(RunSchema) if f.name not in RUN_GROUPS}
    return yaml.safe_dump(own, default_flow_style=None, sort_keys=False).strip()


OmegaConf.register_new_resolver("run_groups", _run_groups, replace=True)
OmegaConf.register_new_resolver("run_keys", _run_keys, replace=True)
# experiments.run's --help: the composed config is 100 lines (every group's keys), so it lists the
# groups' choices and its own keys; --cfg job prints the rest
ConfigStore.instance().store(
    group="hydra/help",
    name="run",
    node={
        "app_name": "${hydra.job.name}",
        "header": "${command_help:}",
        "footer": FOOTER
        + "\nhardware=NAME (conf/hardware/NAME.yaml) or hardware=FILE.yaml; model= and workload="
        " take a FILE.yaml too.",
        "template": (
            "${hydra.help.header}\n\n"
            "== Config groups (group=NAME; a group's keys as group.key=VALUE) ==\n"
            "${run_groups:}\n\n== Its own keys, with their defaults ==\n${run_keys:}\n\n"
            "${hydra.help.footer}\n"
        ),
    },
)


def command(
    name: str,
    schema: type,
    run: Callable[[Any], int | None],
    doc: str | None,
) -> Callable[[Sequence[str] | None], int]:
    """`main(argv) -> exit status` of the command `name`: conf/command/<name>.yaml composed with
    `argv`'s overrides, checked against `schema` (a dataclass, stored as `<name>_schema`), and
    handed to `run` as a `schema` instance."""
    ConfigStore.instance().store(name=f"{name}_schema", node=schema)

    def task(cfg: DictConfig) -> int:
        opts = OmegaConf.to_object(cfg)
        check_not_empty(opts)
        # folders an option names that are not there yet: its output checks make them first
        paths = [Path(v) for v in kv(opts).values() if isinstance(v, str) and v.strip()]
        made = [(p, topmost_missing(p)) for p in paths]
        code = 1
        try:
            code = int(run(opts) or 0)
            return code
        finally:
            if code:  # failed or stopped: no empty folder of its own left that looks like output
                for path, top in made:
                    remove_empty(path, top)

    lists = list_options(schema)

    def main(argv: Sequence[str] | None = None) -> int:
        argv = list(sys.argv[1:] if argv is None else argv)
        twice = key_given_twice(argv)
        if twice:
            print(f"error: {twice}", file=sys.stderr)
            return 2
        argv = [as_list(a, lists) for a in argv]
        running(schema)
        multirun = [a for a in argv if a in ("-m", "--multirun")]
        if multirun:  # hydra would run it once per point, each writing the same output
            print(
                f"error: {multirun[0]}: {name} runs once, not as a sweep (a second point would "
                "write over the first's output); run it once per value, or sweep experiments.run",
                file=sys.stderr,
            )
            return 2
        # what Ctrl-C's line says, unless the command resumes (reproduce_klotski says so)
        on_interrupt("it did not finish; run the same command again for its output")
        hydra_args = [*PLAIN, f"hydra.job.name={name}"]
        return hydra_main(task, name, argv, doc, hydra_args, conf_dir=COMMAND_DIR)

    return main


def check_not_empty(opts: Any, prefix: str = "") -> None:
    """An option given as '' (or blanks) where '' is not its default, or a list option with a
    blank item or one given twice (`_check_items`): refused, not read as the current folder or
    as unset (`out=` took the default folder, `dir=` read the repository as a sweep, bench.real
    `hardware=` wrote a checkpoint, then calibrated a profile named ''). `device` is the
    exception: '' is every command's "cuda if available" (the benchmarks' default)."""
    for f in fields(opts):
        value, key = getattr(opts, f.name), prefix + f.name
        if is_dataclass(value):
            check_not_empty(value, f"{key}.")
            continue
        default = field_default(f)
        if isinstance(value, list):
            _check_items(key, value)
        if not _blank(value) or f.name == "device" or default == "":
            continue
        fix = f"pass {key}=<a value>"
        if default not in (MISSING, "???"):  # a required option has no default to fall back on
            fix = (
                f"drop {key}= for its default{'' if default is None else f' ({default})'}, or {fix}"
            )
        raise MoepipeError(f"{key}={value!r}: an empty value; {fix}")


def field_default(f: Field[Any]) -> Any:
    """A dataclass field's default (a new one from its factory); MISSING where it has none."""
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _check_items(key: str, items: list[Any]) -> None:
    """A list option's items: a blank one, a list or a mapping, or one given twice (its work
    done twice, its row or column doubled: bench.lanes `rows=[8,8]`, report `columns=[a,a]`),
    refused."""
    if any(_blank(v) for v in items):
        raise MoepipeError(f"{key}={items}: an empty item; drop it, or name a value there")
    nested = [v for v in items if isinstance(v, list | dict)]  # `runs=[[a]]`: read as a name
    if nested:
        raise MoepipeError(f"{key}={items}: {nested[0]} is not a value; pass {key}=[a,b]")
    given = [str(v) for v in items]
    comma = comma_in_item(key, given)  # `runs=[/x/a,b]`: one folder's name, split
    if comma is not None:
        raise comma
    twice = sorted({v for v in given if given.count(v) > 1})
    if twice:
        raise MoepipeError(
            f"{key}=[{','.join(given)}]: {', '.join(twice)} given twice; name each once"
        )


def _blank(value: Any) -> bool:
    """`value` is a string of nothing but blanks (Path() of it is the current folder)."""
    return isinstance(value, str) and not value.strip()


def list_options(schema: type) -> set[str]:
    """The names of `schema`'s list options (an optional list too)."""
    import typing

    return {f.name for f in fields(schema) if typing.get_origin(field_type(schema, f.name)) is list}


def as_list(arg: str, lists: set[str]) -> str:
    """`planners=a,b` or `planners=a` for a list option, as hydra's `planners=[a,b]`: the comma
    form the commands took before, and one value without brackets."""
    key, sep, value = arg.partition("=")
    if sep and key in lists and not value.startswith("["):
        return f"{key}=[{value}]"
    return arg


def kv(opts: Any, prefix: str = "") -> dict[str, Any]:
    """A schema instance as the flat dict a command's code reads: nested options as dotted keys
    (`hardware.name`), lists joined by commas (`planners=[a,b]` -> "a,b")."""
    out: dict[str, Any] = {}
    for f in fields(opts):
        value = getattr(opts, f.name)
        if is_dataclass(value):
            out.update(kv(value, f"{prefix}{f.name}."))
        elif isinstance(value, list | tuple):
            out[f"{prefix}{f.name}"] = ",".join(map(str, value))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def timed_command(
    name: str, schema: type, report: Callable[[dict[str, Any]], list[str]], doc: str | None
) -> Callable[[Sequence[str] | None], int]:
    """`command` for a benchmark: `report(kv(opts))`'s lines and the wall time printed, bad input
    one line on stderr and status 2."""

    def run(opts: Any) -> int:
        t0 = time.time()
        print_or_exit(lambda: [*report(kv(opts)), f"({time.time() - t0:.1f} s)"])
        return 0

    return command(name, schema, run, doc)


def check_keys(schema: type, d: Any, where: str) -> Any:
    """A YAML mapping read outside hydra (validate's hardware=FILE.yaml) checked against
    `schema`: a MoepipeError of one line naming `where` and the key when the schema refuses
    it; else `d` with each quoted value the schema reads as a number or bool (`sms: "8"`) read
    so, as a run's config (omegaconf) reads the same file."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        typed = OmegaConf.merge(OmegaConf.structured(schema), d)
    except OmegaConfBaseException as e:
        raise MoepipeError(f"{where}: {one_line(e)}") from None
    return _as_typed(d, OmegaConf.to_container(typed, resolve=False))


def _as_typed(d: Any, typed: Any) -> Any:
    """`d`'s values, each string its schema field (in `typed`) holds as another type taken so."""
    if isinstance(d, dict) and isinstance(typed, dict):
        return {k: _as_typed(v, typed[k]) if k in typed else v for k, v in d.items()}
    return typed if isinstance(d, str) and isinstance(typed, int | float) else d


def remove_if_no_run(out_dir: Path, own: Sequence[str] = ()) -> None:
    """A run rejected at validation leaves no folder that looks like a run: hydra's run dir goes
    when it holds nothing but what hydra put there (.hydra, the log) and the command's `own`
    files (a rerun into a finished run's folder keeps it)."""
    hydras = {".hydra", *own}
    if out_dir.is_dir() and all(p.name in hydras or p.suffix == ".log" for p in out_dir.iterdir()):
        shutil.rmtree(out_dir, ignore_errors=True)


def running(schema: type, check: Callable[[DictConfig], None] | None = None) -> None:
    """The running command's schema (its fields lead an error's list), its sweep points' check."""
    hydra_errors.ROOT_SCHEMA[:] = [schema]
    sweep_points.POINT_CHECK[:] = [] if check is None else [check]


def hydra_main(
    task: Callable[[DictConfig], Any],
    config_name: str,
    argv: Sequence[str] | None = None,
    doc: str | None = None,
    hydra_args: Sequence[str] = (),
    file_groups: Sequence[str] = (),
    conf_dir: Path = CONF_DIR,
) -> int:
    """Run `task` as a hydra app on `argv` (default sys.argv[1:]) and return its exit status.
    `hydra_args` come before the user's (who may override them). A composition error (unknown
    key, wrong type, missing config) is one `error: ` line and status 2; so is a MoepipeError
    from the task. A run dir hydra made for a run that failed goes where it holds nothing of
    the run's (`run_dir.remove_unused`)."""
    status = 2
    with run_dirs_made() as made:
        try:
            status = _hydra_main(task, config_name, argv, doc, hydra_args, file_groups, conf_dir)
        finally:
            if status != 0:
                remove_unused(made)
    return status


def _hydra_main(
    task: Callable[[DictConfig], Any],
    config_name: str,
    argv: Sequence[str] | None,
    doc: str | None,
    hydra_args: Sequence[str],
    file_groups: Sequence[str],
    conf_dir: Path,
) -> int:
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    _HELP["doc"] = doc or ""
    name_config_write_errors()
    strict_bools()  # `sync: 2` in a YAML file: true, unsaid
    result: list[Any] = []
    tmp = tempfile.mkdtemp(prefix="moepipe-conf-")
    files: dict[str, str] = {}
    try:
        argv, added = group_files(argv, file_groups, Path(tmp), files)
        argv = with_search_path(argv, [Path(tmp)] if added else [])
        USER_FILES.clear()  # the copies hydra reads, by path: a task's line names the user's
        USER_FILES.update({str(Path(tmp) / f"{k}.yaml"): v for k, v in files.items()})
        flags, overrides = _checked_args(argv, conf_dir, config_name, file_groups)

        def job(cfg: DictConfig) -> None:
            # hydra would print a line of its own before an exception the job raises: it is
            # kept and raised once hydra is done
            from hydra.core.hydra_config import HydraConfig
            from hydra.types import RunMode

            try:
                with warnings_held():  # each run's, a sweep point's too (held_warnings)
                    result.append(task(cfg))
            except Exception as e:
                keyed = with_key(e, cfg)
                if HydraConfig.get().mode == RunMode.MULTIRUN:
                    # a sweep point's: hydra reports it with the point's overrides
                    raise keyed from (None if keyed is not e else e.__cause__)
                raised.append(keyed)

        raised: list[Exception] = []
        app = hydra.main(version_base="1.3", config_path=str(conf_dir), config_name=config_name)(
            job
        )
        argv0 = sys.argv[0] if sys.argv else config_name
        if sweep := {"-m", "--multirun"} & set(flags):  # (a single run: no pool's imports, 5 ms)
            from experiments.common.pool import sweep_pool_closed
        with (
            _as_hydras_argv([argv0, *flags, *hydra_args, *overrides]),
            validate_each_value_once() if sweep else contextlib.nullcontext(),
            sweep_pool_closed() if sweep else contextlib.nullcontext(),
            mode_unset([*flags, *overrides], (conf_dir, Path(tmp))),
            package_checked(),
            groups_on_demand(),
            printed_once(flags),
        ):
            app()
        if raised:
            raise raised[0]
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    except Exception as e:
        if (stop := interrupt_behind(e)) is not None:  # said as the stop it was
            raise stop from None
        ours = isinstance(e, MoepipeError)
        line = str(e) if ours else one_line(e, files) or (error_line(e) if files else None)
        if line is None:
            raise
        before_line()
        settle(e)  # the warnings held: a refusal's dropped, else said before its line
        say_error(f"error: {_users_files(line, files, Path(tmp))}")
        return 2
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return int(result[0] or 0) if result else 0


def _users_files(line: str, files: dict[str, str], tmp: Path) -> str:
    """`line` naming the user's file (`group_files`), not the copy of it hydra read."""
    for name, user_file in files.items():
        line = line.replace(str(tmp / f"{name}.yaml"), user_file)
    return line


def _checked_args(
    argv: list[str], conf_dir: Path, config_name: str, file_groups: Sequence[str]
) -> tuple[list[str], list[str]]:
    """`argv`'s hydra flags and its overrides, each checked before hydra sees them (a flag
    hydra would misread, an unknown key, a number for a boolean, a sweep past its bounds)."""
    flags, overrides = split_flags(argv)
    flags = check_flags(flags)
    overrides = [quoted_run_dirs(o) for o in overrides]  # a sweep's run dirs, as typed
    if "--hydra-help" in flags:  # hydra's help composes hydra's own config alone
        overrides = [o for o in overrides if o.lstrip("+~").startswith("hydra")]
    check_hydra_overrides(overrides, conf_dir, file_groups)
    refuse_hydras_own(overrides)
    config_dirs = [d.absolute() for d in user_conf_dirs(flags)]  # --config-dir's
    user_dirs = [*config_dirs, *(d.absolute() for d in user_conf_dirs(overrides))]
    hydra_errors.USER_DIRS[:] = user_dirs  # where a line about a file of theirs reads it
    set_typed(overrides)  # a line shows a value as typed, not omegaconf's
    check_conf_dirs(user_dirs, overrides, conf_dir)
    check_planner_files([conf_dir, *user_dirs])
    refuse_group_as_config(flags, [conf_dir, *config_dirs])
    check_plugin_keys(conf_dir, config_name, with_search_path(overrides, config_dirs))
    overrides = [plus_plus(o, conf_dir) for o in overrides]
    for o in overrides:
        check_bool(o)
        check_scalar_parent(o)
    if {"-m", "--multirun"} & set(flags) and not {"--help", "-h"} & set(flags):  # help: one run
        check_sweep(conf_dir, config_name, with_search_path(overrides, config_dirs))
    return flags, overrides


@contextlib.contextmanager
def _as_hydras_argv(args: list[str]) -> Iterator[None]:
    """sys.argv as `hydra.main` reads it, and HYDRA_FULL_ERROR set (errors reach `hydra_main`,
    which makes them one line); both put back after."""
    saved_argv, saved_env = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = args
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_env


def plus_plus(override: str, conf_dir: Path = CONF_DIR) -> str:
    """`+a.b=v` (and `++a.b=v`) checked against the running command's schema: a key it lacks is
    refused in one line (hydra's `+` would add it, unread); else `++a.b=v`, set whether or not
    a YAML lists it (README's `+model.hf_config=DIR` was written before the schemas listed every
    key). Under a free mapping (planner params, replication's cases) the command checks what is
    added. `+group=name` (a default added) is hydra's."""
    key = override.partition("=")[0].lstrip("+")
    if override.startswith("+") and key.startswith("hydra."):  # hydra's own schema
        from hydra.conf import HydraConf

        miss = schema_miss(HydraConf, key.split(".")[1:])
        if miss is not None:
            where, valid = miss
            name = where.rsplit(".", 1)[-1]
            raise MoepipeError(f"hydra.{where}: unknown key; {nearest(name, valid)}")
    group = (conf_dir / key).is_dir() or key.startswith("hydra")
    if not override.startswith("+") or group:
        return override
    parts = key.split(".")
    for root in hydra_errors.ROOT_SCHEMA[:1]:
        miss = schema_miss(root, parts)
        if miss is not None:
            where, valid = miss
            line = f"{where}: unknown key; {nearest(where.rsplit('.', 1)[-1], valid)}"
            raise MoepipeError(line + (taken_by(where) if "." not in where else ""))
    return override if override.startswith("++") else f"+{override}"


def split_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """hydra's flags (with their values) and the overrides, apart: hydra's parser takes the
    overrides in one run, so ours go after the flags and before the user's."""
    flags: list[str] = []
    overrides: list[str] = []
    take_value = False
    for arg in argv:
        if arg.startswith("-") or (take_value and "=" not in arg):
            flags.append(arg)
        else:
            overrides.append(arg)
        take_value = arg in VALUE_FLAGS
    return flags, overrides


def with_search_path(argv: Sequence[str], dirs: Sequence[Path]) -> list[str]:
    """`argv` with `dirs` first on hydra's search path (the `hydra.searchpath=[...]` override,
    added where there is none)."""
    out, entries = list(argv), ",".join(f"file://{d}" for d in dirs)
    if not dirs:
        return out
    for i, arg in enumerate(out):
        if arg.startswith("hydra.searchpath="):
            paths = arg.partition("=")[2].strip().strip("[]")
            out[i] = f"hydra.searchpath=[{entries}{',' + paths if paths else ''}]"
            return out
    return [*out, f"hydra.searchpath=[{entries}]"]
