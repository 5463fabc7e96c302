"""Context managers that change how hydra itself behaves for one command, each put back on
leaving: a one-line `--package` miss, `--help` without listing every group, a sweep checked
once per value, and no composition only to read `hydra.mode`."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.args import check_run_folders
from core.errors import MoepipeError

# in a folder, what makes it a run dir: hydra's record, or the run's files
RUN_MARKS = {".hydra", "config.yaml", "summary.json", "failed.txt", ".previous"}
# in a sweep's folder, the sweep's own: hydra's record, the table and report at its end
SWEEP_FILES = {"multirun.yaml", "results.csv", "results.parquet"}


@contextlib.contextmanager
def package_checked() -> Iterator[None]:
    """`--cfg job --package KEY` where the config has no KEY: hydra prints a line of its own
    without `error: ` and exits 1; here it is one line saying what to pass."""
    from hydra._internal.hydra import Hydra
    from hydra.types import RunMode

    show = Hydra.show_cfg

    def checked(
        self: Any,
        config_name: Any,
        overrides: Any,
        cfg_type: str,
        package: Any,
        resolve: bool = False,
    ) -> None:
        if package not in (None, "_global_"):
            cfg = self.compose_config(
                config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False
            )
            cfg = self.get_sanitized_cfg(cfg, cfg_type)
            top = sorted(str(k) for k in cfg)
            if OmegaConf.select(cfg, package) is None:
                raise MoepipeError(
                    f"--package {package}: no such key in the --cfg {cfg_type} config; pass a "
                    f"dotted key of it (top level: {', '.join(top)})"
                )
        try:
            show(self, config_name, overrides, cfg_type, package, resolve)
        except OmegaConfBaseException as e:  # --resolve: omegaconf's error names no key
            if not resolve or getattr(e, "full_key", None):
                raise
            cfg = self.compose_config(
                config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False
            )
            key = _unresolved(self.get_sanitized_cfg(cfg, cfg_type))
            if key is None:
                raise
            raise MoepipeError(
                f"{key}: {str(e).splitlines()[0]}; fix that value in the config or override"
            ) from None

    Hydra.show_cfg = checked  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.show_cfg = show  # type: ignore[method-assign]


def _unresolved(cfg: Any, at: str = "") -> str | None:
    """The dotted key of the first value of `cfg` whose interpolation does not resolve."""
    from omegaconf import DictConfig, ListConfig
    from omegaconf.errors import OmegaConfBaseException

    keys = range(len(cfg)) if isinstance(cfg, ListConfig) else list(cfg.keys())
    for k in keys:
        key = f"{at}.{k}" if at else str(k)
        try:
            value = cfg[k]
        except OmegaConfBaseException:
            return key
        if isinstance(value, DictConfig | ListConfig):
            found = _unresolved(value, key)
            if found is not None:
                return found
    return None


@contextlib.contextmanager
def groups_on_demand() -> Iterator[None]:
    """`--help`: hydra lists every config group's options for its template before it substitutes
    it, about 2 s of deep copies, though no command's template shows them; here each of the
    template's `$NAME`s is computed only where the template holds it."""
    import string

    from hydra._internal.hydra import Hydra

    get_help = Hydra.get_help

    def on_demand(self: Any, help_cfg: Any, cfg: Any, args_parser: Any, resolve: bool) -> str:
        def groups(hydras: bool) -> str:
            return self.format_config_groups(
                lambda x: (x.startswith("hydra/") or x == "hydra") == hydras
            )

        values = {
            "FLAGS_HELP": lambda: self.format_args_help(args_parser),
            "HYDRA_CONFIG_GROUPS": lambda: groups(True),
            "APP_CONFIG_GROUPS": lambda: groups(False),
            "CONFIG": lambda: OmegaConf.to_yaml(cfg, resolve=resolve),
        }

        class Computed(dict[str, str]):
            def __missing__(self, key: str) -> str:
                return values[key]()  # an unknown $NAME: KeyError, as hydra's own

        return string.Template(help_cfg.template).substitute(Computed())

    Hydra.get_help = on_demand  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_help = get_help  # type: ignore[method-assign]


@contextlib.contextmanager
def validate_each_value_once() -> Iterator[None]:
    """Hydra's basic sweeper composes every point's config before it launches any, one after
    another in this process while the workers wait (Fig. 10's 160 points: about 15 s of its 2
    minutes on 2 cores), and each job composes its own again. Inside this, it composes only the
    points that bring a value of a swept key not seen before: every value is still checked
    before the sweep starts (a bad choice is one line, as `check_sweep` makes it for the command
    line's), and a point whose combination alone fails fails as its job does."""
    # on the base class: hydra's plugin scan loads the basic sweeper's module afresh, so a
    # BasicSweeper imported here is not the class it runs; the method is Sweeper's own
    from hydra.plugins.sweeper import Sweeper

    every_point = Sweeper.validate_batch_is_legal
    launched = [0]  # the jobs of earlier batches: hydra numbers a sweep's jobs on

    def each_value(self: Any, batch: Sequence[Sequence[str]]) -> None:
        seen: set[str] = set()
        firsts = []
        for point in batch:
            if not seen.issuperset(point):
                firsts.append(point)
                seen.update(point)
        every_point(self, firsts)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        # every value is in a first point: one that puts a run outside the sweep is among them
        for point, folder in run_folders(self, firsts, launched[0]):
            if not folder.resolve().is_relative_to(sweep_dir.resolve()):
                raise MoepipeError(
                    f"{' '.join(point)}: its run folder {folder} is outside the sweep folder "
                    "(a value of it names hydra.sweep.subdir's folder with '..' or a leading "
                    "'/'), where the sweep would not find its result; pass a plain name"
                )
        if might_block(sweep_dir):
            check_run_folders([f for _, f in run_folders(self, batch, launched[0])])
        launched[0] += len(batch)

    Sweeper.validate_batch_is_legal = each_value  # type: ignore[method-assign]
    try:
        yield
    finally:
        Sweeper.validate_batch_is_legal = every_point  # type: ignore[method-assign]


def might_block(sweep_dir: Path) -> bool:
    """Whether anything in `sweep_dir` (there from an earlier sweep) could be in the way of a
    run's folder: a file or a link outside the run dirs, or a folder that is not writable. A
    fresh sweep dir holds only hydra's multirun.yaml: its points need not be composed."""
    for root, dirs, files in os.walk(sweep_dir):
        if not os.access(root, os.W_OK | os.X_OK):
            return True
        if RUN_MARKS & {*dirs, *files}:  # a run dir: what is in it is the run's
            dirs[:] = []
            continue
        if root == str(sweep_dir):  # the sweep's own outputs: its end's report and table
            dirs[:] = [d for d in dirs if d != "report"]
            files = [f for f in files if f not in SWEEP_FILES]
        if files or any(Path(root, d).is_symlink() for d in dirs):
            return True
    return False


def run_folders(
    sweeper: Any, batch: Sequence[Sequence[str]], first: int
) -> list[tuple[Sequence[str], Path]]:
    """Each of `batch`'s points with its run dir (jobs `first`, `first` + 1, ...), as the launcher
    composes it: hydra.sweep.dir / hydra.sweep.subdir, with the job's number and choices. A
    point whose dir does not resolve is left out: its job fails on it with its own line."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    loader = getattr(sweeper, "hydra_context", None)
    loader = loader.config_loader if loader is not None else sweeper.config_loader
    sweep_dir, held = Path(str(sweeper.config.hydra.sweep.dir)), HydraConfig.instance().cfg
    folders = []
    try:
        for idx, point in enumerate(batch, first):
            try:
                cfg = loader.load_sweep_config(sweeper.config, list(point))
                with open_dict(cfg):
                    cfg.hydra.job.id, cfg.hydra.job.num = f"{cfg.hydra.job.name}_{idx}", idx
                HydraConfig.instance().set_config(cfg)
                subdir = str(OmegaConf.select(cfg, "hydra.sweep.subdir"))
                folders.append((point, sweep_dir / subdir))
            except Exception:  # noqa: BLE001, S112 (the job fails on it with its own line)
                continue
    finally:
        HydraConfig.instance().cfg = held
    return folders


# flags that bring configs from elsewhere (which might set hydra's mode)
_OTHER_CONFIGS = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd"}
# a line of a config that sets hydra's `mode` (a `mode:` key at any depth, or hydra.mode)
_SETS_MODE = re.compile(r"^\s*(hydra\.)?mode\s*:", re.MULTILINE)


@contextlib.contextmanager
def mode_unset(args: Sequence[str], conf_dirs: Sequence[Path]) -> Iterator[None]:
    """Hydra composes the whole config once before the run only to read `hydra.mode`
    (`Hydra.get_mode`), then composes it again to run (0.1 s or more of every run).
    Where no argument (an override of hydra.mode, another config folder or search path) and no
    config file under `conf_dirs` can set it, that first composition would find it unset
    (None), which this returns without composing; hydra then takes the mode from -m as it does
    for None. Elsewhere hydra composes as it would."""
    from hydra._internal.hydra import Hydra

    keys = {a.partition("=")[0].lstrip("+~") for a in args}
    if keys & {"hydra.mode", "hydra.searchpath", *_OTHER_CONFIGS} or any(
        _SETS_MODE.search(f.read_text()) for d in conf_dirs for f in d.rglob("*.yaml")
    ):
        yield
        return
    composed = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Hydra.get_mode = composed  # type: ignore[method-assign]
