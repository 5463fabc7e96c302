"""A fourth round of config.json fields on checkpoints transformers itself writes
(tests/real/test_hf_parity.py builds them the same way): fields earlier rounds left out that
moepipe runs as transformers does (Qwen2-MoE's layer layout, norm_topk_prob, linear RoPE in
every family, DeepSeek-V2's dense layers, shared experts and scaling, RMSNorm's eps), and
those it ran otherwise: a top-level original_max_position_embeddings, RoPE parameters per
layer type, a weight dtype the real executor has no kernels for, DeepSeek-V2's yarn factor
null with mscale_all_dim or topk_method null, an expert count under its other name
(attribute_map), and is_causal false.

Usage: python -m pytest -q tests/real/test_hf_parity_round4.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, assert_spec_sizes, hf_greedy, without
from tests.real.test_hf_parity_fields import assert_transformers, edit_config, load_hf, save

transformers = pytest.importorskip("transformers")


def linear(theta: float) -> dict[str, Any]:
    """Linear RoPE scaling 4x: positions divided by 4."""
    return {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}}


# case -> (family, config fields over the family's, fields whose absence moves the logits)
MATCHED: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    # layer 1 alone has experts ((i + 1) % 2 == 0, 3 in mlp_only_layers); a shared expert of 24
    # beside dense layers of intermediate_size 48
    "qwen2_moe-sparse_step": (
        "qwen2_moe",
        {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
        | {"shared_expert_intermediate_size": 24},
        (),
    ),
    "qwen2_moe-norm_topk_prob": ("qwen2_moe", {"norm_topk_prob": True}, ("norm_topk_prob",)),
    "olmoe-norm_topk_prob": ("olmoe", {"norm_topk_prob": True}, ("norm_topk_prob",)),
    "mixtral-linear": ("mixtral", linear(1e6), ("rope_parameters",)),
    "qwen2_moe-linear": ("qwen2_moe", linear(1e6), ("rope_parameters",)),
    "olmoe-linear": ("olmoe", linear(1e4), ("rope_parameters",)),
    "deepseek_v2-linear": ("deepseek_v2", linear(1e4), ("rope_parameters",)),
    # layers 0 and 1 dense, 2 MoE with two shared experts, its routed weights times 2.5
    "deepseek_v2-layers": (
        "deepseek_v2",
        {"num_hidden_layers": 3, "first_k_dense_replace": 2, "n_shared_experts": 2}
        | {"routed_scaling_factor": 2.5},
        ("routed_scaling_factor",),
    ),
    # the layer norms take 0.5; q_a_layernorm and kv_a_layernorm keep RMSNorm's 1e-6
    "deepseek_v2-rms_norm_eps": (
        "deepseek_v2",
        {"q_lora_rank": 24, "rms_norm_eps": 0.5},
        ("rms_norm_eps",),
    ),
    # QK-norm takes it too, over all heads at once
    "olmoe-rms_norm_eps": ("olmoe", {"rms_norm_eps": 0.5}, ("rms_norm_eps",)),
    "mixtral-head_dim": ("mixtral", {"head_dim": 8}, ()),  # not hidden_size / heads
    "mixtral-router_jitter_noise": ("mixtral", {"router_jitter_noise": 0.5}, ()),  # training's
    "mixtral-yarn_attention_factor": (
        "mixtral",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e6,
                "original_max_position_embeddings": 8,
                "attention_factor": 1.5,
                "truncate": False,
            }
        },
        ("rope_parameters",),
    ),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(case, dtype) -> (checkpoint dir, transformers' model loaded from it), built on first use
    and shared by the module's tests."""
    root = tmp_path_factory.mktemp("round4")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(case: str, dtype: str) -> tuple[Path, Any]:
        if (case, dtype) not in made:
            family, fields, _ = MATCHED[case]
            made[case, dtype] = save(family, fields, root / f"{case}-{dtype}", dtype)
        return made[case, dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MATCHED)
def test_equals_transformers(case, dtype, built, prompt, tmp_path):
    """Greedy tokens equal in both dtypes, float32 logits within 1e-4, bfloat16 within one bf16
    step of |logit| < 4 (observed: 0 in every case, both dtypes); a field under test moves
    the logits far from its absence (RoPE scaling: from plain RoPE of its base), so its match
    is no accident (observed: routed_scaling_factor 0.19, the others 0.9 to 2.7)."""
    ckpt, hf = built(case, dtype)
    assert_transformers(ckpt, hf, prompt, dtype)
    keys = MATCHED[case][2]
    if keys and dtype == "f32":
        _, logits = hf_greedy(hf, prompt)
        _, plain_logits = reference_generate(without(ckpt, keys, tmp_path / "plain"), prompt, GEN)
        assert (plain_logits - logits).abs().max() > 0.05


@pytest.mark.parametrize("case", MATCHED)
def test_spec_sizes_are_the_checkpoints(case, built):
    """The simulator's spec of each case sizes every decoder layer (dense ones and MoE ones
    with their shared experts), the embedding and head and a token's KV cache as the
    checkpoint holds them, as tests/real/test_hf_parity.py checks its cases."""
    assert_spec_sizes(built(case, "f32")[0])


# (family, RoPE object, the top-level original_max_position_embeddings config.json is given):
# yarn and llama3 stretch the top-level length where the two differ; yarn with factor null
# stretches max_position_embeddings (64) over it, 8x here, where the object's 16 gave 4x
TOP_LEVEL_ORIGINAL = {
    "mixtral-llama3": (
        "mixtral",
        {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e6}
        | {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
        32,
    ),
    "deepseek_v2-yarn": (
        "deepseek_v2",
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        | {"original_max_position_embeddings": 8, "mscale_all_dim": 0.5},
        64,
    ),
    "qwen2_moe-yarn_factor_null": (
        "qwen2_moe",
        {"rope_type": "yarn", "factor": None, "rope_theta": 1e6}
        | {"original_max_position_embeddings": 16},
        8,
    ),
}


@pytest.mark.parametrize("case", TOP_LEVEL_ORIGINAL)
def test_a_top_level_original_max_position_embeddings_is_transformers(case, prompt, tmp_path):
    """A top-level original_max_position_embeddings in config.json (where Phi-3's keeps it)
    is the length yarn and llama3 stretch, over the RoPE object's, as transformers'
    standardize_rope_params puts it (and saves both alike); moepipe read only the object's,
    as it still gives without the top-level field: 0.6 to 1.6 off transformers' logits."""
    family, rope, top = TOP_LEVEL_ORIGINAL[case]
    ckpt, _ = save(family, {"rope_parameters": rope}, tmp_path / "ckpt")
    edit_config(ckpt, original_max_position_embeddings=top)
    hf = load_hf(ckpt)
    assert_transformers(ckpt, hf, prompt, "f32")
    _, hf_logits = hf_greedy(hf, prompt)
    inner = without(ckpt, ("original_max_position_embeddings",), tmp_path / "inner")
    _, inner_logits = reference_generate(inner, prompt, GEN)
    assert (inner_logits - hf_logits).abs().max() > 0.05


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_rope_parameters_per_layer_type_are_refused(family, prompt, tmp_path):
    """rope_parameters nested by layer type ({"full_attention": {...}, "sliding_attention":
    {...}}): transformers' Qwen2-MoE, whose config declares layer_types, fails on it (KeyError
    'rope_type'), and Mixtral, which declares none, runs default RoPE with the objects unread;
    moepipe ran both as default RoPE of the top-level base. It is refused in one line naming
    the field: these families run one RoPE on every layer."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    ckpt, _ = save(family, {}, tmp_path / "ckpt")
    edit_config(ckpt, rope_parameters={"full_attention": yarn, "sliding_attention": yarn})
    if family == "qwen2_moe":
        with pytest.raises(KeyError, match="rope_type"):
            hf_greedy(load_hf(ckpt), prompt)
    with pytest.raises(ConfigError, match=r"config.json: rope_parameters.full_attention is an obj"):
        reference_generate(ckpt, prompt, GEN)


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_dtype_without_kernels_is_refused_naming_the_field(key, tmp_path):
    """A config.json whose dtype (or older torch_dtype) names a weight dtype the real executor
    does not run, float8_e4m3fn, is refused naming the file and the field, as float16 is;
    before, the refusal named neither ("model ...: dtype_bytes=1 has no real-executor dtype")."""
    ckpt, _ = save("mixtral", {}, tmp_path / "ckpt", "bf16")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("dtype", None)
    cfg.pop("torch_dtype", None)
    (ckpt / "config.json").write_text(json.dumps(cfg | {key: "float8_e4m3fn"}))
    match = rf"config.json: {key} float8_e4m3fn is not supported by the real executor"
    with pytest.raises(ConfigError, match=match):
        load_checkpoint(ckpt)


def test_deepseek_yarn_factor_null_with_mscale_all_dim_is_refused(prompt, tmp_path):
    """DeepSeek-V2's yarn with factor null and mscale_all_dim: transformers' DeepseekV2 scales
    its softmax by mscale_all_dim at the factor and fails on null (TypeError); moepipe ran it
    with the stretch of max_position_embeddings. It is refused in one line naming the field;
    without mscale_all_dim the two agree."""
    rope = {"rope_type": "yarn", "factor": None, "rope_theta": 1e4}
    rope |= {"original_max_position_embeddings": 16}
    ckpt, _ = save("deepseek_v2", {}, tmp_path / "ckpt")
    edit_config(ckpt, rope_parameters=rope | {"mscale_all_dim": 1.0})
    with pytest.raises(TypeError, match="'<=' not supported between instances of 'NoneType'"):
        load_hf(ckpt)
    with pytest.raises(ConfigError, match=r"rope_parameters.factor is null with mscale_all_dim"):
        reference_generate(ckpt, prompt, GEN)
    edit_config(ckpt, rope_parameters=rope)
    assert_transformers(ckpt, load_hf(ckpt), prompt, "f32")


# (family, the expert count's field, its other name in transformers' attribute_map)
ALIASED = [
    ("mixtral", "num_local_experts", "num_experts"),
    ("olmoe", "num_experts", "num_local_experts"),
    ("deepseek_v2", "n_routed_experts", "num_experts"),
]


@pytest.mark.parametrize("family, field, alias", ALIASED, ids=[f for f, *_ in ALIASED])
def test_an_expert_count_under_its_other_name_is_read(family, field, alias, prompt, tmp_path):
    """A config.json giving the expert count under the name transformers' attribute_map maps
    to the family's own (Mixtral's num_experts, OLMoE's num_local_experts, DeepSeek-V2's
    num_experts) sizes the model, and wins over the own name where both are given, as
    transformers sets it last. moepipe read the own name alone: the family's default count
    (8, 64, 64) sized the simulator's spec and the checkpoint's 4 experts were refused as
    "config.json expects [8, 64]"."""
    ckpt, _ = save(family, {field: 4}, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[alias] = cfg.pop(field)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(ckpt)[0].n_experts == 4
    assert_transformers(ckpt, load_hf(ckpt), prompt, "f32")
    edit_config(ckpt, **{field: 8})
    assert load_hf(ckpt).config.to_dict()[field] == 4
    assert load_checkpoint(ckpt)[0].n_experts == 4


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"])
def test_is_causal_false_is_refused(family, prompt, tmp_path):
    """is_causal false in config.json: transformers' mask functions then let every position see
    every other (bidirectional), in any family (observed: its logits 2.0 to 2.5 from its causal
    ones, other greedy tokens); moepipe ran it causal, silently. It is refused in one line
    naming the field; is_causal true runs as without it."""
    ckpt, hf = save(family, {}, tmp_path / "ckpt")
    edit_config(ckpt, is_causal=True)
    assert_transformers(ckpt, hf, prompt, "f32")
    edit_config(ckpt, is_causal=False)
    _, logits = hf_greedy(hf, prompt)
    assert (hf_greedy(load_hf(ckpt), prompt)[1] - logits).abs().max() > 0.5
    with pytest.raises(ConfigError, match=r"config.json: is_causal=false: transformers then mas"):
        load_checkpoint(ckpt)


def test_deepseek_topk_method_null_is_refused(prompt, tmp_path):
    """DeepSeek-V2's topk_method null: transformers' DeepseekV2TopkRouter takes neither of its
    methods and fails (UnboundLocalError), as DeepSeek's own MoEGate would; moepipe read the
    null as the default, greedy, and ran a model neither runs. It is refused in one line
    naming the field."""
    ckpt, _ = save("deepseek_v2", {}, tmp_path / "ckpt")
    edit_config(ckpt, topk_method=None)
    with pytest.raises(UnboundLocalError):
        hf_greedy(load_hf(ckpt), prompt)
    with pytest.raises(ConfigError, match=r"config.json: topk_method is null: transformers' Dee"):
        load_checkpoint(ckpt)
