"""`oracle_replication`: `predictive_replication` with the true loads of the coming iteration
(`CausalRouting.peek`): an UPPER BOUND, labelled as such in every output. Its copies still wait
for the slot's previous use, so only the prediction is perfect, not the weight movement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.planner import PlanContext
from core.routing import CausalRouting, GateView
from core.schedule import ScheduleBuilder
from planners.expert_parallel import (
    EPParams,
    EPRunner,
    Layout,
    home_slots,
    read_load,
    replicate_onto,
    resolve_layout,
)
from planners.registry import register


@dataclass(frozen=True)
class OracleParams(EPParams):
    initial_load: str = (
        ""  # optional .npy [MoE layers, E] load: homes packed by it (else round-robin)
    )


class PeekedReplicas:
    def __init__(
        self, layout: Layout, routing: CausalRouting, n_batches: int, homes: list[np.ndarray]
    ) -> None:
        self.layout, self.routing, self.n_batches, self.homes = layout, routing, n_batches, homes

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        step, batch = divmod(t, self.n_batches)
        counts = self.routing.peek(step, moe, batch).counts
        return replicate_onto(
            np.asarray(counts, dtype=np.float64), self.layout, self.homes[moe]
        ), ()

    def observe(self, t: int, moe: int, view: GateView, gate_op: int) -> None:
        pass


@register("oracle_replication", OracleParams)
class OracleReplication:
    def __init__(self, params: OracleParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        layout = resolve_layout(self.params, ctx)
        out.meta["upper_bound"] = "oracle: peeks at the coming iteration's routing"
        n_layers, e = len(ctx.model.moe_layers), ctx.model.n_experts
        init = (
            read_load(self.params.initial_load, n_layers, e, "oracle_replication")
            if self.params.initial_load
            else None
        )
        homes = [home_slots(layout, None if init is None else init[m]) for m in range(n_layers)]
        EPRunner(ctx, out, layout).plan(
            PeekedReplicas(layout, ctx.routing, ctx.workload.n_batches, homes)
        )
