"""What a summary.json read back may hold beyond the metrics `tables.metric_problem` checks:
the planner's own `plan` mapping, and keys this version does not know.

Per key: a `plan` key a reader of this version reads (`PLAN_KEYS`) has the type every planner
writes it with; a `plan` key it does not know is accepted as it is (a planner registered later,
or a later moepipe, adds its own, and the table shows it as a column); so is a top-level key it
does not know (a later version's metric). What no run writes is refused wherever it is: a
number that is NaN or infinite, and a key that takes the column of another (`plan.oracle` beside
`plan: {oracle: ...}`), which the table would show as one of the two without a word.
"""

from __future__ import annotations

import math
from typing import Any

from experiments.common.run_config import short as _short

TIERS = ("gpu", "cpu", "disk")


def _number(v: Any, top: float | None = None) -> bool:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v) and 0 <= v <= (1e30 if top is None else top)
    except OverflowError:  # an int past a float's range
        return False


def _whole(v: Any) -> bool:
    return _number(v) and v == int(v)


def _per_tier(check: Any) -> Any:
    return lambda v: isinstance(v, dict) and all(k in TIERS and check(x) for k, x in v.items())


def _or_null(check: Any) -> Any:
    return lambda v: v is None or check(v)


# plan key (dotted) -> (what it must be, in words; its check): those moepipe's readers read
PLAN_KEYS: dict[str, tuple[str, Any]] = {
    "placement": ("a mapping", lambda v: isinstance(v, dict)),
    "placement.dense": (f"a tier ({', '.join(TIERS)})", lambda v: v in TIERS),
    "placement.kv_layers": ("a mapping of tier -> non-negative integer", _per_tier(_whole)),
    "placement.expert_layers": ("a mapping of tier -> non-negative integer", _per_tier(_whole)),
    "placement.resident_gb": ("a mapping of tier -> number >= 0", _per_tier(_number)),
    "placement.working_gb": ("a number >= 0", _number),
    "n_batches_shared": ("a non-negative integer", _whole),
    "oracle": ("true or false", lambda v: isinstance(v, bool)),
    "prefetch_accuracy": ("a number in [0, 1] or null", _or_null(lambda v: _number(v, 1))),
    "prefetch_used_frac": ("a number in [0, 1] or null", _or_null(lambda v: _number(v, 1))),
    "ep": ("a mapping", lambda v: isinstance(v, dict)),
    "eplb": ("a mapping", lambda v: isinstance(v, dict)),
    "n_plan": ("a mapping", lambda v: isinstance(v, dict)),
}


def plan_problem(summary: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what it is) of the first entry of `summary` no run writes: a known `plan` key of
    another type, a number anywhere that is NaN or infinite, or two keys of one column; None
    where there is none. (`plan` itself, when there, is a mapping: `metric_problem` checks.)"""
    plan = summary.get("plan", {})
    if isinstance(plan, dict):
        for key, (what, ok) in PLAN_KEYS.items():
            parent, _, name = key.rpartition(".")
            holder = plan.get(parent, {}) if parent else plan
            if isinstance(holder, dict) and name in holder and not ok(holder[name]):
                return f"plan.{key}", f"{_short(holder[name])}, not {what}"
    bad = _non_finite(summary, "")
    if bad:
        return bad, "not a finite number (no run writes NaN or infinity)"
    return _one_column(summary)


def _non_finite(value: Any, key: str) -> str | None:
    """The dotted key of the first float inside `value` that is NaN or infinite."""
    if isinstance(value, float) and not math.isfinite(value):
        return key or "(the file)"
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        found = _non_finite(v, f"{key}.{k}" if key else str(k))
        if found:
            return found
    return None


def _one_column(summary: dict[str, Any]) -> tuple[str, str] | None:
    """A dotted top-level key that names a nested one too (`plan.oracle` beside `plan`'s
    `oracle`): both are one column of the table."""
    for key in summary:
        head, dot, rest = str(key).partition(".")
        if not dot:
            continue
        holder: Any = summary.get(head)
        for part in rest.split("."):
            holder = holder.get(part) if isinstance(holder, dict) and part in holder else None
        if holder is not None:
            return str(key), f"a key beside {head}'s own {rest!r}: both are the column {key}"
    return None
