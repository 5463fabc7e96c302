"""Expert-parallel runs with tensor-parallel dense work (dense=tensor): the split weights, the
all-reduces, each GPU's gate parts and memory, as the real run splits them."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from core.errors import CapacityError, ConfigError
from core.hardware import HardwareSpec
from core.spec import ModelSpec, RoutingConfig, Workload
from core.types import OpKind, Tier
from experiments.common.pipeline import RunSpec, simulate_run
from tests.planners.ep_common import tiny_spec


def test_per_gpu_memory_of_tensor_parallel_dense_work_and_of_every_batch():
    """DeepSeek-V2-Lite on 8 GPUs of 5 GB. Data-parallel dense work puts 2.6 GB of dense weights
    on every GPU; with its 8 experts a layer a GPU (3.6 GB) nothing is left for replicas, and the
    line says the model does not fit (it said to lower replica_slots=0). Tensor-parallel dense
    work holds 1/8 of the heads, FFN columns and vocabulary, so replicas fit there. An
    expert-parallel run keeps every batch's KV: more batches of long prompts do not fit."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    hw = replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: 5 * 10**9})
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text()))
    wl = Workload(
        batch_size=8,
        n_batches=1,
        prompt_len=16,
        gen_len=1,
        routing=RoutingConfig(source="synthetic"),
    )
    with pytest.raises(CapacityError, match=r"do not fit 8 GPU\(s\) of 5 GB"):
        simulate_run(RunSpec(m, hw, wl, "ep_static", {"n_devices": 8}))
    tp = {"n_devices": 8, "dense": "tensor", "replica_slots": 1}
    assert simulate_run(RunSpec(m, hw, wl, "eplb", tp)).summary["makespan_s"] > 0
    # MLA's latent cache is whole on every GPU under tensor parallelism: 0.26 GB a batch here
    long, tp0 = wl.with_(batch_size=16, prompt_len=512, n_batches=2), {**tp, "replica_slots": 0}
    simulate_run(RunSpec(m, hw, long, "eplb", tp0))
    with pytest.raises(CapacityError, match="do not fit 8 GPU"):
        simulate_run(RunSpec(m, hw, long.with_(n_batches=3), "eplb", tp0))


def test_tensor_parallel_dense_splits_weights_and_all_reduces():
    """dense=tensor on 2 GPUs: each dense op runs every sequence on half the weights and flops
    (attention: its KV heads too), its partial sums are all-reduced in two phases that each send
    half the bytes per GPU, the head's logits are all-gathered, and no token is dispatched."""
    spec = tiny_spec("ep_static", dense="tensor")
    res = simulate_run(spec)
    m, sched = spec.model, res.schedule
    data = simulate_run(tiny_spec("ep_static")).schedule
    attn = [o for o in sched.ops if o.kind == OpKind.ATTENTION]
    assert len(attn) == len([o for o in data.ops if o.kind == OpKind.ATTENTION])
    prefill = [o for o in attn if o.step == 0]
    assert {o.tokens for o in prefill} == {2 * 8}  # both sequences on both GPUs
    ctx_kv = 2 * 8 * m.kv_bytes_per_token / 2  # 2 sequences x 8 tokens, half the KV heads
    for o in prefill:
        assert o.flops == pytest.approx(m.attention_flops(16, 4, sequences=2) / 2)
        assert o.touch_bytes == pytest.approx(m.attn_bytes / 2 + ctx_kv)
    head = [o for o in sched.ops if o.kind == OpKind.HEAD]
    assert {o.touch_bytes for o in head} == {m.head_bytes / 2}
    reduce = [o for o in sched.ops if o.kind == OpKind.ALL_REDUCE]
    assert {sched.streams[o.stream].name for o in reduce} == {"allreduce0", "allreduce1"}
    after_attn = [o for o in reduce if o.step == 0 and o.layer == 0 and o.batch == 0]
    # attention's all-reduce (2 phases x 2 GPUs) and the MoE layer's (routed + nothing shared)
    assert len(after_attn) == 8
    assert {o.nbytes for o in after_attn} == {16 * m.hidden_size * m.dtype_bytes // 2}
    gather = [o for o in reduce if o.layer == -1 and o.step == 0 and o.batch == 0]
    assert len(gather) == 2 and {o.nbytes for o in gather} == {2 * m.vocab_size * 4 // 2}
    # a phase waits for every GPU's part: the collective synchronises them
    first = after_attn[0]
    assert {sched.ops[d].kind for d in first.deps} == {OpKind.ATTENTION}
    assert len(first.deps) == 2
    kinds = {o.kind for o in sched.ops}
    assert OpKind.DISPATCH not in kinds and OpKind.COMBINE not in kinds
    # nor are the all-to-all's streams declared: each link carries copies and all-reduces
    assert {
        n.rstrip("0123456789") for n in sched.streams if "p2p" in sched.streams[n].resource
    } == {"replicas", "replicas_out", "allreduce"}
    routed = sum(o.tokens for o in sched.ops if o.kind == OpKind.EXPERT)
    assert routed == sum(o.tokens for o in data.ops if o.kind == OpKind.EXPERT)
    assert res.summary["plan"]["ep"]["dense"] == "tensor"


@pytest.mark.parametrize(
    "params, batch, parts",
    [
        ({}, 2, [("compute", 1), ("compute1", 1)]),  # each GPU its own sequence
        ({}, 1, [("compute", 1)]),  # GPU 1 holds no sequence: no gate there
        ({"dense": "tensor"}, 2, [("compute", 2), ("compute1", 2)]),  # every GPU every sequence
        ({"lanes": True}, 2, [("compute", 2)]),  # lanes: one whole-GPU op, as attention
    ],
)
def test_each_gpu_gates_the_sequences_it_holds(params, batch, parts):
    """On G GPUs each GPU runs the router on the sequences it holds, after its own attention;
    every expert op of the batch (and each dispatch) waits for all of the batch's gate parts."""
    spec = tiny_spec("predictive_replication", **params)
    spec = RunSpec(
        spec.model, spec.hardware, spec.workload.with_(batch_size=batch), spec.planner, spec.params
    )
    sched = simulate_run(spec).schedule
    per = spec.workload.prompt_len  # prefill tokens per sequence
    gates = [
        o
        for o in sched.ops
        if o.kind == OpKind.GATE and o.step == 0 and o.layer == 1 and o.batch == 0
    ]
    assert [(sched.streams[o.stream].name, o.tokens // per) for o in gates] == parts
    for g in gates:  # after its own GPU's attention (under tensor: its all-reduce)
        (dep,) = [sched.ops[d] for d in g.deps]
        if params.get("dense") == "tensor":
            assert dep.kind == OpKind.ALL_REDUCE
        else:
            assert dep.kind == OpKind.ATTENTION and dep.stream == g.stream
    ids = {g.id for g in gates}
    waiting = [
        o
        for o in sched.ops
        if o.kind in (OpKind.EXPERT, OpKind.DISPATCH) and (o.step, o.layer, o.batch) == (0, 1, 0)
    ]
    assert waiting and all(ids <= set(o.deps) for o in waiting)


def test_lanes_ignore_dense_tensor():
    """Lanes already run dense work as whole-GPU ops: dense=tensor adds no all-reduce there."""
    lanes = simulate_run(tiny_spec("ep_static", lanes=True, dense="tensor"))
    assert not any(o.kind == OpKind.ALL_REDUCE for o in lanes.schedule.ops)
    assert lanes.summary["plan"]["ep"]["dense"] is None


@pytest.mark.parametrize(
    "params, match",
    [
        ({"dense": "pipeline"}, "dense='pipeline' unknown; valid: data, tensor"),
        ({"dense": "tensor", "n_devices": 3}, "n_heads=4 does not split evenly over 3 ranks"),
    ],
)
def test_bad_dense_is_one_config_error(params, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec("ep_static", **params))


def test_tensor_parallel_kv_heads_and_qk_norm_as_the_real_run_splits_them():
    """tiny (4 query heads, 2 kv heads, 4 experts) on 4 GPUs, dense=tensor: each GPU holds one
    query head and one of the 2 kv heads (each kv head on 2 GPUs, as real/distributed.py and
    vLLM replicate it): the k and v projections and the KV cache per GPU are 1/2, the rest 1/4.
    As OLMoE (QK-norm over all heads) one more all-reduce per attention sums the per-token
    statistics of q and k (2 float32 a token) before the output's. Where the kv heads neither
    split over the GPUs nor divide them the simulator refuses, as the real run does."""
    spec = tiny_spec("ep_static", dense="tensor", n_devices=4)
    m = spec.model
    kv_w = 2 * 64 * 2 * 16 * 2  # k and v: hidden x (2 kv heads x 16) x 2 bytes each
    attn = [
        o for o in simulate_run(spec).schedule.ops if o.kind == OpKind.ATTENTION and o.step == 0
    ]
    assert len(attn) == 4 * 2 * 3  # 4 GPUs x 2 layers x 3 batches
    cache = 2 * 8 * m.kv_bytes_per_token / 2  # 2 sequences x 8 tokens, one of 2 kv heads
    for o in attn:
        assert o.touch_bytes == pytest.approx((m.attn_bytes - kv_w) / 4 + kv_w / 2 + cache)
        proj = 2 * 16 * kv_w / 2  # 16 tokens through k and v (params = bytes / 2)
        assert o.flops == pytest.approx(
            (m.attention_flops(16, 4, sequences=2) - proj) / 4 + proj / 2
        )

    def after_attention(model: ModelSpec) -> list[int]:
        run = RunSpec(model, spec.hardware, spec.workload, "ep_static", spec.params)
        ops = simulate_run(run).schedule.ops
        return [
            o.nbytes
            for o in ops
            if o.kind == OpKind.ALL_REDUCE and (o.step, o.layer, o.batch) == (0, 0, 0)
        ]

    olmoe = replace(spec.model, family="olmoe", name="tiny-qk")
    hidden = 16 * 64 * 2 * 3 // 4  # 16 tokens' hidden states, 3/4 of them sent per phase
    plain, normed = after_attention(spec.model), after_attention(olmoe)
    assert normed == [16 * 2 * 4 * 3 // 4] * 8 + plain  # 2 phases x 4 GPUs, then as before
    assert plain[:8] == [hidden] * 8
    with pytest.raises(ConfigError, match="n_kv_heads=6 neither splits evenly over 4 ranks"):
        bad = replace(spec.model, n_heads=12, n_kv_heads=6)
        simulate_run(RunSpec(bad, spec.hardware, spec.workload, "ep_static", spec.params))


def test_tensor_parallel_mla_keeps_the_latent_projection_whole():
    """MLA (kv_dim set): the kv_a projection that makes the latent every head reads runs whole on
    each GPU, and the latent cache is whole too; the other attention weights split in two."""
    base = yaml.safe_load(Path("conf/model/deepseek-v2-lite.yaml").read_text())
    small = dict(
        n_layers=2,
        moe_layers=[1],
        hidden_size=64,
        expert_ffn_size=128,
        n_experts=4,
        top_k=2,
        n_heads=4,
        n_kv_heads=4,
        head_dim=16,
        vocab_size=256,
        dense_ffn_size=128,
        shared_ffn_size=128,
        kv_dim=24,
        attn_params=20000,
        qk_head_dim=24,
    )
    m = ModelSpec.from_dict({**base, **small})
    spec = tiny_spec("ep_static", dense="tensor")
    res = simulate_run(RunSpec(m, spec.hardware, spec.workload, "ep_static", spec.params))
    whole = 64 * 24  # hidden x kv_dim params of kv_a
    for o in [o for o in res.schedule.ops if o.kind == OpKind.ATTENTION and o.step == 0]:
        assert o.touch_bytes == pytest.approx(
            (m.attn_bytes - 2 * whole) / 2 + 2 * whole + 2 * 8 * m.kv_bytes_per_token
        )
        proj = 2 * 16 * whole  # 16 tokens through kv_a
        assert o.flops == pytest.approx((m.attention_flops(16, 4, sequences=2) - proj) / 2 + proj)
