"""`flexgen`: FlexGen's zig-zag block schedule applied to an MoE model, as Klotski adapted it.

The n batches of a group share each layer's weights: every batch runs the attention layer, then
every batch runs the MoE layer (its gate, then its experts in index order). While one layer
computes, the whole next one is prefetched: the MoE layer (gate + *all* experts) during
attention, the next attention during the MoE layer. KV of the next batch loads while the current
one computes, and each batch's new KV is stored behind it (FlexGen's three streams).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.planner import PlanContext
from core.schedule import ScheduleBuilder
from core.types import Tensor
from planners.common import Emitter, standard_placement
from planners.registry import register


@dataclass(frozen=True)
class FlexGenParams:
    pass


@register("flexgen", FlexGenParams)
class FlexGen:
    def __init__(self, params: FlexGenParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl = ctx.model, ctx.workload
        n = wl.n_batches
        em = Emitter(
            ctx, out, standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)
        )
        out.meta.update(n_batches_shared=n)
        # Sub-layers in FlexGen's list: (layer, "attn") then (layer, "moe"); weights of sub-layer j+1
        # load while j computes, and no earlier than sub-layer j-1 is done (double buffering).
        prev_done: int | None = None  # last compute of sub-layer j-1
        cur_done: int | None = None  # last compute of sub-layer j
        last: int | None = None
        for step in range(wl.n_steps):
            attn_loads = self._load_attention(em, step, 0, prev_done)
            for layer in range(m.n_layers):
                moe_loads = self._load_ffn(em, step, layer, cur_done)
                # attention sub-layer, batch by batch
                for k in range(n):
                    kv = em.kv_load(step, layer, k, deps=(last,))  # overlaps the previous batch
                    last = em.attention(
                        step, layer, k, (attn_loads, kv, last), last_batch=k == n - 1
                    )
                    em.kv_store(step, layer, k, last)
                prev_done, cur_done = cur_done, last
                nxt = layer + 1
                attn_loads = (
                    self._load_attention(em, step, nxt, cur_done) if nxt < m.n_layers else None
                )
                head_load = (
                    em.load(Tensor.HEAD, step, -1, deps=(cur_done,)) if nxt == m.n_layers else None
                )
                # FFN sub-layer, batch by batch
                gate_load, expert_loads, ffn_load = moe_loads
                if m.is_moe(layer):
                    for k in range(n):
                        last, view = em.gate(
                            step, layer, k, (gate_load, last), last_batch=k == n - 1
                        )
                        for e in range(m.n_experts):
                            if view.counts[e]:
                                # Later batches' routing is unknown here, so the expert is freed after the last batch.
                                last = em.expert(
                                    step,
                                    layer,
                                    k,
                                    e,
                                    int(view.counts[e]),
                                    (expert_loads[e], last),
                                    last_use=False,
                                )
                        last = (
                            em.ffn(step, layer, k, (ffn_load, last), last_batch=k == n - 1) or last
                        )
                    for e in range(m.n_experts):
                        em.free(Tensor.EXPERT, step, layer, (last, expert_loads[e]), expert=e)
                else:
                    for k in range(n):
                        last = (
                            em.ffn(step, layer, k, (ffn_load, last), last_batch=k == n - 1) or last
                        )
                prev_done, cur_done = cur_done, last
            for k in range(n):
                last = em.head(step, k, (head_load, last), last_batch=k == n - 1)
            prev_done, cur_done = cur_done, last

    @staticmethod
    def _load_attention(em: Emitter, step: int, layer: int, after: int | None) -> int | None:
        return em.load(Tensor.ATTENTION, step, layer, deps=(after,))

    @staticmethod
    def _load_ffn(
        em: Emitter, step: int, layer: int, after: int | None
    ) -> tuple[int | None, dict[int, int | None], int | None]:
        m = em.model
        gate = experts = None
        if m.is_moe(layer):
            gate = em.load(Tensor.GATE, step, layer, deps=(after,))
            experts = {
                e: em.load(Tensor.EXPERT, step, layer, e, deps=(after,)) for e in range(m.n_experts)
            }
        ffn = em.load(Tensor.FFN, step, layer, deps=(after,))
        return gate, experts or {}, ffn
