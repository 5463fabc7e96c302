"""The keys of hydra's chosen launcher and sweeper, and of its callbacks: `+hydra.launcher.foo=1`
added a key that neither the plugin nor hydra reads, since hydra's schema types these nodes `Any`
(the check of a `+` key against a schema, `app.plus_plus`, passed it); `+hydra.callbacks.X.foo=1`
added a callback of no class, which hydra warned of over eight lines at each event and ran on.
Here the config is composed and the key refused in one line naming it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import MoepipeError
from experiments.common.hydra_errors import nearest

PLUGINS = ("hydra.launcher", "hydra.sweeper")
CALLBACKS = "hydra.callbacks"  # name -> {_target_: a Callback class, its arguments}
# hydra's logging configs are `logging.config.dictConfig`'s, which skips a key it does not know
LOGGING = ("hydra.job_logging", "hydra.hydra_logging")
DICT_CONFIG_KEYS = (
    "version",
    "formatters",
    "filters",
    "handlers",
    "loggers",
    "root",
    "incremental",
    "disable_existing_loggers",
)
# the keys dictConfig reads of an entry of a section, which skips any other; a handler's other
# keys go to its class, which refuses one it does not take (logging's own error)
ENTRY_KEYS = {
    "root": ("level", "handlers", "filters"),
    "loggers": ("level", "handlers", "filters", "propagate"),
    # `defaults` only where dictConfig reads it (Python 3.12): 3.11's skipped it, unsaid
    "formatters": ("format", "datefmt", "style", "class", "validate")
    + (("defaults",) if sys.version_info >= (3, 12) else ()),
    "filters": ("name",),
}


def check_plugin_keys(conf_dir: Path, config_name: str, overrides: Sequence[str]) -> None:
    """Each `+hydra.launcher.KEY=v` / `++...` (the sweeper's too) of `overrides` names a key of
    the plugin the config chooses (`hydra/launcher=...`), or one under a free mapping of it
    (submitit's `additional_parameters`). Composes the config once, and only where one is
    added; a config that does not compose is left to hydra's own error."""
    for o in overrides:
        _check_logging(o)
    added = [o for o in overrides if o.startswith("+") and _plugin_key(o)]
    keys = [o.lstrip("+~").partition("=")[0] for o in overrides]
    # a callback set on the command line, or by a config of the user's (--config-dir)
    callbacks = any(
        k in (CALLBACKS, "hydra.searchpath") or k.startswith(f"{CALLBACKS}.") for k in keys
    )
    if not added and not callbacks:
        return
    cfg = _composed(conf_dir, config_name, [o for o in overrides if o not in added])
    if cfg is None:
        return
    for o in added:
        _check(cfg, o)
    if callbacks:
        check_callbacks(cfg)


def _plugin_key(override: str) -> str | None:
    """The plugin (`hydra.launcher`) whose key `override` sets, if any."""
    key = override.lstrip("+").partition("=")[0]
    return next((p for p in PLUGINS if key.startswith(f"{p}.")), None)


def _composed(conf_dir: Path, config_name: str, overrides: list[str]) -> DictConfig | None:
    """The config with hydra's node, at a sweep's first point; None where it does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.common.sweep_points import first_point

    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
            first = first_point(parsed, [o for o in parsed if o.is_sweep_override()])
            return compose(config_name, first, return_hydra_config=True)
    except Exception:  # hydra names what is wrong with it when it composes the config itself
        return None


def _check(cfg: DictConfig, override: str) -> None:
    plugin = _plugin_key(override)
    assert plugin is not None
    key = override.lstrip("+").partition("=")[0]
    node: Any = OmegaConf.select(cfg, plugin)
    where = plugin
    for part in key[len(plugin) + 1 :].split("."):
        if not isinstance(node, DictConfig):
            return  # a key under a value: omegaconf's error, in hydra's turn
        if part not in node:
            if not is_dataclass(OmegaConf.get_type(node)):
                return  # a free mapping takes any key
            name = str(OmegaConf.select(cfg, f"{plugin}._target_", default="")).rsplit(".", 1)
            raise MoepipeError(
                f"{where}.{part}: unknown key of hydra's {plugin.split('.')[1]} ({name[-1]}); "
                f"{nearest(part, [str(k) for k in node])}; or leave it out"
            )
        node = node._get_node(part)
        where = f"{where}.{part}"


def _check_logging(override: str) -> None:
    """`+hydra.job_logging.KEY=v`: a KEY that `logging.config.dictConfig` takes."""
    key = override.lstrip("+").partition("=")[0]
    for node in LOGGING:
        if override.startswith("+") and key.startswith(f"{node}."):
            part, *rest = key[len(node) + 1 :].split(".")
            if part not in DICT_CONFIG_KEYS:
                raise MoepipeError(
                    f"{node}.{part}: unknown key of a logging config (logging.config.dictConfig "
                    f"skips it); {nearest(part, DICT_CONFIG_KEYS)}; or leave it out"
                )
            _check_logging_entry(f"{node}.{part}", part, rest)


def _check_logging_entry(where: str, section: str, rest: list[str]) -> None:
    """`+hydra.job_logging.root.nosuch=1`, `...loggers.NAME.nosuch=1`: a key of an entry that
    dictConfig skips, as it does a section's it does not know."""
    if section not in ENTRY_KEYS:
        return
    if section != "root":  # an entry of the section by its name: the user's
        if len(rest) < 2:
            return
        where, rest = f"{where}.{rest[0]}", rest[1:]
    if rest and rest[0] not in ENTRY_KEYS[section]:
        raise MoepipeError(
            f"{where}.{rest[0]}: unknown key of a logging config's {section} entry "
            f"(logging.config.dictConfig skips it); {nearest(rest[0], ENTRY_KEYS[section])}; "
            "or leave it out"
        )


def check_logging_config(log_config: Any) -> None:
    """Each key of a composed logging config (hydra.job_logging or hydra.hydra_logging, from a
    config file of the user's or the command line) that dictConfig reads: one it skips, a
    formatter's `defaults` under Python 3.11 among them, is refused in one line naming it."""
    if not isinstance(log_config, DictConfig):
        return
    node = log_config._get_full_key(None) or "hydra.job_logging"
    for part in log_config:
        _check_logging(f"+{node}.{part}=x")
        entries = log_config.get(part)
        if not isinstance(entries, DictConfig) or part not in ENTRY_KEYS:
            continue
        if part == "root":
            for key in entries:
                _check_logging_entry(f"{node}.root", "root", [str(key)])
            continue
        for name, entry in entries.items():  # a logger's name may hold dots: not split
            if isinstance(entry, DictConfig) and "()" not in entry:  # a factory's: its own
                for key in entry:
                    _check_logging_entry(f"{node}.{part}", part, [str(name), str(key)])


def check_callbacks(cfg: DictConfig) -> None:
    """Each of `hydra.callbacks` is a mapping whose `_target_` names a hydra Callback class,
    its other keys arguments that class takes, of the kind it takes: hydra instantiates them
    only as the run starts, and said what was wrong over many lines, or warned and ran on."""
    node: Any = OmegaConf.select(cfg, CALLBACKS)
    if not isinstance(node, DictConfig):
        return  # null or a value: omegaconf's own line, in hydra's turn
    for name in node:
        where = f"{CALLBACKS}.{name}"
        entry = node._get_node(name)
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise MoepipeError(
                f"{where}: a callback is a mapping whose _target_ names a hydra Callback class; "
                f"pass +{where}._target_=module.Class, or leave it out (~{where})"
            )
        cls = _callback_class(where, str(entry["_target_"]))
        _check_arguments(where, cls, entry)


def _callback_class(where: str, target: str) -> type:
    """The class `target` names, a subclass of hydra's Callback, or a MoepipeError."""
    from hydra._internal.utils import _locate
    from hydra.experimental.callback import Callback

    fix = f"pass {where}._target_=module.Class of a hydra Callback, or leave it out (~{where})"
    try:
        cls = _locate(target)
    except Exception:  # noqa: BLE001 (hydra's ImportError of many lines, or the module's own)
        raise MoepipeError(f"{where}._target_={target}: no such class to import; {fix}") from None
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise MoepipeError(
            f"{where}._target_={target}: not a subclass of hydra's "
            f"hydra.experimental.callback.Callback; {fix}"
        )
    return cls


KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_arguments(where: str, cls: type, entry: DictConfig) -> None:
    """The keys of `entry` beside `_target_` name arguments of `cls`, each of the kind its
    annotation says (where that is a plain bool, int, float or str)."""
    import inspect
    import typing

    params = inspect.signature(cls).parameters
    free = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 (an annotation that does not resolve: kinds unchecked)
        hints = {}
    for key in entry:
        key = str(key)
        if key.startswith("_") and key.endswith("_"):  # hydra's own: _target_, _partial_, ...
            continue
        if key not in params and not free:
            valid = [p for p in params if params[p].kind is not inspect.Parameter.VAR_POSITIONAL]
            takes = nearest(key, valid) if valid else f"{cls.__name__} takes none"
            raise MoepipeError(f"{where}.{key}: unknown key of {cls.__name__}; {takes}")
        kind = hints.get(key)
        value = entry._get_node(key)._value()
        if kind in KINDS and not _is_kind(value, kind):
            raise MoepipeError(
                f"{where}.{key}={value!r}: {cls.__name__} takes {KINDS[kind]} there; "
                f"pass {where}.{key}=<{KINDS[kind]}>"
            )


def _is_kind(value: Any, kind: type) -> bool:
    """`value` (as YAML gave it) is one of `kind`: an int is a float too, a bool no number."""
    if isinstance(value, str) and value.startswith("${"):
        return True  # an interpolation: its value is known only when resolved
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)
