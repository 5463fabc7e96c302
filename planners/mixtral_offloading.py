"""`mixtral_offloading`: dvmazur/mixtral-offloading's per-layer LRU expert cache with speculative
loading of the next layer's experts (anchors A6).

Modelled behaviour: one batch at a time; dense weights (and KV) on the GPU, each routed expert
offloaded on its own. Every MoE layer owns an LRU cache of a few GPU expert slots (the spare GPU
memory split evenly over layers), which exploits reuse between consecutive tokens. After layer
l's gate, the next layer's experts are guessed and loaded into layer l+1's cache while layer l's
experts compute; misses load on demand when l+1's gate runs.

The real system guesses by applying layer l+1's gate to layer l's hidden state. The simulator has
no hidden states and must stay causal, so the guess is a *correlation predictor*: a table of
(expert at layer l -> expert at layer l+1) transitions counted from tokens already routed
(plus layer popularity), applied per token to the routing layer l's gate just revealed; the
union of each token's top-k guesses is loaded. Simplification: experts are not quantized (the
real system uses 2-3 bit HQQ experts to fit); the caches start empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import ConfigError, gb_apart, integer_below
from core.planner import PlanContext, Planner
from core.schedule import ScheduleBuilder
from core.types import Tensor
from planners.common import Emitter
from planners.expert_cache import (
    LRUCache,
    PrefetchStats,
    cache_statement,
    sized_cache,
    top_experts,
)
from planners.registry import register


@dataclass
class _Run:
    """One run's per-layer caches and what its correlation predictor has learnt."""

    em: Emitter
    caches: dict[int, LRUCache]  # MoE decoder layer -> its GPU expert slots
    # [MoE layers, E, E]: tokens routed to e at MoE layer i then to e' at i+1 (add-one prior)
    trans: np.ndarray
    popularity: np.ndarray  # [MoE layers, E] tokens routed to each expert (add-one prior)
    stats: PrefetchStats


@dataclass(frozen=True)
class MixtralOffloadingParams:
    speculate: bool = True  # load the guessed next-layer experts ahead of their gate
    guess_k: int = 0  # experts guessed per token; 0 = the model's top-k
    cache_share: float = 1.0  # share of the spare GPU memory given to the per-layer caches

    def __post_init__(self) -> None:
        if self.guess_k < 0:
            raise ValueError(integer_below("guess_k", self.guess_k, 0, "0: the model's top-k"))
        if not 0 < self.cache_share <= 1:
            raise ValueError(
                f"cache_share={self.cache_share} must be in (0, 1]; pass a share in it, e.g. 0.5"
            )


@register("mixtral_offloading", MixtralOffloadingParams)
class MixtralOffloading(Planner):
    def __init__(self, params: MixtralOffloadingParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl, p = ctx.model, ctx.workload, self.params
        if p.guess_k > m.n_experts:  # it was cut to n_experts without a word
            raise ConfigError(
                f"planner mixtral_offloading: planner.params.guess_k={p.guess_k} exceeds the "
                "model's "
                f"{m.n_experts} experts; pass planner.params.guess_k <= {m.n_experts} (0 = its "
                "top-k)"
            )
        n_moe = len(m.moe_layers)

        def short(cache: int) -> str:
            needs, spare = gb_apart(n_moe * m.expert_bytes, cache)
            return (
                f"mixtral_offloading: needs one GPU expert slot per MoE layer ({needs} GB), only "
                f"{spare} GB is spare (the real system quantizes experts to 2-3 bits to fit); "
            )

        placement, cache_bytes = sized_cache(ctx, p.cache_share, n_moe * m.expert_bytes, short)
        em = Emitter(ctx, out, placement)
        slots = min(cache_bytes // m.expert_bytes // max(n_moe, 1), m.n_experts)
        run = _Run(
            em,
            {layer: LRUCache(em, slots) for layer in m.moe_layers},
            np.ones((n_moe, m.n_experts, m.n_experts)),
            np.ones((n_moe, m.n_experts)),
            PrefetchStats(n_moe),
        )
        last: int | None = None
        for batch in range(wl.n_batches):
            for step in range(wl.n_steps):
                prev_ids: np.ndarray | None = None
                guessed: set[int] = set()
                for layer in range(m.n_layers):
                    attn_load = em.load(Tensor.ATTENTION, step, layer, deps=(last,))
                    kv = em.kv_load(step, layer, batch, deps=(last,))
                    last = em.attention(step, layer, batch, (attn_load, kv, last), last_batch=True)
                    em.kv_store(step, layer, batch, last)
                    if m.is_moe(layer):
                        last, guessed, prev_ids = self._moe_layer(
                            run, step, layer, batch, last, prev_ids, guessed
                        )
                    ffn_load = em.load(Tensor.FFN, step, layer, deps=(last,))
                    last = em.ffn(step, layer, batch, (ffn_load, last), last_batch=True) or last
                head_load = em.load(Tensor.HEAD, step, -1, deps=(last,))
                last = em.head(step, batch, (head_load, last), last_batch=True)
        hits = sum(c.hits for c in run.caches.values())
        total = hits + sum(c.misses for c in run.caches.values())
        out.meta.update(
            n_batches_shared=1,
            cache_slots_per_layer=int(slots),
            gpu_cache=cache_statement(
                int(slots) * n_moe, m.expert_bytes, f", {int(slots)} in each MoE layer"
            ),
            cache_hit_rate=round(hits / max(total, 1), 4),
            **run.stats.summary(),
        )

    def _moe_layer(
        self,
        run: _Run,
        step: int,
        layer: int,
        batch: int,
        last: int,
        prev_ids: np.ndarray | None,
        guessed: set[int],
    ) -> tuple[int, set[int], np.ndarray]:
        """MoE layer `layer` after its attention op `last`: the gate, the transitions it reveals
        from the previous MoE layer's routing `prev_ids` (how well `guessed` fared), each routed
        expert from the layer's cache (hits first, misses loaded), and the next MoE layer's
        guessed experts loaded behind the misses. Returns the last expert op, the new guess and
        this layer's routing."""
        em, p = run.em, self.params
        m = em.model
        # One FIFO for prefetches and on-demand loads: memory is then granted in program order
        # (an on-demand load on its own stream could take the memory an eviction freed for an
        # earlier prefetch, and deadlock).
        on_demand = em.weights
        mi = m.moe_index(layer)
        gate_load = em.load(Tensor.GATE, step, layer, deps=(last,))
        gate, view = em.gate(step, layer, batch, (gate_load, last), last_batch=True)
        run.stats.record(mi, guessed, view.counts)
        run.popularity[mi] += view.counts
        if prev_ids is not None:  # learn l-1 -> l transitions, now both are revealed
            pairs = prev_ids[:, :, None].astype(np.int64) * m.n_experts + view.ids[:, None, :]
            run.trans[mi - 1] += np.bincount(pairs.ravel(), minlength=m.n_experts**2).reshape(
                m.n_experts, m.n_experts
            )
        cache = run.caches[layer]
        needed = [int(e) for e in np.flatnonzero(view.counts)]
        order = sorted(needed, key=lambda e: (layer, e) not in cache)  # hits first
        last, after = gate, gate  # speculative loads queue behind this layer's misses
        for e in order:
            hit = (layer, e) in cache
            load = cache.ensure(step, layer, e, on_demand, deps=(gate,))
            after = after if hit or load is None else load
            last = em.expert(
                step, layer, batch, e, int(view.counts[e]), (load, last), last_use=False
            )
            cache.used(layer, e, last)
        guessed = set()
        if p.speculate and mi + 1 < len(m.moe_layers):
            nxt, k_guess = m.moe_layers[mi + 1], p.guess_k or m.top_k
            learnt = run.trans[mi], run.popularity[mi + 1]
            guessed = self._speculate(
                em, run.caches[nxt], step, nxt, *learnt, view.ids, k_guess, (gate, after)
            )
        return last, guessed, view.ids

    @staticmethod
    def _speculate(
        em: Emitter,
        cache: LRUCache,
        step: int,
        layer: int,
        trans: np.ndarray,
        popularity: np.ndarray,
        ids: np.ndarray,
        k: int,
        deps: tuple[int, ...],
    ) -> set[int]:
        """Guess each token's next-layer top-k from its current experts; load the union's best."""
        rows = trans / trans.sum(axis=1, keepdims=True)  # [E, E'] P(e' | e)
        e = len(popularity)
        codes, n_tok = np.unique(
            ids.astype(np.int64) @ (e ** np.arange(ids.shape[1])), return_counts=True
        )
        combos = (
            codes[:, None] // (e ** np.arange(ids.shape[1]))[None, :]
        ) % e  # [C, k] distinct token routings
        per_combo = rows[combos].sum(axis=1) + 1e-3 * popularity / popularity.sum()  # [C, E']
        top = np.argsort(-per_combo, axis=1, kind="stable")[:, :k]  # [C, k]
        votes = np.bincount(top.ravel(), weights=np.repeat(n_tok, top.shape[1]), minlength=e)
        chosen = top_experts(votes, min(cache.capacity, int(np.count_nonzero(votes))))
        for e in chosen:
            cache.prefetch(
                step, layer, e, em.weights, deps, protect=tuple((layer, c) for c in chosen)
            )
        return set(chosen)
