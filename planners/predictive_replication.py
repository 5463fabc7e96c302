"""`predictive_replication`: the replication paper's idea (MoE-MPMC) as a planner: predict each
MoE layer's per-expert load for the coming iteration, replicate the experts predicted to
overload into the replica slots (EPLB's greedy, or FasterMoE's cost gate with `gate`), split each
expert's tokens over its copies, and prefetch the changed copies before the layer; homes are
re-placed every `rehome_interval`. Its predictors (`last`, `ema`, `window`, `layer_corr`,
`task_mix`) and choices: docs/replication-model.md#predictive-replication-and-its-predictors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from core.errors import ConfigError, integer_below
from core.planner import PlanContext, Planner
from core.routing import GateView
from core.schedule import ScheduleBuilder
from core.types import ReplicaPredictor
from planners.ep.params import ReplicaParams, resolve_layout, within_run
from planners.ep.placement import PredictionError, Replicator, read_npy
from planners.ep.runner import EPRunner
from planners.registry import register

PREDICTORS = tuple(ReplicaPredictor)


# prior_weight's highest: a million iterations' worth, past any run's (times a label's
# selections it overflowed a float64 to inf, and the shares were NaN)
MAX_PRIOR = 1e6


@dataclass(frozen=True)
class PredictiveParams(ReplicaParams):
    predictor: str = ReplicaPredictor.LAYER_CORR  # a ReplicaPredictor (configs give strings)
    ema_alpha: float = 0.5  # weight of the newest iteration in the EMA
    window: int = 4  # `window` (and `task_mix`'s online part): the last this many iterations
    # `window` predictor: the prior's share (`initial_load`) stays in the mean as this many
    # iterations' worth, so one noisy batch does not replace a whole training split's load
    # (`task_mix`: each label's training share, as many iterations' worth of that label)
    prior_weight: float = 0.0
    table: str = (
        ""  # optional .npy [MoE layers, E, E] transition counts from a training split (layer_corr)
    )
    # Optional .npy [S, MoE layers, E] loads of training groups (e.g. each held-out-sized split of
    # the training sequences): before any iteration has been seen at a layer, the gate judges a
    # placement by its mean busiest-device time over the prediction and these loads (scaled to the
    # prediction's total), a hedge against the prior being another split's load.
    prior_scenarios: str = ""
    # `task_mix` predictor: .npy [labels, MoE layers, E] a training split's load per request label
    # (the ESFT trace's tasks, in its task_names order)
    task_load: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.predictor not in PREDICTORS:
            raise ConfigError(
                f"predictive_replication: planner.params.predictor={self.predictor!r} unknown; "
                "valid: "
                f"{', '.join(PREDICTORS)}"
            )
        object.__setattr__(self, "predictor", ReplicaPredictor(self.predictor))
        if self.predictor == ReplicaPredictor.TASK_MIX and not self.task_load:
            raise ConfigError(
                "predictive_replication: predictor task_mix needs task_load=<.npy [labels, MoE "
                "layers, experts]>, a training split's load per request label; pass it, or "
                "choose another predictor"
            )
        if self.task_load and self.predictor != ReplicaPredictor.TASK_MIX:
            raise ConfigError(
                f"predictive_replication: task_load is read only by predictor task_mix, not "
                f"{self.predictor}; drop task_load or set predictor=task_mix"
            )
        if self.window < 1:
            raise ConfigError(
                f"predictive_replication: {integer_below('window', self.window, 1)}; pass "
                "window=1 or more (iterations in the load's mean)"
            )
        if not (math.isfinite(self.prior_weight) and 0 <= self.prior_weight <= MAX_PRIOR):
            raise ConfigError(
                f"predictive_replication: prior_weight={self.prior_weight} must be a finite "
                f"number in [0, {MAX_PRIOR:g}] (iterations' worth of the prior in the window's "
                "mean; past it the prior alone decides); pass one"
            )
        if not 0.0 < self.ema_alpha <= 1.0:
            raise ConfigError(
                f"predictive_replication: ema_alpha={self.ema_alpha} must be in (0, 1]; pass "
                "one in it (1: the last iteration's load alone)"
            )


def read_table(path: str, n_layers: int, n_experts: int) -> np.ndarray:
    return read_npy(
        path,
        "predictive_replication table",
        (n_layers, n_experts, n_experts),
        f"[{n_layers} MoE layers, {n_experts}, {n_experts}]",
    )


def transition_counts(ids: np.ndarray, n_experts: int) -> np.ndarray:
    """[L, E, E] counts of (layer l-1 expert, layer l expert) pairs per token, each token's k x k
    pairs weighted 1/k; ids [T, L, k]. Row l = 0 stays zero. What `table` files hold."""
    t, n_layers, k = ids.shape
    out = np.zeros((n_layers, n_experts, n_experts))
    for layer in range(1, n_layers):
        prev, cur = ids[:, layer - 1].astype(np.int64), ids[:, layer].astype(np.int64)
        np.add.at(
            out[layer], (np.repeat(prev, k, axis=1).ravel(), np.tile(cur, (1, k)).ravel()), 1.0 / k
        )
    return out


def read_task_load(path: str, n_layers: int, n_experts: int) -> np.ndarray:
    return read_npy(
        path,
        "predictive_replication task_load",
        (None, n_layers, n_experts),
        f"[labels >= 1, {n_layers} MoE layers, {n_experts}]",
    )


def read_scenarios(path: str, n_layers: int, n_experts: int) -> np.ndarray:
    return read_npy(
        path,
        "predictive_replication prior_scenarios",
        (None, n_layers, n_experts),
        f"[scenarios >= 1, {n_layers} MoE layers, {n_experts}]",
    )


class LoadPredictor:
    """Keeps what the gates revealed; `predict` returns a load [E] and the gate ops it used.

    The EMA is kept over each iteration's shares of the selections, and a prediction is the EMA
    times iteration t's selections (`selections(t)`), so a prefill iteration's loads do not
    stand for a decode step's. With `prior` [L, E] (a training split's load, the `initial_load`
    eplb and the oracle get too) the EMA starts from its shares instead of from nothing, and the
    first iteration is predicted from it. `task_mix` reads iteration t's request labels from
    `labels(t)` ([T] per token) and each label's shares from `task_load`."""

    def __init__(
        self,
        p: PredictiveParams,
        n_layers: int,
        n_experts: int,
        selections: Callable[[int], float] = lambda t: 1.0,
        prior: np.ndarray | None = None,
        labels: Callable[[int], np.ndarray] | None = None,
    ) -> None:
        self.p, self.selections, self.labels = p, selections, labels
        self.ema = np.zeros((n_layers, n_experts))  # [L, E] shares
        self.seen = np.zeros(n_layers, dtype=bool)  # an EMA exists for this layer
        self.seen_any = np.zeros(n_layers, dtype=bool)  # an iteration's routing was observed
        self.prior_share: np.ndarray | None = None  # [L, E]
        if prior is not None:
            rows = prior.sum(1, keepdims=True)
            self.prior_share = prior / np.where(rows > 0, rows, 1.0)
            self.seen[:] = rows[:, 0] > 0
            self.ema[self.seen] = self.prior_share[self.seen]
        self.trans = np.zeros(
            (n_layers, n_experts, n_experts)
        )  # [L, E, E] layer l-1 expert -> layer l expert
        if p.table:
            self.trans += read_table(p.table, n_layers, n_experts)
        self.past: dict[int, list[np.ndarray]] = {}  # moe -> last `window` shares [E] (window)
        self.prior_scen: np.ndarray | None = None  # [S, L, E] shares
        if p.prior_scenarios:
            loads = read_scenarios(p.prior_scenarios, n_layers, n_experts)
            self.prior_scen = loads / np.maximum(loads.sum(2, keepdims=True), 1.0)
        self.task_share: np.ndarray | None = None  # [labels, L, E] (task_mix)
        # moe -> the last `window` iterations' selections per label [labels, E] (task_mix)
        self.label_past: dict[int, list[np.ndarray]] = {}
        if p.task_load:
            self.task_share = self.label_shares(read_task_load(p.task_load, n_layers, n_experts))
        self.ids: dict[int, np.ndarray] = {}  # moe -> [T, k] this iteration's ids so far
        self.gate_of: dict[tuple[int, int], tuple[int, ...]] = {}  # (t, moe) -> gate ops

    def label_shares(self, loads: np.ndarray) -> np.ndarray:
        """[labels, L, E] shares of per-label loads; a label never seen at a layer takes the
        prior's share there (uniform without a prior)."""
        rows = loads.sum(2, keepdims=True)
        fallback = self.prior_share if self.prior_share is not None else np.ones(loads.shape[1:])
        fallback = fallback / np.maximum(fallback.sum(1, keepdims=True), 1e-12)
        return np.where(rows > 0, loads / np.where(rows > 0, rows, 1.0), fallback[None])

    def predict(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        # the iteration's labels, and past iterations' routing; not the run's first iteration,
        # whose placement is loaded with the model, before any request has arrived
        if self.p.predictor == ReplicaPredictor.TASK_MIX and t > 0:
            used = self.gate_of[(t - 1, moe)] if self.label_past.get(moe) else ()
            return self.mix_share(t, moe) * self.selections(t), used
        # layer_corr from this iteration's routing at the layer before; not for a layer's first
        # placement, which is loaded before the run, before any routing exists
        if (
            self.p.predictor == ReplicaPredictor.LAYER_CORR
            and moe > 0
            and self.seen_any[moe]
            and self.trans[moe].sum() > 0
        ):
            counts = np.bincount(
                self.ids[moe - 1].ravel(), minlength=self.ema.shape[1]
            )  # [E] at layer moe-1
            rows = self.trans[moe] + 1e-3  # smoothed: experts unseen as predecessors spread thinly
            rows /= rows.sum(1, keepdims=True)
            return counts @ rows, self.gate_of[(t, moe - 1)]
        if self.p.predictor == ReplicaPredictor.WINDOW and self.past.get(moe):
            return self.window_share(moe) * self.selections(t), self.gate_of[(t - 1, moe)]
        if not self.seen[moe]:
            return np.ones(self.ema.shape[1]), ()
        load = self.ema[moe] * self.selections(t)
        return load, self.gate_of.get((t - 1, moe), ())  # from the prior alone: no gate to wait for

    def scenarios(self, moe: int, load: np.ndarray) -> np.ndarray | None:
        """[S, E] loads the cost gate judges placements on: before any iteration at `moe` has
        been observed, the prediction `load` and `prior_scenarios`' groups scaled to its total;
        afterwards None (the prediction alone)."""
        if self.seen_any[moe] or self.prior_scen is None:
            return None
        return np.stack([load, *(s * load.sum() for s in self.prior_scen[:, moe])])

    def home_share(self, moe: int) -> np.ndarray:
        """[E] the share of past iterations' load the homes are packed by: the window's mean
        (`window`) or the EMA."""
        if self.p.predictor == ReplicaPredictor.WINDOW and self.past.get(moe):
            return self.window_share(moe)
        return self.ema[moe].copy()

    def mix_share(self, t: int, moe: int) -> np.ndarray:
        """[E] iteration t's predicted share at `moe` (`task_mix`): each label's share weighted by
        how many of the iteration's tokens carry it."""
        assert self.labels is not None and self.task_share is not None
        mix = np.bincount(self.labels(t), minlength=len(self.task_share)).astype(np.float64)
        if len(mix) > len(self.task_share):
            raise ConfigError(
                f"predictive_replication: a request label {len(mix) - 1} but task_load has "
                f"{len(self.task_share)} labels; build task_load from the same trace"
            )
        return mix @ self.label_share(moe) / max(mix.sum(), 1.0)

    def label_share(self, moe: int) -> np.ndarray:
        """[labels, E] each label's share at `moe`: the training split's, and once iterations
        have been seen, the selections of that label's tokens in the last `window` of them,
        pooled, with the training split's share counted in as `prior_weight` times the mean
        selections of that label an iteration (a label not seen yet: the training split's)."""
        assert self.task_share is not None
        prior, past = self.task_share[:, moe], self.label_past.get(moe)
        if not past:
            return prior
        seen = np.sum(past, axis=0)  # [labels, E]
        n = seen.sum(1, keepdims=True)
        strength = self.p.prior_weight * n / len(past)
        return np.where(
            n > 0, (seen + strength * prior) / np.where(n > 0, n + strength, 1.0), prior
        )

    def window_share(self, moe: int) -> np.ndarray:
        """[E] the mean share of the last `window` iterations at `moe`, the prior's share
        (without one, nothing) counted in as `prior_weight` iterations."""
        past = self.past[moe]
        total, w = np.sum(past, axis=0), 0.0
        if self.prior_share is not None and self.prior_share[moe].sum() > 0:  # a prior at moe
            w = self.p.prior_weight
            total = total + w * self.prior_share[moe]
        return total / (len(past) + w)

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        counts = np.asarray(view.counts, dtype=np.float64)
        share = counts / max(counts.sum(), 1.0)
        if self.p.predictor == ReplicaPredictor.WINDOW:
            self.past[moe] = [*self.past.get(moe, []), share][-self.p.window :]
        a = (
            1.0
            if self.p.predictor == ReplicaPredictor.LAST or not self.seen[moe]
            else self.p.ema_alpha
        )
        self.ema[moe] = a * share + (1 - a) * self.ema[moe]
        self.seen[moe] = self.seen_any[moe] = True
        self.gate_of[(t, moe)] = gates
        ids = np.asarray(view.ids, dtype=np.int64)  # [T, k]
        if moe > 0 and self.p.predictor == ReplicaPredictor.LAYER_CORR:
            prev = self.ids[moe - 1]  # [T, k] same tokens, previous layer
            k = ids.shape[1]
            np.add.at(
                self.trans[moe],
                (np.repeat(prev, k, axis=1).ravel(), np.tile(ids, (1, k)).ravel()),
                1.0 / k,
            )
        self.ids[moe] = ids
        if self.p.predictor == ReplicaPredictor.TASK_MIX:  # each label's selections this iteration
            assert self.labels is not None and self.task_share is not None
            lab = np.repeat(self.labels(t), ids.shape[1])  # [T * k], in ids' order
            keep = lab < len(self.task_share)  # a label task_load lacks: refused by mix_share
            by_label = np.zeros_like(self.task_share[:, moe])  # [labels, E]
            np.add.at(by_label, (lab[keep], ids.ravel()[keep]), 1.0)
            self.label_past[moe] = [*self.label_past.get(moe, []), by_label][-self.p.window :]


class PredictedReplicas:
    def __init__(self, rep: Replicator, predictor: LoadPredictor) -> None:
        self.rep, self.predictor = rep, predictor
        self.error = PredictionError()

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        load, used = self.predictor.predict(t, moe)
        self.error.planned_from(t, moe, load)
        scenarios = self.predictor.scenarios(moe, load)
        home_load = None
        if (
            self.rep.rehome_due(t)
            and self.predictor.p.predictor == ReplicaPredictor.TASK_MIX
            and t > 0
        ):
            home_load = load / max(load.sum(), 1e-12)  # the same prediction (its gates: `used`)
        elif self.rep.rehome_due(t) and self.predictor.seen[moe]:  # shares of iterations < t
            home_load = self.predictor.home_share(moe)
            used = tuple(dict.fromkeys((*used, *self.predictor.gate_of[(t - 1, moe)])))
        return self.rep.place(moe, load, home_load, scenarios), used

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        self.error.observed(t, moe, view.counts)
        self.predictor.observe(t, moe, view, gates)


@register("predictive_replication", PredictiveParams)
class PredictiveReplication(Planner):
    def __init__(self, params: PredictiveParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        within_run(self.params, ctx, "predictive_replication", ("rehome_interval",))
        layout = resolve_layout(self.params, ctx)
        rep, init = Replicator.for_run(self.params, ctx, layout, "predictive_replication")
        wl, k = ctx.workload, ctx.model.top_k

        def selections(t: int) -> float:  # expert selections of iteration t = (step, batch)
            return float(wl.batch_size * wl.step_tokens(t // wl.n_batches) * k)

        def labels(t: int) -> np.ndarray:  # iteration t's request labels, known before its gates
            return ctx.routing.batch_labels(
                t // wl.n_batches, t % wl.n_batches, "predictive_replication predictor=task_mix"
            )

        n_layers, e = len(ctx.model.moe_layers), ctx.model.n_experts
        predictor = LoadPredictor(self.params, n_layers, e, selections, init, labels)
        names = ctx.routing.label_names
        if predictor.task_share is not None and names and len(predictor.task_share) != len(names):
            raise ConfigError(
                f"predictive_replication: task_load has {len(predictor.task_share)} labels but "
                f"the routing names {len(names)} ({', '.join(names)}); build task_load "
                "from the same trace, one row per label in its order"
            )
        out.meta["predictor"] = self.params.predictor
        policy = PredictedReplicas(rep, predictor)
        EPRunner(ctx, out, layout).plan(policy)
        assert out.ep is not None
        out.ep = replace(out.ep, prediction_tv=policy.error.mean())
