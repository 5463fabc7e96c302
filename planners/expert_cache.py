"""Helpers shared by the expert-caching baselines (`moe_infinity`, `mixtral_offloading`, `fiddler`):
a placement that keeps every routed expert off the GPU and leaves the spare GPU memory for a
cache, an LRU expert cache that emits its loads and evictions, and prefetch-accuracy bookkeeping.

Causality: nothing here reads routing; callers feed it only what a gate op has revealed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from core.errors import CapacityError
from core.planner import PlanContext
from core.shown import gb
from core.types import Tensor, Tier
from planners.common import Emitter
from planners.placement import GpuEdgeError, Placement, dense_bytes, greedy_placement


def cache_placement(
    ctx: PlanContext,
    kv_sequences: int,
    layers_in_flight: int,
    cache_share: float = 1.0,
    keeps: Callable[[int], Mapping[int, int]] | None = None,
) -> tuple[Placement, int]:
    """Placement with all routed experts on CPU/disk, plus the GPU bytes left for an expert cache.

    First pass: the greedy placement with the planner's streaming working set; the GPU memory it
    leaves after dense weights and KV (`spare`) becomes the cache (`cache_share` of it). Second
    pass: the same placement with all of `spare` added to the working set, so no expert layer
    lands on the GPU statically (the cache holds them dynamically instead): a `cache_share`
    below 1 leaves the rest of it unused, not given to an expert layer. `keeps(cache bytes)`:
    layer -> the experts a planner keeps in the cache for the whole run (`fiddler`'s resident
    ones), which the second pass places nowhere else (no copy elsewhere is ever read); a layer
    it keeps whole lives on the GPU.
    """
    m, wl, hw = ctx.model, ctx.workload, ctx.hardware
    layer_max = max(m.layer_bytes(i) for i in range(m.n_layers))
    dense_stream = max(m.attn_bytes + m.gate_bytes + m.shared_ffn_bytes, m.dense_ffn_bytes)
    kv_buf = 2 * wl.batch_size * (wl.prompt_len + wl.gen_len) * m.kv_bytes_per_token
    act = 3 * kv_sequences * wl.prompt_len * m.hidden_size * m.dtype_bytes
    staging = m.expert_bytes  # disk reads pass through CPU; free CPU memory adds read-ahead
    # streamed dense weights (if dense ends up on CPU) + the head + KV buffers; experts go to cache
    weights = layers_in_flight * min(layer_max, dense_stream) + m.head_bytes
    working = weights + kv_buf
    kw: dict[str, Any] = dict(
        kv_sequences=kv_sequences,
        kv_tokens=wl.prompt_len + wl.gen_len,
        activation_bytes=act,
        cpu_staging_bytes=staging,
        working_weight_bytes=weights,
    )
    first = greedy_placement(m, hw, working_bytes=working, **kw)
    dense_gpu = dense_bytes(m) if first.dense == Tier.GPU else 0
    kv_gpu = first.kv.count(Tier.GPU) * first.kv_bytes_per_layer
    spare = hw.memory_bytes[Tier.GPU] - working - act - dense_gpu - kv_gpu
    cache = max(int(spare * cache_share), 0)
    held = keeps(cache) if keeps else {}
    placement = greedy_placement(
        m, hw, working_bytes=working + max(spare, 0), held_experts=held, **kw
    )
    assert all(
        placement.experts[i] != Tier.GPU for i in m.moe_layers if held.get(i, 0) < m.n_experts
    ), "experts must be off the GPU"
    return placement, cache


def sized_cache(
    ctx: PlanContext, cache_share: float, needs_bytes: int, short: Callable[[int], str]
) -> tuple[Placement, int]:
    """`cache_placement` of one batch (one layer in flight), refused where its cache holds less
    than `needs_bytes` (`short(cache bytes)`: the line's start, saying what it needs and has),
    or where its working set does not fit; each refusal names only the fixes that help."""
    try:
        placement, cache = cache_placement(ctx, ctx.workload.batch_size, 1, cache_share)
    except GpuEdgeError as e:  # a smaller workload helps only where its cache holds them
        if _least_cache(ctx, cache_share) < needs_bytes:
            raise CapacityError(e.only_gpu) from None
        raise
    if cache < needs_bytes:
        raise CapacityError(short(cache) + cache_fix(ctx, cache_share, needs_bytes))
    return placement, cache


def _least_cache(ctx: PlanContext, cache_share: float) -> int:
    """The cache of the least workload of `ctx`'s kind (one sequence, one token each way); -1
    where even that does not fit."""
    least = ctx.workload.with_(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)
    try:
        return cache_placement(replace(ctx, workload=least), 1, 1, cache_share)[1]
    except CapacityError:
        return -1


def cache_fix(ctx: PlanContext, cache_share: float, needs_bytes: int) -> str:
    """What to do where a cache of `cache_share` of the spare GPU memory (one sequence a batch
    slot, as its planners place) holds less than `needs_bytes`: the whole share, or the least
    workload, each named only where it would hold them; then more GPU memory, which always
    does."""
    fixes = []
    if cache_share < 1 and cache_placement(ctx, ctx.workload.batch_size, 1)[1] >= needs_bytes:
        fixes.append(f"raise planner.params.cache_share (now {cache_share:g})")
    if _least_cache(ctx, cache_share) >= needs_bytes:
        fixes.append("use a smaller batch or context (workload.batch_size, workload.prompt_len)")
    return ", or ".join([*fixes, "raise hardware.memory_gb.gpu"])


def cache_statement(experts: int, expert_bytes: int, where: str = "") -> str:
    """What a plan block says of its expert cache's GPU memory (`plan.gpu_cache`): which is
    kept past the experts' last use, by design, and how much of it at most."""
    held = gb(experts * expert_bytes)
    return (
        f"keeps up to {experts} experts ({held} GB){where} on the GPU to the run's end: "
        "an expert stays after its last use until a miss evicts it"
    )


@dataclass
class _Slot:
    load: int | None  # op that brought the expert in (its users depend on it)
    last_use: int | None  # last op that reads it (an eviction waits for it)


@dataclass
class LRUCache:
    """An LRU cache of experts on the GPU, `capacity` experts large.

    `ensure` returns the op a compute must depend on, loading (and first evicting the least
    recently used expert) on a miss. An eviction is a free op that waits for the evicted
    expert's load and last use, emitted before the load that takes its memory, so every wait
    points to an earlier op and the schedule cannot deadlock; the load waits for it, so the
    cache never holds more than `capacity` experts at once (a load granted before its
    eviction ran held one expert past the cache's size).
    """

    em: Emitter
    capacity: int  # experts
    slots: OrderedDict[tuple[int, int], _Slot] = field(
        default_factory=OrderedDict
    )  # (layer, expert), LRU first
    hits: int = 0
    misses: int = 0

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key in self.slots

    def ensure(
        self,
        step: int,
        layer: int,
        expert: int,
        stream: str,
        deps: tuple[int | None, ...] = (),
        count: bool = True,
    ) -> int | None:
        key = (layer, expert)
        slot = self.slots.get(key)
        if slot is not None:
            self.slots.move_to_end(key)
            self.hits += count
            return slot.load
        self.misses += count
        evicted = self._make_room(step, protect=())
        assert evicted is not None, "nothing protected: room is always made"
        deps = (*deps, *evicted)
        op = self.em.load(Tensor.EXPERT, step, layer, expert, stream=stream, deps=deps)
        self.slots[key] = _Slot(op, op)
        return op

    def prefetch(
        self,
        step: int,
        layer: int,
        expert: int,
        stream: str,
        deps: tuple[int | None, ...],
        protect: tuple[tuple[int, int], ...],
    ) -> bool:
        """Load an expert ahead of need unless cached; never evicts `protect`. True if loaded."""
        key = (layer, expert)
        if key in self.slots:
            return False
        evicted = self._make_room(step, protect)
        if evicted is None:
            return False
        deps = (*deps, *evicted)
        op = self.em.load(Tensor.EXPERT, step, layer, expert, stream=stream, deps=deps)
        self.slots[key] = _Slot(op, op)
        return True

    def used(self, layer: int, expert: int, op: int) -> None:
        slot = self.slots[(layer, expert)]
        slot.last_use = op
        self.slots.move_to_end((layer, expert))

    def _make_room(
        self, step: int, protect: tuple[tuple[int, int], ...]
    ) -> tuple[int | None, ...] | None:
        """Evict the least recently used experts not in `protect` until one more fits; the
        evictions' free ops (the load that takes their memory waits for them), or None where
        every expert held is protected."""
        frees: list[int | None] = []
        while len(self.slots) >= self.capacity:
            victim = next((k for k in self.slots if k not in protect), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
            frees.append(
                self.em.free(
                    Tensor.EXPERT, step, victim[0], (slot.load, slot.last_use), expert=victim[1]
                )
            )
        return tuple(frees)


@dataclass
class PrefetchStats:
    """Per MoE layer: experts prefetched, and how many of them the gate then asked for."""

    n_layers: int
    issued: np.ndarray = field(init=False)
    useful: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.issued = np.zeros(self.n_layers, np.int64)
        self.useful = np.zeros(self.n_layers, np.int64)

    def record(self, moe_idx: int, predicted: set[int], needed: np.ndarray) -> None:
        if predicted:
            self.issued[moe_idx] += len(predicted)
            self.useful[moe_idx] += len(predicted & set(np.flatnonzero(needed).tolist()))

    def summary(self) -> dict[str, object]:
        acc = np.where(self.issued > 0, self.useful / np.maximum(self.issued, 1), np.nan)
        total = float(self.useful.sum() / self.issued.sum()) if self.issued.sum() else None
        return {
            "prefetch_accuracy": total,
            "prefetch_accuracy_per_layer": [
                None if np.isnan(a) else round(float(a), 4) for a in acc
            ],
        }


def top_experts(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest positive scores, best first (ties by lower id)."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return [int(e) for e in order[:k] if scores[e] > 0]
