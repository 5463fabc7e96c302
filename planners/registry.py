"""Planner registry: `@register("name", Params)` in a planner's own file; the name is the stem
of `conf/planner/<name>.yaml`. Params are frozen dataclasses of primitives.

Usage:
    planner = make_planner("flexgen", {"prefetch_depth": 1})
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from core.errors import ConfigError
from core.planner import Planner


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[[Any], Planner]  # Params -> planner
    params: type  # frozen dataclass of primitives


_REGISTRY: dict[str, Entry] = {}

T = TypeVar("T")


def register(name: str, params: type) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        assert name not in _REGISTRY, f"planner {name} registered twice"
        _REGISTRY[name] = Entry(name, cls, params)  # type: ignore[arg-type]
        return cls

    return deco


def planner_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def entry(name: str) -> Entry:
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown planner {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def make_params(name: str, values: Mapping[str, Any] | None = None) -> Any:
    cls = entry(name).params
    values = dict(values or {})
    valid = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ConfigError(
            f"planner {name}: unknown param(s) {unknown}; valid: {sorted(valid) or 'none'}"
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"planner {name}: {e}") from None


def make_planner(name: str, values: Mapping[str, Any] | None = None) -> Planner:
    return entry(name).factory(make_params(name, values))


def _load_all() -> None:
    import planners  # noqa: F401  (imports every planner module, which registers it)
