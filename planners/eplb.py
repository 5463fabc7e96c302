"""`eplb`: DeepSeek EPLB as a planner: every `interval` iterations, re-place all expert copies
(homes and replicas) from the load matrix of the last `window` iterations with EPLB's
hierarchical or global policy (planners/eplb_algo.py). Causal: layer l's window is known at
iteration t-1's gate of layer l, so layer l's new copies load behind the rest of that iteration.

Before any load is seen it places from `initial_load` (a .npy [MoE layers, experts] file, e.g.
counts from a training split) or, without one, from uniform load.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import ConfigError, integer_below
from core.planner import PlanContext, Planner
from core.routing import GateView
from core.schedule import ScheduleBuilder
from planners.ep.params import EPParams, Layout, resolve_layout, within_run
from planners.ep.placement import read_load
from planners.ep.runner import EPRunner
from planners.eplb_algo import check_args, rebalance_experts
from planners.registry import register


@dataclass(frozen=True)
class EPLBParams(EPParams):
    window: int = 8  # iterations of load history EPLB places from
    interval: int = 4  # re-place every this many iterations
    num_groups: int = (
        1  # expert groups (group-limited routing); hierarchical policy when num_nodes divides it
    )
    num_nodes: int = 1  # nodes the devices are spread over
    initial_load: str = (
        ""  # optional .npy [MoE layers, experts] load matrix for the first placement
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.no_gate("eplb")
        for name in ("window", "interval", "num_groups", "num_nodes"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"eplb: {integer_below(name, getattr(self, name), 1)}; pass "
                    f"planner.params.{name}=1 or more"
                )


class EPLBPolicy:
    def __init__(self, p: EPLBParams, layout: Layout, initial: np.ndarray) -> None:
        self.p, self.layout = p, layout
        e, g = layout.n_experts, layout.n_devices
        # EPLB gives every GPU the same number of physical experts: the budget rounded down to that
        self.n_phy = (e + layout.replicas) // g * g
        if self.n_phy < e:
            need = -e % g
            raise ConfigError(
                f"eplb: {e} experts over n_devices={g} need at least {need} replicas so every "
                f"device holds as many physical experts (EPLB's layout), got replicas="
                f"{layout.replicas}; raise planner.params.replica_slots to 1+ (or replicas to "
                f"{need}+)"
            )
        check_args(initial.shape, self.n_phy, p.num_groups, p.num_nodes, layout.n_devices)
        self.history: list[np.ndarray] = []  # per iteration: [L, E] counts seen so far
        self.gates: dict[tuple[int, int], tuple[int, ...]] = {}
        self.current = [self._slots(initial[m]) for m in range(initial.shape[0])]

    def _slots(self, load: np.ndarray) -> np.ndarray:
        phy2log, _, _ = rebalance_experts(
            load[None], self.n_phy, self.p.num_groups, self.p.num_nodes, self.layout.n_devices
        )
        per_dev = phy2log[0].reshape(self.layout.n_devices, -1)  # slot s on device s // (R / G)
        slots = np.full((self.layout.n_devices, self.layout.slots_per_device), -1, dtype=np.int64)
        slots[:, : per_dev.shape[1]] = per_dev
        return slots

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        if t == 0 or t % self.p.interval:
            return self.current[moe], ()
        past = range(max(0, t - self.p.window), t)
        load = sum(self.history[i][moe] for i in past)
        if load.sum() > 0:
            self.current[moe] = self._slots(load)
        return self.current[moe], self.gates[(t - 1, moe)]

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        if moe == 0:
            self.history.append(np.zeros((len(self.current), self.layout.n_experts)))
        self.history[t][moe] = view.counts
        self.gates[(t, moe)] = gates


@register("eplb", EPLBParams)
class EPLB(Planner):
    def __init__(self, params: EPLBParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        within_run(self.params, ctx, "eplb", ("interval",))
        layout = resolve_layout(self.params, ctx)
        n_layers, e = len(ctx.model.moe_layers), ctx.model.n_experts
        if self.params.initial_load:
            initial = read_load(self.params.initial_load, n_layers, e, "eplb")
        else:
            initial = np.ones((n_layers, e))
        policy = EPLBPolicy(self.params, layout, initial)
        out.meta["eplb"] = dict(
            window=self.params.window,
            interval=self.params.interval,
            warm_start=bool(self.params.initial_load),
            replicas_used=policy.n_phy - e,
        )
        EPRunner(ctx, out, layout).plan(policy)
