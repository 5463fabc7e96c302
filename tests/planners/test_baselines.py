"""Contract tests for the baseline planners (moe_infinity, fiddler, mixtral_offloading,
zero_inference) on the tiny model, with GPUs small enough that experts must be offloaded."""

from __future__ import annotations

import pytest

from core.hardware import HardwareSpec
from core.routing import load_routing
from core.schedule import validate
from core.spec import ModelSpec, RoutingConfig, Workload
from core.trace import peak_bytes
from core.types import OpKind, Tier
from experiments.common.pipeline import RunSpec, build_schedule, simulate_run

BASELINES = ["moe_infinity", "fiddler", "mixtral_offloading", "zero_inference"]
TINY_MODEL = dict(
    name="tiny",
    family="mixtral",
    n_layers=2,
    hidden_size=64,
    expert_ffn_size=128,
    n_experts=4,
    top_k=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=256,
)


def hardware(gpu_gb: float) -> HardwareSpec:
    """Round numbers (1 GB/s links, 1 TFLOP/s GPU); one tiny expert is 49152 B."""
    return HardwareSpec.from_dict(
        dict(
            name=f"tiny-{gpu_gb}",
            memory_gb={"gpu": gpu_gb, "cpu": 4.0, "disk": 100.0},
            gpu={"tflops": 1.0, "mem_bw_gbps": 1000.0},
            cpu={"tflops": 0.1, "mem_bw_gbps": 100.0},
            links={"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}, "disk": {"gbps": 0.1}},
        )
    )


def spec(planner: str, gpu_gb: float, **params: object) -> RunSpec:
    model = ModelSpec.from_dict(TINY_MODEL)
    wl = Workload(
        batch_size=2,
        n_batches=3,
        prompt_len=8,
        gen_len=4,
        routing=RoutingConfig(source="synthetic"),
    )
    return RunSpec(model, hardware(gpu_gb), wl, planner, dict(params))


@pytest.mark.parametrize("gpu_gb", [0.0007, 0.0012, 1.0])
@pytest.mark.parametrize("planner", BASELINES)
def test_contract(planner: str, gpu_gb: float) -> None:
    """Validates, is deterministic, every op runs once, memory never exceeds a tier."""
    s = spec(planner, gpu_gb)
    routing = load_routing(s.model, s.workload)
    a, b = build_schedule(s, routing), build_schedule(s, routing)
    assert a.ops == b.ops
    validate(a)
    res = simulate_run(s, routing)
    assert sorted(res.trace["op_id"]) == list(range(len(a.ops)))
    assert (res.trace["end_s"] >= res.trace["start_s"]).all()
    for tier, peak in peak_bytes(res.schedule, res.trace).items():
        assert peak <= a.capacity_bytes[Tier(tier)], tier
    assert res.summary["throughput_tok_s"] > 0


@pytest.mark.parametrize("planner", ["moe_infinity", "mixtral_offloading"])
def test_cache_planners_prefetch_causally(planner: str) -> None:
    """Every expert load that is issued ahead of need depends on an already-run gate op."""
    s = spec(planner, 0.0005)
    sched = build_schedule(s, load_routing(s.model, s.workload))
    gates = {o.id for o in sched.ops if o.kind == OpKind.GATE}
    loads = [o for o in sched.ops if o.kind == OpKind.LOAD and o.step > 0]
    assert loads and all(
        any(d in gates or sched.ops[d].kind == OpKind.LOAD for d in o.deps) for o in loads
    )
    assert sched.meta["prefetch_accuracy"] is not None
    assert 0 <= sched.meta["cache_hit_rate"] <= 1


def test_fiddler_policy_moves_activations_not_weights() -> None:
    """policy=cpu: no expert weight crosses the link; experts run on the cpu_compute stream."""
    s = spec("fiddler", 0.0004, policy="cpu", resident_share=0.0)
    res = simulate_run(s)
    experts = res.trace[res.trace["kind"] == "compute-expert"]
    assert (experts["resource"].astype(str) == "cpu").all()
    weights = res.trace[(res.trace["kind"] == "load") & (res.trace["tensor"] == "expert")]
    assert weights.empty
    assert (res.trace["tensor"] == "hidden").any()


@pytest.mark.parametrize("sync", [True, False])
def test_flexgen_step_sync(sync: bool) -> None:
    """FlexGen's loop synchronizes after each (sub-layer, batch) step: a layer's expert weights,
    loaded during its attention's first batch, are all in before the second batch's attention
    starts. Without `sync` they overlap the later batches. Either way, a batch's offloaded KV
    load is issued beside the previous batch's attention, not after it (double buffering)."""
    wl = Workload(
        batch_size=4,
        n_batches=3,
        prompt_len=64,
        gen_len=4,
        routing=RoutingConfig(source="synthetic"),
    )
    s = RunSpec(ModelSpec.from_dict(TINY_MODEL), hardware(0.001), wl, "flexgen", dict(sync=sync))
    res = simulate_run(s)
    t, ops = res.trace, res.schedule.ops
    attn = t[t["kind"] == "compute-attention"]
    waits = []
    for (step, layer), loads in t[(t["kind"] == "load") & (t["tensor"] == "expert")].groupby(
        ["step", "layer"]
    ):
        later = attn[(attn["step"] == step) & (attn["layer"] == layer) & (attn["batch"] >= 1)]
        waits.append(bool((later["start_s"] >= loads["end_s"].max() - 1e-12).all()))
    assert waits and all(waits) == sync
    attn_op = {(o.step, o.layer, o.batch): o.id for o in ops if o.kind == OpKind.ATTENTION}
    kv = [o for o in ops if o.kind == OpKind.KV_LOAD and o.batch >= 1]
    assert kv, "the case must offload KV"
    assert all(attn_op[(o.step, o.layer, o.batch - 1)] not in o.deps for o in kv)
    assert all(attn_op[(o.step, o.layer, o.batch - 2)] in o.deps for o in kv if o.batch >= 2)
