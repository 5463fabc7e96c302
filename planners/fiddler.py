"""`fiddler`: Fiddler's CPU-GPU orchestration: experts not on the GPU run on the CPU (anchors A4).

Modelled behaviour: one batch at a time (latency-oriented). Dense weights and KV stay on the GPU;
the spare GPU memory holds as many routed experts as fit, statically, spread evenly over layers
(Fiddler ranks them by an offline popularity profile; the simulator has no profile, so each
layer keeps its lowest-id experts). Those need no copy in host memory or on disk, which no op
would read: the placement puts only the other experts there. After a gate, every routed expert
that is resident runs on the GPU. For a missing one, a per-expert latency model (Fiddler's
`mixtral.py` chooses the same way, with profiled constants) compares
  CPU: ship the expert's tokens' activations GPU->CPU, compute on the CPU (the hardware
       profile's CPU peak flop/s and memory bandwidth), ship the results back;
  GPU: copy the expert's weights host->GPU, compute on the GPU, drop them;
and takes the faster: decode (few tokens) goes to the CPU, long prefills bring the weights.
CPU experts run on a `cpu_compute` stream, overlapping the GPU's resident experts. No prefetch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from core.planner import PlanContext, Planner
from core.schedule import ScheduleBuilder
from core.types import OpKind, Resource, Stream, Tensor, Tier
from planners.common import Emitter
from planners.expert_cache import cache_placement
from planners.placement import Placement
from planners.registry import register

POLICIES = ("latency", "cpu", "gpu")


class _Streams(NamedTuple):
    cpu: str  # the CPU experts' compute
    to_cpu: str  # their tokens' activations, GPU -> CPU
    to_gpu: str  # their results, CPU -> GPU
    on_demand: str  # experts copied to the GPU to run there


@dataclass(frozen=True)
class FiddlerParams:
    policy: str = "latency"  # latency: per-expert CPU-vs-GPU choice; cpu / gpu: always that side
    resident_share: float = 1.0  # share of the spare GPU memory filled with resident experts

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r} unknown; pass one of {POLICIES}")
        if not 0 <= self.resident_share <= 1:
            raise ValueError(
                f"resident_share={self.resident_share} must be in [0, 1]; pass a share in it"
            )


@register("fiddler", FiddlerParams)
class Fiddler(Planner):
    def __init__(self, params: FiddlerParams) -> None:
        self.params = params

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl, p = ctx.model, ctx.workload, self.params
        # the resident experts' host copies are never read: the placement holds none of them
        placement, cache = cache_placement(
            ctx,
            wl.batch_size,
            1,
            p.resident_share,
            lambda c: _kept(m.moe_layers, m.n_experts, c // m.expert_bytes),
        )
        em = Emitter(ctx, out, placement)
        streams = _Streams(
            cpu=out.stream(Stream.CPU_COMPUTE, Resource.CPU),
            to_cpu=out.stream("act_to_cpu", Resource.D2H),
            to_gpu=out.stream("act_to_gpu", Resource.H2D),
            on_demand=out.stream(Stream.EXPERTS, Resource.H2D),
        )
        resident = _resident_experts(m.moe_layers, m.n_experts, cache // m.expert_bytes)
        held = sum(len(v) for v in resident.values()) * m.expert_bytes
        out.reserve(Tier.GPU, held)
        out.meta["placement"] = _held_placement(placement, held).summary()
        where = {"cpu": 0, "gpu_loaded": 0, "gpu_resident": 0}  # experts run by where they ran
        last: int | None = None
        for batch in range(wl.n_batches):
            for step in range(wl.n_steps):
                for layer in range(m.n_layers):
                    last = self._layer(em, streams, resident, where, step, layer, batch, last)
                head_load = em.load(Tensor.HEAD, step, -1, deps=(last,))
                last = em.head(step, batch, (head_load, last), last_batch=True)
        total = max(sum(where.values()), 1)
        out.meta.update(
            n_batches_shared=1,
            policy=p.policy,
            resident_experts=sum(len(v) for v in resident.values()),
            expert_share_cpu=round(where["cpu"] / total, 4),
            expert_share_gpu_loaded=round(where["gpu_loaded"] / total, 4),
            expert_share_gpu_resident=round(where["gpu_resident"] / total, 4),
        )

    def _layer(
        self,
        em: Emitter,
        streams: _Streams,
        resident: dict[int, set[int]],
        where: dict[str, int],
        step: int,
        layer: int,
        batch: int,
        last: int | None,
    ) -> int:
        """One decoder layer of one batch: attention, and on an MoE layer each routed expert
        where Fiddler runs it (counted in `where`); returns the op the next layer waits for."""
        m, out = em.model, em.out
        attn_load = em.load(Tensor.ATTENTION, step, layer, deps=(last,))
        kv = em.kv_load(step, layer, batch, deps=(last,))
        last = em.attention(step, layer, batch, (attn_load, kv, last), last_batch=True)
        em.kv_store(step, layer, batch, last)
        returns: list[int] = []
        if m.is_moe(layer):
            gate_load = em.load(Tensor.GATE, step, layer, deps=(last,))
            gate, view = em.gate(step, layer, batch, (gate_load, last), last_batch=True)
            last = gate
            act_bytes = m.hidden_size * m.dtype_bytes  # per token, each way
            for e in (int(x) for x in np.flatnonzero(view.counts)):
                tokens = int(view.counts[e])
                if e in resident[layer]:
                    where["gpu_resident"] += 1
                    last = em.expert(step, layer, batch, e, tokens, (last,), last_use=False)
                elif self._on_cpu(em.ctx, tokens, act_bytes):
                    where["cpu"] += 1
                    back = self._cpu_expert(
                        em, streams, step, layer, batch, e, tokens, act_bytes, gate
                    )
                    returns.append(back)
                else:
                    where["gpu_loaded"] += 1
                    load = em.load(
                        Tensor.EXPERT, step, layer, e, stream=streams.on_demand, deps=(gate,)
                    )
                    last = em.expert(step, layer, batch, e, tokens, (load, last), last_use=True)
        ffn_load = em.load(Tensor.FFN, step, layer, deps=(last,))
        last = em.ffn(step, layer, batch, (ffn_load, last, *returns), last_batch=True) or last
        if returns:  # the layer's output combines the CPU experts' results
            last = out.add(
                OpKind.FREE, em.compute, (last, *returns), step=step, layer=layer, batch=batch
            )
        return last

    def _on_cpu(self, ctx: PlanContext, tokens: int, act_bytes: int) -> bool:
        """Fiddler's latency model: run a missing expert where it finishes first."""
        if self.params.policy != "latency":
            return self.params.policy == "cpu"
        m, cost = ctx.model, ctx.cost
        flops = m.expert_flops(tokens)
        cpu_s = (
            cost.transfer_s(Resource.D2H, tokens * act_bytes)
            + cost.compute_s(Resource.CPU, OpKind.EXPERT, flops, m.expert_bytes)
            + cost.transfer_s(Resource.H2D, tokens * act_bytes)
        )
        gpu_s = cost.transfer_s(Resource.H2D, m.expert_bytes) + cost.compute_s(
            Resource.GPU, OpKind.EXPERT, flops, m.expert_bytes
        )
        return cpu_s <= gpu_s

    @staticmethod
    def _cpu_expert(
        em: Emitter,
        streams: _Streams,
        step: int,
        layer: int,
        batch: int,
        expert: int,
        tokens: int,
        act_bytes: int,
        gate: int,
    ) -> int:
        """Activations to the CPU, the expert there (weights from host memory), results back."""
        m, out = em.model, em.out
        where = dict(step=step, layer=layer, batch=batch, expert=expert)
        deps: tuple[int, ...] = ()
        extra: dict[str, object] = {}
        if em.tensor_tier(Tensor.EXPERT, layer) == Tier.DISK:  # the CPU reads it from disk first
            deps = (
                out.add(
                    OpKind.LOAD,
                    em.disk,
                    (gate,),
                    tensor=Tensor.EXPERT,
                    nbytes=m.expert_disk_bytes,  # as the disk holds it (FP8: 1 a weight)
                    src=Tier.DISK,
                    dst=Tier.CPU,
                    alloc_tier=Tier.CPU,
                    alloc_bytes=m.expert_bytes,
                    **where,
                ),
            )
            extra = dict(free_tier=Tier.CPU, free_bytes=m.expert_bytes)
        send = out.add(
            OpKind.LOAD,
            streams.to_cpu,
            (gate,),
            tensor=Tensor.HIDDEN,
            nbytes=tokens * act_bytes,
            src=Tier.GPU,
            dst=Tier.CPU,
            **where,
        )
        run = out.add(
            OpKind.EXPERT,
            streams.cpu,
            (send, gate, *deps),
            tensor=Tensor.EXPERT,
            tokens=tokens,
            flops=m.expert_flops(tokens),
            touch_bytes=m.expert_bytes,
            **where,
            **extra,
        )
        return out.add(
            OpKind.LOAD,
            streams.to_gpu,
            (run,),
            tensor=Tensor.HIDDEN,
            nbytes=tokens * act_bytes,
            src=Tier.CPU,
            dst=Tier.GPU,
            **where,
        )


def _held_placement(placement: Placement, held_bytes: int) -> Placement:
    """`placement` as the run holds it: the GPU's resident bytes count the held experts, which
    the working set no longer keeps free (a layer held whole is on the GPU already, and no
    tier holds a copy of a held expert)."""
    on = dict(placement.resident_bytes)
    on[Tier.GPU] = on.get(Tier.GPU, 0) + held_bytes
    return replace(placement, resident_bytes=on, working_bytes=placement.working_bytes - held_bytes)


def _kept(moe_layers: tuple[int, ...], n_experts: int, budget: int) -> dict[int, int]:
    """Layer -> how many experts `_resident_experts` keeps on the GPU."""
    return {layer: len(v) for layer, v in _resident_experts(moe_layers, n_experts, budget).items()}


def _resident_experts(
    moe_layers: tuple[int, ...], n_experts: int, budget: int
) -> dict[int, set[int]]:
    """`budget` experts spread evenly over layers (earlier layers take the remainder)."""
    per, extra = divmod(max(budget, 0), max(len(moe_layers), 1))  # a dense model: none
    return {
        layer: set(range(min(per + (i < extra), n_experts))) for i, layer in enumerate(moe_layers)
    }
