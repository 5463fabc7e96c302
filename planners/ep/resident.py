"""What an expert-parallel run keeps resident on its GPUs, and its refusal where that does not
fit: the placement's activations (`activation_bytes`) and one line whose numbers add up
(`not_resident`), whichever of the fullest GPU or the GPUs together it is that overflows; a
working set past the GPUs names no smaller workload where the experts leave no room for one
(`resident_edge`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from core.errors import CapacityError, gb_apart
from core.spec import ModelSpec
from core.types import Tier
from planners.placement import GpuEdgeError, Placement


@contextmanager
def resident_edge(model: ModelSpec, gpus: int, cap: int) -> Iterator[None]:
    """Inside, a working set past `gpus` GPUs of `cap` bytes (`GpuEdgeError`) names only more
    GPU memory where no workload fits: a GPU's share of the experts and of the dense weights
    (at least theirs over the GPUs, as tensor parallelism splits them) exceeds it."""
    try:
        yield
    except GpuEdgeError as e:
        expert_layer = len(model.moe_layers) * model.expert_bytes  # one expert of every layer
        dense = model.total_bytes - model.n_experts * expert_layer
        if -(-model.n_experts // gpus) * expert_layer + dense // gpus > cap:
            raise CapacityError(e.only_gpu) from None
        raise


def activation_bytes(model: ModelSpec, p: Placement, gpu_bytes: int) -> int:
    """The activations a placement holds on the GPUs: of what it holds there (`gpu_bytes`),
    what is not the dense weights, KV cache and experts it placed there."""
    layer_experts = model.n_experts * model.expert_bytes
    dense = model.total_bytes - layer_experts * len(model.moe_layers)
    on_gpu = sum(1 for i, t in enumerate(p.experts) if t == Tier.GPU and model.is_moe(i))
    placed = (
        dense * (p.dense == Tier.GPU)
        + p.kv_bytes_per_layer * p.kv.count(Tier.GPU)
        + on_gpu * layer_experts
    )
    return max(0, gpu_bytes - placed)


def not_resident(
    model: ModelSpec, p: Placement, gpus: int, cap: int, held: float, act: int
) -> CapacityError:
    """The refusal of a run whose experts do not all stay on its `gpus` GPUs of `cap` bytes:
    the fullest GPU's bytes (`held`) where they exceed one GPU, else what the placement could
    not fit into them together (the dense weights, every expert, all KV, the activations `act`
    and its working buffers), which the fullest GPU's count leaves out."""
    experts = model.n_experts * model.expert_bytes * len(model.moe_layers)
    if held > cap:
        has, holds = gb_apart(cap, int(held))
        need = (
            f"with its dense weights and KV cache do not fit {gpus} GPU(s) of {has} GB "
            f"(the fullest holds {holds} GB)"
        )
    else:
        kv = p.kv_bytes_per_layer * model.n_layers
        total = model.total_bytes + kv + act + p.working_bytes
        needs, has, all_ = gb_apart(total, cap, gpus * cap)
        need = (
            f"with its dense weights, KV cache, activations and {p.working_bytes / 1e9:.3g} GB "
            f"of buffers ({needs} GB) do not fit {gpus} GPU(s) of {has} GB"
            + (f" ({all_} GB in all)" if gpus > 1 else "")
        )
    return CapacityError(
        f"expert parallelism keeps every expert resident, but {model.name}'s experts "
        f"({experts / 1e9:.3g} GB) {need}; use hardware with more GPU memory (raise "
        "hardware.memory_gb.gpu), more GPUs, or a smaller model"
    )
