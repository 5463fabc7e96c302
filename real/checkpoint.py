"""Hugging Face-layout checkpoints for the real executor: tensor layout, model specs and loading.

`unit_layout(spec)` is the one table of which tensors (HF name, shape) make up each unit a
schedule moves (a layer's attention, its gate, one expert, ...). `real.checkpoint_write` writes
seeded random weights in that layout; `load_checkpoint` validates a directory and indexes its
tensors (file, dtype, shape, byte offset; each shard's header checked in real.shards).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from core.errors import ConfigError, did_you_mean, quoted
from core.files import no_file_there, read_small, unchanged_since, unwritten_state
from core.hf_config import (
    HFConfig,
    fp8_block,
    hf_dtype_name,
    hf_runtime,
    mla_dims,
    read_hf_config,
    spec_mla_fields,
)
from core.hf_config.to_spec import RUN_DTYPE_ALIASES
from core.spec import MAX_LAYERS, ModelSpec
from core.types import Tensor
from core.yaml_size import UniqueKeyLoader, check_yaml_size, yaml_problem
from real.empty_shared import empty_shared
from real.fp8 import attach_scales, read_weight
from real.fused_experts import unfuse_experts
from real.hf_names import HFNames, hf_names
from real.shards import (  # noqa: F401 (the file names: checkpoint's too)
    AT_ODDS,
    INDEX_FILE,
    SINGLE_FILE,
    TensorEntry,
    index_files,
    index_metadata,
    read_header,
    read_index,
    read_tensor,
    weight_files,
)

log = logging.getLogger(__name__)

CONF_MODEL_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"

_TORCH_DTYPE = {4: torch.float32, 2: torch.bfloat16}
# the dtypes a checkpoint may be saved in; each runs in any of them (`compute_dtype`)
SAVED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a run's dtype: "auto" (or None) computes in the saved dtype, as transformers' dtype="auto"
RUN_DTYPES = ("auto", "float32", "bfloat16", "float16")


def torch_dtype(spec: ModelSpec) -> torch.dtype:
    """The compute dtype of a spec: 4 bytes = float32, 2 bytes = bfloat16 (float16 where the
    spec says so)."""
    if spec.float16:
        return torch.float16
    try:
        return _TORCH_DTYPE[spec.dtype_bytes]
    except KeyError:
        raise ConfigError(
            f"model {spec.name}: dtype_bytes={spec.dtype_bytes} has no real-executor dtype; "
            "use 4 (float32) or 2 (bfloat16)"
        ) from None


def weight_dtype(spec: ModelSpec, key: str) -> torch.dtype:
    """The dtype a unit's tensor `key` runs in: the compute dtype, but DeepSeek's router weight
    (and V3's correction bias) in float32 (`ModelSpec.router_dtype_bytes`), as transformers'
    from_pretrained keeps it at any dtype, so float32-saved router weights are not rounded."""
    if key in ("router", "router_bias") and spec.router_dtype_bytes == 4:
        return torch.float32
    return torch_dtype(spec)


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


def _ffn(
    template: str, mats: Mapping[str, str], i: int, h: int, f: int, bias: bool = False, **kw: int
) -> dict[str, TensorSpec]:
    """One FFN's matrices: up-projections [F, H] (w1, w3, wi), down-projection [H, F] (w2, wo);
    with `bias` (DeepSeek-V2's mlp_bias), each one's bias too (`w1_bias` [F], `w2_bias` [H])."""
    out = {}
    for key, hf in mats.items():
        shape = (h, f) if key in ("w2", "wo") else (f, h)
        out[key] = TensorSpec(template.format(i=i, w=hf, **kw), shape)
        if bias:
            name = template.removesuffix(".weight") + ".bias"
            out[key + "_bias"] = TensorSpec(name.format(i=i, w=hf, **kw), shape[:1])
    return out


def unit_layout(spec: ModelSpec) -> dict[Unit, dict[str, TensorSpec]]:
    """Every unit of the model -> its tensors (our short key -> HF name and shape), in file order.

    Keys: attention `input_norm q k v o` (+ `q_bias k_bias v_bias` for Qwen with qkv_bias,
    `q_norm k_norm` for OLMoE and Qwen3-MoE (one head's), and their `q_bias k_bias v_bias
    o_bias` with attention_bias), or
    for DeepSeek-V2's MLA `input_norm q kv_a kv_a_norm kv_b o`
    (HF's q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; sizes from `mla_dims`),
    with `q_a q_a_norm q_b` (q_a_proj, q_a_layernorm, q_b_proj) in place of `q` where
    config.json's q_lora_rank compresses the query (+ `q_a_bias kv_a_bias o_bias` with
    attention_bias); gate
    `post_norm router`; expert `w1 w3 w2` (SwiGLU) or `wi wo` (ReLU); FFN `w1 w3 w2`/`wi wo` plus
    `post_norm` for a dense layer, `shared_gate` for Qwen's shared expert, `w1_bias` etc. with
    mlp_bias; embed `embed`; head
    `norm lm_head`.
    """
    n = hf_names(spec.family)
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
            ffn = _ffn(n.dense, n.dense_mats, i, h, spec.dense_ffn_size, spec.mlp_bias)
            out[Unit(Tensor.FFN, i)] = post_norm | ffn
            continue
        router = {"router": TensorSpec(n.router.format(i=i), (spec.n_experts, h))}
        if n.router_bias:  # DeepSeek-V3's e_score_correction_bias
            router["router_bias"] = TensorSpec(n.router_bias.format(i=i), (spec.n_experts,))
        out[Unit(Tensor.GATE, i)] = post_norm | router
        for e in range(spec.n_experts):
            out[Unit(Tensor.EXPERT, i, e)] = _ffn(
                n.expert, n.expert_mats, i, h, spec.expert_ffn_size, e=e
            )
        if spec.shared_ffn_size:
            if not n.shared:
                raise ConfigError(
                    f"model {spec.name}: family {spec.family} has no shared experts; "
                    "set shared_ffn_size: 0"
                )
            shared = _ffn(n.shared, n.dense_mats, i, h, spec.shared_ffn_size, spec.mlp_bias)
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
    if spec.mla:
        m = mla_dims(spec)
        qk = m["qk_nope_head_dim"] + m["qk_rope_head_dim"]
        rank, q_rank = m["kv_lora_rank"], m["q_lora_rank"]
        q: dict[str, tuple[int, ...]] = (
            {"q_a": (q_rank, h), "q_a_norm": (q_rank,), "q_b": (heads * qk, q_rank)}
            if q_rank
            else {"q": (heads * qk, h)}
        )
        mla = {
            "input_norm": (h,),
            **q,
            "kv_a": (rank + m["qk_rope_head_dim"], h),
            "kv_a_norm": (rank,),
            "kv_b": (heads * (m["qk_nope_head_dim"] + m["v_head_dim"]), rank),
            "o": (h, heads * m["v_head_dim"]),
        }
        biased = ("q_a", "kv_a", "o") if spec.attention_bias else ()
        return mla | {k + "_bias": mla[k][:1] for k in biased if k in mla}
    q_dim, kv_dim = heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes = {"input_norm": (h,), "q": (q_dim, h), "k": (kv_dim, h), "v": (kv_dim, h)}
    shapes["o"] = (h, q_dim)
    if spec.attention_bias or (spec.qkv_bias and spec.family == "qwen2_moe"):  # Qwen's: no o
        shapes |= {"q_bias": (q_dim,), "k_bias": (kv_dim,), "v_bias": (kv_dim,), "o_bias": (h,)}
    if spec.head_qk_norm:  # one weight of a head, shared by all
        return shapes | {"q_norm": (spec.head_dim,), "k_norm": (spec.head_dim,)}
    return shapes | {"q_norm": (q_dim,), "k_norm": (kv_dim,)}


# ---- model configs with overrides ---------------------------------------------------------


def _model_yaml(path: Path, arg: str) -> Any:
    """A model YAML file's data; a ConfigError naming `arg` where it is too large, not text, not
    YAML, or nests or expands past any config (a user's file: the checks a run's group has)."""
    fix = "pass a model YAML file or a conf/model name"
    try:
        text = read_small(path, fix=fix).decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"{arg}: not UTF-8 text (byte {e.start}); {fix}") from None
    except OSError as e:
        raise ConfigError(f"{arg}: cannot read it ({e.strerror or e}); {fix}") from None
    check_yaml_size(text, arg, fix)
    try:
        d = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except yaml.YAMLError as e:  # a key given twice (the later won without a word)
        problem, line = yaml_problem(e, text)
        raise ConfigError(f"{arg}:{line or ''}: not valid YAML ({problem}); {fix}") from None
    if not isinstance(d, dict):  # ModelSpec.from_dict's TypeError, an internal error
        what = "nothing" if d is None else "a list" if isinstance(d, list) else "a single value"
        raise ConfigError(f"{arg}: the file holds {what}, not a model's fields; {fix}")
    return d


def reduced_spec(model: str, **overrides: Any) -> ModelSpec:
    """`conf/model/<model>.yaml` (or `model`, a path to a .yaml file) with field overrides,
    keeping derived fields consistent.

    Unless given: head_dim = hidden_size // n_heads when either changes; n_kv_heads follows n_heads
    where it equalled it; moe_layers keep the family's pattern for a new n_layers; shared and
    Switch's dense FFN scale with expert_ffn_size; DeepSeek's MLA kv_dim/attn_params/qk_head_dim
    follow head_dim.
    """
    is_file = model.endswith((".yaml", ".yml"))
    path = Path(model).expanduser() if is_file else CONF_MODEL_DIR / f"{model}.yaml"
    if not path.is_file() and is_file:
        raise ConfigError(
            f"model={model}: {no_file_there(path)}; pass a model YAML file or a conf/model name"
        )
    if not path.is_file():
        have = ", ".join(sorted(p.stem for p in CONF_MODEL_DIR.glob("*.yaml")))
        raise ConfigError(f"model={model}: no conf/model/{model}.yaml; valid: {have}, or FILE.yaml")
    base = ModelSpec.from_dict(_model_yaml(path, f"model={model}"), where=str(path))
    d = {k: v for k, v in vars(base).items()} | dict(overrides)
    given = set(overrides)
    if {"hidden_size", "n_heads"} & given and "head_dim" not in given:
        _derive_head_dim(d, base.name)
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
    derive_mla = base.mla and not mla_fields & given
    if derive_mla:  # the MLA sizes of the new head_dim (and of qk_rope_head_dim, q_lora_rank)
        d |= dict.fromkeys(mla_fields, 0)
        if "qk_rope_head_dim" not in given:
            d["qk_rope_head_dim"] = 0
    spec = ModelSpec.from_dict(d, where=f"{path} with overrides {dict(overrides)}")
    if derive_mla:
        spec = replace(spec, **spec_mla_fields(spec))
    return spec


def _derive_head_dim(d: dict[str, Any], name: str) -> None:
    """head_dim = hidden_size // n_heads in `d`, where both are positive (ModelSpec names a
    size that is not); a ConfigError naming the two where the quotient is 0 (hidden_size=1 was
    named as a head_dim the user never set, n_heads=0 a division by zero)."""
    hidden, heads = d["hidden_size"], d["n_heads"]
    if not (isinstance(hidden, int) and isinstance(heads, int) and hidden > 0 and heads > 0):
        return
    if hidden < heads:
        raise ConfigError(
            f"model {name}: hidden_size={hidden} with n_heads={heads} leaves head_dim = "
            "hidden_size // n_heads = 0; raise hidden_size, lower n_heads or pass head_dim"
        )
    d["head_dim"] = hidden // heads


def _moe_pattern(base: ModelSpec, n: int) -> tuple[int, ...]:
    """`base`'s pattern of MoE layers over `n` layers; `n` past MAX_LAYERS refused before the
    list is made (n_layers=1e9 filled the RAM until the kernel killed the command)."""
    if n > MAX_LAYERS:
        raise ConfigError(
            f"model {base.name}: n_layers={n}, over any model's; pass n_layers <= {MAX_LAYERS}"
        )
    dense = [i for i in range(base.n_layers) if not base.is_moe(i)]
    if base.mla:  # its first dense layers, the last layer MoE at least
        return tuple(range(min(min(base.moe_layers), n - 1), n))
    if base.family == "switch_transformers":
        step = base.moe_layers[1] - base.moe_layers[0] if len(base.moe_layers) > 1 else 2
        return tuple(i for i in range(n) if i % step == step - 1)
    return tuple(i for i in range(n) if i not in dense)


_LAYER = re.compile(r"(?:model|encoder|decoder)\.(?:layers|block)\.(\d+)\.")  # a decoder layer's


# ---- loading ------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _warn_cut(config: str, mtime_ns: int, n_layers: int, weights_layers: int) -> None:
    """The warning for a checkpoint cut by its config.json, once per config file a process
    loads (a run loads its checkpoint to resolve the model, then to run it)."""
    log.warning(
        "%s: num_hidden_layers=%d of the weights' %d layers: the model runs its first %d",
        config,
        n_layers,
        weights_layers,
        n_layers,
    )


def load_checkpoint(
    ckpt_dir: str | Path, dtype: str | None = None
) -> tuple[ModelSpec, dict[str, TensorEntry]]:
    """Validate a checkpoint directory; return its spec (dtype_bytes: `compute_dtype(dtype)`'s)
    and HF tensor name -> where its bytes are (in the saved dtype).

    Raises a one-line ConfigError naming the missing directory, config.json or shard, a truncated
    file, a config.json field the real model does not run (hf_runtime's refusals, before its
    tensors are found unread), a tensor whose shape/dtype disagrees with config.json, or a
    checkpoint another process writes meanwhile (`core.files.unwritten_state`).
    """
    before = unwritten_state(Path(ckpt_dir), "checkpoint")
    loaded = _load_checkpoint(Path(ckpt_dir), dtype)
    unchanged_since(Path(ckpt_dir), "checkpoint", before)
    return loaded


def _load_checkpoint(d: Path, dtype: str | None) -> tuple[ModelSpec, dict[str, TensorEntry]]:
    if d.exists() and not d.is_dir():  # config.json or a shard named itself
        raise ConfigError(f"{d}: a file, not a checkpoint directory; pass the folder holding it")
    if not d.is_dir():
        raise ConfigError(
            f"{d}: no such checkpoint directory; "
            "write one with python -m experiments.make_checkpoint"
        )
    cfg = hf_config(d)
    saved = hf_dtype_name(cfg)  # before the spec's own list, which holds dtypes only simulated
    if saved not in SAVED_DTYPES:
        key = "dtype" if cfg.get("dtype", None) is not None else "torch_dtype"
        raise ConfigError(
            f"{d / 'config.json'}: {key} {saved or repr(saved)} is not supported by the real "
            f"executor (weights saved in {' or '.join(SAVED_DTYPES)}); convert them to bfloat16"
        )
    spec = ModelSpec.from_hf_config(d)
    files = weight_files(d)
    index: dict[str, TensorEntry] = {}
    for f in files:
        header = read_header(d / f)
        twice = sorted(header.keys() & index.keys())
        if twice:  # transformers loads every shard whole: which copy it keeps is load order
            raise ConfigError(
                f"{d}: tensor {quoted(twice[0])} is in both {index[twice[0]].file.name} and {f} "
                f"({len(twice)} such); a checkpoint holds each tensor once: re-copy it"
            )
        index |= header
    listed = list(index)  # the checkpoint's tensors: those its index names, or the file's
    if (d / INDEX_FILE).is_file():  # each name the index maps to a shard is in that shard
        wmap = read_index(d / INDEX_FILE)
        lost = [n for n, f in wmap.items() if n not in index or index[n].file.name != f]
        if lost:
            raise ConfigError(
                f"{d / INDEX_FILE}: weight_map names {lost[0]!r} in {quoted(wmap[lost[0]])}, "
                f"which does not hold it ({len(lost)} such); rewrite or re-copy the index"
            )
        # a stale index: which of the shards' tensors the weights are is unsaid; a cut's index
        # (bench.real's linked cut) leaves out the layers past config.json's, which it may
        past = {n for n in index if (m := _LAYER.match(n)) and int(m.group(1)) >= spec.n_layers}
        unlisted = sorted(index.keys() - wmap.keys() - past)
        if unlisted:
            raise ConfigError(
                f"{d / INDEX_FILE}: weight_map lacks tensor {unlisted[0]!r}, which "
                f"{index[unlisted[0]].file.name} holds ({len(unlisted)} such); rewrite or "
                "re-copy the index"
            )
        listed = index_metadata(d / INDEX_FILE, wmap, index)  # its total_size, if stale
    layers = {int(m.group(1)) for n in listed if (m := _LAYER.match(n))}
    if layers and max(layers) >= spec.n_layers:  # a cut by config.json, as transformers allows
        cfg_file = d / "config.json"
        _warn_cut(str(cfg_file), cfg_file.stat().st_mtime_ns, spec.n_layers, max(layers) + 1)
    listed = attach_scales(index, listed, fp8_block(cfg))  # FP8: each weight with its scales
    names = hf_names(spec.family)
    if spec.family != "switch_transformers":  # transformers' modules' own names of experts
        listed = unfuse_experts(d, spec, names, index, listed)
    stored = SAVED_DTYPES[saved]
    embed = index.get(names.embed)  # no dtype in config.json: the weights', as transformers'
    named = cfg.get("dtype", None) or cfg.get("torch_dtype", None)
    if not named and embed is not None and embed.dtype in SAVED_DTYPES.values():
        stored = embed.dtype
    if cfg.get("tie_word_embeddings"):
        _tie_head(index, names)
    hf_runtime(cfg, spec)  # a field not run (attention_bias, ...) named before its tensors
    if spec.family != "switch_transformers":  # moepipe's Switch reads its encoder alone
        check_all_read(d, spec, cfg, listed, index)
    _check_shapes(d, spec, cfg, index, ", ".join(files), stored)
    return _computed_in(spec, stored, dtype), index


def _computed_in(spec: ModelSpec, stored: torch.dtype, dtype: str | None) -> ModelSpec:
    """`spec` run in `compute_dtype(stored, dtype)`: its dtype_bytes the compute dtype's, and
    where that is not the saved one its disk_dtype_bytes the saved width (the store reads the
    saved bytes and casts them into its host buffer), unless FP8's already."""
    compute = compute_dtype(stored, dtype)
    disk = spec.disk_dtype_bytes or (stored.itemsize if stored != compute else 0)
    run = dict(dtype_bytes=compute.itemsize, float16=compute == torch.float16)
    return replace(spec, disk_dtype_bytes=disk, **run)


def compute_dtype(stored: torch.dtype, dtype: str | None) -> torch.dtype:
    """The dtype a run computes in: `dtype` (float32, bfloat16 or float16, the weights cast to
    it as they load, as transformers' from_pretrained(dtype=...)), or with "auto" (None) the
    saved one (docs/commands.md, "Saved and compute dtypes")."""
    if dtype in (None, "auto"):
        return stored
    return SAVED_DTYPES[run_dtype(dtype)]


def run_dtype(dtype: str | None) -> str:
    """executor.dtype checked (every command that runs a checkpoint takes it, before it runs):
    auto (None), float32, bfloat16, float16 or an alias (bf16, half); else one line naming it."""
    dtype = "auto" if dtype is None else RUN_DTYPE_ALIASES.get(str(dtype), dtype)
    if dtype not in RUN_DTYPES:
        near = did_you_mean(dtype, RUN_DTYPES)
        raise ConfigError(
            f"executor.dtype={dtype or repr(dtype)}: not a compute dtype; {near}pass one of "
            f"{', '.join(RUN_DTYPES)}"
        )
    return dtype


def _tie_head(index: dict[str, TensorEntry], names: HFNames) -> None:
    """tie_word_embeddings as transformers' from_pretrained applies it: where the checkpoint
    saves one of the embedding and the LM head, the other is that tensor; where it saves both,
    each runs its own (transformers ties them only where their values are equal, and runs a
    saved head that differs, warning). Switch's tied head runs without T5's rescaling before
    it (moepipe's Switch is a documented substitute)."""
    if names.lm_head not in index and names.embed in index:
        index[names.lm_head] = index[names.embed]
    elif names.embed not in index and names.lm_head in index:
        index[names.embed] = index[names.lm_head]


def _check_shapes(
    d: Path,
    spec: ModelSpec,
    cfg: Mapping[str, Any],
    index: dict[str, TensorEntry],
    where: str,
    dtype: torch.dtype,
) -> None:
    """Every tensor the model reads is in the checkpoint, of config.json's shape and (saved)
    dtype, or float32 where it runs in float32 at any dtype (DeepSeek's router weight and
    V3's correction bias, which its bfloat16 releases save in float32 and transformers keeps)."""
    for tensors in unit_layout(spec).values():
        for key, ts in tensors.items():
            e = index.get(ts.hf_name)
            if e is None:
                raise ConfigError(f"{d}: tensor {quoted(ts.hf_name)} is not in {where}; {AT_ODDS}")
            if e.shape != ts.shape:
                raise ConfigError(
                    f"{e.file}: tensor {quoted(ts.hf_name)} has shape {list(e.shape)}, config.json "
                    f"expects {list(ts.shape)}; {AT_ODDS}"
                )
            kept = e.dtype == torch.float32 == weight_dtype(spec, key)
            if e.dtype != dtype and not kept and e.scale is None:  # FP8: dequantized to dtype
                said = (
                    f"config.json says {dtype}; re-save the tensor in {dtype}"
                    if cfg.get("dtype", None) or cfg.get("torch_dtype", None)
                    else f"config.json names no dtype (read as {dtype}): add "
                    f'"torch_dtype": "{str(e.dtype).removeprefix("torch.")}" to it'
                )
                raise ConfigError(f"{e.file}: tensor {quoted(ts.hf_name)} is {e.dtype}, {said}")


# a checkpoint's tensors that hold what config.json says a layer's FFN is: its routed experts
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.")
# the config.json fields that decide which layers have experts, per family
_LAYER_KIND_FIELDS = {
    "qwen2_moe": "decoder_sparse_step and mlp_only_layers",
    "qwen3_moe": "decoder_sparse_step and mlp_only_layers",
    "deepseek_v2": "first_k_dense_replace and moe_layer_freq",
    "deepseek_v3": "first_k_dense_replace",
}
# why a family's layer kinds may differ from a checkpoint another program wrote
_LAYER_KIND_NOTE = {
    "deepseek_v2": " (transformers' DeepseekV2 ignores moe_layer_freq)",
    "deepseek_v3": (
        " (moe_layer_freq is ignored, as transformers' DeepseekV3 does; DeepSeek's "
        "modeling_deepseek.py leaves layers between dense)"
    ),
}
# a layer's dense FFN projection (DeepSeek's and Qwen's names)
_DENSE = re.compile(r"model\.layers\.(\d+)\.mlp\.(?:gate|up|down)_proj\.weight$")


def check_all_read(
    d: Path, spec: ModelSpec, cfg: HFConfig, listed: list[str], index: Mapping[str, TensorEntry]
) -> None:
    """Every tensor of the layers the model runs (and outside them) is one the model reads: a
    tensor left over means config.json describes another model than the weights (a field
    moepipe does not model, or another layer layout), which transformers would run and moepipe
    would silently not. A layer that holds experts where config.json makes it dense names the
    fields that decide it. Layers past a config.json cut, RoPE's saved inverse frequencies
    (derived, not weights) and a shared expert of width 0 (`empty_shared`) are left out."""
    read = {ts.hf_name for tensors in unit_layout(spec).values() for ts in tensors.values()}
    read |= empty_shared(spec, listed, index)
    if cfg.get("tie_word_embeddings"):
        read.add(hf_names(spec.family).lm_head)
    unused = []
    for name in listed:
        m = _LAYER.match(name)
        if name in read or name.endswith("rotary_emb.inv_freq"):
            continue
        if m and int(m.group(1)) >= spec.n_layers:
            continue
        unused.append(name)
    if not unused:
        return
    moe = set(spec.moe_layers)
    dense_with_experts = sorted({int(m.group(1)) for n in unused if (m := _EXPERTS.match(n))} - moe)
    moe_with_dense = sorted({int(m.group(1)) for n in unused if (m := _DENSE.match(n))} & moe)
    if dense_with_experts or moe_with_dense:
        fields = _LAYER_KIND_FIELDS.get(spec.family, "config.json")
        held = "their experts" if dense_with_experts else "a dense FFN"
        which = "dense" if dense_with_experts else "MoE"
        raise ConfigError(
            f"{d / 'config.json'}: layer(s) {dense_with_experts or moe_with_dense} are {which} "
            f"by {fields}, but the checkpoint holds {held}{_LAYER_KIND_NOTE.get(spec.family, '')}; "
            "set the fields to the weights' layout"
        )
    raise ConfigError(
        f"{d}: tensor {quoted(unused[0])} ({len(unused)} such) is in the checkpoint but "
        "config.json gives the model nothing that reads it: a field moepipe does not model, or "
        "a config.json of another model; fix config.json or remove the tensors"
    )


def load_units(
    ckpt_dir: str | Path, dtype: str | None = None
) -> tuple[ModelSpec, dict[Unit, dict[str, torch.Tensor]]]:
    """Every unit's tensors in RAM under our short keys (the in-memory reference's weights), in
    the run's compute dtype (`load_checkpoint`'s `dtype`)."""
    spec, index = load_checkpoint(ckpt_dir, dtype)
    units = {
        unit: {
            key: read_weight(index[ts.hf_name]).to(weight_dtype(spec, key))
            for key, ts in tensors.items()
        }
        for unit, tensors in unit_layout(spec).items()
    }
    return spec, units


def hf_config(ckpt_dir: str | Path) -> HFConfig:
    """A checkpoint's config.json (for fields the spec does not carry, like norm_topk_prob), its
    fields read through core.hf_config's checked accessor."""
    return read_hf_config(Path(ckpt_dir) / "config.json")
