"""A sweep's points as hydra will run them: the overrides of its first point (`first_point`), the
run dir each point's config gives it (`check_subdirs`), and a bad value every point shares
(`check_shared`), checked before the sweep starts."""

from __future__ import annotations

import copy
import itertools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from core.errors import MoepipeError

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
    A template naming the job's number tells them apart, and so does one naming a swept key's
    value; each point over the keys it does not name is resolved (a config composed per point,
    hydra's runtime choices with it: `x_${hydra:runtime.choices.hardware}` over planners was one
    folder), inside an initialized hydra."""
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
    reached = expanded(cfg, text)  # `${tag}`, `+tag=${planner.name}`: names planner too
    if "hydra.job.num" in reached or "hydra.job.id" in reached:
        return  # a folder per job
    exclude = OmegaConf.select(cfg, "hydra.job.config.override_dirname.exclude_keys") or []
    varied = [o for o in swept if len(list(o.sweep_string_iterator())) > 1]
    if "override_dirname" in text:
        unnamed = [o for o in varied if _key(o) in exclude and not _named(_key(o), reached)]
        # a field of a swept group's (`${planner.name}`): resolved point by point below
        fields = any(f"{{{_key(o)}." in reached for o in unnamed)
        if unnamed and len(unnamed) == len(varied) and not fields:
            raise MoepipeError(
                f"hydra.sweep.subdir={text}: the swept "
                f"{', '.join(_key(o) for o in unnamed)} are left out of "
                "hydra.job.override_dirname (exclude_keys) and named nowhere else in it: every "
                f"point would write one folder, each replacing the last; {fix} with them"
            )
    else:
        unnamed = [o for o in varied if not _named(_key(o), reached)]
    # a key the folder's name holds tells its points apart (a value the key reads as another,
    # `2,'2'`, is refused as swept twice); each other is resolved point by point, the keys
    # named at their first value: a config composed per point holds hydra's runtime choices
    own = [o for o in varied if _own_names(o, lines) and o not in unnamed]
    if own:  # two configs of one name: the name is what to change
        key = _key(own[0])
        fix = f"give each {key} a name of its own (a file's name:, not {key}.name=)"
    _distinct_subdirs(config_name, lines, swept, [*unnamed, *own], text, fix)


def check_sweep_dir(cfg: Any, swept: Sequence[Any]) -> None:
    """Refuse a `hydra.sweep.dir` that names a swept key's value (`g${workload.gen_len}`,
    `${hydra:runtime.choices.planner}`) or the job's own (`${hydra.job.num}`): each point's
    job resolved it for itself and wrote a sweep folder of its own, while the sweep counted,
    tabled and reported only the first's, saying one run where two ran; or that is a run's
    folder (`_not_a_run`). `cfg`: the first point's config."""
    hydra_sweep = OmegaConf.to_container(cfg.hydra.sweep, resolve=False)
    text = str(hydra_sweep.get("dir") or "")  # type: ignore[union-attr]
    reached = expanded(cfg, text)
    per_job = [k for k in ("hydra.job.", "hydra:job.") if k in reached]
    # a field of a swept group's (`${planner.name}`) differs from point to point too
    named = per_job + [
        _key(o) for o in swept if _named(_key(o), reached) or f"{{{_key(o)}." in reached
    ]
    via = "" if not named or named[0] in text else " (through the keys it interpolates)"
    if named:
        raise MoepipeError(
            f"hydra.sweep.dir={text}: names {named[0].rstrip('.')}{via}, which differs from "
            "point to point, so each would write a sweep folder of its own and the sweep count "
            "one; name it in hydra.sweep.subdir instead"
        )
    _not_a_run(cfg)


def _not_a_run(cfg: Any) -> None:
    """Refuse a sweep dir that is a run's folder (its summary.json or files.sha256, a single
    run's or one of a sweep's points): the sweep wrote its points and multirun.yaml beside
    that run's result, and `collect` then refused the folder as a run's; or a checkpoint's
    folder, where they went in among the model's weights (as a run dir there is refused)."""
    from hydra.core.hydra_config import HydraConfig

    from core.args import RUN_FILES, checkpoint_folder, checkpoint_folder_line

    HydraConfig.instance().set_config(cfg)
    try:
        where = Path(str(cfg.hydra.sweep.dir))
    except Exception:  # noqa: BLE001 (a value that does not resolve: hydra's own line says so)
        return
    held = next((f for f in RUN_FILES[:2] if (where / f).is_file()), None)
    if held is not None:
        raise MoepipeError(
            f"hydra.sweep.dir={where}: a run's folder (its {held}), which the sweep's points "
            "would be written beside; pass hydra.sweep.dir= another folder"
        )
    if checkpoint_folder(where):
        raise MoepipeError(checkpoint_folder_line(where, "hydra.sweep.dir", "the sweep's"))
    _launcher_folder(cfg)


def _launcher_folder(cfg: Any) -> None:
    """Refuse a submitit launcher's `submitit_folder` (its jobs' logs) that a file is in the way
    of: submitit's mkdir said "File exists" of the file alone, once the sweep had started."""
    from core.args import blocked_folder

    try:
        given = OmegaConf.select(cfg, "hydra.launcher.submitit_folder", default=None)
    except Exception:  # noqa: BLE001 (a value that does not resolve: hydra's own line says so)
        return
    why = None if given is None else blocked_folder(Path(str(given).split("%", 1)[0]))
    if why is not None:  # `%j`: the job's id, a folder each
        raise MoepipeError(
            f"hydra.launcher.submitit_folder={given}: {why}; pass hydra.launcher."
            "submitit_folder= a folder (the jobs' logs go in it)"
        )


def _key(o: Any) -> str:
    return str(o.get_key_element()).lstrip("+~")


_INTERPOLATED = re.compile(r"\$\{([\w.\[\]-]+)\}")  # `${a.b}`: a key's value, not a resolver's


def expanded(cfg: Any, template: str) -> str:
    """`template` and the raw value of each key it interpolates, theirs in turn: a template
    that reaches a swept key only through another key (`hydra.sweep.subdir=${tag}` with
    `+tag=${planner.name}`) names it as much as one that names it itself."""
    out, seen = [template], set()
    todo = _INTERPOLATED.findall(template)
    while todo and len(seen) < 100:  # a loop of interpolations: omegaconf's own line says so
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        parent, _, last = key.rpartition(".")
        try:
            node = OmegaConf.select(cfg, parent) if parent else cfg
            raw = OmegaConf.to_container(node, resolve=False).get(last)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 (not a mapping there, or a value that does not resolve)
            continue
        if isinstance(raw, str):
            out.append(raw)
            todo += _INTERPOLATED.findall(raw)
    return " ".join(out)


_SHIPPED = Path(__file__).resolve().parents[2] / "conf"


def _own_names(o: Any, lines: Sequence[str]) -> bool:
    """Whether swept override `o` picks a model or hardware whose name the user set: a config
    of theirs (a FILE.yaml, a config dir's), whose `name:` two files may share (one copied from
    the other), or any under a `hardware.name=` override. The folder takes that name, so
    `${run_hardware:}` does not tell their points apart as it does conf/'s, whose names differ."""
    key = _key(o)
    if key not in ("model", "hardware"):
        return False
    renamed = any(line.lstrip("+~").startswith(f"{key}.name=") for line in lines)
    return renamed or any(
        not (_SHIPPED / key / f"{v}.yaml").is_file() for v in o.sweep_string_iterator()
    )


def _named(key: str, template: str) -> bool:
    """Whether a subdir template names `key`'s value (`${workload.gen_len}`, a group's
    `${hydra:runtime.choices.planner}`, the model's and hardware's `${run_model:}` resolvers)."""
    resolver = {"model": "run_model:", "hardware": "run_hardware:"}.get(key)
    return (
        f"{{{key}}}" in template
        or f"choices.{key}}}" in template
        or bool(resolver and resolver in template)
    )


def _distinct_subdirs(
    config_name: str,
    lines: Sequence[str],
    swept: Sequence[Any],
    unnamed: Sequence[Any],
    text: str,
    fix: str,
) -> None:
    """Each point over the values of the `unnamed` swept keys (the others at their first value)
    composed, and its subdir resolved: two that are one folder are refused."""
    from hydra.core.hydra_config import HydraConfig

    first = {
        o.input_line: f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}"
        for o in swept
    }
    values = [[f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()] for o in unnamed]
    seen: dict[str, list[str]] = {}
    for point in itertools.product(*values):
        chosen = dict(first) | dict(zip([o.input_line for o in unnamed], point, strict=True))
        cfg = composed(config_name, [chosen.get(line, line) for line in lines])
        HydraConfig.instance().set_config(cfg)
        subdir = os.path.normpath(str(cfg.hydra.sweep.subdir))
        if subdir in seen:
            raise MoepipeError(
                f"hydra.sweep.subdir={text}: points {' '.join(seen[subdir])} and "
                f"{' '.join(map(_as_typed, point))} would both write {subdir}, the second "
                f"replacing the first's result; {fix}, or name a swept key in it"
            )
        seen[subdir] = [_as_typed(v) for v in point]


def _as_typed(override: str) -> str:
    """`hardware=file_a` (a FILE.yaml as `group_files` names its copy) as the user typed it,
    `hardware=a.yaml`; any other override as it is."""
    from experiments.common.app import USER_FILES

    key, _, value = override.partition("=")
    ends = f"/{key}/{value}.yaml"
    return next((f"{key}={v}" for k, v in USER_FILES.items() if k.endswith(ends)), override)


# the config roots a point's folder name is read from (`names_fit`): a swept key under another
# (`workload.seed=range(0,3000)`) names no folder, and composing each of its values (0.1 s each)
# held a sweep of thousands of points for minutes before its first ran, with nothing said
_NAMING_ROOTS = ("model", "hardware", "replication", "experiment")


def names_a_folder(o: Any) -> bool:
    """Whether swept override `o` can change what names a point's folder (`_NAMING_ROOTS`)."""
    return o.get_key_element().lstrip("+~").split(".")[0] in _NAMING_ROOTS


def names_fit(cfg: Any) -> None:
    """What names each point's folder, checked as its folder will take it: the model and
    hardware names (`resolve.name_part`) and a replication block's case. A name too long or not
    a plain name, or the replication experiment run without a case, was each point's error
    once the pool had started (and left a `None/...` folder), the sweep's workers up for
    nothing."""
    if "model" not in cfg or "hardware" not in cfg:
        return  # not a run's config
    from experiments.common.ep_inputs import case_set
    from experiments.common.resolve import hardware_name, run_model_name

    hardware_name(_root_=cfg)
    run_model_name(_root_=cfg)
    rep = cfg.get("replication")
    if rep is not None and rep.get("routing"):
        case_set(rep)


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
    failing alone; where none does (of a key's first VALUES_TRIED and its last), no value the
    sweep tries avoids the failure. Needs an initialized hydra."""
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


# the values of one swept key `check_shared` tries (its first point failed): each is a config
# composed (0.2 s); all 3000 of `workload.seed=range(0,3000) workload.gen_len=0` held the sweep
# for ten minutes before its one line
VALUES_TRIED = 32


def _tried(override: Any) -> list[str]:
    """The values of a swept key `check_shared` tries: its first VALUES_TRIED and its last (a
    range whose first values are all bad, `range(-40,10)`, may end in good ones)."""
    values = list(override.sweep_string_iterator())
    return values[:VALUES_TRIED] + values[-1:] if len(values) > VALUES_TRIED else values


def _value_points(parsed: Sequence[Any], swept: Sequence[Any]) -> Iterator[list[str]]:
    """A sweep's first point (its overrides), then each other value of a swept key with the
    others at their first (a key's first VALUES_TRIED and its last)."""
    lines = [o.input_line for o in parsed]
    values = [[f"{o.get_key_element()}={v}" for v in _tried(o)] for o in swept]
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


def check_sweep_values(swept: Sequence[Any]) -> None:
    """Each swept override sweeps one value or more, as the basic sweeper can list them:
    `range(5,3)` (none) and `range(3,5,0)` were internal errors, `interval(3,5)` (an optimizing
    sweeper's) hydra's line with nothing to do, `choice(1,choice(2,3))` omegaconf's words on
    hydra's own type."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    for o in swept:
        v = o.value()
        if isinstance(v, ChoiceSweep) and any(_holds_sweep(x) for x in v.list):
            # hydra lists none of its values (omegaconf's "tags: Unexpected type annotation")
            raise MoepipeError(
                f"{o.input_line}: a sweep among a sweep's values; list them in one: "
                "a,b,c or choice(a,b,c)"
            )
        if isinstance(v, IntervalSweep):
            raise MoepipeError(
                f"{o.input_line}: interval() is for optimizing sweepers; this sweep lists its "
                "values: pass a,b,c, range(start,stop,step) or choice(a,b)"
            )
        if isinstance(v, RangeSweep) and not v.step:
            raise MoepipeError(f"{o.input_line}: a range's step is 0; pass a step that is not")
        if is_glob(o) and o.config_loader is None:
            continue  # its names are listed with the config loader (check_sweep)
        if next(iter(o.sweep_string_iterator()), None) is None:
            raise MoepipeError(
                f"{o.input_line}: sweeps no value (a glob that matches no name, or a range "
                "whose start is not before its stop in the step's direction); pass one or more"
            )


# a run's keys that change how it is run or kept, not its result: a sweep of one makes points
# of one result, each in a run dir of its own
SAME_RESULT_KEYS = ("skip_finished", "trace_json", "executor.rendezvous_timeout_s")
# key -> (what it names, the sweep of what sets it with the settings it names)
NAMING_KEYS = {
    "replication.case": ("case column", "experiment=replication_A,replication_B"),
    "replication.label": ("variant row", "replication_row=A,B"),
}


def refuse_sweeps_of_one_result(swept: Sequence[Any]) -> None:
    """A MoepipeError for a swept key no point's result depends on: a key of SAME_RESULT_KEYS,
    reproduce_klotski's `reproduce.*`, a replication case's or row's name (NAMING_KEYS: its
    file sets it with the settings it names), or one of hydra's own (`hydra.job.chdir=true,false`,
    `hydra/job_logging=a,b`), which hydra sets once for the whole sweep and refused in a line
    with nothing to do."""
    for o in swept:
        key = o.get_key_element().lstrip("+~")
        if key == "hydra" or key.startswith(("hydra.", "hydra/")):
            raise MoepipeError(
                f"{o.input_line}: hydra's own keys cannot be swept (hydra sets them once per "
                f"sweep); run the sweep once per value, each with {key}=<one value>"
            )
        if key == "reproduce" or key.startswith("reproduce."):  # reproduce_klotski's grid
            raise MoepipeError(
                f"{o.input_line}: {key} is experiments.reproduce_klotski's, which a run ignores, "
                f"so the sweep's points would be runs of one result; drop {key} from the sweep "
                "(python -m experiments.reproduce_klotski runs its grid)"
            )
        if key in NAMING_KEYS:  # a replication case's or row's name: its file sets both
            raise MoepipeError(
                f"{o.input_line}: {key} only names a run (the replication report's "
                f"{NAMING_KEYS[key][0]}), so the sweep's points would be runs of one result; "
                f"drop {key} from the sweep, and sweep {NAMING_KEYS[key][1]} instead"
            )
        if key in SAME_RESULT_KEYS:
            raise MoepipeError(
                f"{o.input_line}: {key} does not change a run's result, so the sweep's points "
                f"would be runs of one result; drop {key} from the sweep (pass one value)"
            )


def _holds_sweep(value: Any) -> bool:
    """Whether an override's value is, or holds in a list or dict, a sweep (`choice(2,3)`)."""
    from hydra.core.override_parser.types import Sweep

    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, Sweep) or (
        isinstance(value, list) and any(_holds_sweep(x) for x in value)
    )


def refuse_nested_sweeps(parsed: Sequence[Any]) -> None:
    """A MoepipeError for a list or dict value holding a sweep (`workload.routing.tasks=[a,
    choice(b,c)]`): hydra passed its object on, said as `ChoiceSweep(tags=set(), ...)`."""
    for o in parsed:
        if not o.is_sweep_override() and _holds_sweep(o.value()):
            raise MoepipeError(
                f"{o.input_line}: a sweep inside a list or dict; sweep the whole value "
                f"instead ({o.get_key_element()}=[a,b],[a,c])"
            )


def is_glob(o: Any) -> bool:
    """Whether override `o` sweeps a glob of a group's names (`planner=glob(klotski*)`)."""
    from hydra.core.override_parser.types import Glob

    return isinstance(o.value(), Glob)
