"""Checks of a command line made before hydra parses it, where hydra would fail with a
traceback or run something the user did not mean: a launcher without its plugin, a sweep
experiment without -m, a run or sweep folder that cannot be written.

Usage:
    line = key_given_twice(argv) or missing_launcher(argv)   # None: fine
    exit_on_unwritable_dir(argv, ("hydra.run.dir", "hydra.sweep.dir"))
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from core.args import output_dir
from core.errors import MoepipeError
from core.files import read_small
from experiments.common.conf_files import unquoted

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def key_given_twice(argv: Sequence[str]) -> str | None:
    """A key the command line sets more than once (`n=3 n=4`, `planner=a +planner=b`,
    `x=1 ~x`, a group or a hydra.* key alike): hydra kept the last value without a word. One
    line naming the key and both values; None where each is given once. Flags and their values
    (`-cd DIR`, `--cfg job`) are not keys; a sweep's list (`-m a=1,2`) is one value."""
    seen: dict[str, str] = {}
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue
        key, _, value = arg.partition("=")
        if key.startswith("~"):
            key, value = key[1:], "~ to delete it"
        key = key.lstrip("+").strip()
        value = value if value else "''"
        if key in seen:
            return f"{key} is given twice ({seen[key]}, then {value}): give it once"
        seen[key] = value
    return None


def missing_launcher(argv: Sequence[str]) -> str | None:
    """`hydra/launcher=slurm` without its plugin installed (hydra says only that it cannot load
    `submitit_slurm`), or on a machine without slurm (submitit's RuntimeError, inside)."""
    import importlib.util
    import shutil

    picks = (a.partition("=") for a in argv)
    slurm = any((k, unquoted(v)) == ("hydra/launcher", "slurm") for k, _, v in picks)
    if slurm and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return "hydra/launcher=slurm needs its plugin: pip install hydra-submitit-launcher"
    nothing_runs = {"--cfg", "-c", "--help", "-h", "--info", "-i", "--hydra-help"} & set(argv)
    sweep = {"-m", "--multirun"} & set(argv) and not nothing_runs
    if slurm and sweep and shutil.which("srun") is None:  # submitit failed inside on it
        return (
            "hydra/launcher=slurm: no slurm on this machine (no srun on PATH) to submit the "
            "sweep's jobs to; run it on the cluster's login node, or pass "
            "hydra/launcher=submitit_local (or leave the launcher out) to run it here"
        )
    return None


def sweep_experiment_misused(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> str | None:
    """`experiment=X` of a sweep experiment (its yaml has hydra.sweeper.params) without -m, which
    runs one default point, or swept with others (`-m experiment=a,b`), which runs one point of
    each and none of their own sweeps: one line saying how to run it. None otherwise."""
    if any(a in ("--cfg", "-c", "--help", "-h", "--info", "-i") for a in argv):
        return None  # nothing runs: the config or the help is printed
    multirun = any(a in ("-m", "--multirun") for a in argv)
    dirs = [conf_dir, *user_conf_dirs(argv)]
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        names = value.split(",") if key == "experiment" else []
        sweeps = []
        for name in names:
            if any(_declares_sweep(d / "experiment" / f"{name}.yaml") for d in dirs):
                sweeps.append(name)
        if sweeps and len(names) > 1:
            return (
                f"experiment={value}: an experiment's own sweep runs only when it is chosen "
                f"alone; run one command per experiment (-m experiment={sweeps[0]})"
            )
        if sweeps and not multirun:
            return (
                f"experiment={sweeps[0]} is a sweep: add -m (python -m experiments.run -m "
                f"experiment={sweeps[0]}); without it one default point runs"
            )
    return None


def _declares_sweep(path: Path) -> bool:
    """Whether the experiment file at `path` declares a sweep (hydra.sweeper.params)."""
    try:
        cfg = yaml.safe_load(read_small(path).decode("utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError):  # run's own load words them
        return False
    return isinstance(cfg, dict) and bool(
        ((cfg.get("hydra") or {}).get("sweeper") or {}).get("params")
    )


def user_conf_dirs(argv: Sequence[str]) -> list[Path]:
    """The config folders a command line adds to conf/: `--config-dir DIR` (`-cd`) and the
    `file://` entries of `hydra.searchpath=[...]`."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, inline = arg.partition("=")
        if flag in ("--config-dir", "-cd"):
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            out.append(Path(value))
        elif arg.lstrip("+").startswith("hydra.searchpath="):
            for entry in arg.partition("=")[2].strip().strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if entry.startswith("file://"):
                    out.append(Path(entry.removeprefix("file://")))
    return out


def _remove_empty(folder: Path, top: Path) -> None:
    """`folder` and its parents up to `top`, each removed only while empty: another run into the
    same folder may have made it too and taken its lock there since (`dir_lock`), and must
    not find it gone under it."""
    for f in (folder, *folder.parents):
        try:
            f.rmdir()
        except OSError:  # not empty (another's by now), or not there
            return
        if f == top:
            return


def writable_dir(value: str, key: str) -> None:
    """A MoepipeError naming `key` when the folder `value` cannot be made or written; a folder
    this check made is removed again (the command makes it when it runs)."""
    new = next((p for p in (Path(value), *Path(value).parents) if p.parent.exists()), Path(value))
    made = not new.exists()
    output_dir(value, key)
    if made:  # checked, not made: hydra (or joblib) makes it when the run starts
        _remove_empty(Path(value), new)


def exit_on_unwritable_dir(argv: Sequence[str], keys: Sequence[str]) -> None:
    """Exit 2 with one line when a `key=folder` argument (hydra's run or sweep dir) names a folder
    that cannot be made or written: hydra would fail on it with a traceback. Folders with
    interpolations (`${now:...}`) are left to hydra."""
    for arg in argv:
        key, sep, typed = arg.partition("=")
        value = unquoted(typed)  # `hydra.run.dir='/a b/é'`: hydra reads it without its quotes
        if sep and key in keys and "$" not in value:
            try:
                writable_dir(value, key)
            except MoepipeError as e:
                from experiments.common.launch_line import say_error

                say_error(f"error: {e}")  # under torchrun: once, not once a rank
                sys.exit(2)


def unread_beside(opts: Any, keys: Sequence[str], flag: str, why: str) -> None:
    """A MoepipeError naming the first of `keys` that `opts` (a command's options dataclass)
    holds at other than its default, where `flag` makes the command read none of them."""
    default = type(opts)()
    for key in keys:
        value = getattr(opts, key)
        if (list(value) if isinstance(value, list) else value) != getattr(default, key):
            shown = f"[{','.join(map(str, value))}]" if isinstance(value, list) else value
            shown = str(shown).lower() if isinstance(shown, bool) else shown
            raise MoepipeError(f"{key}={shown}: {flag} {why}; drop {key}= or {flag}")


def refuse_values_twice(swept: Sequence[Any], cfg: Any = None) -> None:
    """A MoepipeError for a sweep override that lists one value twice (`planner=flexgen,flexgen`,
    `choice(2,2)`), or two that the key reads as one (`workload.gen_len=2,'2'`,
    `workload.seed=1,01`: where `cfg`, a point's config, holds a number or a boolean there):
    both points would be one run dir (the run dir is keyed by the config), the second reported
    as reused, the sweep one run short of its points; or two run dirs of one config."""
    from omegaconf import OmegaConf

    for o in swept:
        key = o.get_key_element().lstrip("+~")
        held = None if cfg is None else OmegaConf.select(cfg, key, default=None)
        seen: dict[Any, str] = {}
        for value in o.sweep_string_iterator():
            typed = _as_read(value, held)
            if typed in seen:
                also = "" if seen[typed] == value else f" ({seen[typed]} and {value} are one {key})"
                raise MoepipeError(
                    f"{o.input_line}: sweeps {value} twice{also}; a sweep runs each point once, "
                    "into the run dir of its config: drop the repeat"
                )
            seen[typed] = value


def _as_read(value: str, held: Any) -> Any:
    """A swept value as a config key holding `held` reads it: a number or boolean converted
    (`'2'`, `02` and `2` are one int), any other (a name, a string) without its quotes."""
    text = value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value
    try:
        if isinstance(held, bool):
            return {"true": True, "yes": True, "on": True, "1": True}.get(
                text.lower(), False if text.lower() in ("false", "no", "off", "0") else text
            )
        if isinstance(held, int | float):
            return type(held)(text)
    except ValueError:
        pass
    return text


# keys hydra sets as a run starts, over any override: one given was replaced without a word
HYDRAS_OWN = ("hydra.runtime", "hydra.job.override_dirname")


def refuse_hydras_own(overrides: Sequence[str]) -> None:
    """A MoepipeError for an override of a key hydra computes itself (`hydra.runtime.cwd=`,
    `hydra.runtime.output_dir=`, `hydra.job.override_dirname=`): the run went on with hydra's
    value, its record showing hydra's too."""
    for o in overrides:
        key = o.partition("=")[0].lstrip("+~")
        if any(key == own or key.startswith(f"{own}.") for own in HYDRAS_OWN):
            tip = ", pass hydra.run.dir= or hydra.sweep.dir=" if key.endswith("output_dir") else ""
            raise MoepipeError(
                f"{o}: hydra sets {key} itself as the run starts, over any override; leave it "
                f"out{' (to choose where a run writes' + tip + ')' if tip else ''}"
            )


def refuse_group_as_config(flags: Sequence[str], conf_dirs: Sequence[Path]) -> None:
    """A MoepipeError for `--config-name GROUP/NAME` (`-cn`), a config group's file where a
    whole config goes: hydra composed it alone, and failed on the first key the command reads
    that it lacks ("Key 'executor' is not in struct"), naming no file."""
    for i, arg in enumerate(flags):
        flag, eq, inline = arg.partition("=")
        if flag not in ("--config-name", "-cn"):
            continue
        name = inline if eq else (flags[i + 1] if i + 1 < len(flags) else "")
        group = name.strip("/").split("/")[0]
        if "/" in name.strip("/") and any((d / group).is_dir() for d in conf_dirs):
            raise MoepipeError(
                f"--config-name {name}: a file of config group {group}, not a whole config; "
                f"pass {group}={name.strip('/').split('/', 1)[1].removesuffix('.yaml')} instead"
            )


def refuse_idle_flags(flags: Sequence[str], short: dict[str, str]) -> None:
    """--resolve and --package (-p) change what --cfg (or --help) prints; without either hydra
    ran the command (a sweep, with -m) as if --package were not there, and said --resolve in
    an internal error. `short`: each short flag's long name."""
    names = [short.get(f, f) for f in flags]
    if "--cfg" in names or "--help" in names:
        return
    idle = next((f for f in flags if short.get(f, f) in ("--resolve", "--package")), None)
    if idle is not None:
        raise MoepipeError(
            f"{idle}: changes what --cfg prints, and no --cfg is given; add --cfg job (or "
            f"hydra, all), or leave {idle} out"
        )
