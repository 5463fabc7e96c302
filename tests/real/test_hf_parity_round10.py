"""A tenth round: Qwen3-MoE (`model_type: qwen3_moe`, Qwen3-30B-A3B's family) end to end, on
checkpoints transformers' Qwen3MoeForCausalLM writes.

Qwen3-MoE was refused in one line ("not supported"). It now runs as transformers runs it: each
q and k head RMS-normed by one weight of head_dim before RoPE, heads wider than hidden_size /
heads, no shared expert, norm_topk_prob, decoder_sparse_step and mlp_only_layers, attention_bias
on q/k/v/o, a sliding window on every layer where use_sliding_window is true (max_window_layers,
which Qwen3's own config.json carries, is Qwen2-MoE's and changes nothing here), RoPE scaling;
through moepipe's forward and the real executor's planners, in float32 and bfloat16.

Usage: python -m pytest -q tests/real/test_hf_parity_round10.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from real.model import live_routing, reference_generate
from tests.real.test_hf_parity import (
    DTYPES,
    GEN,
    assert_spec_sizes,
    hf_config,
    hf_generate_out,
    hf_greedy,
    without,
    yarn,
)
from tests.real.test_hf_parity_fields import save_cast

transformers = pytest.importorskip("transformers")

# case -> (config.json fields over test_hf_parity's family ones, the fields whose effect the
# test checks by their absence)
Cases = dict[str, tuple[dict[str, Any], tuple[str, ...]]]
CASES: Cases = {
    "qwen3_moe": ({}, ()),
    "qwen3_moe-norm_topk_prob": ({"norm_topk_prob": True}, ("norm_topk_prob",)),
    "qwen3_moe-attention_bias": ({"attention_bias": True}, ()),
    # 4 layers: step 2 makes 1 and 3 sparse, mlp_only_layers [3] leaves 1 alone
    "qwen3_moe-sparse_step": (
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
        (),
    ),
    # every layer slides; max_window_layers 1 would slide layer 0 alone in Qwen2-MoE
    "qwen3_moe-sliding_window": (
        {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 3}
        | {"max_window_layers": 1},
        ("use_sliding_window",),
    ),
    "qwen3_moe-yarn": (yarn(1e6), ("rope_parameters",)),
}


def randomise(model: Any) -> None:
    """Norm weights drawn around 1, biases and DeepSeek-V3's e_score_correction_bias around 0
    (transformers initialises them to 1 and 0), so each moves the logits or the routing."""
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)


def built_cases(root: Path, family: str, cases: Cases) -> Any:
    """(case, dtype) -> (checkpoint, transformers' model loaded from it) of `cases`' fields
    over test_hf_parity's `family` ones, `randomise`d, built on first use."""
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(case: str, dtype: str = "f32") -> tuple[Path, Any]:
        if (case, dtype) not in made:
            to, cast = root / f"{case}-{dtype}", DTYPES[dtype]
            made[case, dtype] = save_cast(family, cases[case][0], to, cast, cast, randomise)
        return made[case, dtype]

    return get


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return built_cases(tmp_path_factory.mktemp("round10"), "qwen3_moe", CASES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_qwen3_moe_equals_transformers(case, dtype, qwen3, prompt, tmp_path):
    """moepipe's greedy tokens are transformers' in float32 and bfloat16, its last logits within
    1e-4 in float32 and one bf16 step in bfloat16 (observed: below 1e-6, and 0); the spec sizes
    each layer as the checkpoint holds it; a field under test moves the logits from its
    absence. Before: `model_type 'qwen3_moe' is not supported`."""
    assert_case_is_transformers(qwen3(case, dtype), CASES[case][1], prompt, tmp_path)


# fields that set the router's weights: their absence is run free, not on the same routing
WEIGHING = ("norm_topk_prob", "routed_scaling_factor")


def assert_case_is_transformers(
    built: tuple[Path, Any], keys: tuple[str, ...], prompt: torch.Tensor, tmp_path: Path
) -> None:
    """moepipe's greedy tokens on `built` (checkpoint, transformers' model) are transformers',
    its last logits within 1e-4 in float32 (one bf16 step in bfloat16); in float32 the spec
    sizes the checkpoint, and without `keys` (config.json's fields under test) the logits move
    by over 0.05, on the same routing where the keys do not weigh it (`WEIGHING`)."""
    ckpt, hf = built
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    f32 = hf.dtype == torch.float32
    torch.testing.assert_close(logits, hf_logits, atol=1e-4 if f32 else 2**-6, rtol=0)
    if f32:
        assert_spec_sizes(ckpt)
        if keys:
            plain = without(ckpt, keys, tmp_path / "plain")
            free = set(keys) & set(WEIGHING)
            routing = None if free else live_routing(ckpt, prompt, GEN)
            _, plain_logits = reference_generate(plain, prompt, GEN, routing)
            assert (plain_logits - logits).abs().max() > 0.05


def test_qwen3_moe_reads_its_layers_and_heads(qwen3):
    """The spec of the cases: MoE layers from decoder_sparse_step and mlp_only_layers, heads of
    head_dim 32 (not hidden_size / heads = 16), no shared expert, the experts under
    num_local_experts, the name transformers' save_pretrained writes."""
    import json

    ckpt, _ = qwen3("qwen3_moe-sparse_step")
    spec, _ = load_checkpoint(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "num_experts" not in cfg and cfg["num_local_experts"] == 8
    assert (spec.n_layers, spec.moe_layers, spec.dense_ffn_size) == (4, (1,), 48)
    assert (spec.head_dim, spec.n_heads, spec.n_kv_heads, spec.n_experts) == (32, 4, 2, 8)
    assert spec.shared_ffn_size == 0 and not spec.qk_norm and spec.head_qk_norm


def test_qwen3_moe_experts_under_both_names_read_as_transformers():
    """A config.json with num_experts and num_local_experts (Qwen3's own files write the first,
    save_pretrained the second) sizes the experts as transformers' config does, whichever
    order: num_local_experts, which its attribute_map stores num_experts as."""
    from core.hf_config import hf_config_to_spec

    fields = hf_config("qwen3_moe", {}).to_dict()
    for both in ({"num_experts": 4} | fields, fields | {"num_experts": 4}):
        hf = transformers.Qwen3MoeConfig.from_dict(both)
        assert hf_config_to_spec(both, "q").n_experts == hf.num_experts == 8


def test_qwen3_moe_qk_norm_is_per_head(qwen3, prompt):
    """The QK-norm weights count: the same checkpoint with every q_norm and k_norm weight set
    to 1 gives other logits, so the parity above is parity of a per-head norm that is run."""
    import shutil

    from real.shards import read_header, read_tensor, save_shard

    ckpt, _ = qwen3("qwen3_moe")
    ones = ckpt.parent / "qwen3_moe-ones"
    shutil.copytree(ckpt, ones)
    file = ones / "model.safetensors"
    t = {n: read_tensor(e).clone() for n, e in read_header(file).items()}
    normed = [n for n in t if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert normed and all(t[n].shape == (32,) for n in normed)
    save_shard({n: x.fill_(1.0) if n in normed else x for n, x in t.items()}, file, {})
    _, logits = reference_generate(ckpt, prompt, 2)
    _, plain = reference_generate(ones, prompt, 2, live_routing(ckpt, prompt, 2))
    assert (logits - plain).abs().max() > 1e-2


# The real executor: offloaded (klotski) and expert-parallel, replicated or tensor-parallel

TENSOR = {"dense": "tensor", "n_devices": 2}
EXECUTORS = [
    ("klotski", {}, "f32"),
    ("klotski", {}, "bf16"),
    ("ep_static", {}, "bf16"),
    ("eplb", TENSOR, "f32"),
]
ON_EXECUTORS = pytest.mark.parametrize(
    "planner, params, dtype", EXECUTORS, ids=[f"{p}-{len(k)}-{d}" for p, k, d in EXECUTORS]
)


@ON_EXECUTORS
def test_qwen3_moe_real_executor_equals_transformers(planner, params, dtype, qwen3):
    """A real run (live routing) of the attention_bias checkpoint gives transformers' greedy
    tokens, and its last logits within 1e-4 of transformers' in float32: klotski streaming
    the experts from disk, ep_static on 2 GPUs' streams, eplb with dense=tensor (each GPU's
    heads, the per-head QK-norm weights whole on each)."""
    assert_run_is_transformers(qwen3("qwen3_moe-attention_bias", dtype), planner, params)


def assert_run_is_transformers(built: tuple[Path, Any], planner: str, params: dict) -> None:
    """A real run of `built` (checkpoint, transformers' model from it) under `planner` with
    live routing: transformers' greedy tokens, and in float32 its last logits within 1e-4.
    klotski on memory that makes it stream the experts from disk, the others on 2 GPUs."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from tests.real.test_executor import RESIDENT_2GPU, WORKLOAD, hardware

    ckpt, hf = built
    model, _ = load_checkpoint(ckpt)
    # GPU memory too small for the two expert layers (197 kB each in float32) beside the rest
    # and klotski's working set, host RAM for half of one: the experts stream from disk
    scale = model.dtype_bytes / 4
    hw = hardware(0.0008 * scale, 0.0001 * scale) if planner == "klotski" else RESIDENT_2GPU
    result, out = real_execute(ckpt, RunSpec(model, hw, WORKLOAD, planner, params), "live")
    if planner == "klotski":
        assert result.summary["bytes_moved"].get("disk", 0) > 0
    wl = WORKLOAD.with_(n_batches=result.summary["n_batches"])
    prompts = prompts_for(model, wl)
    hf_out = hf_generate_out(hf, prompts, wl.gen_len)
    assert torch.equal(out.tokens, hf_out.sequences[:, prompts.shape[1] :])
    if model.dtype_bytes == 4:
        hf_logits = hf_out.logits[-1].float()
        torch.testing.assert_close(out.logits, hf_logits, atol=1e-4, rtol=0)


# config.json's refusals, each one line naming the field


def test_qwen3_moe_refuses_another_familys_field(qwen3, tmp_path):
    """A Qwen2-MoE field that sizes a shared expert, which Qwen3-MoE has not, is refused naming
    it, as is a sliding window of 1 (transformers' decode steps then see every position)."""
    import shutil

    from tests.real.test_hf_parity_fields import edit_config

    base, _ = qwen3("qwen3_moe")
    for n, (fields, match) in enumerate(
        [
            ({"shared_expert_intermediate_size": 48}, "shared_expert_intermediate_size is a"),
            (
                {"use_sliding_window": True, "sliding_window": 1},
                "sliding_window must be an integer >= 2",
            ),
            ({"layer_types": ["sliding_attention"] * 2}, "layer_types is a list of 2"),
        ]
    ):
        bad = tmp_path / str(n)
        shutil.copytree(base, bad)
        edit_config(bad, **fields)
        with pytest.raises(ConfigError, match=match) as e:
            reference_generate(bad, torch.zeros(1, 4, dtype=torch.long), 2)
        assert "\n" not in str(e.value)


# Switch in float16: transformers' blocks clamp hidden states that overflow (T5's clamp)


@pytest.fixture(scope="module")
def switch_overflow(tmp_path_factory):
    """(checkpoint, transformers' model) of a Switch saved in float16 whose dense block's FFN
    (block 0's wo) and sparse block's attention (block 1's o) are scaled 3e4 times: both
    overflow float16 on the module's prompt."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    cfg = transformers.SwitchTransformersConfig(**SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.encoder.block[0].layer[-1].mlp.wo.weight.mul_(3e4)
        model.encoder.block[1].layer[0].SelfAttention.o.weight.mul_(3e4)
    ckpt = tmp_path_factory.mktemp("round10-switch") / "overflow"
    model.to(torch.float16).save_pretrained(ckpt)
    return ckpt, model


class _Given(torch.nn.Module):
    """transformers' self-attention layer replaced by its output (the residual sum) given."""

    def __init__(self, out: torch.Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[Any, ...]:
        return self.out, None, None


@pytest.mark.parametrize("inf", [True, False])
def test_switch_float16_clamps_as_transformers_block(inf, switch_overflow):
    """A dense Switch block in float16, its attention's residual sum given (with an infinite
    value, or without one but within 1000 of float16's max): moepipe's clamp of it, then its
    FFN with the residual and the clamp, is transformers' SwitchTransformersBlock bit for bit
    (the FFN's scaled wo overflows: infinities clamped to max - 1000)."""
    from real.checkpoint import Unit, load_units
    from real.model import Model
    from real.model import Tensor as Kind

    ckpt, hf = switch_overflow
    spec, units = load_units(ckpt)
    model = Model.from_checkpoint(ckpt, spec)
    g = torch.Generator().manual_seed(2)
    summed = torch.randn(2, 6, spec.hidden_size, generator=g).to(torch.float16)
    summed[0, 1, 3] = float("inf") if inf else 65000.0
    summed[1, 2, 5] = -65500.0
    block = type(hf).from_pretrained(ckpt, dtype=torch.float16).encoder.block[0]
    block.layer[0] = _Given(summed)
    with torch.inference_mode():
        want = block(summed)[0]
        ours = model.dense_ffn(units[Unit(Kind.FFN, 0)], model.clamp_overflow(summed))
    assert torch.isinf(summed).any() == inf and torch.isfinite(want).all()
    assert torch.equal(ours, want)


@pytest.mark.parametrize("planner, params", [("klotski", {}), ("ep_static", TENSOR)])
def test_switch_float16_overflow_runs_clamped(planner, params, switch_overflow, monkeypatch):
    """moepipe's forward and a real run of the overflowing checkpoint give finite logits, the
    run's tokens the forward's, and its logits bit for bit (dense=tensor: within 2 float16
    steps of 16, its parts rounded before their sum); before, the run stopped ("non-finite
    values (NaN or inf) in the output of layer 1 (attention)") and the forward gave NaN
    logits. Without the clamp they are NaN again (the checkpoint does overflow)."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from real.model import Model
    from tests.real.test_executor import OFFLOAD, RESIDENT_2GPU, WORKLOAD

    ckpt, _ = switch_overflow
    model, _ = load_checkpoint(ckpt)
    assert model.float16
    hw = RESIDENT_2GPU if params else OFFLOAD
    _, out = real_execute(ckpt, RunSpec(model, hw, WORKLOAD, planner, params), "live")
    prompts = prompts_for(model, WORKLOAD)
    tokens, logits = reference_generate(ckpt, prompts, WORKLOAD.gen_len)
    assert torch.isfinite(logits).all() and torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logits, logits, atol=2 * 2**-6 if params else 0, rtol=0)
    monkeypatch.setattr(Model, "clamp_overflow", lambda self, hidden: hidden)
    assert not torch.isfinite(reference_generate(ckpt, prompts, WORKLOAD.gen_len)[1]).all()
