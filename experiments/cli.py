"""Shared by the commands: printing a report or a user's mistake as one line, and the argument
checks the schemas (experiments/schema.py, experiments/app.py) do not cover.

Usage:
    print_or_exit(lambda: run(cfg))                               # report lines, or exit 2
    exit_on_unknown_choice(sys.argv[1:], CONF_DIR)                 # before a hydra main
    n = as_int("disk_mb", opts["disk_mb"], at_least=1)              # one line naming the key
    out = output_file(opts["out"], "out")                          # its folder made, writable
"""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from core.args import as_bool, as_float, as_int, output_dir, output_file
from core.errors import MoepipeError

__all__ = ["CONF_DIR", "as_bool", "as_float", "as_int", "exit_on_unknown_choice", "output_dir",
           "output_file", "print_or_exit", "unknown_choice", "unknown_param",
           "exit_on_unwritable_dir", "missing_config", "until_interrupted",
           "another_commands_experiment", "unknown_key", "missing_launcher",
           "unknown_config_key"]  # fmt: skip


def print_or_exit(report: Callable[[], list[str]]) -> None:
    """Prints the lines `report` returns; a MoepipeError (a mistake in the user's input) becomes
    one line on stderr and exit status 2."""
    try:
        print("\n".join(report()))
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


# What `until_interrupted` says after "interrupted: ": a command whose output folder is not the
# same on a rerun (a sweep under a timestamped folder, a single run) sets it with `on_interrupt`.
_ON_INTERRUPT = ["finished runs are kept; run the same command again to resume"]
_BEFORE_LINE: list[Callable[[], Any]] = []  # e.g. a progress bar to close first


def on_interrupt(text: str, before: Callable[[], Any] | None = None) -> None:
    """What Ctrl-C's line says in this process from now on (how to resume, or that nothing is),
    and what to do before printing it (`before`: close a progress bar, whose line it would
    otherwise continue)."""
    _ON_INTERRUPT[0] = text
    _BEFORE_LINE[:] = [before] if before else []


def until_interrupted(main: Callable[[], Any]) -> Any:
    """`main()`; Ctrl-C ends it with one line, not the launcher's traceback, and exit status 130.
    What finished is on disk; the line says how to resume (`on_interrupt`)."""
    try:
        return main()
    except KeyboardInterrupt:
        for before in _BEFORE_LINE:
            before()
        _stop_pool_tracker()
        print(f"interrupted: {_ON_INTERRUPT[0]}", file=sys.stderr)
        sys.exit(130)


def _stop_pool_tracker() -> None:
    """Let joblib's worker-pool resource tracker (loky's: a process of its own, which a `-m`
    sweep starts) finish now, so that what it says comes before Ctrl-C's line, not after it.

    Ctrl-C reaches the pool's workers too, and now and then one of the pool's semaphores is
    left registered; the tracker, which ends when this process does, then warns of "1 leaked
    semlock objects" after the line that says how to resume (and after the shell's prompt). The
    pool is gone by now (joblib kills its workers on the interrupt), so this runs what exit
    would (the multiprocessing finalizers that unlink and unregister the live semaphores) and
    then stops the tracker, which cleans up whatever is left before it ends."""
    from multiprocessing import util

    # Private to loky and multiprocessing (as of joblib 1.6, Python 3.11): where either is missing,
    # as in a later version, the line is printed as before, the tracker's words after it.
    module = sys.modules.get("joblib.externals.loky.backend.resource_tracker")
    stop = getattr(getattr(module, "_resource_tracker", None), "_stop", None)
    finalizers = getattr(util, "_run_finalizers", None)
    if stop is None or finalizers is None:
        return
    finalizers(0)  # exit's first step, run early
    stop()


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
        # hydra's own groups (hydra/launcher=basic ...) have options in its plugins too
        if not sep or key.startswith(("-", "~", "hydra/")) or not (conf_dir / key).is_dir():
            continue
        for name in value.split(","):
            problem = (
                missing_config(groups, key, name, key) if re.fullmatch(r"[\w.\-]+", name) else None
            )
            if problem:
                return problem
    return None


def missing_config(groups: Sequence[Path], group: str, name: str, key: str) -> str | None:
    """One line naming the valid names when no folder of `groups` (one config group, possibly
    from several search paths) holds <name>.yaml; None when one does. `key` is the argument."""
    if any((g / f"{name}.yaml").is_file() for g in groups):
        return None
    valid = ", ".join(sorted({p.stem for g in groups for p in g.glob("*.yaml")}))
    return f"{key}={name}: no conf/{group}/{name}.yaml; valid: {valid}"


def unknown_param(argv: Sequence[str], conf_dir: Path) -> str | None:
    """A `planner.params.X=v` override (no `+`) that hydra would refuse with a screen of text, as
    one line: X is not a param of the planner, or is one its YAML does not list (then `+` adds
    it). Checked for the planner config the command line names (else config.yaml's default)
    when it names no experiment, which may choose another; otherwise None."""
    from dataclasses import fields

    import yaml

    from planners.registry import entry

    choice = {a.partition("=")[0]: a.partition("=")[2] for a in argv if "=" in a}
    defaults = (yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}).get("defaults", [])
    default = next((d["planner"] for d in defaults if isinstance(d, dict) and "planner" in d), "")
    planner = choice.get("planner", str(default))
    path = conf_dir / "planner" / f"{planner}.yaml"
    if "experiment" in choice or not re.fullmatch(r"[\w.\-]+", planner) or not path.is_file():
        return None  # another search path's config, or one hydra or the run reports
    d = yaml.safe_load(path.read_text()) or {}
    listed = set((d.get("params") or {}).keys())
    try:
        valid = sorted(f.name for f in fields(entry(str(d.get("name", planner))).params))
    except MoepipeError:
        return None  # an unknown planner name: the run says so
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key.startswith("planner.params."):
            continue
        name = key.removeprefix("planner.params.")
        if name not in valid:
            return f"{key}: planner {planner} has no param {name!r}; valid: {', '.join(valid)}"
        if name not in listed:
            return f"{key}: not in conf/planner/{planner}.yaml; add it with +{key}={value}"
    return None


GROUPS = ("model", "hardware", "workload", "planner", "executor")  # experiments.run's config groups


def unknown_key(argv: Sequence[str], conf_dir: Path) -> str | None:
    """An override `a.b=v` (no `+`) of a key the config lacks, which hydra refuses with a screen
    of text, as one line naming the key and what is there. Checked against config.yaml and the
    group configs the command line chooses (else the experiment's, else config.yaml's
    defaults), and the keys an experiment adds; not under another search path. Planner params
    are `unknown_param`'s."""
    import yaml

    choice = {a.partition("=")[0]: a.partition("=")[2] for a in argv if "=" in a}
    if "hydra.searchpath" in choice:
        return None
    root = yaml.safe_load((conf_dir / "config.yaml").read_text()) or {}
    defaults = {k: str(v) for d in root.get("defaults", []) if isinstance(d, dict)
                for k, v in d.items() if k in GROUPS}  # fmt: skip
    experiment: dict[str, Any] = {}
    if "experiment" in choice:
        path = conf_dir / "experiment" / f"{choice['experiment']}.yaml"
        if not re.fullmatch(r"[\w.\-]+", choice["experiment"]) or not path.is_file():
            return None  # a sweep over experiments, or one hydra reports
        experiment = yaml.safe_load(path.read_text()) or {}
        for d in experiment.get("defaults", []):  # `override /model: mixtral-8x7b`
            for k, v in d.items() if isinstance(d, dict) else ():
                if str(k).removeprefix("override /") in GROUPS:
                    defaults[str(k).removeprefix("override /")] = str(v)
    top = set(root) - {"defaults", "hydra"}
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or key.startswith(("+", "~", "-", "hydra")) or key in (*GROUPS, "experiment"):
            continue
        head, _, rest = key.partition(".")
        if not rest:
            if head not in top and head not in experiment:
                return f"{key}: not a key of the config; valid: {', '.join(sorted(top))}, or a group: {', '.join(GROUPS)}"
            continue
        if head not in GROUPS or key.startswith("planner.params."):
            continue
        name = choice.get(head, defaults.get(head, ""))
        path = conf_dir / head / f"{name}.yaml"
        if not re.fullmatch(r"[\w.\-]+", name) or not path.is_file():
            continue  # a sweep over choices, or a config hydra or the run reports
        miss = _missing(yaml.safe_load(path.read_text()) or {}, rest)
        if miss is not None and _missing(experiment, key) is not None:
            others = [p.stem for p in sorted((conf_dir / head).glob("*.yaml"))
                      if _missing(yaml.safe_load(p.read_text()) or {}, rest) is None]  # fmt: skip
            fix = (f"choose {head}={' or '.join(others)}, which has it" if others
                   else f"add a new key with +{arg}")  # fmt: skip
            have = _fields(miss[1], sort=True)
            return f"{key}: conf/{head}/{name}.yaml has no {rest!r} (there: {have}); {fix}"
    return None


# experiment configs that are another command's, not an experiments.run sweep's
OWN_COMMAND = {"replication": "python -m experiments.replication (or experiments.replication_cv)"}


def another_commands_experiment(argv: Sequence[str]) -> str | None:
    """`experiment=X` where X is another command's config (experiments.run would ignore its keys
    and run its default planner into X's out_dir), as one line naming the command."""
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        for name in value.split(",") if key == "experiment" else ():
            if name in OWN_COMMAND:
                return (
                    f"experiment={name} is the config of another command: run {OWN_COMMAND[name]}"
                )
    return None


def _missing(node: Any, dotted: str) -> tuple[int, Any] | None:
    """Where a config tree lacks the dotted key: (index of the first missing part, the node it
    is missing from); None when the tree has the key."""
    for i, part in enumerate(dotted.split(".")):
        if not isinstance(node, dict) or part not in node:
            return i, node
        node = node[part]
    return None


def _fields(node: Any, sort: bool = False) -> str:
    """The keys at a node of a config tree, for an error line."""
    if not isinstance(node, dict):
        return "no fields"
    return ", ".join(sorted(map(str, node)) if sort else map(str, node))


def unknown_config_key(argv: Sequence[str], config: Path) -> str | None:
    """For a command with one config file (experiments.replication's): an override `a.b=v` (no
    `+`) of a key the file lacks, as one line naming what is there at that level."""
    import yaml

    tree = yaml.safe_load(config.read_text()) or {}
    added = [a.lstrip("+").partition("=")[0] + "." for a in argv if a.startswith("+")]
    for arg in argv:
        key, sep, _ = arg.partition("=")
        if not sep or key.startswith(("+", "~", "-", "hydra")):
            continue
        miss = _missing(tree, key)
        if miss is None or any(key.startswith(a) for a in added):  # (under a key + adds)
            continue
        parts = key.split(".")
        where = ".".join(parts[: miss[0]]) or "the top level"
        return (f"{key}: {config.name} has no {parts[miss[0]]!r} at {where} "
                f"(there: {_fields(miss[1])}); add a new key with +{arg}")  # fmt: skip
    return None


def missing_launcher(argv: Sequence[str]) -> str | None:
    """`hydra/launcher=slurm` without its plugin installed: hydra says only that it cannot load
    `submitit_slurm`."""
    import importlib.util

    slurm = any(a.partition("=")[::2] == ("hydra/launcher", "slurm") for a in argv)
    if slurm and importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        return "hydra/launcher=slurm needs its plugin: pip install hydra-submitit-launcher"
    return None


def sweep_experiment_misused(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> str | None:
    """`experiment=X` of a sweep experiment (its yaml has hydra.sweeper.params) without -m, which
    runs one default point, or swept with others (`-m experiment=a,b`), which runs one point of
    each and none of their own sweeps: one line saying how to run it. None otherwise."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        names = value.split(",") if key == "experiment" else []
        sweeps = []
        for name in names:
            path = conf_dir / "experiment" / f"{name}.yaml"
            try:
                cfg = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError):
                continue
            if ((cfg.get("hydra") or {}).get("sweeper") or {}).get("params"):
                sweeps.append(name)
        if sweeps and len(names) > 1:
            return (f"experiment={value}: an experiment's own sweep runs only when it is chosen "
                    f"alone; run one command per experiment (-m experiment={sweeps[0]})")  # fmt: skip
        if sweeps and not multirun:
            return (f"experiment={sweeps[0]} is a sweep: add -m (python -m experiments.run -m "
                    f"experiment={sweeps[0]}); without it one default point runs")  # fmt: skip
    return None


def exit_on_unknown_choice(argv: Sequence[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit 2 with one line on stderr when `unknown_choice`, `unknown_param` or
    `another_commands_experiment` finds one."""
    problem = (
        unknown_choice(argv, conf_dir)
        or unknown_param(argv, conf_dir)
        or unknown_key(argv, conf_dir)
        or another_commands_experiment(argv)
        or sweep_experiment_misused(argv, conf_dir)
        or missing_launcher(argv)
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def exit_on_unwritable_dir(argv: Sequence[str], keys: Sequence[str]) -> None:
    """Exit 2 with one line when a `key=folder` argument (hydra's run or sweep dir) names a folder
    that cannot be made or written: hydra would fail on it with a traceback. Folders with
    interpolations (`${now:...}`) are left to hydra."""
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys and "$" not in value:
            new = next((p for p in (Path(value), *Path(value).parents) if p.parent.exists()),
                       Path(value))  # fmt: skip
            made = not new.exists()
            try:
                output_dir(value, key)
                if made:  # checked, not made: hydra makes it when the run starts
                    shutil.rmtree(new, ignore_errors=True)
            except MoepipeError as e:
                print(f"error: {e}", file=sys.stderr)
                sys.exit(2)
