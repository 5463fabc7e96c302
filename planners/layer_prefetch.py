"""`layer_prefetch`: Klotski's "simple pipeline": one batch at a time, and while layer i
computes, the whole of layer i+1 (attention, gate, *all* experts, FFN) is prefetched.

Double buffering: layer i+1's loads wait until layer i-1 is done, so at most two layers of
streamed weights are on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.planner import PlanContext, Planner
from core.schedule import ScheduleBuilder
from core.types import Tensor
from planners.common import Emitter, standard_placement
from planners.layer_experts import free_unrouted
from planners.registry import register


@dataclass(frozen=True)
class LayerPrefetchParams:
    pass


@register("layer_prefetch", LayerPrefetchParams)
class LayerPrefetch(Planner):
    def __init__(self, params: LayerPrefetchParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl = ctx.model, ctx.workload
        em = Emitter(
            ctx, out, standard_placement(ctx, kv_sequences=wl.batch_size, layers_in_flight=2)
        )
        out.meta.update(n_batches_shared=1)
        done_layer: list[int | None] = [None, None]  # last compute of the two previous layers
        last: int | None = None
        for batch in range(wl.n_batches):
            for step in range(wl.n_steps):
                for layer in range(m.n_layers + 1):  # layer n_layers = the LM head
                    window = (done_layer[0],)
                    if layer == m.n_layers:
                        head_load = em.load(Tensor.HEAD, step, -1, deps=window)
                        last = em.head(step, batch, (head_load, last), last_batch=True)
                        done_layer = [done_layer[1], last]
                        continue
                    attn_load = em.load(Tensor.ATTENTION, step, layer, deps=window)
                    loads = {}
                    gate_load = ffn_load = None
                    if m.is_moe(layer):
                        gate_load = em.load(Tensor.GATE, step, layer, deps=window)
                        loads = {
                            e: em.load(Tensor.EXPERT, step, layer, e, deps=window)
                            for e in range(m.n_experts)
                        }
                    ffn_load = em.load(Tensor.FFN, step, layer, deps=window)
                    kv = em.kv_load(step, layer, batch)
                    last = em.attention(step, layer, batch, (attn_load, kv, last), last_batch=True)
                    em.kv_store(step, layer, batch, last)
                    if m.is_moe(layer):
                        last, view = em.gate(step, layer, batch, (gate_load, last), last_batch=True)
                        free_unrouted(em, step, layer, view.counts, loads, last)
                        for e in range(m.n_experts):
                            if view.counts[e]:
                                last = em.expert(
                                    step,
                                    layer,
                                    batch,
                                    e,
                                    int(view.counts[e]),
                                    (loads[e], last),
                                    last_use=True,
                                )
                    last = em.ffn(step, layer, batch, (ffn_load, last), last_batch=True) or last
                    done_layer = [done_layer[1], last]
