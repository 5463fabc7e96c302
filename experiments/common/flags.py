"""hydra's own command-line flags checked before hydra reads them (`check_flags`): an unknown
or mistyped flag, a value not among a flag's choices, a flag missing its value or given one it
takes none of, two modes at once; each one line naming the flag, not argparse's usage.

Usage:
    flags = check_flags(flags)  # --info's value filled in, --config-dir made absolute
"""

from __future__ import annotations

from pathlib import Path

from core.errors import MoepipeError, did_you_mean
from core.files import no_folder_there
from experiments.common.argv_checks import refuse_idle_flags
from experiments.common.path_values import CONTROL, CONTROL_NAMES, shell_arg

# hydra's flags that take a value (`--cfg job`): the value stays with its flag
VALUE_FLAGS = {
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--experimental-rerun",
    "--info",
    "-i",
}
# hydra's own command-line flags (hydra/_internal/utils.py get_args_parser, hydra 1.3)
_FLAGS = VALUE_FLAGS | {
    "--help",
    "-h",
    "--hydra-help",
    "--version",
    "--resolve",
    "--run",
    "-r",
    "--multirun",
    "-m",
    "--shell-completion",
    "-sc",
}


# the values hydra's argparse accepts after a flag (hydra/_internal/utils.py, hydra 1.3)
_CHOICES = {
    "--cfg": ("job", "hydra", "all"),
    "--info": ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"),
}
_SHORT = {"-c": "--cfg", "-i": "--info", "-p": "--package", "-m": "--multirun", "-r": "--run"}
# what hydra runs: one of these at a time (it raises a ValueError naming its own flags)
_MODES = ("--run", "--multirun", "--cfg", "--info")
# hydra flags these commands do not serve, with what to do instead
_REFUSED = {
    "--shell-completion": "shell completion is not supported for `python -m` commands; "
    "see --help for the options",
    "-sc": "shell completion is not supported for `python -m` commands; see --help for the options",
    "--experimental-rerun": "rerunning a pickled config is not supported; run the command "
    "again with the overrides in the run dir's .hydra/overrides.yaml",
}
ALL_FLAGS = "flags: --help, -m, --cfg job|hydra|all [--package KEY], --info [WHAT]"


def check_flags(flags: list[str]) -> list[str]:
    """`flags` checked as hydra's argparse would (an unknown flag, a value not among a flag's
    choices, a flag missing its value, two modes at once), each one line naming the flag, not
    argparse's 8 lines of usage; returned with `--info`'s value filled in (left out, argparse
    would take the override after it for its value)."""
    refuse_control(flags)
    out: list[str] = []
    modes: list[str] = []
    i = 0
    while i < len(flags):
        flag, eq, inline = flags[i].partition("=")
        name = _SHORT.get(flag, flag)
        if eq and name in _CHOICES:  # `--cfg=job`: as `--cfg job`
            flags = [*flags[:i], flag, inline, *flags[i + 1 :]]
        flag = flags[i]
        if name not in _FLAGS:
            raise MoepipeError(
                f"{flag}: unknown flag; {_nearest_flag(flag)}options are key=value "
                f"(see --help), {ALL_FLAGS}"
            )
        if name in _REFUSED:
            raise MoepipeError(f"{flag}: {_REFUSED[name]}")
        if eq and name not in VALUE_FLAGS:  # `--help=1`: argparse's 8 lines of usage
            bare = flag.partition("=")[0]
            raise MoepipeError(f"{flag}: {bare} takes no value; pass {bare} alone, {ALL_FLAGS}")
        if name in _MODES:
            modes.append(flag.partition("=")[0])
        if flag in VALUE_FLAGS:
            has_value = i + 1 < len(flags) and not flags[i + 1].startswith("-")
            if not has_value and name == "--info":
                out += [flag, "all"]  # hydra's own default for a bare --info
                i += 1
                continue
            if not has_value:
                raise MoepipeError(f"{flag}: needs a value; give it one ({ALL_FLAGS})")
            value = _config_folder(name, flags[i + 1])
            choices = _CHOICES.get(name, ())
            if choices and value not in choices:
                raise MoepipeError(
                    f"{flag} {value}: not a choice; pass one of {', '.join(choices)}"
                )
            out += [flag, value]
            i += 2
            continue
        if eq and _LONG.get(name, name) in _FOLDERS:  # `--config-dir=DIR`
            flag = f"{name}={_config_folder(name, inline)}"
        out.append(flag)
        i += 1
    if len(set(modes)) > 1:
        raise MoepipeError(
            f"{' and '.join(dict.fromkeys(modes))}: only one of -m, --cfg and --info at a time; "
            "--cfg and --info print the config without running"
        )
    refuse_idle_flags(out, {**_SHORT, "-h": "--help"})
    return out


def refuse_control(flags: list[str]) -> None:
    """A flag or a flag's value holding a control character (`--config-dir $'a\\nb'`, a line
    break pasted into `-cn`): one line naming the flag, with the flag and its value without it,
    each quoted for the shell, as overrides' (`path_values.control_line`); hydra read such a
    folder or config name as given, and failed or wrote to a folder of that name."""
    for i, arg in enumerate(flags):
        found = CONTROL.search(arg)
        if found is None:
            continue
        flag = flags[i - 1] if i and flags[i - 1] in VALUE_FLAGS else ""
        char = found.group()
        name = CONTROL_NAMES.get(char, f"a control character ({char!r})")
        shown = CONTROL.sub(lambda m: repr(m.group())[1:-1], arg)
        fix = " ".join(shell_arg(a) for a in (flag, CONTROL.sub("", arg)) if a)
        raise MoepipeError(
            f"{flag + ' ' if flag else ''}{shown}: holds {name}, which no flag takes (bash's "
            f"$'...' or a line break pasted into the command); pass it on one line: {fix}"
        )


def _nearest_flag(flag: str) -> str:
    """`did you mean '--help'? ` for a mistyped long flag (`--hlep`), `did you mean 'out=x'? `
    for an option written as a flag (`--out=x`), else empty."""
    names = sorted(f[2:] for f in _FLAGS if f.startswith("--"))
    near = did_you_mean(flag.partition("=")[0].lstrip("-"), names).replace("'", "'--", 1)
    option = flag.lstrip("-")
    return near or (f"did you mean {option!r}? " if "=" in option[1:] else "")


# the flags that name a folder of configs, long and short
_FOLDERS = ("--config-path", "--config-dir")
_LONG = {"-cp": "--config-path", "-cd": "--config-dir"}


def _config_folder(flag: str, value: str) -> str:
    """`value` of a flag that names a folder of configs, as an absolute path: hydra reads a
    relative --config-path against the command's module (experiments/common/), not where the
    user is, and says only that a config module was not found. Other flags' values as given."""
    if _LONG.get(flag, flag) not in _FOLDERS:
        return value
    folder = Path(value).expanduser()
    if not folder.is_dir():
        there = no_folder_there(folder)
        raise MoepipeError(f"{flag} {value}: {there}; pass a folder of config files")
    return str(folder.absolute())
