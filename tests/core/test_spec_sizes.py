"""Hand-worked `ModelSpec` sizes and flops from the conf/model YAMLs (bf16: 2 bytes per element).

Sizes count parameters x dtype_bytes: one SwiGLU expert is 3 matrices of hidden x ffn; a GQA
attention is q and o (hidden x heads*head_dim each), k and v (hidden x kv_heads*head_dim each)
plus the input RMSNorm (hidden); `kv_bytes_per_token` is one token's K and V in ONE layer.
Flops count 2 per multiply-add.
"""

from __future__ import annotations

import dataclasses

import pytest

from core.errors import ConfigError
from core.hf_config import hf_config_to_spec
from core.spec import ModelSpec
from tests.conftest import model_from_conf


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return model_from_conf("tiny")


def test_tiny_expert_bytes(tiny):
    """hidden 64, expert ffn 128, SwiGLU: 3 * 64 * 128 = 24576 params * 2 B = 49152 B."""
    assert tiny.expert_params == 3 * 64 * 128 == 24576
    assert tiny.expert_bytes == 3 * 64 * 128 * 2 == 49152


def test_tiny_attention_bytes(tiny):
    """4 heads, 2 KV heads, head_dim 16, hidden 64: q + o = 2 * 64 * 4 * 16 = 8192; k + v =
    2 * 64 * 2 * 16 = 4096; + RMSNorm 64 -> 12352 params * 2 B = 24704 B."""
    assert tiny.attn_param_count == 8192 + 4096 + 64 == 12352
    assert tiny.attn_bytes == 24704


def test_tiny_kv_bytes_per_token(tiny):
    """K and V of 2 KV heads x 16 dims = 2 * 2 * 16 = 64 elements * 2 B = 128 B per layer;
    the 2 layers hold 256 B per token."""
    assert tiny.kv_elems_per_token == 64
    assert tiny.kv_bytes_per_token == 128
    assert tiny.kv_bytes_per_token * tiny.n_layers == 256


def test_tiny_other_weights_and_total(tiny):
    """gate = (64 * 4 router + 64 norm) * 2 = 640 B; embed = 256 * 64 * 2 = 32768 B;
    head = (256 * 64 + 64) * 2 = 32896 B; one MoE layer = 24704 + 640 + 4 * 49152 = 221952 B;
    total = 2 * 221952 + 32768 + 32896 = 509568 B."""
    assert tiny.gate_bytes == 640
    assert tiny.embed_bytes == 32768
    assert tiny.head_bytes == 32896
    assert tiny.layer_bytes(0) == tiny.layer_bytes(1) == 221952
    assert tiny.total_bytes == 509568


def test_tiny_flops_per_token(tiny):
    """One token: expert 2 * 24576 = 49152; gate 2 * 64 * 4 = 512; head 2 * 256 * 64 = 32768;
    attention with a context of 10 = projections 2 * (12352 - 64) = 24576 + scores
    4 * 4 heads * 16 * 10 = 2560 -> 27136. A whole forward of one token (2 layers, top-2):
    2 * (27136 + 512 + 2 * 49152) + 32768 = 284672."""
    assert tiny.expert_flops(1) == 49152
    assert tiny.gate_flops(1) == 512
    assert tiny.head_flops(1) == 32768
    assert tiny.attention_flops(1, 10, sequences=1) == 27136
    assert tiny.expert_flops(3) == 3 * 49152  # linear in tokens
    per_layer = (
        tiny.attention_flops(1, 10, sequences=1) + tiny.gate_flops(1) + 2 * tiny.expert_flops(1)
    )
    assert tiny.n_layers * per_layer + tiny.head_flops(1) == 284672


def test_mixtral_8x7b_sizes():
    """hidden 4096, expert ffn 14336: one expert = 3 * 4096 * 14336 * 2 = 352321536 B (352 MB).
    Attention: q + o = 2 * 4096 * 32 * 128 = 33554432, k + v = 2 * 4096 * 8 * 128 = 8388608,
    + 4096 -> 41947136 params = 83894272 B. KV: 2 * 8 * 128 * 2 = 4096 B per layer per token,
    * 32 layers = 131072 B (128 KiB) per token."""
    m = model_from_conf("mixtral-8x7b")
    assert m.expert_bytes == 3 * 4096 * 14336 * 2 == 352_321_536
    assert m.attn_bytes == 83_894_272
    assert m.kv_bytes_per_token == 4096
    assert m.kv_bytes_per_token * m.n_layers == 131_072
    assert m.expert_flops(1) == 2 * 3 * 4096 * 14336


def test_deepseek_v2_lite_mla_sizes():
    """MLA caches the 512-dim latent + the 64-dim RoPE key per token per layer: kv_dim 576 ->
    576 * 2 B = 1152 B per layer (`kv_bytes_per_token` counts one layer), * 27 layers = 31104 B
    per token. One routed expert: 3 * 2048 * 1408 * 2 = 17301504 B. Attention = the MLA
    projections and kv_a_layernorm 13763072 (yaml attn_params) + 2048 norm = 13765120 params =
    27530240 B. Attention flops of one token over a context of 10: projections 2 * 13763072 =
    27526144 + scores 2 * 16 heads * (192 qk + 128 v) * 10 = 102400 -> 27628544, plus the 9
    cached positions' latents expanded again through kv_b (512 x 16 x (128 + 128) = 2097152
    params), 2 * 2097152 * 9 = 37748736 -> 65377280 (the real executor's and transformers' op
    order: `torch.utils.flop_counter` counts 8.704e9 for the real MLA + o_proj at 4 sequences x
    512 positions, as this does). A prefill's context is its own new tokens: nothing again.
    Layer 0 is dense (ffn 10944), layers 1..26 MoE with 64 experts and 2816 shared ffn."""
    m = model_from_conf("deepseek-v2-lite")
    assert m.kv_elems_per_token == 512 + 64
    assert m.kv_bytes_per_token == (512 + 64) * 2 == 1152
    assert m.kv_bytes_per_token * m.n_layers == 31104
    assert m.expert_bytes == 3 * 2048 * 1408 * 2 == 17_301_504
    assert m.attn_bytes == (13_763_072 + 2048) * 2 == 27_530_240
    assert m.attention_flops(1, 10, sequences=1) == 27_628_544 + 37_748_736 == 65_377_280
    assert m.attention_flops(4, 512, sequences=4) == 8_704_233_472
    prefill = m.attention_flops(4 * 512, 256, sequences=4)
    assert prefill == 2 * 13_763_072 * 2048 + 2 * 16 * (192 + 128) * 2048 * 256
    assert not m.is_moe(0) and m.is_moe(1) and m.is_moe(26)
    assert m.layer_bytes(0) == 27_530_240 + (3 * 2048 * 10944 + 2048) * 2
    # the router float32, as transformers keeps DeepSeek-V2's gate.weight at any dtype
    moe_ffn = 2048 * 64 * 4 + 2048 * 2 + 64 * 17_301_504 + 3 * 2048 * 2816 * 2
    assert m.layer_bytes(1) == 27_530_240 + moe_ffn


def test_deepseek_v2_lite_yaml_matches_its_hf_config():
    """The yaml's MLA numbers follow from DeepSeek-V2-Lite's config.json (no q_lora_rank):
    q = 2048 * 16 * (128 + 64) = 6291456; kv_a = 2048 * (512 + 64) = 1179648;
    kv_a_layernorm = 512; kv_b = 512 * 16 * (128 + 128) = 2097152; o = 16 * 128 * 2048 = 4194304;
    sum 13763072; kv_dim = 512 + 64 = 576; qk_head_dim = 128 + 64 = 192. A transformers-5 config
    keeps rope_theta in rope_parameters."""
    cfg = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "vocab_size": 102400,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
    }
    hf = hf_config_to_spec(cfg, "deepseek-v2-lite")
    m = model_from_conf("deepseek-v2-lite")
    assert hf.attn_params == 6291456 + 1179648 + 512 + 2097152 + 4194304 == 13_763_072
    assert hf.kv_dim == 576 and hf.qk_head_dim == 192 == m.qk_head_dim
    assert hf.rope_theta == 10000.0
    moved = {k: v for k, v in cfg.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}
    }
    assert hf_config_to_spec(moved, "deepseek-v2-lite").rope_theta == 5e5
    assert hf.total_bytes == m.total_bytes
    assert hf.kv_bytes_per_token == m.kv_bytes_per_token


@pytest.mark.parametrize("key", ["kv_dim", "attn_params", "qk_head_dim", "shared_ffn_size"])
def test_negative_optional_size_is_one_clear_error(key):
    """The sizes where 0 means "none" or "derive it" refuse a negative value, naming the field
    (it would silently give negative bytes or flops)."""
    fields = dataclasses.asdict(model_from_conf("tiny")) | {key: -1}
    with pytest.raises(ConfigError, match=rf"model tiny: {key}=-1 is negative; set it >= 0"):
        ModelSpec.from_dict(fields)


SWITCH_CFG = {
    "model_type": "switch_transformers",
    "num_layers": 12,
    "d_model": 768,
    "d_ff": 3072,
    "num_experts": 128,
    "num_heads": 12,
    "d_kv": 64,
    "vocab_size": 32128,
    "encoder_sparse_step": 2,
    "torch_dtype": "float32",
}


def test_config_dtype_is_read_from_either_key_and_an_unknown_one_is_named():
    """transformers 5 writes `dtype`, older versions `torch_dtype`: a float32 config saved by
    either is 4 bytes a weight (a `dtype` one was read as bf16, halving every byte count); a
    dtype with no byte size here is one line, not 2 bytes."""
    old = hf_config_to_spec(SWITCH_CFG, "s")
    new = hf_config_to_spec({**SWITCH_CFG, "torch_dtype": None, "dtype": "float32"}, "s")
    assert old.dtype_bytes == new.dtype_bytes == 4 and new.expert_bytes == old.expert_bytes
    with pytest.raises(ConfigError, match=r"c.json: dtype 'int8' has no byte size here"):
        hf_config_to_spec({**SWITCH_CFG, "dtype": "int8"}, "s", where="c.json")


@pytest.mark.parametrize(
    "step,sparse", [(2, (1, 3, 5, 7, 9, 11)), (4, (1, 5, 9)), (1, tuple(range(12)))]
)
def test_switch_sparse_blocks_follow_transformers(step, sparse):
    """SwitchTransformersStack makes block i sparse where i % step == 1 (all at step 1); the
    spec picked i % step == step - 1, which agrees only at steps 1 and 2 (3, 7, 11 at step 4)."""
    spec = hf_config_to_spec({**SWITCH_CFG, "encoder_sparse_step": step}, "s")
    assert spec.moe_layers == sparse


def test_switch_without_sparse_blocks_is_one_line():
    # 0: no block sparse, as transformers' SwitchTransformersStack reads it (a dense model)
    with pytest.raises(ConfigError, match=r"config.json: encoder_sparse_step=0 leaves no sparse"):
        hf_config_to_spec({**SWITCH_CFG, "encoder_sparse_step": 0}, "s")
