"""Memory a run's schedule reserves for the whole run against what its ops need there (issue
48, round 24l): each tier's resident bytes (`Schedule.resident_bytes`, what `reserve` holds)
take off the bytes of expert copies that no op ever reads from that tier, because the run
keeps those experts on the GPU for the whole run (run there, never loaded); the rest is the
need. `reservation_problems` lists each tier that reserves more than it needs.

The GPU tier (round 25c), from the run's trace (`GpuLedger`): each allocation on the GPU from
its grant to its release against its reads (a GPU compute's weight, an attention's KV, a
transfer out of the GPU); the need is the resident weights, KV and activations of the
sequences live at once, plus each allocation to its last read (a speculative load no op
reads: to its release). `gpu_problems` lists a read of a copy not reserved, a free that waits
for an op which does not read what it frees, memory kept to the run's end or at the peak
past the need beyond the cache the plan block states in words (`plan.gpu_cache`), and GPU
figures of summary.json and its plan block that the schedule and trace contradict.

Usage: `assert not reservation_problems(spec, result)` with a `pipeline.RunResult` of `spec`;
`assert not gpu_problems(spec, result)` likewise.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from core.activations import activation_bytes
from core.schedule import Op, Schedule
from core.shown import gb
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from experiments.common.pipeline import RunResult, RunSpec
from planners.placement import dense_bytes
from tests.probes.statements import DENSE

OFF_GPU = (Tier.CPU, Tier.DISK)
EXPERT = Tensor.EXPERT


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


# ---- the GPU tier (round 25c) ---------------------------------------------------------------
# A GPU copy's key: (tensor, layer, expert) of a weight, (KV, layer, batch) of a KV buffer.
_Key = tuple[Tensor, int, int]


def gpu_problems(spec: RunSpec, result: RunResult) -> list[str]:
    """What the run's GPU tier reserves against what its ops need there: each GPU copy an op
    reads while none is reserved (released before its last use, or never loaded), a free
    of a copy no allocation holds, a free that waits for an op which does not read what it
    frees, copies held to the run's end past
    their last use where the plan block states no cache, the peak reserved past the peak
    needed (beyond the cache the plan block says it keeps: `kept_cache_bytes`), a cache that
    holds more than its stated size, and summary.json's GPU peak against the trace's."""
    gpu = GpuLedger(result)
    kept = kept_cache_bytes(spec, result)
    problems = gpu.unreserved_reads() + gpu.late_frees()
    problems += [
        f"{o.label()} frees {o.free_bytes} B of gpu that no allocation of its copy holds"
        for o in gpu.orphan_frees[:3]
    ]
    kept_end = gpu.kept_to_end()
    if kept_end and not kept:
        s = kept_end[0]
        problems.append(
            f"{len(kept_end)} GPU copies held to the run's end past their last use, which the "
            f"plan block does not say it keeps (op {s.op}'s {s.nbytes} B of {s.key})"
        )
    reserved = gpu.peak_reserved()
    # an expert-parallel run holds every expert, replica slot and dense copy for its whole
    # length (checked per GPU by its planner); its need is not modelled here
    needed = reserved if result.schedule.ep else gpu.peak_needed(spec)
    if reserved > needed + kept:
        problems.append(
            f"gpu reserves {reserved} B at its peak, needs {needed} B (+ {kept} B of cache kept)"
        )
    experts = peak_live(
        [(s.granted, s.released, s.nbytes) for s in gpu.spans if s.key[0] == EXPERT]
    )
    if kept and experts > kept:
        problems.append(f"the expert cache holds {experts} B at once, says it keeps {kept} B")
    said = result.summary["peak_bytes"]["gpu"]
    if said != reserved:
        problems.append(f"summary.json's peak_bytes.gpu {said} B, the trace's {reserved} B")
    return problems + _figure_problems(result, reserved)


def _figure_problems(result: RunResult, peak: int) -> list[str]:
    """The plan block's GPU figures against the schedule's: `placement.resident_gb.gpu` is
    what the run holds on the GPU for its whole length, and `placement.working_gb` covers
    what it allocates there beside that at its peak."""
    placement = result.summary["plan"].get("placement", {})
    held = result.schedule.resident_bytes.get(Tier.GPU, 0)
    problems = []
    said = placement.get("resident_gb", {}).get("gpu")
    if said is not None and said != gb(held):
        problems.append(f"plan's resident_gb.gpu says {said} GB, the run holds {gb(held)} GB")
    working = placement.get("working_gb")
    if working is not None and gb(peak - held) > working:
        problems.append(
            f"plan's working_gb says {working} GB, the run allocates {gb(peak - held)} GB "
            "beside what it holds"
        )
    return problems


@dataclass
class _Span:
    """One GPU allocation: granted at `granted`, released at `released` (the run's end where
    no op frees it), last read at `last_use` (-inf where no op reads it)."""

    key: _Key
    op: int
    nbytes: int
    granted: float
    released: float
    last_use: float = -math.inf
    freed_by: int = -1  # the op that releases it (-1: none, held to the run's end)
    readers: list[int] = field(default_factory=list)


def _alloc_key(op: Op) -> _Key:
    if op.kind in (OpKind.KV_LOAD, OpKind.ATTENTION) or op.tensor == Tensor.KV:
        return (Tensor.KV, op.layer, op.batch)  # an attention's allocation: its new KV
    return (op.tensor, op.layer, op.expert)


def _free_key(op: Op) -> _Key:
    if op.kind == OpKind.KV_STORE or op.tensor == Tensor.KV:
        return (Tensor.KV, op.layer, op.batch)
    return (op.tensor, op.layer, op.expert)


def _reads(sched: Schedule, op: Op) -> list[_Key]:
    """The GPU copies `op` reads: a GPU compute its weight (and an attention its batches' KV),
    a transfer out of the GPU what it moves."""
    res = sched.streams[op.stream].resource
    if op.kind in COMPUTE_KINDS and res == Resource.GPU:
        keys = [(op.tensor, op.layer, op.expert if op.tensor == Tensor.EXPERT else -1)]
        if op.kind == OpKind.ATTENTION:
            keys += [(Tensor.KV, op.layer, b) for b in range(op.batch, op.batch + op.batches)]
        return keys
    if op.kind in (OpKind.LOAD, OpKind.KV_STORE) and op.src == Tier.GPU:
        return [_free_key(op)]
    return []


class GpuLedger:
    """A run's GPU allocations (granted, released, last read: from its trace) and the reads
    of its GPU copies."""

    def __init__(self, result: RunResult) -> None:
        sched, trace = result.schedule, result.trace
        self.sched, self.result = sched, result
        self.end = trace["end_s"].to_numpy()
        start = trace["start_s"].to_numpy()
        granted = (
            trace["alloc_s"].fillna(trace["start_s"]).to_numpy() if "alloc_s" in trace else start
        )
        self.makespan = float(self.end.max(initial=0.0))
        self.spans: list[_Span] = []
        self.by_key: dict[_Key, list[_Span]] = defaultdict(list)
        held: dict[_Key, deque[_Span]] = defaultdict(deque)
        self.orphan_frees: list[Op] = []
        for o in sched.ops:
            if o.alloc_tier == Tier.GPU and o.alloc_bytes:
                span = _Span(_alloc_key(o), o.id, o.alloc_bytes, granted[o.id], self.makespan)
                held[span.key].append(span)
                self.spans.append(span)
                self.by_key[span.key].append(span)
            if o.free_tier == Tier.GPU and o.free_bytes:
                q = held.get(_free_key(o))
                if q:
                    span = q.popleft()
                    span.released, span.freed_by = float(self.end[o.id]), o.id
                else:
                    self.orphan_frees.append(o)
        self.unreserved: list[str] = []
        for o in sched.ops:
            for key in _reads(sched, o):
                spans = self.by_key.get(key)
                if not spans:
                    continue  # resident for the whole run (counted in `resident_need`)
                live = [
                    s for s in spans if s.granted <= start[o.id] and s.released >= self.end[o.id]
                ]
                if live:
                    s = max(live, key=lambda s: s.granted)
                    s.last_use = max(s.last_use, float(self.end[o.id]))
                    s.readers.append(o.id)
                else:
                    self.unreserved.append(f"{o.label()} reads {key[0]} with no GPU copy reserved")

    def unreserved_reads(self) -> list[str]:
        return self.unreserved[:3] + (
            [f"... {len(self.unreserved) - 3} more"] if len(self.unreserved) > 3 else []
        )

    def kept_to_end(self) -> list[_Span]:
        """GPU copies held to the run's end past their last read (or never read): kept, which
        only a cache the plan block states does by design."""
        return [s for s in self.spans if s.released >= self.makespan > s.last_use]

    def late_frees(self) -> list[str]:
        """Frees that wait for an op which neither reads what they free nor (for a copy no op
        reads) is a gate that tells it is not needed, and that ends after its last read: the
        copy is held past its last use for that op."""
        ops, late = self.sched.ops, []
        for s in self.spans:
            if s.freed_by < 0 or ops[s.freed_by].kind != OpKind.FREE:
                continue  # a reader's own release, or none
            ok = {s.op, *s.readers}
            last = s.last_use if s.readers else s.granted
            for d in ops[s.freed_by].deps:
                gate = ops[d].kind == OpKind.GATE and not s.readers
                if d not in ok and not gate and self.end[d] > last:
                    late.append(f"{ops[s.freed_by].label()} waits for {ops[d].label()}")
                    break
        return late[:3] + ([f"... {len(late) - 3} more"] if len(late) > 3 else [])

    def peak_reserved(self) -> int:
        held = [(s.granted, s.released, s.nbytes) for s in self.spans]
        return self.sched.resident_bytes.get(Tier.GPU, 0) + peak_live(held)

    def peak_needed(self, spec: RunSpec) -> int:
        needed = [(s.granted, _needed_until(s), s.nbytes) for s in self.spans]
        return resident_need(spec, self) + peak_live(needed)


def _needed_until(s: _Span) -> float:
    """A span's last read, or its release where no op reads it (a speculative load)."""
    return s.last_use if s.last_use > -math.inf else s.released


def peak_live(spans: list[tuple[float, float, int]]) -> int:
    """The most bytes live at once over [from, to] spans; at equal times releases first."""
    events = sorted([(a, n) for a, _, n in spans] + [(b, -n) for _, b, n in spans])
    live = peak = 0
    for _, n in events:
        live += n
        peak = max(peak, live)
    return peak


def live_sequences(spec: RunSpec, result: RunResult) -> int:
    """The most sequences whose batches are under way at once (a batch from its first op's
    start to its last op's end)."""
    trace, bs = result.trace, spec.workload.batch_size
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    start, end = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
    for o in result.schedule.ops:
        for b in range(o.batch, o.batch + o.batches) if o.batch >= 0 else ():
            first[b] = min(first.get(b, math.inf), float(start[o.id]))
            last[b] = max(last.get(b, -math.inf), float(end[o.id]))
    if not first:
        return spec.workload.n_sequences
    return bs * peak_live([(first[b], last[b], 1) for b in first])


def resident_need(spec: RunSpec, gpu: GpuLedger) -> int:
    """GPU bytes the run needs for its whole length: the dense weights where a GPU computes
    with them and none is loaded, each layer's KV where it is never moved (the sequences live
    at once, at their whole context), the experts a GPU runs and never loads, and the
    activations of the sequences live at once (3 hidden states per prompt token)."""
    sched, m, wl = gpu.sched, spec.model, spec.workload
    read = {k for o in sched.ops for k in _reads(sched, o)}
    streamed = set(gpu.by_key)
    dense_read = {k for k in read if k[0] in DENSE}
    dense = dense_bytes(m) if dense_read and not dense_read & streamed else 0
    live = live_sequences(spec, gpu.result)
    moved_kv = {k[1] for k in streamed if k[0] == Tensor.KV}
    kv_layers = {k[1] for k in read if k[0] == Tensor.KV} - moved_kv
    kv = len(kv_layers) * live * (wl.prompt_len + wl.gen_len) * m.kv_bytes_per_token
    experts = sum(1 for k in read if k[0] == Tensor.EXPERT and k not in streamed)
    act = 3 * live * wl.prompt_len * m.hidden_size * m.dtype_bytes
    if spec.params.get("real_activations"):
        act = activation_bytes(m, wl, live).total
    return dense + kv + experts * m.expert_bytes + act


def kept_cache_bytes(spec: RunSpec, result: RunResult) -> int:
    """GPU bytes the plan block says the run keeps as a cache past their last use: none
    unless it says so in words (`plan.gpu_cache`), then its experts' (`cache_experts`, or
    `cache_slots_per_layer` in each MoE layer)."""
    plan, m = result.summary["plan"], spec.model
    if "gpu_cache" not in plan:
        return 0
    if "cache_slots_per_layer" in plan:
        return plan["cache_slots_per_layer"] * len(m.moe_layers) * m.expert_bytes
    return plan.get("cache_experts", 0) * m.expert_bytes
