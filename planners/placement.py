"""Greedy per-layer placement of weights and KV cache across GPU, CPU and disk.

Dense parts (embeddings, attention, gates, dense/shared FFNs) go to the GPU if they fit after
the planner's working set, else to CPU; then the KV cache layer by layer (GPU, then CPU); then
experts layer by layer (GPU, then CPU, then disk). CPU keeps a staging area for disk reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import CapacityError, capacity_error, gb_apart, with_fixes
from core.hardware import HardwareSpec
from core.shown import gb
from core.spec import ModelSpec
from core.types import Tier

# what shrinks a group's KV cache, and the memory that holds it (KV has no disk path)
KV_LOWER = ("workload.batch_size", "workload.n_batches", "workload.prompt_len", "workload.gen_len")
KV_MORE = ("hardware.memory_gb.gpu", "hardware.memory_gb.cpu")


@dataclass(frozen=True)
class Placement:
    dense: Tier  # embeddings, attention, gates, dense and shared FFNs, LM head
    kv: tuple[Tier, ...]  # per layer: where the KV cache lives
    experts: tuple[Tier, ...]  # per layer: where its routed experts live (dense layers: `dense`)
    resident_bytes: dict[Tier, int]  # what the placement holds for the whole run
    working_bytes: int  # GPU memory kept free for streamed weights / KV buffers
    kv_bytes_per_layer: int  # KV cache of all sequences in one layer
    moe_layers: tuple[int, ...]  # the layers with routed experts, which `expert_layers` counts

    def summary(self) -> dict[str, object]:
        def count(xs: tuple[Tier, ...]) -> dict[str, int]:
            return {str(t): xs.count(t) for t in Tier if xs.count(t)}

        # MoE layers only: a dense layer has no routed experts to place (a dense model: {})
        return {
            "dense": str(self.dense),
            "kv_layers": count(self.kv),
            "expert_layers": count(tuple(self.experts[i] for i in self.moe_layers)),
            "resident_gb": {str(k): gb(v) for k, v in self.resident_bytes.items()},
            "working_gb": gb(self.working_bytes),
        }


def dense_bytes(model: ModelSpec) -> int:
    per_layer = sum(
        model.attn_bytes
        + (model.gate_bytes + model.shared_ffn_bytes if model.is_moe(i) else model.dense_ffn_bytes)
        for i in range(model.n_layers)
    )
    return per_layer + model.embed_bytes + model.head_bytes


def greedy_placement(
    model: ModelSpec,
    hw: HardwareSpec,
    kv_sequences: int,
    kv_tokens: int,
    working_bytes: int,
    activation_bytes: int = 0,
    cpu_staging_bytes: int = 0,
    working_weight_bytes: int = 0,
    held_experts: Mapping[int, int] | None = None,
) -> Placement:
    """Place weights and KV for `kv_sequences` sequences of `kv_tokens` tokens each. CPU memory
    goes to the dense weights and the KV cache first; then up to `cpu_staging_bytes` of what is
    left (at least one expert, what a disk read needs to pass through) is kept free for disk
    reads on their way to the GPU, before experts take CPU memory. `working_weight_bytes`: the
    streamed weights' part of `working_bytes`, which no smaller workload shrinks (the rest, KV
    buffers, scales with it). `held_experts`: layer -> how many of its experts the planner keeps
    on the GPU for the whole run (held beside the placement), which need no copy elsewhere."""
    if not hw.has_disk:  # no disk reads to stage
        cpu_staging_bytes = 0
    least_staging = min(cpu_staging_bytes, model.expert_bytes)
    kv_layer = kv_sequences * kv_tokens * model.kv_bytes_per_token
    working = _Working(working_weight_bytes, working_bytes - working_weight_bytes, activation_bytes)
    free = _free_memory(model, hw, kv_layer, working, least_staging)
    resident = {Tier.GPU: activation_bytes, Tier.CPU: 0, Tier.DISK: 0}
    dense = dense_bytes(model)
    dense_tier = _take(free, (Tier.GPU, Tier.CPU), dense)
    if dense_tier is None:
        raise CapacityError(
            f"model {model.name}: attention/gate/embedding weights ({dense / 1e9:.3g} GB) fit "
            "neither GPU nor CPU memory beside the working set; raise hardware.memory_gb.gpu or "
            "hardware.memory_gb.cpu"
        )
    resident[dense_tier] += dense

    kv: list[Tier] = []
    for _ in range(model.n_layers):
        tier = _take(free, (Tier.GPU, Tier.CPU), kv_layer)
        if tier is None:
            raise capacity_error(
                f"KV cache of {kv_sequences} sequences x {kv_tokens} tokens "
                f"({kv_layer * model.n_layers / 1e9:.3g} GB) cannot fit in GPU + CPU memory",
                KV_LOWER,
                KV_MORE,
            )
        kv.append(tier)
        resident[tier] += kv_layer

    # disk reads' staging: what the window asks, as far as the dense weights and KV leave room
    # (the CPU's free memory already holds back `least_staging`)
    free[Tier.CPU] -= min(cpu_staging_bytes - least_staging, free[Tier.CPU])
    experts = _place_experts(model, free, resident, dense_tier, held_experts or {})
    return Placement(
        dense_tier, tuple(kv), tuple(experts), resident, working_bytes, kv_layer, model.moe_layers
    )


@dataclass(frozen=True)
class _Working:
    """The GPU memory a planner keeps free beside the placement, in its parts."""

    weight_bytes: int  # streamed weights: as large for the smallest workload
    buffer_bytes: int  # KV cache buffers: scale with the batch and the context
    activation_bytes: int  # activations: scale with the batch and the prompt

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.buffer_bytes + self.activation_bytes

    def refusal(self, gpu_bytes: int) -> GpuEdgeError:
        """The refusal of a GPU of `gpu_bytes` smaller than this working set: a smaller workload
        is named only where the weights leave room for one."""
        has, needs = gb_apart(gpu_bytes, self.total_bytes)
        said = (
            f"GPU memory {has} GB is smaller than the working set {needs} GB (streamed weights "
            f"{self.weight_bytes / 1e9:.3g} GB, KV cache buffers {self.buffer_bytes / 1e9:.3g} "
            f"GB, activations {self.activation_bytes / 1e9:.3g} GB); "
        )
        only_gpu = said + "raise hardware.memory_gb.gpu (no smaller workload fits)"
        more = ("hardware.memory_gb.gpu",)
        if self.weight_bytes >= gpu_bytes:
            return with_fixes(GpuEdgeError(only_gpu, only_gpu), said[:-2], (), more)
        workload = "lower workload.prompt_len or workload.batch_size (or workload.n_batches)"
        line = f"{said}{workload}, or raise hardware.memory_gb.gpu"
        lower = ("workload.prompt_len", "workload.batch_size", "workload.n_batches")
        return with_fixes(GpuEdgeError(line, only_gpu), said[:-2], lower, more)


class GpuEdgeError(CapacityError):
    """A GPU smaller than a planner's working set. `only_gpu`: its line where a planner knows
    that no smaller workload fits either (a cache it needs besides)."""

    def __init__(self, line: str, only_gpu: str) -> None:
        super().__init__(line)
        self.only_gpu = only_gpu


def _free_memory(
    model: ModelSpec,
    hw: HardwareSpec,
    kv_layer: int,
    working: _Working,
    least_staging: int,
) -> dict[Tier, int]:
    """Each tier's memory free for the placement: the GPU's beside the working set and the
    activations, the CPU's beside the least staging area disk reads need; CapacityError where
    those do not fit, or the weights and KV (`kv_layer` bytes a layer) fit no tier at all."""
    cap = dict(hw.memory_bytes)
    if least_staging > cap[Tier.CPU]:
        has, needs = gb_apart(cap[Tier.CPU], least_staging)
        raise CapacityError(
            f"CPU memory {has} GB is smaller than the staging area {needs} GB that disk reads "
            "pass through; add CPU memory"
        )
    cpu_free = cap[Tier.CPU] - least_staging  # for the total: the rest of staging is a preference
    disk_free = cap[Tier.DISK]
    total = model.total_bytes + kv_layer * model.n_layers
    room = cap[Tier.GPU] + max(cpu_free, 0) + disk_free
    if total > room:
        needs, has = gb_apart(total, room)
        # a smaller workload shrinks only the KV cache: named where the weights alone fit
        more = "add memory" + (" or shrink the workload" if model.total_bytes <= room else "")
        if not hw.has_disk:
            raise CapacityError(
                f"model {model.name} ({needs} GB weights + KV) does not fit in GPU + CPU ({has} "
                f"GB), and hardware {hw.name} has no disk tier (memory_gb.disk: null); set "
                "hardware.memory_gb.disk to the GB of a disk to offload to (and links.disk), "
                f"or {more}"
            )
        raise CapacityError(
            f"model {model.name} ({needs} GB weights + KV) does not fit in GPU + CPU + disk "
            f"({has} GB); {more}"
        )
    gpu_free = cap[Tier.GPU] - working.total_bytes
    if gpu_free < 0:
        raise working.refusal(cap[Tier.GPU])
    return {Tier.GPU: gpu_free, Tier.CPU: cpu_free, Tier.DISK: disk_free}


def _take(free: dict[Tier, int], tiers: tuple[Tier, ...], nbytes: int) -> Tier | None:
    """The first of `tiers` with `nbytes` free, which then holds them; None where none has."""
    tier = next((t for t in tiers if nbytes <= free[t]), None)
    if tier is not None:
        free[tier] -= nbytes
    return tier


def _place_experts(
    model: ModelSpec,
    free: dict[Tier, int],
    resident: dict[Tier, int],
    dense_tier: Tier,
    held: Mapping[int, int],
) -> list[Tier]:
    """Per layer, the first tier with room for its routed experts but the `held` ones (GPU,
    CPU, disk), added to `resident` (on disk at the bytes the disk holds: FP8's 1 a weight and
    its scales); a layer without experts gets the dense weights' tier."""
    experts: list[Tier] = []
    for layer in range(model.n_layers):
        if not model.is_moe(layer):
            experts.append(dense_tier)
            continue
        placed = model.n_experts - held.get(layer, 0)
        layer_experts, on_disk = placed * model.expert_bytes, placed * model.expert_disk_bytes
        tier = _take(free, (Tier.GPU, Tier.CPU), layer_experts) or _take(
            free, (Tier.DISK,), on_disk
        )
        if tier is None:  # pragma: no cover - excluded by the total check above
            raise CapacityError(f"layer {layer}'s experts fit nowhere")
        experts.append(tier)
        resident[tier] += on_disk if tier == Tier.DISK else layer_experts
    return experts


def staged_placement(
    model: ModelSpec,
    hw: HardwareSpec,
    staging_bytes: int,
    kv_sequences: int,
    kv_tokens: int,
    working_bytes: int,
    activation_bytes: int = 0,
    working_weight_bytes: int = 0,
) -> Placement:
    """`greedy_placement`; where experts spill to disk, placed again with `staging_bytes` of CPU
    memory reserved for the disk reads to pass through on their way to the GPU."""
    kw: dict[str, Any] = dict(
        kv_sequences=kv_sequences,
        kv_tokens=kv_tokens,
        working_bytes=working_bytes,
        activation_bytes=activation_bytes,
        working_weight_bytes=working_weight_bytes,
    )
    first = greedy_placement(model, hw, **kw)
    if Tier.DISK not in first.experts:
        return first
    return greedy_placement(model, hw, cpu_staging_bytes=staging_bytes, **kw)


def klotski_placement(
    model: ModelSpec,
    hw: HardwareSpec,
    kv_sequences: int,
    kv_tokens: int,
    stream_bytes: int,
    activation_bytes: int,
    window_layers: int,
    kv_buffer_bytes: int = 0,
) -> Placement:
    """Klotski's placement (paper §6.1): GPU room for one layer of experts (the transfer space)
    plus the streamed non-expert units (`stream_bytes` of weights, `kv_buffer_bytes` of KV
    buffers), then `greedy_placement`'s order.

    CPU memory goes to weights before any staging: when the experts do not all fit in RAM, a
    rolling window of `window_layers` expert layers is kept in CPU memory and the disk stream
    reads ahead into it (the planner issues those reads). KV has no disk path, so KV that does
    not fit the GPU takes CPU before experts do (the experts spill to disk instead).
    """
    layer_experts = model.n_experts * model.expert_bytes
    weights = layer_experts + stream_bytes
    # The rolling disk -> CPU window: `window_layers` expert layers, or as much as CPU memory has
    # but never less than the one expert a disk read passes through (a CPU smaller than that is
    # refused up front, not met as an op that cannot allocate)
    staging = max(min(window_layers * layer_experts, hw.memory_bytes[Tier.CPU]), model.expert_bytes)
    working = weights + kv_buffer_bytes
    return staged_placement(
        model, hw, staging, kv_sequences, kv_tokens, working, activation_bytes, weights
    )
