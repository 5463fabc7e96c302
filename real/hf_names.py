"""Hugging Face tensor-name templates of each family the real executor runs (the names
`real.checkpoint.unit_layout` pairs with shapes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError


@dataclass(frozen=True)
class HFNames:
    """HF name templates of one family; `{i}` layer, `{e}` expert, `{w}` matrix name."""

    embed: str
    final_norm: str
    lm_head: str
    attn: Mapping[str, str]  # our key -> template
    post_norm: str
    router: str
    expert: str
    expert_mats: Mapping[str, str]  # our key (w1/w3/w2 or wi/wo) -> HF matrix name
    dense: str
    dense_mats: Mapping[str, str]
    shared: str = ""  # "" = the family has no shared experts
    shared_gate: str = ""  # Qwen's sigmoid gate on the shared expert
    router_bias: str = ""  # DeepSeek-V3's e_score_correction_bias; "" = none


def hf_names(family: str) -> HFNames:
    swiglu = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    if family == "switch_transformers":
        # Decoder-only use of the encoder stack's names: block i = layer i; layer.0 is
        # self-attention, layer.1 the (sparse or dense) feed-forward.
        b = "encoder.block.{i}.layer."
        relu = {"wi": "wi", "wo": "wo"}
        return HFNames(
            embed="shared.weight",
            final_norm="encoder.final_layer_norm.weight",
            lm_head="lm_head.weight",
            attn={"input_norm": b + "0.layer_norm.weight"}
            | {x: b + f"0.SelfAttention.{x}.weight" for x in "qkvo"},
            post_norm=b + "1.layer_norm.weight",
            router=b + "1.mlp.router.classifier.weight",
            expert=b + "1.mlp.experts.expert_{e}.{w}.weight",
            expert_mats=relu,
            dense=b + "1.mlp.{w}.weight",
            dense_mats=relu,
        )
    b = "model.layers.{i}."
    attn = {"input_norm": b + "input_layernorm.weight"}
    attn |= {x: b + f"self_attn.{x}_proj.weight" for x in "qkvo"}
    common: dict[str, Any] = dict(
        embed="model.embed_tokens.weight",
        final_norm="model.norm.weight",
        lm_head="lm_head.weight",
        attn=attn,
        post_norm=b + "post_attention_layernorm.weight",
        dense=b + "mlp.{w}.weight",
        dense_mats=swiglu,
    )
    if family == "mixtral":
        mats = {"w1": "w1", "w3": "w3", "w2": "w2"}
        moe = b + "block_sparse_moe."
        return HFNames(
            **common,
            router=moe + "gate.weight",
            expert=moe + "experts.{e}.{w}.weight",
            expert_mats=mats,
        )
    moe = dict(
        router=b + "mlp.gate.weight", expert=b + "mlp.experts.{e}.{w}.weight", expert_mats=swiglu
    )
    # QK-norm before RoPE: RMSNorm over the whole projected q and k (OLMoE), or over each head
    # (Qwen3-MoE); attention_bias: q/k/v/o biases
    if family in ("olmoe", "qwen3_moe"):
        common["attn"] = attn | {f"{x}_norm": b + f"self_attn.{x}_norm.weight" for x in "qk"}
        common["attn"] |= {f"{x}_bias": b + f"self_attn.{x}_proj.bias" for x in "qkvo"}
        return HFNames(**common, **moe)
    if family == "qwen2_moe":
        common["attn"] = attn | {f"{x}_bias": b + f"self_attn.{x}_proj.bias" for x in "qkv"}
        shared = dict(
            shared=b + "mlp.shared_expert.{w}.weight",
            shared_gate=b + "mlp.shared_expert_gate.weight",
        )
        return HFNames(**common, **moe, **shared)
    if family in ("deepseek_v2", "deepseek_v3"):  # MLA; q_a, q_a_norm and q_b where q is
        # compressed (full V2, V3)
        mla = {"q": "q_proj", "q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"}
        mla |= {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj"}
        common["attn"] = {"input_norm": b + "input_layernorm.weight"}
        mla["o"] = "o_proj"
        common["attn"] |= {k: b + f"self_attn.{x}.weight" for k, x in mla.items()}
        common["attn"] |= {
            k + "_bias": b + f"self_attn.{mla[k]}.bias" for k in ("q_a", "kv_a", "o")
        }
        bias = b + "mlp.gate.e_score_correction_bias" if family == "deepseek_v3" else ""
        return HFNames(
            **common, **moe, shared=b + "mlp.shared_experts.{w}.weight", router_bias=bias
        )
    raise ConfigError(
        f"model family {family!r} has no real-executor layout; "
        "use mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3 or "
        "switch_transformers"
    )
