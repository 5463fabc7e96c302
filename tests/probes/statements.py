"""What a run, simulated or real, says about itself against what its schedule does (issue 48,
round 24g): each statement of summary.json's `plan` block (where each unit lives, what is
resident, cache sizes, shares of experts by where they ran, replica copies, the n chosen,
experts prefetched, the placement within its budget) checked against the ops that run and the
memory the schedule holds. `statement_problems` lists each one false; an empty list is a
true plan block.

Usage: `assert not statement_problems(spec, result)` with a `pipeline.RunResult` of `spec`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from core.schedule import Op, Schedule
from core.shown import gb
from core.types import OpKind, Resource, Stream, Tensor, Tier
from experiments.common.pipeline import RunResult, RunSpec

DENSE = (Tensor.ATTENTION, Tensor.GATE, Tensor.FFN, Tensor.EMBED, Tensor.HEAD)
OFF_GPU = (Tier.CPU, Tier.DISK)


def statement_problems(spec: RunSpec, result: RunResult) -> list[str]:
    """Each statement of the run's `plan` block that its schedule contradicts."""
    plan, sched = result.summary["plan"], result.schedule
    placement = plan.get("placement", {})
    problems = _expert_tier_problems(spec, plan, sched)
    problems += _dense_kv_problems(spec, placement, sched.ops)
    problems += _count_problems(spec, plan, sched)
    problems += _held_problems(plan, sched)
    problems += _budget_problems(result.summary, sched)
    return problems


def _to_gpu(op: Op, tensor: Tensor) -> bool:
    return op.kind == OpKind.LOAD and op.tensor == tensor and op.dst == Tier.GPU


def _expert_tier_problems(spec: RunSpec, plan: dict[str, Any], sched: Schedule) -> list[str]:
    """Expert layers said to be on the GPU are never read from CPU or disk; those said to be
    off it reach the GPU by a load before a GPU computes with them."""
    placement, plan_resident = plan.get("placement", {}), plan.get("resident_experts", 0)
    if "expert_layers" not in placement:
        return []
    n_moe, problems = len(spec.model.moe_layers), []
    gpu_layers = placement["expert_layers"].get("gpu", 0)
    loaded = {(o.layer, o.expert) for o in sched.ops if _to_gpu(o, Tensor.EXPERT)}
    on_gpu = {
        (o.layer, o.expert)
        for o in sched.ops
        if o.kind == OpKind.EXPERT and sched.streams[o.stream].resource != Resource.CPU
    }
    # run on a GPU, never moved there: layers said to be on the GPU, or the experts a plan
    # says it keeps resident besides (fiddler's `resident_experts`)
    never = on_gpu - loaded
    by_layer = Counter(layer for layer, _ in never)
    whole = sum(1 for n in by_layer.values() if n == spec.model.n_experts)
    if whole > gpu_layers:
        problems.append(
            f"expert_layers says {gpu_layers} of {n_moe} on the GPU, but all experts of {whole} "
            "layers run there and are never loaded"
        )
    besides = len(never) - gpu_layers * spec.model.n_experts
    if besides > plan_resident:
        problems.append(
            f"{besides} experts off the GPU layers run there and are never loaded, but the "
            f"plan says {plan_resident} are resident"
        )
    from_off = {o.layer for o in sched.ops if _to_gpu(o, Tensor.EXPERT) and o.src in OFF_GPU}
    if len(from_off) > n_moe - gpu_layers:
        problems.append(
            f"expert_layers says {n_moe - gpu_layers} off the GPU, but {len(from_off)} layers' "
            "experts are loaded from CPU or disk"
        )
    return problems


def _dense_kv_problems(spec: RunSpec, placement: dict[str, Any], ops: list[Op]) -> list[str]:
    """Dense weights and KV said to be on the GPU are never read from CPU or disk."""
    problems = []
    if placement.get("dense") == "gpu" and any(
        o.src in OFF_GPU for o in ops if o.tensor in DENSE and _to_gpu(o, o.tensor)
    ):
        problems.append("dense says gpu, but dense weights are loaded from CPU or disk")
    if "kv_layers" in placement:
        kv_gpu = placement["kv_layers"].get("gpu", 0)
        kv_off = {o.layer for o in ops if o.kind == OpKind.KV_LOAD and o.src in OFF_GPU}
        if len(kv_off) > spec.model.n_layers - kv_gpu:
            problems.append(
                f"kv_layers says {kv_gpu} on the GPU, but {len(kv_off)} of "
                f"{spec.model.n_layers} layers load KV from CPU or disk"
            )
    return problems


def _count_problems(spec: RunSpec, plan: dict[str, Any], sched: Schedule) -> list[str]:
    """Counts and sizes: caches no larger than the model's experts, shares of experts by where
    they ran as the ops ran, and a size in GB that shows 0 only where nothing is held."""
    m, problems = spec.model, []
    experts = len(m.moe_layers) * m.n_experts
    for key in ("cache_experts", "resident_experts"):
        if key in plan and plan[key] > experts:
            problems.append(f"{key} {plan[key]} > the model's {experts} routed experts")
    if "expert_share_cpu" in plan:
        runs = Counter(
            sched.streams[o.stream].resource == Resource.CPU
            for o in sched.ops
            if o.kind == OpKind.EXPERT
        )
        share = runs[True] / max(sum(runs.values()), 1)
        if abs(plan["expert_share_cpu"] - share) > 1e-3:
            problems.append(f"expert_share_cpu {plan['expert_share_cpu']} != {share:.4f}")
    held = sched.resident_bytes
    for tier, said in plan.get("placement", {}).get("resident_gb", {}).items():
        if said == 0 and held.get(Tier(tier), 0) > 0:
            problems.append(f"resident_gb.{tier} says 0 while {held[Tier(tier)]} bytes are held")
    ep = plan.get("ep", {})
    if ep.get("replica_gb") == 0 and ep.get("replicas", 0) > 0:
        problems.append(f"ep.replica_gb says 0 for {ep['replicas']} replicas")
    return problems


def _held_problems(plan: dict[str, Any], sched: Schedule) -> list[str]:
    """The placement's resident GB is memory the schedule holds for the whole run; an EP run's
    `copies` are the replica copies its links carry."""
    problems = []
    for tier, said in plan.get("placement", {}).get("resident_gb", {}).items():
        held = gb(sched.resident_bytes.get(Tier(tier), 0))
        if said > held:
            problems.append(f"resident_gb.{tier} says {said} while the run holds {held} GB")
    ep = plan.get("ep", {})
    if "copies" in ep:
        # a copy lands by its destination's link (P2P), or within one GPU on lanes (D2D); its
        # leaving op on the source's outgoing link (P2P_OUT) is the same copy
        into = {n for n, s in sched.streams.items() if s.resource in (Resource.P2P, Resource.D2D)}
        copies = sum(1 for o in sched.ops if o.kind == OpKind.LOAD and o.stream in into)
        if copies != ep["copies"]:
            problems.append(f"ep.copies says {ep['copies']} while {copies} copies run")
    return problems


def _budget_problems(summary: dict[str, Any], sched: Schedule) -> list[str]:
    """The placement fits the GPU it was given, what it holds shows in each tier's peak, the n
    a planner says it chose is the run's, and Klotski prefetches at most `hot_k` experts a
    layer and batch."""
    plan, problems = summary["plan"], []
    placement = plan.get("placement", {})
    cap = sched.capacity_bytes[Tier.GPU]
    if "working_gb" in placement:
        parts = (placement["resident_gb"].get("gpu", 0), placement["working_gb"])
        fit = sum(parts)
        if fit > gb(cap) + sum(map(_rounded_by, (*parts, gb(cap)))):
            problems.append(f"resident_gb.gpu + working_gb {fit} > the GPU's {gb(cap)} GB")
    for tier, held in sched.resident_bytes.items():
        if summary["peak_bytes"][str(tier)] < held:
            problems.append(f"peak_bytes.{tier} {summary['peak_bytes'][str(tier)]} < {held} held")
    if "n_plan" in plan and plan["n_plan"]["n"] != summary["n_batches"]:
        problems.append(f"n_plan.n {plan['n_plan']['n']} != n_batches {summary['n_batches']}")
    if "hot_k" in plan:
        ahead = Counter(
            (o.step, o.layer, o.batch)
            for o in sched.ops
            if _to_gpu(o, Tensor.EXPERT) and o.stream == Stream.WEIGHTS
        )
        if max(ahead.values(), default=0) > plan["hot_k"]:
            problems.append(f"hot_k {plan['hot_k']} < {max(ahead.values())} prefetched a layer")
    return problems


def _rounded_by(shown_gb: float) -> float:
    """The most `core.shown.gb` moves a figure: half its last of 3 decimals, or of its 3
    significant digits below 0.1."""
    return 5e-4 if shown_gb >= 0.1 else 5e-3 * shown_gb
