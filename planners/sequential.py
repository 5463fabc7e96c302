"""`sequential`: Hugging Face Accelerate-style offloading, the no-overlap baseline.

Each batch generates on its own (row by row); before each module runs, its weights are moved to
the GPU (a MoE block moves its gate and *all* experts, as Accelerate's hooks move the whole
module), then it computes, then the weights are dropped. Nothing overlaps.
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
class SequentialParams:
    pass


@register("sequential", SequentialParams)
class Sequential(Planner):
    def __init__(self, params: SequentialParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl = ctx.model, ctx.workload
        em = Emitter(
            ctx, out, standard_placement(ctx, kv_sequences=wl.batch_size, layers_in_flight=1)
        )
        out.meta.update(n_batches_shared=1)
        last: int | None = None  # everything waits for the previous op: no overlap
        for batch in range(wl.n_batches):
            for step in range(wl.n_steps):
                for layer in range(m.n_layers):
                    load = em.load(Tensor.ATTENTION, step, layer, deps=(last,))
                    kv = em.kv_load(step, layer, batch, deps=(load or last,))
                    last = em.attention(step, layer, batch, (load, kv, last), last_batch=True)
                    store = em.kv_store(step, layer, batch, last)
                    last = store or last
                    if m.is_moe(layer):
                        gate_load = em.load(Tensor.GATE, step, layer, deps=(last,))
                        loads = {}
                        prev = gate_load or last
                        for e in range(m.n_experts):
                            loads[e] = em.load(Tensor.EXPERT, step, layer, e, deps=(prev,))
                            prev = loads[e] or prev
                        last, view = em.gate(
                            step, layer, batch, (gate_load, prev, last), last_batch=True
                        )
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
                    ffn_load = em.load(Tensor.FFN, step, layer, deps=(last,))
                    last = em.ffn(step, layer, batch, (ffn_load, last), last_batch=True) or last
                head_load = em.load(Tensor.HEAD, step, -1, deps=(last,))
                last = em.head(step, batch, (head_load, last), last_batch=True)
