"""What a run dir's summary.json records of its config, checked against its config.yaml: a run
writes both from one config, so a field they disagree on is an edited config or a run dir put
together by hand (`collect`, `report` and `replication` skip it, naming the field)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import MoepipeError

if TYPE_CHECKING:
    from core.spec import ModelSpec

# summary.json keys that repeat a config.yaml column (summary key -> that column)
REPEATED = {
    "planner": "planner.name",
    "executor": "executor.name",
    "model": "model.name",
    "hardware": "hardware.name",
    "batch_size": "workload.batch_size",
    "prompt_len": "workload.prompt_len",
    "gen_len": "workload.gen_len",
    "params": "planner.params",
}


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys; lists -> JSON strings; scalars as they are."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict):
                out.update(flatten(v, key))
            elif isinstance(v, list | tuple):
                out[key] = json.dumps(v)
            else:
                out[key] = v
    return out


# summary.json's keys a run writes from its config as config.yaml holds them: the model is
# the one that ran (a checkpoint's), which config.yaml's model.name need not name
AS_CONFIGURED = tuple(k for k in REPEATED if k not in ("model", "params"))


def config_disagrees(config: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """Where a run's summary.json records a field of its config (the planner, its executor and
    hardware, the workload's sizes, each of the planner's `params`) other than its config.yaml
    holds, the first such field in words; None where they agree."""
    cfg = flatten(config)
    for key in AS_CONFIGURED:
        if key in summary and REPEATED[key] in cfg and not _same(cfg[REPEATED[key]], summary[key]):
            return _differs(REPEATED[key], cfg[REPEATED[key]], key, summary[key])
    routing = routing_disagrees(cfg, summary, _auto_source(config, cfg))
    if routing:
        return routing
    params = summary.get("params")
    if not isinstance(params, dict):  # an older summary's, without them: nothing to compare
        return None
    planner = config.get("planner")
    planner = planner if isinstance(planner, dict) else {}
    given = planner.get("params")
    given = dict(given) if isinstance(given, dict) else {}
    rep = config.get("replication")
    if isinstance(rep, dict) and rep.get("routing"):  # a replication run: its block's too
        from experiments.common import ep_inputs  # (planners' registry: only where needed)

        try:
            given = ep_inputs.block_params(rep, str(planner.get("name")), given)
        except (MoepipeError, ValueError, TypeError, AttributeError):
            return "config.yaml's replication block is not one a run reads"
        tables = {k: f"{ep_inputs.INPUTS}/{k}.npy" for k in ep_inputs.TABLES}
        for key, path in tables.items():  # the training tables it wrote into its run dir
            if not given.get(key) and str(params.get(key, "")).endswith(path):
                given[key] = params[key]
    for key in sorted(given.keys() | params.keys(), key=str):
        if not (key in given and key in params and _same(given[key], params[key])):
            return _differs(
                f"planner.params.{key}",
                given.get(key, _NONE),
                f"params.{key}",
                params.get(key, _NONE),
            )
    return None


_NONE = object()  # a key a mapping does not hold
# per routing source, its summary.json routing_fields that config.yaml's columns set
DRAWN_FROM = {
    "synthetic": {
        **{k: f"workload.routing.{k}" for k in ("skew", "layer_corr", "reuse", "hot_experts")},
        "hot_share": "workload.routing.hot_share",  # (only where there are hot experts)
        "seed": "workload.seed",
    },
    "trace": {
        "tasks": "workload.routing.tasks",  # (only where it names some: else every task)
        "exclude_tasks": "workload.routing.exclude_tasks",
        "seed": "workload.seed",
    },
}


def routing_disagrees(
    cfg: dict[str, Any], summary: dict[str, Any], auto: str | None = None
) -> str | None:
    """Where a summary's `routing_fields` (the routing it ran, as data) is not what config.yaml
    (flattened) draws: the first field that differs in words, its source first; None where they
    agree, where the summary has no fields (`tables.summary_lacks` refuses a `routing` without
    them) or where the run is a replication case's (it draws its own: a fitted skew, a split of
    the trace). `auto`: the source `auto` is for config.yaml's model, where it can be read."""
    ran = summary.get("routing_fields")
    if not isinstance(ran, dict) or cfg.get("replication.routing"):
        return None
    source, got = str(cfg.get("workload.routing.source", "auto")), ran.get("source", _NONE)
    mode = cfg.get("executor.routing_mode")  # a real run's: live runs its model's own gates
    source = "live" if mode == "live" else source
    key = "executor.routing_mode" if mode and "live" in (source, got) else "workload.routing.source"
    drawn = isinstance(got, str) and got in DRAWN_FROM
    if source == "auto" and drawn and auto not in (None, got):
        said = _differs(key, "auto", "routing_fields.source", got)
        return said.replace("'auto'", f"'auto' ({auto!r} for its model)", 1)
    if source != got and not (source == "auto" and drawn):
        return _differs(key, cfg.get(key, _NONE), "routing_fields.source", got)
    for key, given, field in _wanted(cfg, str(got)):
        if not _same(given, ran.get(field, _NONE)):
            return _differs(key, given, f"routing_fields.{field}", ran.get(field, _NONE))
    return _layers_differ(cfg, ran) if got in DRAWN_FROM else None


def _auto_source(config: dict[str, Any], cfg: dict[str, Any]) -> str | None:
    """The source `auto` resolves to for the model config.yaml (`config`, flattened `cfg`)
    names: a config.json's (a real run's checkpoint, a model.hf_config) as it is now, else its
    model group's; None where the model cannot be read (a checkpoint moved away)."""
    from core.routing import resolve_source
    from core.spec import ModelSpec
    from core.types import RoutingSource

    real = cfg.get("executor.name") == "real"
    path = (cfg.get("checkpoint") if real else None) or cfg.get("model.hf_config")
    model = config.get("model")
    try:
        if path:
            spec = hf_spec(str(path))
        elif real or not isinstance(model, dict):
            return None
        else:
            spec = ModelSpec.from_dict({k: v for k, v in model.items() if v is not None})
        return str(resolve_source(spec, RoutingSource.AUTO))
    except (MoepipeError, OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _wanted(cfg: dict[str, Any], source: str) -> list[tuple[str, Any, str]]:
    """(config.yaml's key, its value, the routing field it sets) for each field of `source`'s
    routing that config.yaml (flattened) sets: a task list sorted (those named less those
    excluded; none named: every task). The MoE layers are `_layers_differ`'s."""
    out = []
    excluded = _names(cfg.get("workload.routing.exclude_tasks"))
    for field, key in DRAWN_FROM.get(source, {}).items():
        if key not in cfg or field == "hot_share" and not cfg.get("workload.routing.hot_experts"):
            continue  # (a share of no hot experts draws nothing)
        given = cfg[key]
        if field == "exclude_tasks":
            given = sorted(excluded)
        elif field == "tasks" and _names(given):
            given = sorted(_names(given) - excluded)
        elif field == "tasks":  # none named: every task of the trace's less those excluded
            continue
        out.append((key, given, field))
    return out


def _layers_differ(cfg: dict[str, Any], ran: dict[str, Any]) -> str | None:
    """The number of MoE layers a run's routing covered (`routing_fields.moe_layers`) against
    its model's (`_moe_layers`); None where they agree or the model's cannot be read."""
    layers, where = _moe_layers(cfg)
    got = ran.get("moe_layers", _NONE)
    if layers is None or _same(len(layers), got):
        return None
    if where == "model.moe_layers":
        return _differs("len(model.moe_layers)", len(layers), "routing_fields.moe_layers", got)
    said = "has no routing_fields.moe_layers" if got is _NONE else f"has {short(got)} of them"
    return f"{where} has {len(layers)} MoE layers where the run's summary.json {said}"


def _moe_layers(cfg: dict[str, Any]) -> tuple[list[Any] | None, str]:
    """The MoE layers of the model a run's config.yaml (flattened) names, and where they are
    read: where the model is a config.json's (a real run's checkpoint, a model.hf_config), whose
    layers config.yaml does not hold (model.moe_layers: null, or the config group's, not the
    checkpoint's), that file's as it is now (a run dir of a config.json edited since is then
    stale), else config.yaml's model.moe_layers. None where there are none to read (a
    checkpoint moved away, a hand-made config's string or a list nested deep)."""
    real = cfg.get("executor.name") == "real"
    path = (cfg.get("checkpoint") if real else None) or cfg.get("model.hf_config")
    if real and not path:  # (its config group's layers are not the checkpoint's)
        return None, ""
    if not path:
        try:  # a list, flattened to its JSON
            layers = json.loads(str(cfg.get("model.moe_layers")))
        except (ValueError, RecursionError):
            return None, ""
        return (layers if isinstance(layers, list) else None), "model.moe_layers"
    from core.hf_config import hf_config_file

    try:
        moe = hf_spec(str(path)).moe_layers
        where = str(hf_config_file(str(path)))
    except (MoepipeError, OSError, ValueError):
        return None, ""
    return list(moe), f"{where} (config.yaml's model)"


def hf_spec(path: str) -> ModelSpec:
    """The spec of config.json `path` (a file or its checkpoint's folder), read once for each
    state of the file (its path, size and modification time): a sweep of many runs on one
    checkpoint reads it once, and a file edited since is read again."""
    from core.hf_config import hf_config_file

    file = hf_config_file(path).resolve()
    st = file.stat()
    return _hf_spec_of(file, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _hf_spec_of(file: Path, size: int, mtime_ns: int) -> ModelSpec:
    """`hf_spec`'s read of `file` (`size` and `mtime_ns` its state, the cache's key)."""
    from core.spec import ModelSpec

    return ModelSpec.from_hf_config(file)


def _names(value: Any) -> set[str]:
    """A flattened list of task names (its JSON), or one name given as a string."""
    try:
        names = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        names = [value]
    return {str(n) for n in (names if isinstance(names, list) else [names] if names else [])}


def _same(a: Any, b: Any) -> bool:
    """The one value written twice (YAML, JSON): true is not 1, and 2 is 2.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def _differs(key: str, given: Any, summary_key: str, ran: Any) -> str:
    said = f"has no {key}" if given is _NONE else f"'s {key} is {short(given)}"
    has = f"has no {summary_key}" if ran is _NONE else f"has {summary_key} {short(ran)}"
    return f"config.yaml{' ' if given is _NONE else ''}{said} where the run's summary.json {has}"


def short(value: Any) -> str:
    """`value`'s repr, cut to fit a line (an int of 400 digits, a long list)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
