"""A sweep's points as hydra will run them: the overrides of its first point (`first_point`), the
run dir each point's config gives it (`check_subdirs`), and a bad value every point shares
(`check_shared`), checked before the sweep starts."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.errors import MoepipeError

_PER_POINT = ("hydra.job.override_dirname", "hydra.job.num", "hydra.job.id")

# the running command's check of one point's config (its job's, without running it), if any
POINT_CHECK: list[Callable[[Any], None]] = []
# the configs composed while a sweep is checked (`composing`), by their config and overrides
_COMPOSED: list[dict[tuple[str, ...], Any]] = []


@contextmanager
def composing() -> Iterator[None]:
    """Compose each point's config once while a sweep is checked (`composed`): a sweep's first
    point was composed four times (for its launcher, its names, its folder and the values every
    point shares), about 0.1 s each. Forgotten as the block ends: a config file may change
    before the next command in the same process composes it."""
    _COMPOSED.append({})
    try:
        yield
    finally:
        _COMPOSED.pop()


def composed(config_name: str, overrides: Sequence[str]) -> Any:
    """`compose(config_name, overrides, return_hydra_config=True)`, kept for the sweep's check
    (`composing`). Its callers read it; one that changes it changes a copy."""
    from hydra import compose

    key = (config_name, *overrides)
    kept = _COMPOSED[-1] if _COMPOSED else {}
    if key not in kept:
        kept[key] = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    return kept[key]


def check_subdirs(config_name: str, parsed: Sequence[Any], swept: Sequence[Any]) -> None:
    """Refuse a sweep two of whose points would write the same run dir (`hydra.sweep.subdir=`
    empty, or a template of values the swept keys do not change): the second point would
    replace the first's result, and the sweep end with one run fewer than it had points.
    A template naming a per-point value (`_PER_POINT`) tells them apart; another is resolved
    for each point (a config composed per point), inside an initialized hydra."""
    import itertools

    from hydra.core.hydra_config import HydraConfig

    lines = [o.input_line for o in parsed]
    cfg = composed(config_name, first_point(parsed, swept))
    template = OmegaConf.to_container(cfg.hydra.sweep, resolve=False).get("subdir")  # type: ignore[union-attr]
    text = "" if template is None else str(template)
    fix = "give hydra.sweep.subdir a template naming ${hydra.job.override_dirname}"
    if not text.strip(" ./"):
        raise MoepipeError(
            f"hydra.sweep.subdir={text}: every point of the sweep would write the sweep dir "
            f"itself, each replacing the last; {fix}, or leave it out"
        )
    if text.startswith(("/", "~")) or ".." in Path(text).parts:
        raise MoepipeError(
            f"hydra.sweep.subdir={text}: a point's folder must stay under the sweep dir (its "
            "runs would be written elsewhere, and the sweep count none); drop the leading '/' "
            "and any '..'"
        )
    excluded = any(o.get_key_element().startswith("hydra.job.config") for o in parsed)
    if any(key in text for key in _PER_POINT) and not excluded:
        return
    if excluded and "override_dirname" in text:
        exclude = OmegaConf.select(cfg, "hydra.job.config.override_dirname.exclude_keys") or []
        varied = [o.get_key_element() for o in swept if len(list(o.sweep_string_iterator())) > 1]
        if varied and all(
            k in exclude and k.rsplit(".", 1)[-1].lstrip("+~") not in text for k in varied
        ):
            raise MoepipeError(
                f"hydra.sweep.subdir={text}: the swept {', '.join(varied)} are left out of "
                "hydra.job.override_dirname (exclude_keys) and named nowhere else in it: every "
                f"point would write one folder, each replacing the last; {fix} with them"
            )
    if "hydra:" in text or "hydra." in text:
        # hydra's runtime values (the job's choices, its override_dirname) are set by its
        # launcher per job; a config composed here does not hold them (every point read the
        # same choice), so such a template is left to them
        return
    seen: dict[str, list[str]] = {}
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in swept]
    swept_lines = [o.input_line for o in swept]
    for point in itertools.product(*values):
        chosen = dict(zip(swept_lines, point, strict=True))
        overrides = [chosen.get(line, line) for line in lines]
        cfg = composed(config_name, overrides)
        HydraConfig.instance().set_config(cfg)
        subdir = os.path.normpath(str(cfg.hydra.sweep.subdir))
        if subdir in seen:
            raise MoepipeError(
                f"hydra.sweep.subdir={text}: points {' '.join(seen[subdir])} and "
                f"{' '.join(point)} would both write {subdir}, the second replacing the first's "
                f"result; {fix}, or name a swept key in it"
            )
        seen[subdir] = list(point)


def first_point(parsed: Sequence[Any], swept: Sequence[Any]) -> list[str]:
    """The overrides of a sweep's first point: each swept override at its first value."""
    first = {
        o.input_line: f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
        for o in swept
    }
    return [first.get(o.input_line, o.input_line) for o in parsed]


def check_shared(config_name: str, parsed: Sequence[Any], swept: Sequence[Any]) -> None:
    """Refuse a sweep every point of which would fail on its config (a value it does not sweep,
    `workload.gen_len=0`) with the one line a single run prints, before any point runs or has a
    folder; each failed after the sweep had started, one line per point. The first point is
    checked, then, where it fails, each other value of each swept key with the others at
    their first: one that passes lets the sweep run, its points with a bad value of their own
    failing alone; where none does, no value the sweep tries avoids the failure. Needs an
    initialized hydra."""
    from core.errors import MoepipeError
    from experiments.common.cli import error_line
    from experiments.common.hydra_errors import one_line

    if not POINT_CHECK:
        return
    first = None
    for point in _value_points(parsed, swept):
        # a point that does not compose (a value of hydra.sweeper.params of the wrong type) is
        # said as a command line's value is, naming its key, not in hydra's merging words
        line = _point_line(
            config_name, point, POINT_CHECK[0], lambda e: one_line(e) or error_line(e)
        )
        if line is None:
            return
        first = first or line
    raise MoepipeError(str(first))


def _value_points(parsed: Sequence[Any], swept: Sequence[Any]) -> Iterator[list[str]]:
    """A sweep's first point (its overrides), then each other value of a swept key with the
    others at their first."""
    lines = [o.input_line for o in parsed]
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in swept]
    first = [v[0] for v in values]
    points = [first] + [
        first[:i] + [v] + first[i + 1 :] for i, vs in enumerate(values) for v in vs[1:]
    ]
    for point in points:
        chosen = dict(zip([o.input_line for o in swept], point, strict=True))
        yield [chosen.get(line, line) for line in lines]


def _point_line(
    config_name: str, point: list[str], check: Callable[[Any], None], line_of: Any
) -> str | None:
    """The one line `check` fails with on `point`'s config as its job composes it; None where
    it passes, or fails on what is no user's mistake (a bug: its job says so)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from experiments.common.hydra_errors import with_key

    held, cfg = HydraConfig.instance().cfg, None
    try:
        cfg = copy.deepcopy(composed(config_name, point))  # its hydra node taken away below
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]  # as the job gets it
        check(cfg)
        return None
    except Exception as e:  # noqa: BLE001 (each kind is the job's: its line, or none)
        return line_of(e if cfg is None else with_key(e, cfg))
    finally:
        HydraConfig.instance().cfg = held
