"""`flexgen`: FlexGen's zig-zag block schedule applied to an MoE model, as Klotski adapted it.

The n batches of a group share each layer's weights: every batch runs the attention layer, then
every batch runs the MoE layer (its gate, then its experts in index order). While one layer
computes, the whole next one is prefetched: the MoE layer (gate + *all* experts) during
attention, the next attention during the MoE layer. KV of the next batch loads while the current
one computes, and each batch's new KV is stored behind it (FlexGen's three streams).

`sync` (default) keeps FlexGen's loop (`generation_loop_overlap_multi_batch`): each (sub-layer,
batch) step issues its loads, computes, and then synchronizes the device, so every op of a step
waits for every op of the step before. The next sub-layer's weights load during the current
sub-layer's first batch only (FlexGen loads a layer's weights at batch 0), and the later batches
wait for that load; `sync: false` lets the loads overlap every batch (streams and events only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import compress
from operator import is_not
from typing import TypeGuard, cast

from core.planner import PlanContext, Planner
from core.schedule import ScheduleBuilder
from core.types import Tensor
from planners.common import Emitter, standard_placement
from planners.layer_experts import free_unrouted
from planners.registry import register


@dataclass(frozen=True)
class FlexGenParams:
    sync: bool = True  # FlexGen's device synchronize after every (sub-layer, batch) step


# an op id, not None (a C call: the planner's hottest filter)
_is_op = cast("Callable[[int | None], TypeGuard[int]]", partial(is_not, None))


class _Steps:
    """FlexGen's per-step synchronize: with `on`, each op of a step also depends on every op of
    the step before (`deps`); `add` records this step's ops, `next` ends the step."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.prev: tuple[int, ...] = ()
        self.cur: list[int] = []

    def deps(self, *deps: int | None) -> tuple[int | None, ...]:
        return deps + self.prev if self.on else deps

    def add(self, *ops: int | None) -> None:
        if self.on:
            self.cur += filter(_is_op, ops)

    def next(self) -> None:
        if self.on and self.cur:
            self.prev, self.cur = tuple(self.cur), []


@register("flexgen", FlexGenParams)
class FlexGen(Planner):
    def __init__(self, params: FlexGenParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl = ctx.model, ctx.workload
        n = wl.n_batches
        em = Emitter(
            ctx, out, standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)
        )
        out.meta.update(n_batches_shared=n)
        s = _Steps(self.params.sync)
        # Sub-layers in FlexGen's list: (layer, "attn") then (layer, "moe"); weights of sub-layer
        # j+1 load while j computes, and no earlier than sub-layer j-1 is done (double buffering).
        done: int | None = None  # last compute of the sub-layer before the current one
        last: int | None = None
        store: int | None = None  # the previous batch's KV store, which runs during this step
        attn_loads = self._load_attention(em, 0, 0, ())
        kv = em.kv_load(0, 0, 0)
        s.add(attn_loads, kv)
        for step in range(wl.n_steps):
            for layer in range(m.n_layers):
                # attention sub-layer, batch by batch; KV of batch k+1 loads while k computes
                for k in range(n):
                    if k == 0:
                        moe_loads = self._load_ffn(em, step, layer, s.deps(done))
                        s.add(moe_loads[0], *moe_loads[1].values(), moe_loads[2])
                    kv_next = (
                        em.kv_load(step, layer, k + 1, deps=s.deps(last)) if k + 1 < n else None
                    )
                    last = em.attention(
                        step, layer, k, s.deps(attn_loads, kv, last), last_batch=k == n - 1
                    )
                    s.add(kv_next, last, store)
                    store, kv = em.kv_store(step, layer, k, last), kv_next
                    s.next()
                done = last
                nxt = layer + 1
                # FFN sub-layer, batch by batch; the next attention (or the head) loads meanwhile
                used: dict[int, int] = {}  # expert -> its last compute so far
                for k in range(n):
                    if k == 0:
                        attn_loads = (
                            self._load_attention(em, step, nxt, s.deps(done))
                            if nxt < m.n_layers
                            else None
                        )
                        head_load = (
                            em.load(Tensor.HEAD, step, -1, deps=s.deps(done))
                            if nxt == m.n_layers
                            else None
                        )
                        s.add(attn_loads, head_load)
                    if k == n - 1 and nxt < m.n_layers:
                        kv = em.kv_load(step, nxt, 0, deps=s.deps(last))
                        s.add(kv)
                    s.add(store)
                    store = None
                    last = self._ffn_batch(em, s, step, layer, k, moe_loads, last, used)
                    s.next()
                done = last
            for k in range(n):
                if k == 0 and step + 1 < wl.n_steps:
                    attn_loads = self._load_attention(em, step + 1, 0, s.deps(done))
                    s.add(attn_loads)
                if k == n - 1 and step + 1 < wl.n_steps:
                    kv = em.kv_load(step + 1, 0, 0, deps=s.deps(last))
                    s.add(kv)
                last = em.head(step, k, s.deps(head_load, last), last_batch=k == n - 1)
                s.add(last)
                s.next()
            done = last

    @staticmethod
    def _ffn_batch(
        em: Emitter,
        s: _Steps,
        step: int,
        layer: int,
        k: int,
        loads: tuple[int | None, dict[int, int | None], int | None],
        last: int | None,
        used: dict[int, int],
    ) -> int | None:
        """One batch of the FFN sub-layer: the gate and the experts it chose in index order (MoE),
        then the shared / dense FFN. At the last batch each expert's GPU copy is released at its
        last use (`used`: each expert's last compute so far): one the batch does not run right
        after its gate, one it runs by that compute (held to the layer's end, each was held
        past its last use for the other batches' and experts' computes)."""
        m, n = em.model, em.ctx.workload.n_batches
        gate_load, expert_loads, ffn_load = loads
        if m.is_moe(layer):
            last, view = em.gate(step, layer, k, s.deps(gate_load, last), last_batch=k == n - 1)
            s.add(last)
            final = k == n - 1  # later batches' routing is unknown before: freed at the last
            if final:
                s.add(*free_unrouted(em, step, layer, view.counts, expert_loads, last, used))
            # s.deps and s.add inlined, the experts emitted in one call: the planner's hottest
            # loop
            counts = view.counts.tolist()
            prev = s.prev if s.on else ()
            ids = em.expert_chain(step, layer, k, counts, expert_loads, last, prev, release=final)
            used.update(zip(compress(range(len(counts)), counts), ids, strict=True))
            if ids:
                last = ids[-1]
                if s.on:
                    s.cur += ids
        ffn = em.ffn(step, layer, k, s.deps(ffn_load, last), last_batch=k == n - 1)
        s.add(ffn)
        return ffn or last

    @staticmethod
    def _load_attention(
        em: Emitter, step: int, layer: int, deps: tuple[int | None, ...]
    ) -> int | None:
        return em.load(Tensor.ATTENTION, step, layer, deps=deps)

    @staticmethod
    def _load_ffn(
        em: Emitter, step: int, layer: int, deps: tuple[int | None, ...]
    ) -> tuple[int | None, dict[int, int | None], int | None]:
        m = em.model
        gate = experts = None
        if m.is_moe(layer):
            gate = em.load(Tensor.GATE, step, layer, deps=deps)
            experts = {
                e: em.load(Tensor.EXPERT, step, layer, e, deps=deps) for e in range(m.n_experts)
            }
        ffn = em.load(Tensor.FFN, step, layer, deps=deps)
        return gate, experts or {}, ffn
