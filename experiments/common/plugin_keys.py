"""The keys of hydra's chosen launcher and sweeper: `+hydra.launcher.foo=1` added a key that
neither the plugin nor hydra reads, since hydra's schema types both nodes `Any` (the check of a
`+` key against a schema, `app.plus_plus`, passed it). Here the config is composed and the key
refused in one line naming it, where the plugin's node is a structured config that lacks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.errors import MoepipeError
from experiments.common.hydra_errors import nearest

PLUGINS = ("hydra.launcher", "hydra.sweeper")
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


def check_plugin_keys(conf_dir: Path, config_name: str, overrides: Sequence[str]) -> None:
    """Each `+hydra.launcher.KEY=v` / `++...` (the sweeper's too) of `overrides` names a key of
    the plugin the config chooses (`hydra/launcher=...`), or one under a free mapping of it
    (submitit's `additional_parameters`). Composes the config once, and only where one is
    added; a config that does not compose is left to hydra's own error."""
    for o in overrides:
        _check_logging(o)
    added = [o for o in overrides if o.startswith("+") and _plugin_key(o)]
    if not added:
        return
    cfg = _composed(conf_dir, config_name, [o for o in overrides if o not in added])
    if cfg is None:
        return
    for o in added:
        _check(cfg, o)


def _plugin_key(override: str) -> str | None:
    """The plugin (`hydra.launcher`) whose key `override` sets, if any."""
    key = override.lstrip("+").partition("=")[0]
    return next((p for p in PLUGINS if key.startswith(f"{p}.")), None)


def _composed(conf_dir: Path, config_name: str, overrides: list[str]) -> DictConfig | None:
    """The config with hydra's node, at a sweep's first point; None where it does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.common.overrides import _first_point

    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            parsed = OverridesParser.create(config_loader=loader).parse_overrides(overrides)
            first = _first_point(parsed, [o for o in parsed if o.is_sweep_override()])
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
            part = key[len(node) + 1 :].split(".")[0]
            if part not in DICT_CONFIG_KEYS:
                raise MoepipeError(
                    f"{node}.{part}: unknown key of a logging config (logging.config.dictConfig "
                    f"skips it); {nearest(part, DICT_CONFIG_KEYS)}; or leave it out"
                )
