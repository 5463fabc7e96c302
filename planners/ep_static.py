"""`ep_static`: the expert-parallel baseline: expert e lives on device e % G, no replicas.

A layer lasts as long as the device whose experts drew the most tokens (planners/ep/).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.planner import PlanContext, Planner
from core.routing import GateView
from core.schedule import ScheduleBuilder
from planners.ep.params import EPParams, Layout, resolve_layout
from planners.ep.runner import EPRunner
from planners.registry import register


@dataclass(frozen=True)
class EPStaticParams(EPParams):
    replica_slots: int = 0  # the baseline places no replicas

    def __post_init__(self) -> None:
        super().__post_init__()
        self.no_gate("ep_static")


class RoundRobin:
    def __init__(self, layout: Layout) -> None:
        self.slots = layout.round_robin()

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        return self.slots, ()

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        pass


@register("ep_static", EPStaticParams)
class EPStatic(Planner):
    def __init__(self, params: EPStaticParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        layout = resolve_layout(self.params, ctx)
        EPRunner(ctx, out, layout).plan(RoundRobin(layout))
