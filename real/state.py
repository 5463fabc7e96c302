"""What a real run holds: which weight unit an op touches, where units sit before the start, each
batch's activations and a MoE layer's state between its gate and the ops that add its output.

Usage:
    unit_of(op); resident_units(schedule, n_experts)   # the unit an op moves; units preloaded
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from core.routing import Routing
from core.schedule import Op, Schedule
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from real.checkpoint import Unit
from real.model import KVCache

_WEIGHT_TENSORS = {Tensor.ATTENTION, Tensor.GATE, Tensor.EXPERT, Tensor.FFN, Tensor.HEAD}


def unit_of(op: Op) -> Unit | None:
    """The weight unit an op moves, computes with or frees; None for KV/activation ops."""
    if op.tensor not in _WEIGHT_TENSORS:
        return None
    if op.tensor == Tensor.HEAD:
        return Unit(Tensor.HEAD)
    return Unit(op.tensor, op.layer, op.expert if op.tensor == Tensor.EXPERT else -1)


def resident_units(schedule: Schedule, n_experts: int = 0) -> dict[Unit, Tier]:
    """Units the schedule uses without ever loading from disk: where they must sit before t=0.

    Loaded to the GPU but never read from disk -> host RAM; computed on but never loaded -> the
    tier of the stream that computes with them (device pool for gpu streams, host for cpu ones).
    With `n_experts`, a layer with one host-resident expert gets all its experts in host RAM
    (placements put a layer's experts on one tier; a live run may use experts the plan did not).
    """
    from_disk, to_gpu, computed = set(), set(), {}
    for op in schedule.ops:
        u = unit_of(op)
        if u is None:
            continue
        if op.kind == OpKind.LOAD and op.src == Tier.DISK:
            from_disk.add(u)
        elif op.kind == OpKind.LOAD and op.src == Tier.CPU and op.dst == Tier.GPU:
            to_gpu.add(u)
        elif op.kind in COMPUTE_KINDS or (op.kind == OpKind.LOAD and op.src == op.dst):
            # a replica copy (GPU to GPU) reads a copy some GPU holds: resident there, as a
            # unit computed on; a live run may compute it before the copy, where no plan did
            res = schedule.streams[op.stream].resource
            computed.setdefault(u, Tier.CPU if res == Resource.CPU else Tier.GPU)
    out = {u: Tier.CPU for u in to_gpu - from_disk}
    for u, tier in computed.items():
        if u not in from_disk and u not in to_gpu:
            out[u] = tier
        elif u in from_disk and u not in to_gpu and tier == Tier.GPU:
            out.setdefault(u, Tier.GPU)  # read to host for a CPU user elsewhere; GPU copy resident
    if schedule.ep is not None:  # expert parallelism keeps every expert resident on the GPU
        for layer in {u.layer for u in computed if u.kind == Tensor.EXPERT}:
            for e in range(n_experts):
                out.setdefault(Unit(Tensor.EXPERT, layer, e), Tier.GPU)
    host_layers = {u.layer for u, t in out.items() if u.kind == Tensor.EXPERT and t == Tier.CPU}
    for layer in host_layers:
        for e in range(n_experts):
            u = Unit(Tensor.EXPERT, layer, e)
            if u not in from_disk:
                out.setdefault(u, Tier.CPU)
    return out


def host_kv_layers(ops: Iterable[Op]) -> dict[int, frozenset[int]]:
    """Batch -> the layers whose KV cache the ops keep in host memory (KV_LOAD / KV_STORE)."""
    out: dict[int, set[int]] = {}
    for op in ops:
        if op.kind in (OpKind.KV_LOAD, OpKind.KV_STORE):
            out.setdefault(op.batch, set()).add(op.layer)
    return {b: frozenset(layers) for b, layers in out.items()}


@dataclass
class RunOutput:
    """What a real run produced: op times, the schedule run, the generated tokens and logits."""

    schedule: Schedule
    start_s: np.ndarray  # [ops] seconds from the run's start
    end_s: np.ndarray  # [ops]
    tokens: torch.Tensor  # [n*b, gen_len] generated token ids
    logits: torch.Tensor  # [n*b, V] float32 logits of the last step
    routing: Routing  # the experts the gates used (replayed or chosen live)
    fallback_loads: int = 0  # units a compute found nowhere and read synchronously (should be 0)


@dataclass
class _Pending:
    """A batch's MoE layer between its gate and the next op that reads its hidden state. Its
    gate may run in parts, each over a share of the sequences (one per device, data-parallel
    expert parallelism): `gated` says which have run."""

    step: int
    layer: int
    normed: torch.Tensor  # [T, H]
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    slots: torch.Tensor  # [T, k, H]
    done: torch.Tensor  # [b] bool: sequences whose hidden state has the layer's output added
    gated: torch.Tensor  # [b] bool: sequences the gate has run on
    shared: torch.Tensor | None = None  # [T, H]


@dataclass
class _BatchState:
    """One batch's activations. Dense ops may each take a share of its sequences (data-parallel
    expert-parallel planners): `Executor._range` holds each op's [s0, s1)."""

    prompt: torch.Tensor  # [b, P]
    tokens: torch.Tensor  # [b, G] generated so far
    # per decoder layer, the cache attention reads (device), [B, H, M, D] each: allocated when a
    # layer's first attention or KV_LOAD starts, dropped when a KV_STORE releases it (KV kept in
    # host memory), so the device holds the KV the schedule's memory effects say it holds
    kv_dev: list[tuple[torch.Tensor, ...] | None]
    # KV_STORE puts it here, KV_LOAD takes it: [M, B, H, D] each (`_host_kv`); allocated when
    # the batch's first KV op is planned (None where the schedule keeps its KV on the device)
    kv_host: KVCache | None
    # step -> [b, S, H]: the hidden state of each step under way (micro-batches of one batch
    # may be a step apart: one's next step starts while another's head still reads this one)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # micro-batch (-1: the whole batch) -> the MoE layer whose output its next ops add, and the
    # next one, while its gate parts run
    pending: dict[int, _Pending] = field(default_factory=dict)
    gating: dict[int, _Pending] = field(default_factory=dict)
    written: list[int] = field(default_factory=list)  # per step: sequences whose head ran
    logits: torch.Tensor | None = None  # [b, V]


def bst_index(batches: list[_BatchState], bst: _BatchState) -> int:
    """The batch index of a batch's state (for an error line)."""
    return next(i for i, b in enumerate(batches) if b is bst)
