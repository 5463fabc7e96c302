"""`moe_infinity`: MoE-Infinity's activation-aware expert prefetching and caching (anchors A5).

Modelled behaviour: one batch runs at a time (a request, latency-oriented); dense weights and
the KV cache stay on the GPU when they fit and every routed expert lives in host memory (or
disk). Spare GPU memory is one expert cache shared by all layers, LRU-evicted. Each batch keeps
an *expert activation matrix* (EAM, MoE layers x experts, token counts so far, over all its
steps); finished batches' EAMs form a bounded history. After layer l's gate, the planner scores
layer l+1..l+d's experts by the current EAM plus the most cosine-similar historical EAM, and
prefetches the best ones (priority decays with distance) on the weight stream; experts the gate
then asks for that are not cached load on demand on the expert stream.

Causal: the EAM and history only hold routing revealed at gate ops. Simplifications: the
C++ runtime's priority-score eviction is plain LRU (the open-source code ships LRU too); the
cache starts empty.
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


@dataclass(frozen=True)
class MoEInfinityParams:
    prefetch_distance: int = 1  # MoE layers ahead to prefetch after each gate
    history: int = 32  # finished batches' EAMs kept for matching
    cache_share: float = 1.0  # share of the spare GPU memory given to the expert cache

    def __post_init__(self) -> None:
        for name in ("prefetch_distance", "history"):
            if getattr(self, name) < 0:
                raise ValueError(integer_below(name, getattr(self, name), 0))
        if not 0 < self.cache_share <= 1:
            raise ValueError(
                f"cache_share={self.cache_share} must be in (0, 1]; pass a share in it, e.g. 0.5"
            )


@register("moe_infinity", MoEInfinityParams)
class MoEInfinity(Planner):
    def __init__(self, params: MoEInfinityParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl, p = ctx.model, ctx.workload, self.params
        if p.prefetch_distance >= max(len(m.moe_layers), 2):  # no layer that far ahead
            raise ConfigError(
                f"planner moe_infinity: planner.params.prefetch_distance={p.prefetch_distance} "
                "reaches past the "
                f"model's {len(m.moe_layers)} MoE layers; pass at most "
                f"{max(len(m.moe_layers) - 1, 1)}"
            )

        def short(cache: int) -> str:
            spare, needs = gb_apart(cache, m.expert_bytes)
            return (
                f"moe_infinity: no GPU room for an expert cache ({spare} GB spare, one expert is "
                f"{needs} GB); "
            )

        placement, cache_bytes = sized_cache(ctx, p.cache_share, m.expert_bytes, short)
        em = Emitter(ctx, out, placement)
        # One FIFO for prefetches and on-demand loads: memory is then granted in program order
        # (an on-demand load on its own stream could take the memory an eviction freed for an
        # earlier prefetch, and deadlock).
        on_demand = em.weights
        capacity = cache_bytes // m.expert_bytes
        cache = LRUCache(em, capacity)
        n_moe = len(m.moe_layers)
        stats = PrefetchStats(n_moe)
        history: list[np.ndarray] = []  # normalised EAMs of finished batches
        predicted: dict[tuple[int, int], set[int]] = {}  # (step, moe_idx) -> experts prefetched
        last: int | None = None
        for batch in range(wl.n_batches):
            eam = np.zeros((n_moe, m.n_experts))
            for step in range(wl.n_steps):
                for layer in range(m.n_layers):
                    attn_load = em.load(Tensor.ATTENTION, step, layer, deps=(last,))
                    kv = em.kv_load(step, layer, batch, deps=(last,))
                    last = em.attention(step, layer, batch, (attn_load, kv, last), last_batch=True)
                    em.kv_store(step, layer, batch, last)
                    if m.is_moe(layer):
                        mi = m.moe_index(layer)
                        gate_load = em.load(Tensor.GATE, step, layer, deps=(last,))
                        gate, view = em.gate(step, layer, batch, (gate_load, last), last_batch=True)
                        last = gate
                        stats.record(mi, predicted.pop((step, mi), set()), view.counts)
                        eam[mi] += view.counts
                        last, after = self._experts(
                            em, cache, on_demand, step, layer, batch, view.counts, last
                        )
                        match = _best_match(eam, history)
                        for d in range(1, p.prefetch_distance + 1):
                            if mi + d >= n_moe:
                                break
                            want = _scores(eam[mi + d], None if match is None else match[mi + d])
                            k = max(int(np.count_nonzero(view.counts)) - d + 1, 1)
                            nxt = m.moe_layers[mi + d]
                            protect = tuple((layer, int(e)) for e in np.flatnonzero(view.counts))
                            chosen = set()
                            for e in top_experts(want, k):
                                cache.prefetch(step, nxt, e, em.weights, (gate, after), protect)
                                if (nxt, e) in cache:
                                    chosen.add(e)
                            predicted[(step, mi + d)] = chosen
                    ffn_load = em.load(Tensor.FFN, step, layer, deps=(last,))
                    last = em.ffn(step, layer, batch, (ffn_load, last), last_batch=True) or last
                head_load = em.load(Tensor.HEAD, step, -1, deps=(last,))
                last = em.head(step, batch, (head_load, last), last_batch=True)
            if p.history:
                history = [*history, eam / max(float(np.linalg.norm(eam)), 1e-12)][-p.history :]
        held = min(capacity, len(m.moe_layers) * m.n_experts)  # room past all: idle
        out.meta.update(
            n_batches_shared=1,
            cache_experts=held,
            gpu_cache=cache_statement(held, m.expert_bytes),
            cache_hit_rate=round(cache.hits / max(cache.hits + cache.misses, 1), 4),
            **stats.summary(),
        )

    @staticmethod
    def _experts(
        em: Emitter,
        cache: LRUCache,
        stream: str,
        step: int,
        layer: int,
        batch: int,
        counts: np.ndarray,
        last: int,
    ) -> tuple[int, int]:
        """Cached experts first (no wait), then misses; returns the last compute and the last
        on-demand load (prefetches queue behind it: the current layer's misses go first)."""
        needed = [int(e) for e in np.flatnonzero(counts)]
        order = [e for e in needed if (layer, e) in cache] + [
            e for e in needed if (layer, e) not in cache
        ]
        after = last
        for e in order:
            hit = (layer, e) in cache
            load = cache.ensure(step, layer, e, stream, deps=(last,) if hit else (after,))
            after = after if hit or load is None else load
            last = em.expert(step, layer, batch, e, int(counts[e]), (load, last), last_use=False)
            cache.used(layer, e, last)
        return last, after


def _best_match(eam: np.ndarray, history: list[np.ndarray]) -> np.ndarray | None:
    """The historical EAM most cosine-similar to the current one (MoE-Infinity's matching)."""
    if not history or not eam.any():
        return None
    cur = eam.ravel() / np.linalg.norm(eam)
    sims = [float(h.ravel() @ cur) for h in history]
    return history[int(np.argmax(sims))]


def _scores(current: np.ndarray, matched: np.ndarray | None) -> np.ndarray:
    """Score one layer's experts: this batch's own past use, plus the matched history's."""
    s = current / current.sum() if current.sum() else np.zeros_like(current)
    if matched is not None and matched.sum():
        s = s + matched / matched.sum()
    return s  # all zero when nothing is known yet: no prefetch
