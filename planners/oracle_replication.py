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
    EPRunner,
    ReplicaParams,
    Replicator,
    resolve_layout,
)
from planners.registry import register


@dataclass(frozen=True)
class OracleParams(ReplicaParams):
    pass


class PeekedReplicas:
    def __init__(self, rep: Replicator, routing: CausalRouting, n_batches: int) -> None:
        self.rep, self.routing, self.n_batches = rep, routing, n_batches

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        step, batch = divmod(t, self.n_batches)
        load = np.asarray(self.routing.peek(step, moe, batch).counts, dtype=np.float64)
        return self.rep.place(moe, load, load if self.rep.rehome_due(t) else None), ()

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        pass


@register("oracle_replication", OracleParams)
class OracleReplication:
    def __init__(self, params: OracleParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        layout = resolve_layout(self.params, ctx)
        out.meta["upper_bound"] = "oracle: peeks at the coming iteration's routing"
        rep, _ = Replicator.for_run(self.params, ctx, layout, "oracle_replication")
        EPRunner(ctx, out, layout).plan(PeekedReplicas(rep, ctx.routing, ctx.workload.n_batches))
