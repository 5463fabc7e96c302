"""Memory a run's schedule reserves for the whole run against what its ops need there (issue
48, round 24l): each tier's resident bytes (`Schedule.resident_bytes`, what `reserve` holds)
take off the bytes of expert copies that no op ever reads from that tier, because the run
keeps those experts on the GPU for the whole run (run there, never loaded); the rest is the
need. `reservation_problems` lists each tier that reserves more than it needs.

Usage: `assert not reservation_problems(spec, result)` with a `pipeline.RunResult` of `spec`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from core.schedule import Schedule
from core.types import OpKind, Resource, Tensor, Tier
from experiments.common.pipeline import RunResult, RunSpec
from planners.placement import dense_bytes
from tests.probes.statements import DENSE

OFF_GPU = (Tier.CPU, Tier.DISK)


def reservation_problems(spec: RunSpec, result: RunResult) -> list[str]:
    """Each tier off the GPU that reserves more than its ops need there."""
    return [
        f"{tier} reserves {reserved} B, needs {needed} B (dense, KV written, experts read)"
        for tier, (reserved, needed) in reserved_vs_needed(spec, result).items()
        if reserved > needed
    ]


def reserved_vs_needed(spec: RunSpec, result: RunResult) -> dict[Tier, tuple[int, int]]:
    """Off-GPU tier -> (bytes reserved for the whole run, bytes its ops need there: the dense
    weights where they are read from it, the KV written to it, and each expert layer read
    from it less its experts that run on a GPU and are never loaded nor run on the CPU)."""
    sched, m = result.schedule, spec.model
    tiers, unread = _expert_tiers(sched), _unread(sched)
    need = Counter[Tier]()
    for o in sched.ops:
        if o.kind == OpKind.KV_STORE and o.dst in OFF_GPU:
            need[o.dst] += o.nbytes
    dense_from = {o.src for o in sched.ops if o.kind == OpKind.LOAD and o.tensor in DENSE}
    for tier in OFF_GPU:
        need[tier] += dense_bytes(m) if tier in dense_from else 0
    for layer, tier in tiers.items():
        per = m.expert_disk_bytes if tier == Tier.DISK else m.expert_bytes
        need[tier] += (m.n_experts - unread[layer]) * per
    return {t: (sched.resident_bytes.get(t, 0), need[t]) for t in OFF_GPU}


def _unread(sched: Schedule) -> Counter[int]:
    """Layer -> its experts that run on a GPU and are never loaded nor run on the CPU (kept on
    the GPU for the whole run: no copy elsewhere is read)."""
    read = {
        (o.layer, o.expert)
        for o in sched.ops
        if o.tensor == Tensor.EXPERT and (o.kind == OpKind.LOAD or _on_cpu(sched, o))
    }
    on_gpu = {
        (o.layer, o.expert) for o in sched.ops if o.kind == OpKind.EXPERT and not _on_cpu(sched, o)
    }
    return Counter(layer for layer, _ in on_gpu - read)


def _on_cpu(sched: Schedule, op: Any) -> bool:
    return op.kind == OpKind.EXPERT and sched.streams[op.stream].resource == Resource.CPU


def _expert_tiers(sched: Schedule) -> dict[int, Tier]:
    """Layer -> the off-GPU tier its experts are read from (disk where any read starts
    there, else the CPU); a layer none of whose experts is read off the GPU has none."""
    tiers: dict[int, Tier] = {}
    for o in sched.ops:
        if o.tensor != Tensor.EXPERT:
            continue
        if o.kind == OpKind.LOAD and o.src in OFF_GPU:
            tiers[o.layer] = Tier.DISK if Tier.DISK in (o.src, tiers.get(o.layer)) else o.src
        elif _on_cpu(sched, o):
            tiers.setdefault(o.layer, Tier.CPU)
    return tiers
