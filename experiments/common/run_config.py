"""What a run dir's summary.json records of its config, checked against its config.yaml: a run
writes both from one config, so a field they disagree on is an edited config or a run dir put
together by hand (`collect`, `report` and `replication` skip it, naming the field)."""

from __future__ import annotations

import json
import re
from typing import Any

from core.errors import MoepipeError

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
    routing = routing_disagrees(cfg, summary.get("routing"))
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
_SYNTHETIC = ("skew", "layer_corr", "reuse")  # the generator's knobs its description names


def routing_disagrees(cfg: dict[str, Any], said: Any) -> str | None:
    """Where a summary's `routing` (free text: `synthetic skew=1 ... seed=0`, `trace ... [law]
    ...`, behind a real run's `replay: `) is not what config.yaml's workload (flattened) draws:
    the first field that differs in words; None where they agree or the text is of no source a
    config names (a live gate's, another version's)."""
    text = said.removeprefix("replay: ") if isinstance(said, str) else ""
    kind, _, rest = text.partition(" ")
    source = str(cfg.get("workload.routing.source", "auto"))
    # a replication run draws its own (a fitted skew, a split of the trace)
    if kind not in ("synthetic", "trace") or source == "live" or cfg.get("replication.routing"):
        return None
    if source not in ("auto", kind):
        return (
            f"config.yaml's workload.routing.source is {source!r} where the run's summary.json "
            f"has routing {short(text)}"
        )
    ran = dict(f.partition("=")[::2] for f in rest.split() if "=" in f)
    want = {k: cfg.get(f"workload.routing.{k}") for k in _SYNTHETIC}
    hot = cfg.get("workload.routing.hot_experts") or 0
    want |= {"hot": f"{hot}@{cfg.get('workload.routing.hot_share')}" if hot else None}
    want |= {"seed": cfg.get("workload.seed")}
    if kind == "trace":  # `trace <name> [tasks] ...`: the tasks a config selects
        return (
            _tasks_differ(cfg, rest)
            or _start_differs(cfg.get("workload.seed"), rest)
            or _layers_differ(cfg.get("model.moe_layers"), rest)
        )
    for key, value in want.items():
        got = ran.get(key)
        if (value is not None or key == "hot") and not _same_text(value, got):
            where = {"seed": "workload.seed", "hot": "workload.routing.hot_experts"}.get(key)
            shown = hot if key == "hot" else value
            said = f"{key}={got}" if got is not None else f"no {key}="
            return (
                f"config.yaml's {where or f'workload.routing.{key}'} is {short(shown)} where "
                f"the run's summary.json has routing {said}"
            )
    return None


def _same_text(value: Any, got: str | None) -> bool:
    """A config's value and the text a summary wrote of it (`:g` for a number)."""
    if value is None or got is None:
        return value is None and got is None
    if isinstance(value, str) and "@" in value:  # hot: `<experts>@<share>`
        n, _, share = value.partition("@")
        return _same_text(int(n), got.partition("@")[0]) and _same_text(
            float(share), got.partition("@")[2]
        )
    try:
        return float(value) == float(got)
    except (TypeError, ValueError):
        return str(value) == got


def _start_differs(seed: Any, rest: str) -> str | None:
    """A trace replay's `in N sequences, start seq S`: the sequence workload.seed starts at."""
    m = re.search(r"in (\d+) sequences, start seq (\d+)", rest)
    if m is None or not isinstance(seed, int) or seed % int(m[1]) == int(m[2]):
        return None
    return (
        f"config.yaml's workload.seed is {seed} where the run's summary.json has routing start "
        f"seq {m[2]} of {m[1]} (seed % {m[1]})"
    )


def _names(value: Any) -> set[str]:
    """A flattened list of task names (its JSON), or one name given as a string."""
    try:
        names = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        names = [value]
    return {str(n) for n in (names if isinstance(names, list) else [names] if names else [])}


def _layers_differ(moe_layers: Any, rest: str) -> str | None:
    """A trace replay's `, its first L of N MoE layers` (a model of fewer MoE layers than the
    trace's replays its first ones; none said: all N), against the config's model.moe_layers
    (absent where the model is a config.json's, which config.yaml does not hold)."""
    try:
        layers = json.loads(moe_layers) if isinstance(moe_layers, str) else None
    except json.JSONDecodeError:
        return None
    n = re.search(
        r"in \d+ sequences,.*wrapped \d+x(?:, its first (\d+) of (\d+) MoE layers)?", rest
    )
    if not isinstance(layers, list) or n is None:
        return None
    from core.traces import N_LAYERS  # (numpy: only where a trace run is read)

    said = int(n[1]) if n[1] else N_LAYERS
    if len(layers) == said:
        return None
    return (
        f"config.yaml's model.moe_layers has {len(layers)} MoE layers where the run's "
        f"summary.json has routing of the trace's first {said}"
    )


def _tasks_differ(cfg: dict[str, Any], rest: str) -> str | None:
    """A trace replay's `[a,b]` tasks, against the config's tasks and exclude_tasks."""
    if "[" not in rest:
        return None
    ran = set(filter(None, rest.partition("[")[2].partition("]")[0].split(",")))
    tasks, exclude = (_names(cfg.get(f"workload.routing.{k}")) for k in ("tasks", "exclude_tasks"))
    want = tasks - exclude if tasks else None
    if (want is not None and ran != want) or ran & exclude:
        key = "tasks" if want is not None and ran != want else "exclude_tasks"
        return _differs(
            f"workload.routing.{key}",
            sorted(tasks if key == "tasks" else exclude),
            "routing tasks",
            sorted(ran),
        )
    return None


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
