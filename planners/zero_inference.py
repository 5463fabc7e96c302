"""`zero_inference`: DeepSpeed ZeRO-Inference's layer-by-layer weight streaming (anchors A8).

Modelled behaviour: weights live in host memory (or NVMe) and stream into the GPU one whole
decoder layer at a time (attention, gate, *all* experts, FFN: ZeRO-3 partitions parameters, it
knows nothing of experts), with the next layer prefetched while the current one computes and at
most two layers on the GPU (double buffering). Throughput comes from a large batch: the n
batches of a group form one big batch that passes through each layer before the next layer
starts (every sub-batch's attention, then every sub-batch's MoE block), so one weight load
serves all of them. The KV cache of the big batch is offloaded to host memory when the GPU is
full (the 2023 release) and loaded synchronously, without overlap, before each attention.
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
class ZeroInferenceParams:
    pass


@register("zero_inference", ZeroInferenceParams)
class ZeroInference(Planner):
    def __init__(self, params: ZeroInferenceParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl = ctx.model, ctx.workload
        n = wl.n_batches
        em = Emitter(
            ctx, out, standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)
        )
        out.meta.update(n_batches_shared=n)
        done: list[int | None] = [None, None]  # last compute of the two previous layers
        last: int | None = None
        for step in range(wl.n_steps):
            loads = self._load_layer(em, step, 0, done[0])
            for layer in range(m.n_layers):
                # prefetch layer+1 once layer-1 is done: two layers of weights at most
                nxt = (
                    self._load_layer(em, step, layer + 1, done[1])
                    if layer + 1 < m.n_layers
                    else None
                )
                attn_load, gate_load, expert_loads, ffn_load = loads
                for k in range(n):
                    kv = em.kv_load(
                        step, layer, k, deps=(last,)
                    )  # synchronous: waits for the compute
                    last = em.attention(
                        step, layer, k, (attn_load, kv, last), last_batch=k == n - 1
                    )
                    store = em.kv_store(step, layer, k, last)
                    last = store or last
                used: dict[int, int] = {}  # expert -> its last compute so far
                for k in range(n):
                    if m.is_moe(layer):
                        last = self._experts(
                            em, step, layer, k, k == n - 1, expert_loads, used, (gate_load, last)
                        )
                    last = em.ffn(step, layer, k, (ffn_load, last), last_batch=k == n - 1) or last
                done = [done[1], last]
                loads = nxt  # type: ignore[assignment]
            head_load = em.load(Tensor.HEAD, step, -1, deps=(done[0],))
            for k in range(n):
                last = em.head(step, k, (head_load, last), last_batch=k == n - 1)
            done = [done[1], last]

    @staticmethod
    def _experts(
        em: Emitter,
        step: int,
        layer: int,
        batch: int,
        last_batch: bool,
        loads: dict[int, int | None],
        used: dict[int, int],
        deps: tuple[int | None, ...],
    ) -> int:
        """Batch `batch`'s gate and routed experts of one MoE layer; returns its last op. At
        the last batch each expert's GPU copy is released at its last use: one no batch runs
        any more right after the gate (it held the layer's experts to the layer's end, past
        the shared experts' compute), one the batch runs by that compute."""
        last, view = em.gate(step, layer, batch, deps, last_batch=last_batch)
        gate = last
        if last_batch:
            free_unrouted(em, step, layer, view.counts, loads, gate, used)
        for e in range(em.model.n_experts):
            if view.counts[e]:
                last = em.expert(
                    step, layer, batch, e, int(view.counts[e]), (loads[e], last), last_batch
                )
                used[e] = last
        return last

    @staticmethod
    def _load_layer(
        em: Emitter, step: int, layer: int, after: int | None
    ) -> tuple[int | None, int | None, dict[int, int | None], int | None]:
        m = em.model
        attn = em.load(Tensor.ATTENTION, step, layer, deps=(after,))
        gate, experts = None, {}
        if m.is_moe(layer):
            gate = em.load(Tensor.GATE, step, layer, deps=(after,))
            experts = {
                e: em.load(Tensor.EXPERT, step, layer, e, deps=(after,)) for e in range(m.n_experts)
            }
        ffn = em.load(Tensor.FFN, step, layer, deps=(after,))
        return attn, gate, experts, ffn
