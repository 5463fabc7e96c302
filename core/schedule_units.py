"""The units a schedule's ops name (step, layer, batch, expert, device) within the run's: a
planner that loops over more layers, batches, experts, steps or devices than the model,
workload and its layout have is refused naming the unit and its valid range (`within_units`),
not an IndexError in a shared helper or a silent op for a layer that does not exist."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from core.errors import ScheduleBug
from core.schedule import Schedule, ScheduleBuilder
from core.spec import ModelSpec, Workload

# a unit's column, the context's field that counts it, and its lowest value (-1: "none" or
# "every batch of the group")
_UNITS = (
    ("step", "ctx.workload.n_steps", 0),
    ("layer", "ctx.model.n_layers", -1),
    ("batch", "ctx.workload.n_batches", -1),
    ("expert", "ctx.model.n_experts", -1),
)
_PLURAL = {"step": "steps", "layer": "layers", "batch": "batches", "expert": "experts"}


@contextmanager
def within_units(builder: ScheduleBuilder, model: ModelSpec, workload: Workload) -> Iterator[None]:
    """Inside, the planner emits into `builder`. Where it raises (an IndexError in a shared
    helper: the routing of a layer or batch that is not there), an op it emitted past the run's
    units is the cause named; the whole schedule's are checked after (`check_units`)."""
    try:
        yield
    except Exception as e:
        line = out_of_range(builder.build(), model, workload)
        if line:
            raise ScheduleBug(line) from e
        raise


def check_units(schedule: Schedule, model: ModelSpec, workload: Workload) -> None:
    """Every op's units within the run's (`out_of_range`), read from the columns the validator
    reads anyway."""
    line = out_of_range(schedule, model, workload)
    if line:
        raise ScheduleBug(line)


def out_of_range(schedule: Schedule, model: ModelSpec, workload: Workload) -> str:
    """One line naming the first op whose step, layer, batch, expert or device is past the
    run's (its planner, the unit and its valid range); "" when every op's are within."""
    if not schedule.ops:
        return ""
    cols = schedule.columns()
    counts = {
        "step": workload.n_steps,
        "layer": model.n_layers,
        "batch": workload.n_batches,
        "expert": model.n_experts,
    }
    planner = schedule.meta.get("planner", "")
    for unit, field, low in _UNITS:
        values = cols[unit]
        if unit == "batch":  # a span of batches ends within too
            values = np.where(values >= 0, values + cols["batches"] - 1, values)
        bad = np.flatnonzero((values < low) | (values >= counts[unit]))
        if len(bad):
            op = schedule.ops[int(bad[0])]
            return (
                f"planner {planner}: {op.label()} names {unit} {int(values[bad[0]])}, past the "
                f"run's {counts[unit]} {_PLURAL[unit]} (valid 0..{counts[unit] - 1}); plan "
                f"within {field}"
            )
    return _past_devices(schedule, planner)


def _past_devices(schedule: Schedule, planner: str) -> str:
    """The line for a stream on a device past the layout's (one device without an EP layout)."""
    n = schedule.ep.n_devices if schedule.ep is not None else 1
    for spec in schedule.streams.values():
        if not 0 <= spec.device < n:
            field = "its EP layout's n_devices" if schedule.ep is not None else "one device"
            return (
                f"planner {planner}: stream {spec.name} is on device {spec.device}, past the "
                f"run's {n} device{'s' * (n != 1)} (valid 0..{n - 1}); plan within {field}"
            )
    return ""


def not_a_number(ops: list[Any], name: str, dt: type) -> str:
    """The line for the first of `ops` whose field `name` numpy cannot cast to its column's
    `dt` (None, NaN, a list, an int past int64: a TypeError or OverflowError otherwise), else
    the first whose unit is not whole (0.5, which the cast would read as 0)."""
    kind = "a whole number" if np.issubdtype(dt, np.integer) else "a finite number"
    for whole in (False, True):
        for op in ops:
            value, one = getattr(op, name), np.empty(1, object)
            one[0] = value  # (a list as one value, not an array of its items)
            try:
                if not whole or one.astype(dt)[0] == float(value):
                    one.astype(dt)
                    continue
            except (TypeError, ValueError, OverflowError):
                pass
            return (
                f"{op.label()}: {name}={value!r:.40} is not {kind} within "
                f"{np.dtype(dt).name}'s range; give every op's {name} as one"
            )
    return f"an op's {name} is not a number its column holds"
