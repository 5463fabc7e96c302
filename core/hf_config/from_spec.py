"""ModelSpec -> config.json: the family's real fields for a spec (the inverse of
`hf_config_to_spec`), refusing, with the spec's name, what a family's config.json cannot express."""

from __future__ import annotations

from typing import Any

from core.errors import ConfigError
from core.hf_config.to_spec import FAMILIES, mla_spec_fields
from core.spec import ModelSpec
from core.types import Activation

_DTYPE_NAME = {4: "float32", 2: "bfloat16"}


def mla_dims(spec: ModelSpec) -> dict[str, Any]:
    """DeepSeek-V2's MLA sizes, config.json's names: read from the spec (v_head_dim = head_dim,
    qk_rope_head_dim, qk_nope_head_dim = qk_head_dim - RoPE dims, kv_lora_rank = kv_dim - RoPE
    dims, q_lora_rank, None if 0), each left 0 in DeepSeek-V2-Lite's proportions to head_dim
    (128: 128 nope / 64 RoPE / 512 latent, no q compression)."""
    d = spec.head_dim
    rope = spec.qk_rope_head_dim or d // 2
    nope = (spec.qk_head_dim or d + rope) - rope
    rank = (spec.kv_dim or 4 * d + rope) - rope
    if min(rope, nope, rank) <= 0:
        raise ConfigError(
            f"model {spec.name}: MLA sizes qk_head_dim={spec.qk_head_dim}, kv_dim={spec.kv_dim}, "
            f"qk_rope_head_dim={rope} leave no room: each of qk_head_dim and kv_dim must exceed "
            "qk_rope_head_dim"
        )
    return dict(
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=d,
        kv_lora_rank=rank,
        q_lora_rank=spec.q_lora_rank or None,
    )


def spec_mla_fields(spec: ModelSpec) -> dict[str, int]:
    """The MLA fields `hf_config_to_spec` derives from the spec's `mla_dims` (a round trip)."""
    m = mla_dims(spec)
    return mla_spec_fields(
        spec.hidden_size, spec.n_heads, m | {"q_lora_rank": m["q_lora_rank"] or 0}
    )


class _Writer:
    """Refuses, naming the spec, what a family's config.json cannot express."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec

    def need(self, ok: bool, what: str) -> None:
        if not ok:
            s = self.spec
            raise ConfigError(
                f"model {s.name}: a {s.family} config.json cannot express {what}; "
                f"choose a model without them, or a family whose config.json has them"
            )


def spec_to_hf_config(spec: ModelSpec, norm_topk_prob: bool = False) -> dict[str, Any]:
    """The family's real `config.json` fields for `spec` (inverse of `hf_config_to_spec`)."""
    if spec.dtype_bytes not in _DTYPE_NAME:
        raise ConfigError(
            f"model {spec.name}: dtype_bytes={spec.dtype_bytes} has no real-executor dtype; "
            "use 4 (float32) or 2 (bfloat16)"
        )
    w = _Writer(spec)
    relu = spec.activation == Activation.RELU
    w.need(relu == (spec.family == "switch_transformers"), f"{spec.activation} experts")
    cfg: dict[str, Any] = dict(
        model_type=spec.family,
        vocab_size=spec.vocab_size,
        torch_dtype="float16" if spec.float16 else _DTYPE_NAME[spec.dtype_bytes],
        tie_word_embeddings=False,
    )
    writers = {
        "mixtral": _llama_config,
        "olmoe": _llama_config,
        "qwen2_moe": _qwen2_moe_config,
        "qwen3_moe": _qwen2_moe_config,
        "deepseek_v2": _deepseek_v2_config,
        "deepseek_v3": _deepseek_v2_config,
        "switch_transformers": _switch_config,
    }
    if spec.family not in writers:
        raise ConfigError(
            f"model {spec.name}: family {spec.family!r} has no config.json layout; "
            f"use one of {', '.join(FAMILIES)}"
        )
    return cfg | writers[spec.family](w, norm_topk_prob)


def _common(spec: ModelSpec) -> dict[str, Any]:
    """The fields Mixtral, OLMoE, Qwen2-MoE and DeepSeek-V2 share (Llama's names)."""
    return dict(
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.n_layers,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=4096,
    )


def _no_mla(w: _Writer) -> None:
    s = w.spec
    w.need(
        not (s.kv_dim or s.attn_params or s.qk_head_dim), "kv_dim/attn_params/qk_head_dim overrides"
    )


def _llama_config(w: _Writer, norm_topk_prob: bool) -> dict[str, Any]:
    s = w.spec
    dense = [i for i in range(s.n_layers) if not s.is_moe(i)]
    w.need(not dense, f"dense layers {dense} (every layer is MoE)")
    w.need(not s.shared_ffn_size, "shared experts")
    _no_mla(w)
    mixtral = s.family == "mixtral"
    cfg = _common(s) | {
        "num_local_experts" if mixtral else "num_experts": s.n_experts,
        "intermediate_size": s.expert_ffn_size,
        "head_dim": s.head_dim,
        "architectures": ["MixtralForCausalLM" if mixtral else "OlmoeForCausalLM"],
    }
    if not mixtral:
        cfg |= {"norm_topk_prob": norm_topk_prob, "attention_bias": s.attention_bias}
    return cfg


def _qwen2_moe_config(w: _Writer, norm_topk_prob: bool) -> dict[str, Any]:
    """Qwen2-MoE's fields, or Qwen3-MoE's: no shared expert, attention_bias for qkv_bias."""
    s = w.spec
    _no_mla(w)
    qwen3 = s.family == "qwen3_moe"
    cfg = _common(s) | dict(
        architectures=["Qwen3MoeForCausalLM" if qwen3 else "Qwen2MoeForCausalLM"],
        num_experts=s.n_experts,
        moe_intermediate_size=s.expert_ffn_size,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(s.n_layers) if not s.is_moe(i)],
        norm_topk_prob=norm_topk_prob,
        head_dim=s.head_dim,
    )
    if qwen3:
        w.need(not s.shared_ffn_size, "shared experts")
        cfg["attention_bias"] = s.attention_bias
    else:
        cfg |= dict(shared_expert_intermediate_size=s.shared_ffn_size, qkv_bias=s.qkv_bias)
    if s.dense_ffn_size:
        cfg["intermediate_size"] = s.dense_ffn_size
    return cfg


def _deepseek_v2_config(w: _Writer, norm_topk_prob: bool) -> dict[str, Any]:
    s = w.spec
    moe, first = list(s.moe_layers), s.moe_layers[0]
    w.need(
        moe == list(range(first, s.n_layers)),
        f"moe_layers {moe} (MoE layers are first_k_dense_replace..n-1)",
    )
    w.need(s.n_kv_heads == s.n_heads, "n_kv_heads != n_heads")
    w.need(
        s.shared_ffn_size % s.expert_ffn_size == 0,
        "shared_ffn_size not a multiple of expert_ffn_size",
    )
    derived = spec_mla_fields(s)
    w.need(
        all(getattr(s, k) == v for k, v in derived.items()),
        "kv_dim/attn_params/qk_head_dim/latent_expand_params other than the MLA sizes of "
        "head_dim, qk_rope_head_dim and q_lora_rank",
    )
    cfg = (
        _common(s)
        | mla_dims(s)
        | dict(
            n_routed_experts=s.n_experts,
            n_shared_experts=s.shared_ffn_size // s.expert_ffn_size,
            moe_intermediate_size=s.expert_ffn_size,
            first_k_dense_replace=first,
            routed_scaling_factor=1.0,
            norm_topk_prob=norm_topk_prob,
            attention_bias=s.attention_bias,
        )
    )
    if s.family == "deepseek_v3":  # one group of every expert: a plain top-k of the scores
        w.need(not s.mlp_bias, "mlp_bias (DeepSeek-V3's FFNs have no biases)")
        cfg |= dict(architectures=["DeepseekV3ForCausalLM"], n_group=1, topk_group=1)
    else:
        cfg |= dict(
            architectures=["DeepseekV2ForCausalLM"],
            moe_layer_freq=1,
            topk_method="greedy",
            scoring_func="softmax",
            mlp_bias=s.mlp_bias,
        )
    if s.dense_ffn_size:
        cfg["intermediate_size"] = s.dense_ffn_size
    return cfg


def _switch_config(w: _Writer, norm_topk_prob: bool) -> dict[str, Any]:
    s = w.spec
    n, moe = s.n_layers, list(s.moe_layers)
    # one sparse block 1 is every (n - 1)-th block; otherwise the gap between the first two
    step = 1 if moe[0] == 0 else (max(2, n - 1) if len(moe) < 2 else moe[1] - moe[0])
    w.need(
        moe == [i for i in range(n) if step == 1 or i % step == 1],
        f"moe_layers {moe} (transformers' sparse blocks: i % encoder_sparse_step == 1)",
    )
    w.need(s.top_k == 1 and s.n_kv_heads == s.n_heads, "top_k != 1 or n_kv_heads != n_heads")
    w.need(s.dense_ffn_size == s.expert_ffn_size, "dense_ffn_size != expert_ffn_size (one d_ff)")
    return dict(
        architectures=["SwitchTransformersForConditionalGeneration"],
        d_model=s.hidden_size,
        d_ff=s.expert_ffn_size,
        d_kv=s.head_dim,
        num_heads=s.n_heads,
        num_layers=n,
        num_decoder_layers=n,
        num_experts=s.n_experts,
        encoder_sparse_step=step,
        decoder_sparse_step=step,
        layer_norm_epsilon=s.rms_norm_eps,
        rope_theta=s.rope_theta,  # ours: Switch uses relative position buckets, we use RoPE
    )
