"""moepipe's model against transformers on checkpoints transformers itself writes.

Each case builds a tiny random model with transformers' own class (2 layers, width 64, seeded),
saves it with `save_pretrained` in float32 or bfloat16, and compares moepipe's
`reference_generate` on that directory with transformers' model loaded from it, greedy:
float32 logits within 1e-4 and the same greedy tokens in float32 and bfloat16. Every supported
family, and each config.json field moepipe reads beyond the defaults: Mixtral's sliding_window,
Qwen2-MoE's use_sliding_window (with sliding_window, max_window_layers, layer_types), OLMoE's
clip_qkv, Qwen2-MoE's qkv_bias false and head_dim, tied embeddings, DeepSeek-V2's
q_lora_rank, group_limited_greedy routing and MLA sizes outside V2-Lite's proportions, and RoPE
scaling (YaRN, dynamic NTK past max_position_embeddings, Llama 3.1's) in every family. A case
whose field could leave the logits as they are also checks that moepipe without the field (for
RoPE scaling: plain RoPE of the same base) gives other logits.

Usage: python -m pytest -q tests/real/test_hf_parity.py
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from real.checkpoint import load_units
from real.model import KVCache, live_routing, reference_generate

transformers = pytest.importorskip("transformers")

GEN = 4  # generated tokens: the prefill of the 6-token prompt, then 3 decode steps
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts_per_tok=2,
    initializer_range=0.1,
    max_position_embeddings=64,
)
FAMILY = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=32, head_dim=16)),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            intermediate_size=48,
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, intermediate_size=32)),
    # heads of 32 dims, wider than hidden_size / heads as Qwen3-30B-A3B's (128 > 2048 / 32)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48, head_dim=32),
    ),
    # layer 0 dense, layer 1 MoE with a shared expert; MLA at V2-Lite's proportions (16/8/32)
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            n_routed_experts=8,
            n_shared_experts=1,
            moe_intermediate_size=32,
            intermediate_size=48,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            topk_method="greedy",
            norm_topk_prob=False,
        ),
    ),
}
# DeepSeek-V2's shape, V3's router: 4 groups of 2 experts, the best 2 groups kept
_V2 = {
    k: v for k, v in FAMILY["deepseek_v2"][1].items() if k not in ("topk_method", "norm_topk_prob")
}
FAMILY["deepseek_v3"] = ("DeepseekV3Config", _V2 | dict(n_group=4, topk_group=2))


def yarn(theta: float, **more: float) -> dict[str, Any]:
    """YaRN 4x from 8 positions: over the test's 9 its frequency ramp is partial."""
    return {
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": theta,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            **more,
        }
    }


def dynamic(theta: float) -> dict[str, Any]:
    """Dynamic NTK 8x past 2 positions: the 6-token prompt and every decode step are longer, so
    each step raises the base anew (transformers recomputes it per forward)."""
    return {
        "max_position_embeddings": 2,
        "rope_parameters": {"rope_type": "dynamic", "factor": 8.0, "rope_theta": theta},
    }


def llama3(theta: float) -> dict[str, Any]:
    """Llama 3.1's scaling 8x from 8 positions: head dims of wavelength below 2 positions kept,
    above 8 divided by 8, between them interpolated (the fastest pair, 6.3 positions)."""
    return {
        "rope_parameters": {
            "rope_type": "llama3",
            "factor": 8.0,
            "rope_theta": theta,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        }
    }


# case -> (family, config fields over the family's, fields whose effect the test checks)
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "mixtral": ("mixtral", {}, ()),
    "mixtral-sliding_window": ("mixtral", {"sliding_window": 3}, ("sliding_window",)),
    "mixtral-yarn": ("mixtral", yarn(1e6), ("rope_parameters",)),
    "mixtral-dynamic": ("mixtral", dynamic(1e6), ("rope_parameters",)),
    "mixtral-llama3": ("mixtral", llama3(1e6), ("rope_parameters",)),
    "qwen2_moe": ("qwen2_moe", {}, ()),
    "qwen2_moe-no_qkv_bias": ("qwen2_moe", {"qkv_bias": False}, ()),
    "qwen2_moe-tied": ("qwen2_moe", {"tie_word_embeddings": True}, ()),
    "qwen2_moe-head_dim": ("qwen2_moe", {"head_dim": 8}, ()),  # not hidden_size / heads
    "qwen2_moe-yarn": ("qwen2_moe", yarn(1e6), ("rope_parameters",)),
    "qwen2_moe-dynamic": ("qwen2_moe", dynamic(1e6), ("rope_parameters",)),
    "qwen2_moe-llama3": ("qwen2_moe", llama3(1e6), ("rope_parameters",)),
    # layer_types: layers 0 and 2 slide (even and below max_window_layers), 1 and 3 see all
    "qwen2_moe-sliding_window": (
        "qwen2_moe",
        {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 3}
        | {"max_window_layers": 3},
        ("use_sliding_window", "layer_types"),
    ),
    # max_window_layers 1: layer 0 alone slides
    "qwen2_moe-max_window_layers": (
        "qwen2_moe",
        {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 2}
        | {"max_window_layers": 1},
        ("use_sliding_window", "layer_types"),
    ),
    "olmoe": ("olmoe", {}, ()),
    "olmoe-clip_qkv": ("olmoe", {"clip_qkv": 0.3}, ("clip_qkv",)),
    "olmoe-yarn": ("olmoe", yarn(1e4), ("rope_parameters",)),
    "olmoe-dynamic": ("olmoe", dynamic(1e4), ("rope_parameters",)),
    "olmoe-llama3": ("olmoe", llama3(1e4), ("rope_parameters",)),
    "deepseek_v2": ("deepseek_v2", {}, ()),
    "deepseek_v2-q_lora_rank": ("deepseek_v2", {"q_lora_rank": 24}, ()),
    # the full V2's routing: the top-2 from the one group (of 4, 2 experts each) of the best
    # expert, where plain top-2 takes experts of two groups (observed: greedy's logits 0.37 off)
    "deepseek_v2-group_limited_greedy": (
        "deepseek_v2",
        {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 1},
        (),
    ),
    # every MLA size independent of the others (V2-Lite ties them all to head_dim)
    "deepseek_v2-mla_dims": (
        "deepseek_v2",
        {"qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 20, "kv_lora_rank": 24},
        (),
    ),
    "deepseek_v2-yarn": (
        "deepseek_v2",
        yarn(1e4, mscale=1.0, mscale_all_dim=0.5),
        ("rope_parameters",),
    ),
    "deepseek_v2-dynamic": ("deepseek_v2", dynamic(1e4), ("rope_parameters",)),
    "deepseek_v2-llama3": ("deepseek_v2", llama3(1e4), ("rope_parameters",)),
    # transformers' other name of SiLU (ACT2FN["swish"] is nn.SiLU)
    "mixtral-swish": ("mixtral", {"hidden_act": "swish"}, ()),
    # a top-1 weight is scaled, never renormalised to 1, by DeepSeek's code and transformers'
    "deepseek_v2-top1_norm_scaled": (
        "deepseek_v2",
        {"num_experts_per_tok": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.0},
        (),
    ),
    # 8 key/value heads: Mixtral's default where config.json leaves the field out
    "mixtral-kv8": ("mixtral", {"num_attention_heads": 8, "num_key_value_heads": 8}, ()),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def hf_config(family: str, fields: dict[str, Any]) -> Any:
    cls, own = FAMILY[family]
    cfg = getattr(transformers, cls)(**(COMMON | own | fields))
    return cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(case, dtype) -> (checkpoint dir, transformers' model loaded from it), built on first use:
    seeded weights in float32, cast to the dtype, saved, and loaded back as a user loads them
    (the cast model itself is no reference: `.to` rounds its RoPE frequencies to bf16 too)."""
    root = tmp_path_factory.mktemp("hf")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(case: str, dtype: str) -> tuple[Path, Any]:
        if (case, dtype) not in made:
            family, fields, _ = CASES[case]
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config(family, fields))
            model = model.to(DTYPES[dtype]).eval()
            ckpt = root / f"{case}-{dtype}"
            model.save_pretrained(ckpt)
            loaded = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPES[dtype])
            made[case, dtype] = ckpt, loaded.eval()
        return made[case, dtype]

    return get


@pytest.fixture
def prompt() -> torch.Tensor:
    """[B=2, P=6] token ids < 128."""
    return torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def hf_greedy(model: Any, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy decoding: (tokens [B, GEN], last step's logits [B, V] float32),
    every sequence GEN tokens long as moepipe's (with its eos token, 2 in Mixtral's and
    DeepSeek-V2's configs, transformers would pad a sequence's tokens after it)."""
    out = hf_generate_out(model, prompt, GEN)
    return out.sequences[:, prompt.shape[1] :], out.logits[-1].float()


def hf_generate_out(model: Any, prompt: torch.Tensor, gen: int) -> Any:
    """transformers' generate() output of `gen` greedy tokens a sequence, with every step's
    logits (`hf_greedy`'s decoding), of the unpadded prompt moepipe runs: without an all-ones
    attention_mask, generate() masks each prompt token equal to pad_token_id."""
    with torch.inference_mode():
        return model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=gen,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )


def without(ckpt: Path, keys: tuple[str, ...], to: Path) -> Path:
    """A copy of the checkpoint whose config.json lacks `keys` (the family's defaults), and
    whose RoPE for `rope_parameters` is plain RoPE of the same base."""
    shutil.copytree(ckpt, to)
    cfg = json.loads((to / "config.json").read_text())
    for key in keys:
        value = cfg.pop(key)
        if key == "rope_parameters":
            cfg[key] = {"rope_type": "default", "rope_theta": value["rope_theta"]}
    (to / "config.json").write_text(json.dumps(cfg))
    return to


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_equals_transformers(case, dtype, built, prompt, tmp_path):
    """Logits within 1e-4 in float32 and greedy tokens equal in both dtypes, bfloat16 logits
    within one bf16 step of |logit| < 4 (observed: float32 below 1e-6, bfloat16 0 in every case;
    0 in both for every RoPE scaling case); a field under test moves the logits far from its
    absence (observed: 1.4 to 4.1; RoPE scaling from plain RoPE of its base: dynamic 0.14 to
    1.4, llama3 1.1 to 2.5, YaRN 1.5 to 2.3)."""
    ckpt, hf = built(case, dtype)
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if dtype == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)
    keys = CASES[case][2]
    if keys and dtype == "f32":  # the same routing, so only the field differs
        plain = without(ckpt, keys, tmp_path / "plain")
        _, plain_logits = reference_generate(plain, prompt, GEN, live_routing(ckpt, prompt, GEN))
        assert (plain_logits - logits).abs().max() > 0.05


def test_mixtral_bf16_sums_experts_as_transformers(built, prompt):
    """Mixtral in bfloat16 weighs each expert's bf16 output by its float32 router weight and sums
    the top-k in float32, rounding once, as transformers' experts do (grouped_mm, its default):
    the last logits are transformers' bit for bit. Rounding the weights to bf16 first (moepipe's
    Qwen2-MoE/OLMoE path, which transformers' routers for those families take) was 0.03 off."""
    ckpt, hf = built("mixtral", "bf16")
    _, logits = reference_generate(ckpt, prompt, GEN)
    _, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(logits, hf_logits)


def test_deepseek_norm_topk_prob_follows_deepseek_and_warns_once(built, prompt, tmp_path, caplog):
    """DeepSeek-V2 with norm_topk_prob true: moepipe renormalises the top-k weights as DeepSeek's
    own modeling_deepseek.py does, which transformers 5.24's DeepseekV2TopkRouter does not. With
    that router patched to DeepSeek's rule the two agree within 1e-4; unpatched they do not. The
    warning naming the field comes once, however often the checkpoint is loaded."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_ds

    base, _ = built("deepseek_v2", "f32")
    ckpt = without(base, (), tmp_path / "norm")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | {"norm_topk_prob": True}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with caplog.at_level(logging.WARNING, logger="real.reference_notes"):
        tokens, logits = reference_generate(ckpt, prompt, GEN)
        reference_generate(ckpt, prompt, GEN)
    assert caplog.text.count("norm_topk_prob is true") == 1
    _, hf_logits = hf_greedy(hf, prompt)
    assert (hf_logits - logits).abs().max() > 0.01

    forward = hf_ds.DeepseekV2TopkRouter.forward

    def deepseek_rule(self, hidden_states):  # modeling_deepseek.py's MoEGate, greedy top-k
        logits_, weights, ids = forward(self, hidden_states)
        return logits_, weights / (weights.sum(-1, keepdim=True) + 1e-20), ids

    hf_ds.DeepseekV2TopkRouter.forward = deepseek_rule
    try:
        hf_tokens, hf_logits = hf_greedy(hf, prompt)
    finally:
        hf_ds.DeepseekV2TopkRouter.forward = forward
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("layers", [1, 2, 5, 6])
@pytest.mark.parametrize("max_window_layers", [0, 1, 3, 28])
@pytest.mark.parametrize("use", [True, False])
@pytest.mark.parametrize("saved_types", [True, False])
def test_qwen2_moe_sliding_layers_are_transformers(layers, max_window_layers, use, saved_types):
    """The layers moepipe gives Qwen2-MoE's sliding window are those transformers' config marks
    sliding_attention, from the layer_types save_pretrained writes or, in a config.json without
    them (older ones), from use_sliding_window and max_window_layers."""
    from core.hf_config import HFConfig, hf_config_to_spec, hf_runtime

    window = dict(use_sliding_window=use, sliding_window=4, max_window_layers=max_window_layers)
    cfg = hf_config("qwen2_moe", dict(num_hidden_layers=layers, **window))
    fields = cfg.to_dict()
    if not saved_types:
        fields.pop("layer_types")
    run = hf_runtime(HFConfig(fields, "config.json"), hf_config_to_spec(fields, "q"))
    sliding = tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
    assert run.sliding_layers == (sliding or None)
    assert run.sliding_window == (4 if sliding else None)


@pytest.mark.parametrize("case", CASES)
def test_spec_sizes_are_the_checkpoints(case, built):
    """The spec read from config.json sizes what the simulator moves and caches as the
    checkpoint holds it: each decoder layer's bytes (q compression, MLA sizes, no Qwen biases
    included), the embedding's and head's (a tied head is moved as a copy of the embedding), and
    the KV cache elements a token takes."""
    assert_spec_sizes(built(case, "f32")[0])


def assert_spec_sizes(ckpt: Path) -> None:
    """The spec `load_units` reads from the checkpoint's config.json sizes each decoder layer,
    the embedding and head, and a token's KV cache as the checkpoint's tensors hold them."""
    spec, units = load_units(ckpt)
    nbytes: dict[int, int] = {}
    for unit, w in units.items():
        nbytes[unit.layer] = nbytes.get(unit.layer, 0) + sum(t.nbytes for t in w.values())
    assert [nbytes[i] for i in range(spec.n_layers)] == [
        spec.layer_bytes(i) for i in range(spec.n_layers)
    ]
    assert nbytes[-1] == spec.embed_bytes + spec.head_bytes
    cache = KVCache.allocate(spec, 1, 1).layers[0]
    assert sum(t[0, :, 0].numel() for t in cache) == spec.kv_elems_per_token


# (case, config.json fields dropped): each left to the family's default in transformers, which
# the checkpoint was built with (Qwen2-MoE's and OLMoE's RoPE base 1e4, Mixtral's 8 KV heads)
ABSENT = [
    ("qwen2_moe", ("rope_parameters", "rope_theta")),
    ("olmoe", ("rope_parameters", "rope_theta")),
    ("mixtral-kv8", ("num_key_value_heads",)),
]


@pytest.mark.parametrize("case, keys", ABSENT, ids=[c for c, _ in ABSENT])
def test_a_field_left_out_takes_transformers_default(case, keys, built, prompt, tmp_path):
    """A config.json written by hand or by an older transformers may leave a field out; moepipe
    then runs transformers' default of the family, not another family's (observed before: the
    RoPE base 1e6 for Qwen2-MoE and OLMoE, 0.9 off; the attention heads for Mixtral's KV heads,
    a shape error)."""
    ckpt, hf = built(case, "f32")
    trimmed = tmp_path / "trimmed"
    shutil.copytree(ckpt, trimmed)
    cfg = json.loads((trimmed / "config.json").read_text())
    for key in keys:
        cfg.pop(key, None)
    (trimmed / "config.json").write_text(json.dumps(cfg))
    tokens, logits = reference_generate(trimmed, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)


def _edited(ckpt: Path, to: Path, **fields: Any) -> Path:
    shutil.copytree(ckpt, to)
    cfg = json.loads((to / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (to / "config.json").write_text(json.dumps(cfg))
    return to


def test_weights_config_json_does_not_describe_are_refused(built, tmp_path):
    """A checkpoint whose config.json describes another layout than its weights is refused in
    one line naming the cause, never run with some weights unread: DeepSeek-V2's moe_layer_freq,
    which transformers ignores (it saves experts in every layer), names the layer-kind fields; a
    DeepSeek-V2 config.json without n_shared_experts (2 in transformers, none in DeepSeek's
    code) names that field; a tensor nothing reads is named."""
    from core.errors import ConfigError
    from real.checkpoint import load_checkpoint
    from real.shards import read_header, save_shard

    ds, _ = built("deepseek_v2", "f32")
    freq = _edited(ds, tmp_path / "freq", first_k_dense_replace=0, moe_layer_freq=2)
    fields = "first_k_dense_replace and moe_layer_freq"
    with pytest.raises(ConfigError, match=rf"layer\(s\) \[1\] are dense by {fields}"):
        load_checkpoint(freq)
    shared = _edited(ds, tmp_path / "shared", n_shared_experts=None)
    with pytest.raises(ConfigError, match="n_shared_experts is missing"):
        load_checkpoint(shared)
    mx, _ = built("mixtral", "f32")
    extra = _edited(mx, tmp_path / "extra")
    index = read_header(extra / "model.safetensors")
    tensors = {name: read_tensor_of(e) for name, e in index.items()}
    tensors["model.layers.0.mlp.gate.bias"] = torch.zeros(8)
    save_shard(tensors, extra / "model.safetensors", {"format": "pt"})
    with pytest.raises(ConfigError, match=r"tensor model.layers.0.mlp.gate.bias \(1 such\)"):
        load_checkpoint(extra)


def read_tensor_of(entry: Any) -> torch.Tensor:
    from real.shards import read_tensor

    return read_tensor(entry).clone()


def test_switch_tied_head_runs_and_unmodelled_fields_are_refused(tmp_path):
    """Switch's config default ties the head to the embedding: it runs on the embedding (the
    lm_head transformers does not save). An activation moepipe does not run and a router bias,
    which moepipe's Switch does not model, are refused naming the field."""
    from core.errors import ConfigError
    from real.checkpoint import load_checkpoint

    sizes = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_experts=4)
    layers = dict(num_layers=2, num_decoder_layers=2)
    sparse = dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)
    cfg = transformers.SwitchTransformersConfig(**sizes, **layers, **sparse)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
    ckpt = tmp_path / "switch"
    model.save_pretrained(ckpt)
    spec, index = load_checkpoint(ckpt)
    assert index["lm_head.weight"] is index["shared.weight"]
    tokens, _ = reference_generate(ckpt, torch.zeros(1, 4, dtype=torch.long), 2)
    assert tokens.shape == (1, 2)
    for field, value in (("dense_act_fn", "prelu"), ("router_bias", True)):
        bad = _edited(ckpt, tmp_path / field, **{field: value})
        with pytest.raises(ConfigError, match=field):
            reference_generate(bad, torch.zeros(1, 4, dtype=torch.long), 2)
