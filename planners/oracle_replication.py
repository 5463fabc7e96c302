"""`oracle_replication`: `predictive_replication` with the true loads of the coming iteration
(`CausalRouting.peek`): an UPPER BOUND, labelled as such in every output. Its copies still wait
for the slot's previous use, so only the prediction is perfect, not the weight movement.

With `truth_weight` below 1 it plans from the true load blended with the prior (`initial_load`'s
shares, else uniform, scaled to the true total): a prediction of known error, whose
total-variation distance from the truth is (1 - truth_weight) times the prior's. A sweep of it
shows how close to the truth a predictor must come to reach a balancedness or a makespan; it is
then no longer a bound, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from core.errors import ConfigError
from core.planner import PlanContext, Planner
from core.routing import CausalRouting, GateView
from core.schedule import ScheduleBuilder
from planners.ep.params import ReplicaParams, resolve_layout
from planners.ep.placement import PredictionError, Replicator
from planners.ep.runner import EPRunner
from planners.registry import register


@dataclass(frozen=True)
class OracleParams(ReplicaParams):
    # the true load's weight in the load placements are planned from; the rest is the prior's
    truth_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.truth_weight) and 0.0 <= self.truth_weight <= 1.0):
            raise ConfigError(
                f"oracle_replication: truth_weight={self.truth_weight} must be in [0, 1] "
                "(1: the true load, an upper bound; 0: the prior alone); pass one in it"
            )


class PeekedReplicas:
    def __init__(
        self,
        rep: Replicator,
        routing: CausalRouting,
        n_batches: int,
        truth_weight: float = 1.0,
        prior: np.ndarray | None = None,
    ) -> None:
        self.rep, self.routing, self.n_batches = rep, routing, n_batches
        self.w, self.prior = truth_weight, prior
        self.error = PredictionError()

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        step, batch = divmod(t, self.n_batches)
        load = np.asarray(self.routing.peek(step, moe, batch).counts, dtype=np.float64)
        if self.w < 1.0:
            row = self.prior[moe] if self.prior is not None else np.zeros(len(load))
            share = row / row.sum() if row.sum() > 0 else np.full(len(load), 1.0 / len(load))
            load = self.w * load + (1.0 - self.w) * share * load.sum()
        self.error.planned_from(t, moe, load)
        return self.rep.place(moe, load, load if self.rep.rehome_due(t) else None), ()

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        self.error.observed(t, moe, view.counts)


@register("oracle_replication", OracleParams)
class OracleReplication(Planner):
    def __init__(self, params: OracleParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        layout = resolve_layout(self.params, ctx)
        w = self.params.truth_weight
        if w == 1.0:
            out.meta["upper_bound"] = "oracle: peeks at the coming iteration's routing"
        else:
            out.meta["not_a_bound"] = (
                f"peeks at the coming iteration's routing, plans from {w:g} of it and "
                f"{1 - w:g} of the prior: not a bound"
            )
        rep, init = Replicator.for_run(self.params, ctx, layout, "oracle_replication")
        policy = PeekedReplicas(rep, ctx.routing, ctx.workload.n_batches, w, init)
        EPRunner(ctx, out, layout).plan(policy)
        assert out.ep is not None
        out.ep = replace(out.ep, prediction_tv=policy.error.mean())
