"""Hugging Face-layout checkpoints for the real executor: tensor names, writing and loading.

`unit_layout(spec)` is the one table of which tensors (HF name, shape) make up each unit a
schedule moves (a layer's attention, its gate, one expert, ...). `write_checkpoint` writes seeded
random weights in that layout with the family's real `config.json` fields; `load_checkpoint`
validates a directory and indexes its tensors (file, dtype, shape, byte offset).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save_file

from core.errors import ConfigError
from core.spec import ModelSpec, hf_dtype_name, read_hf_config
from core.types import Activation, Tensor

CONF_MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_TORCH_DTYPE = {4: torch.float32, 2: torch.bfloat16}
_HF_DTYPE_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
ST_CODE = {v: k for k, v in ST_DTYPES.items()}


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    """The weight dtype of a spec: 4 bytes = float32, 2 bytes = bfloat16."""
    try:
        return _TORCH_DTYPE[spec.dtype_bytes]
    except KeyError:
        raise ConfigError(
            f"model {spec.name}: dtype_bytes={spec.dtype_bytes} has no real-executor dtype; "
            "use 4 (float32) or 2 (bfloat16)"
        ) from None


# ---- units and names ----------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Unit:
    """A group of weights a schedule loads, frees and computes with as one piece."""

    kind: Tensor  # ATTENTION, GATE, EXPERT, FFN (dense, or the shared experts), EMBED, HEAD
    layer: int = -1  # decoder layer; -1 for embed/head
    expert: int = -1  # routed expert index; -1 unless kind is EXPERT

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Tensor(self.kind))

    def __str__(self) -> str:
        if self.layer < 0:
            return str(self.kind)
        suffix = str(self.expert) if self.kind == Tensor.EXPERT else ""
        return f"L{self.layer}.{self.kind}{suffix}"


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str  # name in the safetensors files
    shape: tuple[int, ...]  # [out, in] for projections (torch Linear layout)


@dataclass(frozen=True)
class _Names:
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


def _names(family: str) -> _Names:
    swiglu = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    if family == "switch_transformers":
        # Decoder-only use of the encoder stack's names: block i = layer i; layer.0 is
        # self-attention, layer.1 the (sparse or dense) feed-forward.
        b = "encoder.block.{i}.layer."
        relu = {"wi": "wi", "wo": "wo"}
        return _Names(
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
        return _Names(
            **common,
            router=moe + "gate.weight",
            expert=moe + "experts.{e}.{w}.weight",
            expert_mats=mats,
        )
    moe = dict(
        router=b + "mlp.gate.weight", expert=b + "mlp.experts.{e}.{w}.weight", expert_mats=swiglu
    )
    if family == "olmoe":  # QK-norm: RMSNorm over the whole projected q and k, before RoPE
        common["attn"] = attn | {f"{x}_norm": b + f"self_attn.{x}_norm.weight" for x in "qk"}
        return _Names(**common, **moe)
    if family == "qwen2_moe":
        common["attn"] = attn | {f"{x}_bias": b + f"self_attn.{x}_proj.bias" for x in "qkv"}
        shared = dict(
            shared=b + "mlp.shared_expert.{w}.weight",
            shared_gate=b + "mlp.shared_expert_gate.weight",
        )
        return _Names(**common, **moe, **shared)
    if family == "deepseek_v2":  # MLA; q_a, q_a_norm and q_b where q is compressed (full V2)
        mla = {"q": "q_proj", "q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"}
        mla |= {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj"}
        common["attn"] = {"input_norm": b + "input_layernorm.weight"}
        mla["o"] = "o_proj"
        common["attn"] |= {k: b + f"self_attn.{x}.weight" for k, x in mla.items()}
        return _Names(**common, **moe, shared=b + "mlp.shared_experts.{w}.weight")
    raise ConfigError(
        f"model family {family!r} has no real-executor layout; "
        "use mixtral, qwen2_moe, olmoe, deepseek_v2 or switch_transformers"
    )


def _ffn(
    template: str, mats: Mapping[str, str], i: int, h: int, f: int, **kw: int
) -> dict[str, TensorSpec]:
    """One FFN's matrices: up-projections [F, H] (w1, w3, wi), down-projection [H, F] (w2, wo)."""
    out = {}
    for key, hf in mats.items():
        shape = (h, f) if key in ("w2", "wo") else (f, h)
        out[key] = TensorSpec(template.format(i=i, w=hf, **kw), shape)
    return out


def unit_layout(spec: ModelSpec) -> dict[Unit, dict[str, TensorSpec]]:
    """Every unit of the model -> its tensors (our short key -> HF name and shape), in file order.

    Keys: attention `input_norm q k v o` (+ `q_bias k_bias v_bias` for Qwen with qkv_bias,
    `q_norm k_norm` for OLMoE), or for DeepSeek-V2's MLA `input_norm q kv_a kv_a_norm kv_b o`
    (HF's q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; sizes from `mla_dims`),
    with `q_a q_a_norm q_b` (q_a_proj, q_a_layernorm, q_b_proj) in place of `q` where
    config.json's q_lora_rank compresses the query; gate
    `post_norm router`; expert `w1 w3 w2` (SwiGLU) or `wi wo` (ReLU); FFN `w1 w3 w2`/`wi wo` plus
    `post_norm` for a dense layer and `shared_gate` for Qwen's shared expert; embed `embed`; head
    `norm lm_head`.
    """
    n = _names(spec.family)
    h, v = spec.hidden_size, spec.vocab_size
    attn_shapes = _attn_shapes(spec)
    out: dict[Unit, dict[str, TensorSpec]] = {
        Unit(Tensor.EMBED): {"embed": TensorSpec(n.embed, (v, h))}
    }
    for i in range(spec.n_layers):
        out[Unit(Tensor.ATTENTION, i)] = {
            k: TensorSpec(t.format(i=i), shape)
            for k, t in n.attn.items()
            if (shape := attn_shapes.get(k))
        }
        post_norm = {"post_norm": TensorSpec(n.post_norm.format(i=i), (h,))}
        if not spec.is_moe(i):
            ffn = _ffn(n.dense, n.dense_mats, i, h, spec.dense_ffn_size)
            out[Unit(Tensor.FFN, i)] = post_norm | ffn
            continue
        router = {"router": TensorSpec(n.router.format(i=i), (spec.n_experts, h))}
        out[Unit(Tensor.GATE, i)] = post_norm | router
        for e in range(spec.n_experts):
            out[Unit(Tensor.EXPERT, i, e)] = _ffn(
                n.expert, n.expert_mats, i, h, spec.expert_ffn_size, e=e
            )
        if spec.shared_ffn_size:
            if not n.shared:
                raise ConfigError(
                    f"model {spec.name}: family {spec.family} has no shared experts; set shared_ffn_size: 0"
                )
            shared = _ffn(n.shared, n.dense_mats, i, h, spec.shared_ffn_size)
            if n.shared_gate:
                shared["shared_gate"] = TensorSpec(n.shared_gate.format(i=i), (1, h))
            out[Unit(Tensor.FFN, i)] = shared
    out[Unit(Tensor.HEAD)] = {
        "norm": TensorSpec(n.final_norm, (h,)),
        "lm_head": TensorSpec(n.lm_head, (v, h)),
    }
    return out


def _attn_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Attention tensor shapes by short key ([out, in] for projections); the keys of tensors the
    model has (no Qwen biases without qkv_bias, q or q_a/q_a_norm/q_b for MLA)."""
    h, heads = spec.hidden_size, spec.n_heads
    if spec.family == "deepseek_v2":
        m = mla_dims(spec)
        qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        rank, q_rank = m["kv_lora_rank"], m["q_lora_rank"]
        q: dict[str, tuple[int, ...]] = (
            {"q_a": (q_rank, h), "q_a_norm": (q_rank,), "q_b": (heads * qk, q_rank)}
            if q_rank
            else {"q": (heads * qk, h)}
        )
        return {
            "input_norm": (h,),
            **q,
            "kv_a": (rank + m["qk_rope_head_dim"], h),
            "kv_a_norm": (rank,),
            "kv_b": (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), rank),
            "o": (h, heads * m["v_head_dim"]),
        }
    q_dim, kv_dim = heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes = {"input_norm": (h,), "q": (q_dim, h), "k": (kv_dim, h), "v": (kv_dim, h)}
    shapes["o"] = (h, q_dim)
    if spec.qkv_bias:
        shapes |= {"q_bias": (q_dim,), "k_bias": (kv_dim,), "v_bias": (kv_dim,)}
    return shapes | {"q_norm": (q_dim,), "k_norm": (kv_dim,)}


# ---- config.json --------------------------------------------------------------------------


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


def _mla_spec_fields(spec: ModelSpec) -> dict[str, int]:
    """kv_dim, attn_params, qk_head_dim, latent_expand_params and qk_rope_head_dim as
    core.spec.hf_config_to_spec derives them from `mla_dims` (so the spec round-trips)."""
    m, h, heads = mla_dims(spec), spec.hidden_size, spec.n_heads
    nope, rope, v_dim, rank, q_rank = (
        m["qk_nope_head_dim"],
        m["qk_rope_head_dim"],
        m["v_head_dim"],
        m["kv_lora_rank"],
        m["q_lora_rank"],
    )
    q_params = (
        h * q_rank + q_rank + q_rank * heads * (nope + rope)  # + q_a_layernorm
        if q_rank
        else h * heads * (nope + rope)
    )
    params = (
        q_params
        + h * (rank + rope)
        + rank  # kv_a_layernorm
        + rank * heads * (nope + v_dim)
        + heads * v_dim * h
    )
    return dict(
        kv_dim=rank + rope,
        attn_params=params,
        qk_head_dim=nope + rope,
        latent_expand_params=rank * heads * (nope + v_dim),
        qk_rope_head_dim=rope,
    )


def spec_to_hf_config(spec: ModelSpec, norm_topk_prob: bool = False) -> dict[str, Any]:
    """The family's real `config.json` fields for `spec` (inverse of core.spec.hf_config_to_spec)."""
    fam, n, moe = spec.family, spec.n_layers, list(spec.moe_layers)
    dense = [i for i in range(n) if i not in spec.moe_layers]

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"model {spec.name}: a {fam} config.json cannot express {what}")

    cfg: dict[str, Any] = dict(
        model_type=fam,
        vocab_size=spec.vocab_size,
        torch_dtype=_HF_DTYPE_NAME[torch_dtype(spec)],
        tie_word_embeddings=False,
    )
    llama = dict(
        hidden_size=spec.hidden_size,
        num_hidden_layers=n,
        num_attention_heads=spec.n_heads,
        num_key_value_heads=spec.n_kv_heads,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        num_experts_per_tok=spec.top_k,
        max_position_embeddings=4096,
    )
    need(spec.activation == Activation.SWIGLU or fam == "switch_transformers", "ReLU experts")
    need(fam == "switch_transformers" or spec.activation == Activation.SWIGLU, "SwiGLU experts")
    if fam in ("mixtral", "olmoe"):
        need(not dense, f"dense layers {dense} (every layer is MoE)")
        need(not spec.shared_ffn_size, "shared experts")
        need(
            not (spec.kv_dim or spec.attn_params or spec.qk_head_dim),
            "kv_dim/attn_params/qk_head_dim overrides",
        )
        experts = "num_local_experts" if fam == "mixtral" else "num_experts"
        cfg |= llama | {experts: spec.n_experts, "intermediate_size": spec.expert_ffn_size}
        cfg |= {
            "head_dim": spec.head_dim,
            "architectures": ["MixtralForCausalLM" if fam == "mixtral" else "OlmoeForCausalLM"],
        }
        if fam == "olmoe":
            cfg["norm_topk_prob"] = norm_topk_prob
        return cfg
    if fam == "qwen2_moe":
        need(
            not (spec.kv_dim or spec.attn_params or spec.qk_head_dim),
            "kv_dim/attn_params/qk_head_dim overrides",
        )
        cfg |= llama | dict(
            architectures=["Qwen2MoeForCausalLM"],
            num_experts=spec.n_experts,
            moe_intermediate_size=spec.expert_ffn_size,
            shared_expert_intermediate_size=spec.shared_ffn_size,
            decoder_sparse_step=1,
            mlp_only_layers=dense,
            norm_topk_prob=norm_topk_prob,
            head_dim=spec.head_dim,
            qkv_bias=spec.qkv_bias,
        )
        if spec.dense_ffn_size:
            cfg["intermediate_size"] = spec.dense_ffn_size
        return cfg
    if fam == "deepseek_v2":
        first = moe[0]
        need(
            moe == list(range(first, n)),
            f"moe_layers {moe} (MoE layers are first_k_dense_replace..n-1)",
        )
        need(spec.n_kv_heads == spec.n_heads, "n_kv_heads != n_heads")
        need(
            spec.shared_ffn_size % spec.expert_ffn_size == 0,
            "shared_ffn_size not a multiple of expert_ffn_size",
        )
        need(
            tuple(getattr(spec, k) for k in _mla_spec_fields(spec))
            == tuple(_mla_spec_fields(spec).values()),
            "kv_dim/attn_params/qk_head_dim/latent_expand_params other than the MLA sizes of "
            "head_dim, qk_rope_head_dim and q_lora_rank",
        )
        cfg |= (
            llama
            | mla_dims(spec)
            | dict(
                architectures=["DeepseekV2ForCausalLM"],
                n_routed_experts=spec.n_experts,
                n_shared_experts=spec.shared_ffn_size // spec.expert_ffn_size,
                moe_intermediate_size=spec.expert_ffn_size,
                first_k_dense_replace=first,
                moe_layer_freq=1,
                topk_method="greedy",
                scoring_func="softmax",
                routed_scaling_factor=1.0,
                norm_topk_prob=norm_topk_prob,
            )
        )
        if spec.dense_ffn_size:
            cfg["intermediate_size"] = spec.dense_ffn_size
        return cfg
    if fam == "switch_transformers":
        # one sparse block 1 is every (n - 1)-th block; otherwise the gap between the first two
        step = 1 if moe and moe[0] == 0 else (max(2, n - 1) if len(moe) < 2 else moe[1] - moe[0])
        need(
            moe == [i for i in range(n) if step == 1 or i % step == 1],
            f"moe_layers {moe} (transformers' sparse blocks: i % encoder_sparse_step == 1)",
        )
        need(
            spec.top_k == 1 and spec.n_kv_heads == spec.n_heads,
            "top_k != 1 or n_kv_heads != n_heads",
        )
        need(
            spec.dense_ffn_size == spec.expert_ffn_size,
            "dense_ffn_size != expert_ffn_size (one d_ff)",
        )
        need(spec.activation == Activation.RELU, "SwiGLU experts")
        return cfg | dict(
            architectures=["SwitchTransformersForConditionalGeneration"],
            d_model=spec.hidden_size,
            d_ff=spec.expert_ffn_size,
            d_kv=spec.head_dim,
            num_heads=spec.n_heads,
            num_layers=n,
            num_decoder_layers=n,
            num_experts=spec.n_experts,
            encoder_sparse_step=step,
            decoder_sparse_step=step,
            layer_norm_epsilon=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,  # ours: Switch uses relative position buckets, we use RoPE
        )
    _names(fam)  # raises the unsupported-family error
    raise AssertionError(fam)


# ---- model configs with overrides ---------------------------------------------------------


def reduced_spec(model: str, **overrides: Any) -> ModelSpec:
    """`conf/model/<model>.yaml` with field overrides, keeping derived fields consistent.

    Unless given: head_dim = hidden_size // n_heads when either changes; n_kv_heads follows n_heads
    where it equalled it; moe_layers keep the family's pattern for a new n_layers; shared and
    Switch's dense FFN scale with expert_ffn_size; DeepSeek's MLA kv_dim/attn_params/qk_head_dim follow head_dim.
    """
    path = CONF_MODEL_DIR / f"{model}.yaml"
    if not path.is_file():
        have = sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml"))
        raise ConfigError(f"{path}: no such model config; choose one of {have}")
    base = ModelSpec.from_dict(yaml.safe_load(path.read_text()), where=str(path))
    d = {k: v for k, v in vars(base).items()} | dict(overrides)
    given = set(overrides)
    if {"hidden_size", "n_heads"} & given and "head_dim" not in given:
        d["head_dim"] = d["hidden_size"] // d["n_heads"]
    if "n_heads" in given and "n_kv_heads" not in given and base.n_kv_heads == base.n_heads:
        d["n_kv_heads"] = d["n_heads"]
    if "n_layers" in given and "moe_layers" not in given:
        d["moe_layers"] = _moe_pattern(base, d["n_layers"])
    if "expert_ffn_size" in given:
        ratio = d["expert_ffn_size"] / base.expert_ffn_size
        if "shared_ffn_size" not in given:
            d["shared_ffn_size"] = round(base.shared_ffn_size * ratio)
        if "dense_ffn_size" not in given and base.family == "switch_transformers":
            d["dense_ffn_size"] = d["expert_ffn_size"]
    mla_fields = {"kv_dim", "attn_params", "qk_head_dim", "latent_expand_params"}
    derive_mla = base.family == "deepseek_v2" and not mla_fields & given
    if derive_mla:  # the MLA sizes of the new head_dim (and of qk_rope_head_dim, q_lora_rank)
        d |= dict.fromkeys(mla_fields, 0)
        if "qk_rope_head_dim" not in given:
            d["qk_rope_head_dim"] = 0
    spec = ModelSpec.from_dict(d, where=f"{path} with overrides {dict(overrides)}")
    if derive_mla:
        spec = replace(spec, **_mla_spec_fields(spec))
    return spec


def _moe_pattern(base: ModelSpec, n: int) -> tuple[int, ...]:
    dense = [i for i in range(base.n_layers) if not base.is_moe(i)]
    if base.family == "deepseek_v2":
        return tuple(range(min(base.moe_layers), n))
    if base.family == "switch_transformers":
        step = base.moe_layers[1] - base.moe_layers[0] if len(base.moe_layers) > 1 else 2
        return tuple(i for i in range(n) if i % step == step - 1)
    return tuple(i for i in range(n) if i not in dense)


# ---- writing ------------------------------------------------------------------------------


def _init(
    key: str, shape: tuple[int, ...], spec: ModelSpec, g: torch.Generator, scale: float
) -> torch.Tensor:
    """Seeded weights that keep activations O(1): std 1/sqrt(fan_in); residual-stream outputs
    (o, w2, wo) shrunk by sqrt(2 * n_layers); router logits of std ~1 so routing is spread out."""
    if key.endswith("norm"):
        return torch.ones(shape)
    x = torch.randn(shape, generator=g)
    if key == "embed":
        return x * scale
    if key.endswith("_bias"):
        return x * 0.02 * scale
    std = scale / math.sqrt(shape[-1])
    if key in ("o", "w2", "wo"):
        std /= math.sqrt(2 * spec.n_layers)
    return x * std


def write_checkpoint(
    spec: ModelSpec,
    out_dir: str | Path,
    seed: int = 0,
    scale: float = 1.0,
    shard_bytes: int = 2 * 2**30,
    norm_topk_prob: bool = False,
    rope_scaling: Mapping[str, Any] | None = None,
) -> Path:
    """Write `config.json` (with `rope_scaling` if given, written as is) and seeded random weights
    (sharded past `shard_bytes`) to `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = spec_to_hf_config(spec, norm_topk_prob)
    if rope_scaling:  # e.g. DeepSeek-V2-Lite's {"type": "yarn", "factor": 40, ...}
        cfg["rope_scaling"] = dict(rope_scaling)
    dtype = torch_dtype(spec)
    g = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for tensors in unit_layout(spec).values():
        for key, ts in tensors.items():
            t = _init(key, ts.shape, spec, g, scale).to(dtype).contiguous()
            if size and size + t.nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][ts.hf_name] = t
            size += t.nbytes
    # config.json goes too and is written last: a write cut short (a full disk) leaves no
    # config.json, so the folder is refused as a checkpoint rather than read half-written
    for stale in [out / "config.json", *out.glob("model*.safetensors"), out / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if len(shards) == 1:
        _save(shards[0], out / SINGLE_FILE, meta)
    else:
        weight_map, total = {}, 0
        for j, shard in enumerate(shards):
            name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
            _save(shard, out / name, meta)
            weight_map |= dict.fromkeys(shard, name)
            total += sum(t.nbytes for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    """safetensors' save_file, its I/O errors (a full disk) raised as the OSError they are."""
    from safetensors import SafetensorError

    try:
        save_file(tensors, str(path), metadata=meta)
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        raise OSError(int(code.group(1)) if code else None, str(e), str(path)) from None


# ---- loading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorEntry:
    file: Path  # safetensors file holding the tensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset of the tensor's data from the start of the file
    nbytes: int


# bytes per element of every safetensors dtype (the format's own table), to check each tensor's
# byte range against its shape as safetensors' loader does
ST_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                 "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}  # fmt: skip
ST_MAX_HEADER = 100_000_000  # safetensors refuses a larger header


def _read_header(path: Path) -> dict[str, TensorEntry]:
    """A safetensors file's tensors, its header checked by the format's rules (safetensors'
    `Metadata::validate`): an object of {dtype, shape, data_offsets} entries whose byte ranges
    match shape x dtype and tile the data exactly. Any breach is one ConfigError naming the
    file and the tensor; the library's own loader then opens it as a last check."""
    if not path.is_file():
        raise ConfigError(f"{path}: missing checkpoint shard; re-copy or rewrite the checkpoint")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ConfigError(
                f"{path}: truncated safetensors file ({size} bytes, header cut off); re-copy the checkpoint"
            )
        if n > ST_MAX_HEADER:
            raise ConfigError(f"{path}: safetensors header of {n} bytes, over the format's limit")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(
                f"{path}: corrupt safetensors header; re-copy the checkpoint"
            ) from None
    if not isinstance(header, dict):
        raise ConfigError(
            f"{path}: safetensors header is a JSON {type(header).__name__}, not an object of "
            "tensors; re-copy the checkpoint"
        )
    out, ranges = {}, []
    for name, meta in header.items():
        if name == "__metadata__":
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise ConfigError(f"{path}: __metadata__ must map strings to strings")
            continue
        start, end, shape = _check_entry(path, name, meta)
        if 8 + n + end > size:
            raise ConfigError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {8 + n + end} "
                f"but the file has {size} bytes; re-copy the checkpoint"
            )
        ranges.append((start, end, name))
        if meta["dtype"] not in ST_DTYPES:
            raise ConfigError(
                f"{path}: tensor {name} has dtype {meta['dtype']}; supported: {sorted(ST_DTYPES)}"
            )
        out[name] = TensorEntry(path, ST_DTYPES[meta["dtype"]], shape, 8 + n + start, end - start)
    pos = 0
    for start, end, name in sorted(ranges):
        if start != pos:
            raise ConfigError(
                f"{path}: tensor {name} starts at data byte {start}, but the tensors before it "
                f"end at {pos} (safetensors' data holds its tensors back to back); re-copy the "
                "checkpoint"
            )
        pos = end
    if 8 + n + pos != size:
        raise ConfigError(
            f"{path}: {size - 8 - n - pos} bytes past the last tensor (safetensors' data ends "
            "with it); re-copy the checkpoint"
        )
    _library_check(path)
    return out


def _check_entry(path: Path, name: str, meta: Any) -> tuple[int, int, tuple[int, ...]]:
    """(start, end, shape) of one header entry, or a ConfigError naming the tensor."""
    where = f"{path}: tensor {name}"
    if not isinstance(meta, dict) or not {"dtype", "shape", "data_offsets"} <= set(meta):
        raise ConfigError(
            f"{where}: header entry {json.dumps(meta)[:80]} is not "
            "{dtype, shape, data_offsets}; re-copy the checkpoint"
        )
    dtype, shape, offsets = meta["dtype"], meta["shape"], meta["data_offsets"]

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(dtype, str) or dtype not in ST_ITEM_BYTES:
        raise ConfigError(f"{where}: unknown safetensors dtype {dtype!r}")
    if not isinstance(shape, list) or not all(whole(d) for d in shape):
        raise ConfigError(f"{where}: shape {shape!r} is not a list of whole numbers")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(whole(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise ConfigError(
            f"{where}: data_offsets {offsets!r} is not [begin, end] with begin <= end"
        )
    nbytes = math.prod(shape) * ST_ITEM_BYTES[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise ConfigError(
            f"{where}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes, but shape "
            f"{shape} of {dtype} needs {nbytes}; the file is corrupt: re-copy the checkpoint"
        )
    return offsets[0], offsets[1], tuple(shape)


def _library_check(path: Path) -> None:
    """Open `path` with safetensors' own loader (it maps the file, reading only its header):
    anything its rules refuse that `_read_header` let pass is refused here, naming the file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as e:
        raise ConfigError(f"{path}: safetensors refuses it ({e}); re-copy the checkpoint") from None


def load_checkpoint(ckpt_dir: str | Path) -> tuple[ModelSpec, dict[str, TensorEntry]]:
    """Validate a checkpoint directory; return its spec and HF tensor name -> where its bytes are.

    Raises a one-line ConfigError naming the missing directory, config.json or shard, a truncated
    file, or a tensor whose shape/dtype disagrees with config.json.
    """
    d = Path(ckpt_dir)
    if not d.is_dir():
        raise ConfigError(
            f"{d}: no such checkpoint directory; write one with python -m real.make_checkpoint"
        )
    spec = ModelSpec.from_hf_config(d)
    cfg = hf_config(d)
    if hf_dtype_name(cfg) == "float16":  # 2-byte weights run as bfloat16 here
        raise ConfigError(
            f"{d / 'config.json'}: dtype float16 is not supported by the real executor "
            "(bfloat16 and float32 are); convert the weights to bfloat16"
        )
    if (d / INDEX_FILE).is_file():
        files = _index_files(d / INDEX_FILE)
    elif (d / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise ConfigError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE}; the checkpoint has no weights")
    index: dict[str, TensorEntry] = {}
    for f in files:
        index |= _read_header(d / f)
    names = _names(spec.family)
    if cfg.get("tie_word_embeddings") is True and spec.family != "switch_transformers":
        # the LM head is the embedding (transformers ties them whether or not lm_head is saved;
        # T5's tied head also rescales, and moepipe's Switch is not transformers' model anyway)
        index[names.lm_head] = index[names.embed]
    dtype = torch_dtype(spec)
    for tensors in unit_layout(spec).values():
        for ts in tensors.values():
            e = index.get(ts.hf_name)
            if e is None:
                raise ConfigError(f"{d}: tensor {ts.hf_name} is missing from {', '.join(files)}")
            if e.shape != ts.shape:
                raise ConfigError(
                    f"{e.file}: tensor {ts.hf_name} has shape {list(e.shape)}, config.json "
                    f"expects {list(ts.shape)}"
                )
            if e.dtype != dtype:
                raise ConfigError(
                    f"{e.file}: tensor {ts.hf_name} is {e.dtype}, config.json says {dtype}"
                )
    return spec, index


def _index_files(path: Path) -> list[str]:
    """The shard files a `model.safetensors.index.json` names: its weight_map must map tensor
    names to file names in its own folder."""
    try:
        weight_map = json.loads(path.read_bytes().decode("utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError):  # not UTF-8 / JSON, a list, no weight_map
        raise ConfigError(
            f"{path}: not a safetensors index (a JSON object with a weight_map of tensor name -> "
            "file); rewrite or re-copy it"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{path}: weight_map must be an object of tensor name -> file name")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or Path(file).name != file:
            raise ConfigError(
                f"{path}: weight_map[{name!r}] = {file!r} is not a file name in the checkpoint's "
                "folder"
            )
    return sorted(set(weight_map.values()))


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """One tensor's bytes from its file (a plain buffered read)."""
    with open(entry.file, "rb") as f:
        f.seek(entry.offset)
        buf = bytearray(f.read(entry.nbytes))
    if len(buf) != entry.nbytes:
        raise OSError(
            f"{entry.file}: short read at byte {entry.offset} ({len(buf)} of {entry.nbytes})"
        )
    return torch.frombuffer(buf, dtype=torch.uint8).view(entry.dtype).reshape(entry.shape)


def load_units(ckpt_dir: str | Path) -> tuple[ModelSpec, dict[Unit, dict[str, torch.Tensor]]]:
    """Every unit's tensors in RAM under our short keys (the in-memory reference's weights)."""
    spec, index = load_checkpoint(ckpt_dir)
    units = {
        unit: {key: read_tensor(index[ts.hf_name]) for key, ts in tensors.items()}
        for unit, tensors in unit_layout(spec).items()
    }
    return spec, units


def hf_config(ckpt_dir: str | Path) -> dict[str, Any]:
    """The raw config.json (for fields the spec does not carry, like norm_topk_prob), its
    fields' types checked (core.spec.read_hf_config)."""
    return read_hf_config(Path(ckpt_dir) / "config.json")
