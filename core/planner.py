"""The planner contract: a planner turns (model, hardware, workload, causal routing) into ops.

Planners live in `planners/` and register by name; executors only see this Protocol, so either
executor drives any planner without importing `planners/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from core.cost import CostModel
from core.hardware import HardwareSpec
from core.routing import CausalRouting
from core.schedule import ScheduleBuilder
from core.spec import ModelSpec, Workload


@dataclass(frozen=True)
class PlanContext:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    routing: CausalRouting  # reveals a layer's routing only at its gate op
    cost: CostModel  # the cost model's times, for planners that size themselves (Klotski's n)


class Planner(Protocol):
    """A planner's class subclasses this to take the default `choose_n_batches`."""

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        """Emit the whole run's ops into `out`, in program order. A run may call it twice on
        one planner (a probe of the plan's fit, stopped at its first routing read, then the
        plan): it starts afresh each time."""
        ...

    def choose_n_batches(
        self, model: ModelSpec, hw: HardwareSpec, wl: Workload, cost: CostModel
    ) -> int:
        """The batches per group `wl` runs with, decided before its routing is loaded: the
        workload's own, unless the planner sizes its group (Klotski's `n: 0`)."""
        return wl.n_batches
