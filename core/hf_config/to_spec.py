"""config.json -> ModelSpec: one function per family, each field read through `HFConfig.get`,
relations between fields (top-k within the experts, heads in whole groups, some MoE layer)
checked under config.json's names before the spec is built."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.errors import ConfigError
from core.files import note_once
from core.hf_config.fields import (
    COUNT,
    FAMILY_DEFAULTS,
    HFConfig,
    hf_config_file,
    read_hf_config,
)
from core.hf_config.runtime import check_act_known, fp8_block
from core.spec import FAMILIES, ModelSpec
from core.types import Activation


def spec_from_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """The spec of a `config.json` (file or checkpoint directory), named after its folder."""
    p = hf_config_file(path)
    cfg = read_hf_config(p)
    return hf_config_to_spec(cfg.fields, name or p.resolve().parent.name, where=str(p))


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


# torch's other names of a dtype, which transformers' getattr(torch, dtype) reads as it
TORCH_DTYPE_ALIASES = {"float": "float32", "half": "float16"}
# executor.dtype's other names: torch's (torch.half) and the short ones of accelerate and
# transformers' TrainingArguments (bf16, fp16)
RUN_DTYPE_ALIASES = {
    **TORCH_DTYPE_ALIASES,
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}


def hf_dtype_key(cfg: HFConfig) -> str:
    """The field a config.json names its weights' dtype in: transformers 5 writes `dtype`,
    older ones `torch_dtype`; `dtype` wins where it is not null, as in transformers."""
    return "dtype" if cfg.get("dtype", None) is not None else "torch_dtype"


def hf_dtype_name(cfg: HFConfig) -> str:
    """A config.json's weight dtype (`hf_dtype_key`'s field, torch's other names read as
    transformers reads them); bfloat16 if neither field says. An empty string is a dtype no
    torch has (transformers' getattr(torch, "") fails), not an absent one."""
    value = cfg.get(hf_dtype_key(cfg), None)
    return "bfloat16" if value is None else TORCH_DTYPE_ALIASES.get(value, str(value))


def rope_theta_of(cfg: HFConfig, default: float) -> float:
    """A config.json's RoPE base: transformers 5 keeps it in `rope_parameters` (read first, as
    transformers does), older configs at the top level; `default` if neither has one."""
    scaling = (
        cfg.sub("rope_scaling") if cfg.get("rope_scaling", None) else cfg.sub("rope_parameters")
    )
    inner = scaling.get("rope_theta", None)
    return float(inner if inner is not None else cfg.get("rope_theta", default))


def hf_config_to_spec(cfg: Mapping[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """Map a config.json's fields (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2, Switch) to a
    spec; a
    ConfigError naming `where` (the file) and the config.json field for a field of the wrong type
    or range, or fields that make no model (top-k above the experts, heads that do not divide)."""
    c = HFConfig(cfg, where)
    c.check()
    family = c.get("model_type", None)
    builders = {
        "mixtral": _llama_fields,
        "olmoe": _llama_fields,
        "qwen2_moe": _qwen2_moe_fields,
        "qwen3_moe": _qwen3_moe_fields,
        "deepseek_v2": _deepseek_v2_fields,
        "deepseek_v3": _deepseek_v3_fields,
        "switch_transformers": _switch_fields,
    }
    if family not in builders:
        what = "is missing" if family is None else f"{family!r} is not supported"
        raise c.error(f"model_type {what}; supported: {', '.join(FAMILIES)}")
    _check_architectures(c, family)
    _check_other_family_fields(c, family)
    check_act_known(c, family)
    dtype = hf_dtype_name(c)
    if dtype not in DTYPE_BYTES:
        raise c.error(
            f"{hf_dtype_key(c)} {dtype!r} has no byte size here; supported: "
            f"{', '.join(DTYPE_BYTES)}"
        )
    fields = builders[family](c) | _disk_fields(c)
    try:
        return ModelSpec(
            name=name,
            family=family,
            dtype_bytes=DTYPE_BYTES[dtype],
            float16=dtype == "float16",  # the 2 bytes of float16, not bfloat16's
            **fields,
        )
    except ConfigError as e:  # a rule the checks above missed: still named after the file
        made = [f"{k} is {v}" for k, v in DERIVED.items() if f": {k}=" in str(e)]
        raise c.error(f"{e}{''.join(f' ({m} in config.json)' for m in made[:1])}") from None


def _disk_fields(c: HFConfig) -> dict[str, Any]:
    """FP8 blocks (quantization_config's fp8, DeepSeek-V3's release): the experts' bytes on
    disk, 1 a weight and a float32 scale a block, which the disk's reads move; else none."""
    quant = c.fields.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        return {}  # not quantized, or refused where a checkpoint is read (fp8_block)
    return dict(disk_dtype_bytes=1, disk_block=fp8_block(c))


# spec fields summed from config.json's (each bounded alone), as the spec's errors name them
DERIVED = {
    "qk_head_dim": "qk_nope_head_dim + qk_rope_head_dim",
    "kv_dim": "kv_lora_rank + qk_rope_head_dim",
    "shared_ffn_size": "n_shared_experts * moe_intermediate_size",
}


# each family's class-name prefix in transformers (MixtralForCausalLM, MixtralModel, ...)
ARCH_PREFIX = {
    "mixtral": "Mixtral",
    "olmoe": "Olmoe",
    "qwen2_moe": "Qwen2Moe",
    "qwen3_moe": "Qwen3Moe",
    "deepseek_v2": "DeepseekV2",
    "deepseek_v3": "DeepseekV3",
    "switch_transformers": "SwitchTransformers",
}
_ARCH = re.compile(rf"^({'|'.join(ARCH_PREFIX.values())})(For[A-Za-z]+|[A-Za-z]*Model)$")


def _check_architectures(c: HFConfig, family: str) -> None:
    """`architectures` naming another known family's class than `model_type`'s: which of the
    two the weights are is unknown (transformers builds model_type's class and would load the
    other's weights into it). A class of no family moepipe runs (LlamaForCausalLM under
    mixtral) says nothing of the weights, which are checked against model_type's model: one
    logged line, as transformers' AutoModelForCausalLM builds model_type's class too."""
    for arch in c.get("architectures", []):
        m = _ARCH.match(arch)
        if not m:
            note_once(
                f"{c.where}: architectures names {arch}, no class of model_type {family!r} "
                f"({ARCH_PREFIX[family]}ForCausalLM); moepipe runs model_type's model, as "
                "transformers' AutoModelForCausalLM does; make architectures and model_type agree"
            )
        if m and m.group(1) != ARCH_PREFIX[family]:
            raise c.error(
                f"architectures names {arch}, a {_family_of(m.group(1))} class, but model_type "
                f"is {family!r}; make the two agree (the weights are one model's)"
            )


# fields that size or route a model, by the families whose config.json has them (with their other
# names in `ALIASES`): one of another family's, unread by model_type's, means the two disagree
_DS = ("deepseek_v2", "deepseek_v3")
_CAUSAL = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", *_DS)
_QWEN = ("qwen2_moe", "qwen3_moe")
FAMILY_FIELDS: dict[str, tuple[str, ...]] = {
    "num_local_experts": ("mixtral", "olmoe", "qwen3_moe", "deepseek_v3"),
    "num_experts": (*_CAUSAL, "switch_transformers"),
    "n_routed_experts": _DS,
    "num_experts_per_tok": _CAUSAL,
    "moe_intermediate_size": (*_QWEN, *_DS),
    "shared_expert_intermediate_size": ("qwen2_moe",),
    "n_shared_experts": _DS,
    "intermediate_size": _CAUSAL,
    "hidden_size": (*_CAUSAL, "switch_transformers"),
    "num_hidden_layers": (*_CAUSAL, "switch_transformers"),
    "num_attention_heads": (*_CAUSAL, "switch_transformers"),
    "kv_lora_rank": _DS,
    "q_lora_rank": _DS,
    "qk_nope_head_dim": _DS,
    "qk_rope_head_dim": _DS,
    "v_head_dim": _DS,
    "first_k_dense_replace": _DS,
    "n_group": _DS,
    "topk_group": _DS,
    "routed_scaling_factor": _DS,
    "decoder_sparse_step": (*_QWEN, "switch_transformers"),
    "mlp_only_layers": _QWEN,
    "d_model": ("switch_transformers",),
    "d_ff": ("switch_transformers",),
    "d_kv": ("switch_transformers",),
    "num_heads": ("switch_transformers",),
    "num_layers": ("switch_transformers",),
    "encoder_sparse_step": ("switch_transformers",),
    # and that route it: Mixtral renormalises its top-k always, the others as this says
    "norm_topk_prob": (*_QWEN, "olmoe", *_DS),
    "clip_qkv": ("olmoe",),
}
# flags that add a family's biases, refused where true in a family whose class has no such
# field (transformers ignores it and runs no biases); false is every other family's reading
FAMILY_FLAGS: dict[str, tuple[str, ...]] = {
    "qkv_bias": ("qwen2_moe",),
    "attention_bias": ("olmoe", "qwen3_moe", *_DS),
    "mlp_bias": ("deepseek_v2",),
}


def _check_other_family_fields(c: HFConfig, family: str) -> None:
    """A field that sizes another family's model but not model_type's (num_local_experts under
    qwen2_moe, d_model under mixtral): model_type's own field would be read instead, or its
    transformers default, and the run would be of another model than the file describes."""
    for key in c.fields:
        flag = FAMILY_FLAGS.get(key, (family,))
        if family not in flag and c.fields[key] is True:
            raise c.error(
                f"{key} is true, but it is a field of {' and '.join(flag)}, not of model_type "
                f"{family!r}: transformers ignores it there and runs no biases; remove it, or "
                "fix model_type"
            )
        families = FAMILY_FIELDS.get(key, (family,))
        if family not in families:
            raise c.error(
                f"{key} is a field of {' and '.join(families)}, which model_type {family!r} "
                "does not read (it would size the model from its own fields or their "
                "defaults); fix model_type or the field's name"
            )


def _family_of(prefix: str) -> str:
    return next(f for f, p in ARCH_PREFIX.items() if p == prefix)


# Absent fields take transformers 5.24's config classes' defaults, family by family (a
# config.json written by hand or by an older version may leave them out)
KV_HEADS_ABSENT = {"mixtral": 8, "qwen2_moe": 16, "qwen3_moe": 4}  # others: the attention heads
ROPE_THETA = {"mixtral": 1e6, "qwen2_moe": 1e4, "qwen3_moe": 1e4, "olmoe": 1e4}
ROPE_THETA |= {"deepseek_v2": 1e4, "deepseek_v3": 1e4}


def _attention_heads(c: HFConfig, hidden: int) -> dict[str, int]:
    """n_heads, n_kv_heads, head_dim of a GQA config. num_key_value_heads: where absent, the
    family's default in transformers (`KV_HEADS_ABSENT`, else the heads); where null, the
    heads; head_dim defaults to hidden_size / heads, as transformers' config classes do."""
    heads = c.get("num_attention_heads")
    absent = "num_key_value_heads" not in c.fields
    kv_heads = c.get(
        "num_key_value_heads", KV_HEADS_ABSENT.get(str(c.family), heads) if absent else heads
    )
    if heads % kv_heads:
        raise c.error(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} "
            "(grouped-query attention shares each key/value head among a whole group)"
        )
    head_dim = c.get("head_dim", hidden // heads)
    if head_dim < 1:
        raise c.error(
            f"hidden_size={hidden} is less than num_attention_heads={heads}; set head_dim"
        )
    return dict(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim)


def _experts(c: HFConfig, key: str) -> dict[str, int]:
    """n_experts (config.json's `key`) and top_k, top-k no more than the experts."""
    n, k = c.get(key), c.get("num_experts_per_tok")
    if k > n:
        raise c.error(f"num_experts_per_tok={k} exceeds {c.name(key)}={n}; set it <= {n}")
    return dict(n_experts=n, top_k=k)


def _dense_size(c: HFConfig, moe: tuple[int, ...], n: int) -> int:
    """intermediate_size of the dense layers' FFN, needed only where some layer has no experts
    (absent: the family's default in transformers)."""
    dense = [i for i in range(n) if i not in moe]
    return int(c.get("intermediate_size") if dense else c.get("intermediate_size", 0))


def _llama_fields(c: HFConfig) -> dict[str, Any]:
    """Mixtral and OLMoE: every layer MoE, GQA attention (OLMoE's with QK-norm)."""
    n, hidden = c.get("num_hidden_layers"), c.get("hidden_size")
    experts = "num_local_experts" if c.family == "mixtral" else "num_experts"
    return dict(
        n_layers=n,
        moe_layers=tuple(range(n)),
        hidden_size=hidden,
        expert_ffn_size=c.get("intermediate_size"),
        **_experts(c, experts),
        **_attention_heads(c, hidden),
        vocab_size=c.get("vocab_size"),
        attention_bias=c.family == "olmoe" and c.get("attention_bias", False),
        rms_norm_eps=c.get("rms_norm_eps", 1e-5),
        rope_theta=rope_theta_of(c, ROPE_THETA[c.family]),
    )


def _qwen_layers(c: HFConfig, n: int) -> tuple[int, ...]:
    """Qwen2-MoE's and Qwen3-MoE's MoE layers: layer i has experts unless in mlp_only_layers,
    where (i + 1) % decoder_sparse_step == 0."""
    step = c.get("decoder_sparse_step", 1, rule=COUNT)  # transformers divides by it
    dense_only = set(c.get("mlp_only_layers", []))
    past = sorted(i for i in dense_only if i >= n)
    if past:  # transformers never meets such a layer: a typo, or a config.json of another model
        raise c.error(
            f"mlp_only_layers={sorted(dense_only)} names layer {past[0]}, past the model's "
            f"num_hidden_layers={n} (layers 0..{n - 1}); list layers of this model only"
        )
    # none: a dense model, as transformers runs it
    return tuple(i for i in range(n) if i not in dense_only and (i + 1) % step == 0)


def _qwen_fields(c: HFConfig) -> dict[str, Any]:
    """The fields Qwen2-MoE and Qwen3-MoE share: `_qwen_layers`, GQA heads, routed experts."""
    n, hidden = c.get("num_hidden_layers"), c.get("hidden_size")
    moe = _qwen_layers(c, n)
    return dict(
        n_layers=n,
        moe_layers=moe,
        hidden_size=hidden,
        expert_ffn_size=c.get("moe_intermediate_size"),
        # Qwen3-MoE's also under num_local_experts, its other name (`ALIASES`)
        **_experts(c, "num_experts"),
        **_attention_heads(c, hidden),
        vocab_size=c.get("vocab_size"),
        dense_ffn_size=_dense_size(c, moe, n),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_of(c, ROPE_THETA[c.family]),
    )


def _qwen2_moe_fields(c: HFConfig) -> dict[str, Any]:
    """Qwen2-MoE: a shared expert with a sigmoid gate, q/k/v biases."""
    return _qwen_fields(c) | dict(
        shared_ffn_size=c.get("shared_expert_intermediate_size", 5632),  # transformers'
        qkv_bias=c.get("qkv_bias", True),
    )


def _qwen3_moe_fields(c: HFConfig) -> dict[str, Any]:
    """Qwen3-MoE: no shared expert, per-head QK-norm (real.attention), attention_bias on
    q/k/v/o (none by default)."""
    return _qwen_fields(c) | dict(attention_bias=c.get("attention_bias", False))


def mla_params(hidden: int, heads: int, m: Mapping[str, Any]) -> int:
    """Attention weights of one MLA layer from its config.json sizes (`mla_dims`' keys)."""
    nope, rope, v_dim = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    rank, q_rank = m["kv_lora_rank"], m["q_lora_rank"]
    q_params = (
        hidden * q_rank + q_rank + q_rank * heads * (nope + rope)  # + q_a_layernorm
        if q_rank
        else hidden * heads * (nope + rope)
    )
    return (
        q_params
        + hidden * (rank + rope)
        + rank  # kv_a_layernorm
        + rank * heads * (nope + v_dim)
        + heads * v_dim * hidden
    )


def mla_spec_fields(hidden: int, heads: int, m: Mapping[str, Any]) -> dict[str, int]:
    """The spec's MLA fields (kv_dim, attn_params, qk_head_dim, latent_expand_params,
    qk_rope_head_dim) of config.json's MLA sizes."""
    nope, rope, rank = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["kv_lora_rank"]
    return dict(
        kv_dim=rank + rope,  # MLA caches the compressed latent + the RoPE key
        attn_params=mla_params(hidden, heads, m),
        qk_head_dim=nope + rope,
        latent_expand_params=rank * heads * (nope + m["v_head_dim"]),
        qk_rope_head_dim=rope,
    )


def _deepseek_v2_fields(c: HFConfig) -> dict[str, Any]:
    """DeepSeek-V2: layers from first_k_dense_replace on are MoE (every moe_layer_freq-th, as
    DeepSeek's modeling code; 1 in V2 and V2-Lite), MLA attention, shared experts."""
    n = c.get("num_hidden_layers")
    first, freq = c.get("first_k_dense_replace", 0), c.get("moe_layer_freq", 1)
    moe = tuple(i for i in range(first, n) if i % freq == 0)  # none: a dense model
    if "n_shared_experts" not in c.fields:  # the two references disagree: the file must say
        raise c.error(
            "n_shared_experts is missing: transformers' DeepseekV2Config takes 2 and DeepSeek's "
            "configuration_deepseek.py none; write the checkpoint's count (null or 0: none)"
        )
    shared = c.get("n_shared_experts", 0) or 0
    return _deepseek_fields(c, n, moe, shared) | dict(mlp_bias=c.get("mlp_bias", False))


def _deepseek_v3_fields(c: HFConfig) -> dict[str, Any]:
    """DeepSeek-V3: layers from first_k_dense_replace on are MoE, MLA attention, shared
    experts (absent: transformers' 1); its FFNs have no biases (no mlp_bias in its class)."""
    n = c.get("num_hidden_layers")
    first = c.get("first_k_dense_replace")  # absent: transformers' 3
    moe = tuple(range(first, n))  # none: a dense model, as transformers runs it
    absent = "n_shared_experts" not in c.fields
    shared = c.get("n_shared_experts") if absent else c.get("n_shared_experts", 0) or 0
    return _deepseek_fields(c, n, moe, shared)


def _deepseek_fields(c: HFConfig, n: int, moe: tuple[int, ...], shared: int) -> dict[str, Any]:
    """The fields DeepSeek-V2 and V3 share: MLA attention sized by config.json, `shared`
    shared experts of moe_intermediate_size each, routed experts, attention_bias."""
    hidden, heads = c.get("hidden_size"), c.get("num_attention_heads")
    m = {
        k: c.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank")
    }
    _mla_key_value_heads(c, heads, m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["v_head_dim"])
    # absent: 1536 in transformers' class and DeepSeek's own (null: none, as V2-Lite ships)
    m["q_lora_rank"] = c.get("q_lora_rank", 1536 if "q_lora_rank" not in c.fields else 0)
    expert = c.get("moe_intermediate_size")
    return dict(
        n_layers=n,
        moe_layers=moe,
        hidden_size=hidden,
        expert_ffn_size=expert,
        **_experts(c, "n_routed_experts"),
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=m["v_head_dim"],
        vocab_size=c.get("vocab_size"),
        dense_ffn_size=_dense_size(c, moe, n),
        shared_ffn_size=shared * expert,
        **mla_spec_fields(hidden, heads, m),
        q_lora_rank=m["q_lora_rank"],
        attention_bias=c.get("attention_bias", False),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta_of(c, ROPE_THETA[c.family]),
    )


def _mla_key_value_heads(c: HFConfig, heads: int, qk: int, v: int) -> None:
    """num_key_value_heads of MLA, which expands its latent to one key/value head a query head
    (DeepSeek's modeling_deepseek.py never reads the field). transformers' classes repeat those
    heads by heads // num_key_value_heads: at a ratio of 1 or less, and in its default sdpa
    attention wherever key and value heads are one width (at most 256, enable_gqa on as many
    key/value heads as queries), that is MLA itself, which moepipe runs; elsewhere transformers
    fails, refused."""
    kv_heads = c.get("num_key_value_heads", heads)  # absent or null: the heads
    if heads // kv_heads > 1 and not qk == v <= 256:
        raise c.error(
            f"num_key_value_heads={kv_heads} with num_attention_heads={heads} and "
            f"v_head_dim={v} != qk_nope_head_dim + qk_rope_head_dim={qk}: transformers' "
            f"{ARCH_PREFIX[c.family]} fails on it (it repeats MLA's {heads} key/value heads by "
            f"{heads // kv_heads}); MLA has one a query head: set it to num_attention_heads"
        )


def _switch_fields(c: HFConfig) -> dict[str, Any]:
    """Switch's encoder stack: block i is sparse where i % encoder_sparse_step == 1 (every block
    at step 1), as transformers' SwitchTransformersStack (blocks 1, 3, ..., 11 for switch-base),
    as in the replication paper's encoder-only runs."""
    n = c.get("num_layers")
    # absent: as transformers' SwitchTransformersConfig derives it (3 sparse blocks by default),
    # from num_layers under its own name: its default where config.json has the other name
    # alone (transformers sets num_hidden_layers after deriving the step)
    own = c.fields.get("num_layers", FAMILY_DEFAULTS["switch_transformers"]["num_layers"])
    sparse = c.get("num_sparse_encoder_layers", 3)
    step = c.get("encoder_sparse_step", own // sparse if sparse > 0 else own)
    moe = tuple(i for i in range(n) if step == 1 or (step > 1 and i % step == 1))
    if not moe:
        raise c.error(
            f"encoder_sparse_step={step} leaves no sparse block among num_layers={n}; set it "
            "to 1 (every block sparse) or a step below num_layers"
        )
    heads = c.get("num_heads")
    return dict(
        n_layers=n,
        moe_layers=moe,
        hidden_size=c.get("d_model"),
        expert_ffn_size=c.get("d_ff"),
        n_experts=c.get("num_experts"),
        top_k=1,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=c.get("d_kv"),
        vocab_size=c.get("vocab_size"),
        activation=Activation.RELU,
        dense_ffn_size=c.get("d_ff"),
        rms_norm_eps=c.get("layer_norm_epsilon", 1e-6),
    )
