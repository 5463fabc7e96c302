"""Frozen domain specs: the model (`ModelSpec`) and the workload; the machine is
core.hardware's `HardwareSpec`.

Built from plain dicts (resolved hydra YAML) or, for models, from a Hugging Face `config.json`
(core.hf_config). Every validation error names the field and what would fix it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from core.errors import ConfigError, integer_field
from core.spec_fields import MAX_LAYER_PARAMS, check_family_fields, check_span
from core.types import Activation, RoutingSource

GB = 1e9
GIB = 2**30


def _positive(obj: Any, *names: str) -> None:
    where = {"ModelSpec": "model", "HardwareSpec": "hardware"}.get(type(obj).__name__, "spec")
    for name in names:
        value = getattr(obj, name)
        if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
            if any(f.name == name and f.type in ("int", int) for f in fields(obj)):
                integer_field(f"{where}.{name}", value, 1, "set a positive one")
            raise ConfigError(f"{where}.{name} must be a positive number, got {value!r}; set one")


def check_finite(where: str, **values: Any) -> None:
    """Every value a finite number: NaN passes every `< 0` and `> 0` check it meets, and inf
    every `> 0`, so each float a spec holds is checked here first (issue 48)."""
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ConfigError(f"{where}.{key} must be a finite number, got {v!r}; pass one")


FAMILIES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "switch_transformers",
)
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")  # Multi-head Latent Attention, float32 routers
DTYPE_BYTES = (1, 2, 4, 8)  # fp8/int8, bf16/fp16, fp32, fp64
MAX_LAYERS = 100_000  # decoder layers; far above any model, low enough to list them all
MAX_WIDTH = 1 << 24  # a dimension or count of a layer (16M): past any model's (vocab ~256k)
# routed experts per layer: routing holds expert ids as int16 (core.routing), and a larger id
# wrapped to a negative one unseen; past any model's (Switch-C's 2048)
MAX_EXPERTS = 2**15 - 1
# widths whose 0 is none, or derived from the other fields
_WIDTHS_OR_0: tuple[str, ...] = ("dense_ffn_size", "shared_ffn_size", "kv_dim", "qk_head_dim")
_WIDTHS_OR_0 += ("qk_rope_head_dim", "q_lora_rank")  # MLA's
_WIDTHS = (
    "hidden_size",
    "expert_ffn_size",
    "n_experts",
    "top_k",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "vocab_size",
    *_WIDTHS_OR_0,
)
_COUNTS = ("dtype_bytes", "attn_params", "latent_expand_params", "disk_dtype_bytes")
_INT_FIELDS = ("n_layers", *_WIDTHS, *_COUNTS)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # HF model_type: one of FAMILIES
    n_layers: int  # decoder layers
    moe_layers: tuple[int, ...]  # indices of the layers whose FFN is a routed MoE
    hidden_size: int  # d_model
    expert_ffn_size: int  # intermediate size of one routed expert
    n_experts: int  # routed experts per MoE layer
    top_k: int  # experts chosen per token
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # per-head dimension
    vocab_size: int
    dtype_bytes: int = 2  # bytes per weight / KV element (bf16 = 2)
    # the 2-byte compute dtype is float16, not bfloat16 (a real run's executor.dtype=float16, or
    # auto on float16 weights): the real executor's, which the simulator's byte counts ignore
    float16: bool = False
    activation: Activation = Activation.SWIGLU
    dense_ffn_size: int = 0  # intermediate size of the FFN of non-MoE layers
    shared_ffn_size: int = 0  # total intermediate size of shared experts in each MoE layer
    kv_dim: int = 0  # KV elements cached per token per layer; 0 = 2 * n_kv_heads * head_dim
    attn_params: int = (
        0  # attention weights per layer; 0 = derive from the GQA shape (MLA overrides)
    )
    # query/key dims per head a score is a dot product over; 0 = head_dim. MLA's 192 (128 nope +
    # 64 RoPE) differs from its value head_dim 128.
    qk_head_dim: int = 0
    # MLA's kv_b parameters (latent -> each head's keys and values; DeepSeek-V2-Lite 512 x 16 x
    # (128 + 128)). In transformers' op order, which the real executor runs, every step re-expands
    # the whole cached latent through it, so a decode step costs 2 flops per parameter per cached
    # position (`attention_flops`). 0: the cache holds the keys and values themselves.
    latent_expand_params: int = 0
    # MLA (DeepSeek-V2) sizes config.json gives that the fields above do not: RoPE dims of a
    # query/key head (0 = head_dim / 2, DeepSeek-V2-Lite's proportion; its other qk_head_dim -
    # this dims are unrotated, and kv_dim - this the latent's), and the query compression rank
    # (0 = none, as in V2-Lite; the full V2's 1536: q_a_proj, q_a_layernorm, q_b_proj)
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    # Qwen2-MoE's q/k/v projection biases (config.json qkv_bias); only Qwen has any
    qkv_bias: bool = True
    # config.json attention_bias: OLMoE's and Qwen3-MoE's q/k/v/o biases, DeepSeek-V2's q_a, kv_a, o
    attention_bias: bool = False
    # config.json mlp_bias: DeepSeek-V2's dense and shared-expert FFN biases (routed experts none)
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    # bytes per expert weight on disk: 1 for FP8 (DeepSeek-V3's release, a float32 scale per
    # `disk_block` of each matrix); 2 or 4: a width cast at load; 0: the in-memory dtype_bytes
    disk_dtype_bytes: int = 0
    disk_block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        for key in _INT_FIELDS:  # before any arithmetic: "2", 2.5 and true are not counts
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"model {self.name}: {key}={v!r}: must be an integer; set one")
        self._check_bounds()
        if isinstance(self.moe_layers, str | bytes) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.moe_layers
        ):
            raise ConfigError(
                f"model {self.name}: moe_layers must be a list of layer indices, got "
                f"{self.moe_layers!r}; list integers, e.g. [0, 1]"
            )
        _positive(self, "n_layers", "hidden_size", "expert_ffn_size", "n_experts", "top_k")
        _positive(self, "n_heads", "n_kv_heads", "head_dim", "vocab_size", "dtype_bytes")
        for key in ("rms_norm_eps", "rope_theta"):
            check_span(f"model {self.name}: ", key, getattr(self, key), f"model.{key}")
        if self.family not in FAMILIES:
            raise ConfigError(
                f"model {self.name}: family={self.family!r} unknown; valid: {', '.join(FAMILIES)}"
            )
        mla = MLA_FAMILIES
        biased = {"attention_bias": ("olmoe", "qwen3_moe", *mla), "mlp_bias": mla}
        for key, families in biased.items():
            if getattr(self, key) and self.family not in families:
                raise ConfigError(
                    f"model {self.name}: {key} is implemented for {', '.join(families)} only; "
                    f"remove it for {self.family}"
                )
        self._check_dtype()
        self._check_disk()
        for key in (*_WIDTHS_OR_0, "attn_params", "latent_expand_params"):
            if getattr(self, key) < 0:
                raise ConfigError(
                    f"model {self.name}: {key}={getattr(self, key)} is negative; "
                    "set it >= 0 (0 = none, or derived from the other fields)"
                )
        names = [f.name for f in fields(self) if f.name != "float16"]
        check_family_fields(f"model {self.name}: ", self.family, vars(self), names)
        try:
            object.__setattr__(self, "activation", Activation(self.activation))
        except ValueError:
            valid = ", ".join(a.value for a in Activation)
            raise ConfigError(
                f"model {self.name}: activation={self.activation!r} unknown; valid: {valid}"
            ) from None
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model {self.name}: n_heads={self.n_heads} is not a multiple of "
                f"n_kv_heads={self.n_kv_heads} (grouped-query attention shares each KV head "
                "among n_heads / n_kv_heads query heads); set n_kv_heads to a divisor of it"
            )
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model {self.name}: top_k={self.top_k} exceeds n_experts={self.n_experts}; "
                "set model.top_k <= model.n_experts"
            )
        bad = [i for i in self.moe_layers if not 0 <= i < self.n_layers]
        if bad or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ConfigError(
                f"model {self.name}: moe_layers {list(self.moe_layers)} must be distinct "
                f"indices in [0, {self.n_layers}); list each such layer once"
            )
        if len(self.moe_layers) < self.n_layers and self.dense_ffn_size <= 0:
            raise ConfigError(
                f"model {self.name}: layers without experts need dense_ffn_size > 0; set it"
            )

    def _check_disk(self) -> None:
        if self.disk_dtype_bytes not in (0, 1, 2, 4):
            raise ConfigError(
                f"model {self.name}: disk_dtype_bytes={self.disk_dtype_bytes}; set 1 (FP8 experts, "
                "a float32 scale per disk_block), 2 or 4 (saved in 16 or 32 bits, cast at load) "
                "or 0 (the disk holds dtype_bytes)"
            )
        block = self.disk_block
        if not isinstance(block, tuple | list) or not (
            len(block) == 2 and all(type(n) is int and 0 < n <= MAX_WIDTH for n in block)
        ):
            raise ConfigError(
                f"model {self.name}: disk_block={block!r}; pass two positive integers [rows, "
                "columns] (DeepSeek-V3's [128, 128])"
            )
        object.__setattr__(self, "disk_block", tuple(block))

    def _check_dtype(self) -> None:
        if self.float16 and self.dtype_bytes != 2:
            raise ConfigError(
                f"model {self.name}: float16 with dtype_bytes={self.dtype_bytes}; float16 "
                "weights are 2 bytes: set dtype_bytes 2 or float16 false"
            )
        if self.dtype_bytes not in DTYPE_BYTES:
            raise ConfigError(
                f"model {self.name}: dtype_bytes={self.dtype_bytes} is no weight type's size; "
                f"valid: {', '.join(map(str, DTYPE_BYTES))} (fp8, bf16, fp32, fp64)"
            )

    def _check_bounds(self) -> None:
        """Sizes past any model's, which would only exhaust memory further on."""
        for key in _WIDTHS:
            if getattr(self, key) > MAX_WIDTH:
                raise ConfigError(
                    f"model {self.name}: {key}={getattr(self, key)}, wider than any model "
                    f"(at most {MAX_WIDTH}); pass the model's own"
                )
        if self.n_experts > MAX_EXPERTS:
            raise ConfigError(
                f"model {self.name}: n_experts={self.n_experts}, more than routing can name "
                f"(expert ids are int16: at most {MAX_EXPERTS}); pass a smaller n_experts"
            )
        if self.n_layers > MAX_LAYERS:
            raise ConfigError(
                f"model {self.name}: n_layers={self.n_layers}, more than any model has "
                f"(at most {MAX_LAYERS}); pass the model's own"
            )
        for key in ("attn_params", "latent_expand_params"):
            if getattr(self, key) > MAX_LAYER_PARAMS:
                raise ConfigError(
                    f"model {self.name}: {key}={getattr(self, key)}, more weights in a layer "
                    f"than any whole model has (at most {MAX_LAYER_PARAMS}); pass the model's own"
                )

    # ---- sizes -------------------------------------------------------------------------
    @cached_property
    def ffn_matrices(self) -> int:
        """Weight matrices per FFN: gate/up/down for SwiGLU, in/out for ReLU."""
        return 3 if self.activation == Activation.SWIGLU else 2

    @cached_property
    def expert_params(self) -> int:
        return self.ffn_matrices * self.hidden_size * self.expert_ffn_size

    @cached_property
    def expert_bytes(self) -> int:
        return self.expert_params * self.dtype_bytes

    @cached_property
    def expert_disk_bytes(self) -> int:
        """Bytes of one expert as the disk holds and a read moves them: the saved width's, or
        FP8's 1 a weight and a float32 scale a block (real.fp8's grid, the last block cut short)."""
        if self.disk_dtype_bytes != 1:  # as saved, in its own width or the compute dtype's
            return self.expert_params * (self.disk_dtype_bytes or self.dtype_bytes)
        rows, cols = self.disk_block
        h, f = self.hidden_size, self.expert_ffn_size
        up = -(-f // rows) * -(-h // cols)  # gate and up projections [F, H]
        down = -(-h // rows) * -(-f // cols)  # down projection [H, F]
        return self.expert_params * self.disk_dtype_bytes + 4 * (
            (self.ffn_matrices - 1) * up + down
        )

    @cached_property
    def attn_param_count(self) -> int:
        if self.attn_params:
            return self.attn_params + self.hidden_size + self.attn_bias_count
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q_o, k_v, extra = 2 * self.hidden_size * q_dim, 2 * self.hidden_size * kv_dim, 0
        if self.family == "qwen2_moe" and self.qkv_bias:  # q/k/v projection biases
            extra = q_dim + 2 * kv_dim
        elif self.qk_norm:  # QK-norm weights over all heads
            extra = q_dim + kv_dim
        elif self.family == "qwen3_moe":  # QK-norm weights of one head, shared by all
            extra = 2 * self.head_dim
        return q_o + k_v + extra + self.attn_bias_count + self.hidden_size  # + input RMSNorm

    @cached_property
    def attn_bias_count(self) -> int:
        """attention_bias's parameters per layer: OLMoE's and Qwen3-MoE's q/k/v/o biases, or MLA's
        q_a (where q_lora_rank compresses q), kv_a (latent + RoPE key, kv_dim) and o biases."""
        if not self.attention_bias:
            return 0
        if self.mla:
            rope = self.qk_rope_head_dim or self.head_dim // 2  # mla_dims' defaults
            return self.q_lora_rank + (self.kv_dim or 4 * self.head_dim + rope) + self.hidden_size
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim + self.hidden_size

    def ffn_bias_count(self, ffn_size: int) -> int:
        """mlp_bias's parameters of one dense or shared FFN of `ffn_size` columns (up
        projections' [F] each, down projection's [H])."""
        if not self.mlp_bias:
            return 0
        return (self.ffn_matrices - 1) * ffn_size + self.hidden_size

    @cached_property
    def attn_bytes(self) -> int:
        return self.attn_param_count * self.dtype_bytes

    @cached_property
    def gate_bytes(self) -> int:
        """Router (DeepSeek-V3's with its e_score_correction_bias [E]) + post-attention norm of
        one MoE layer."""
        rows = self.hidden_size + (self.family == "deepseek_v3")
        return rows * self.n_experts * self.router_dtype_bytes + self.hidden_size * self.dtype_bytes

    @property
    def router_dtype_bytes(self) -> int:
        """Bytes per router weight: DeepSeek's are float32 at any compute dtype (transformers
        keeps its gate.weight in float32, _keep_in_fp32_modules_strict), others the compute's."""
        return max(4, self.dtype_bytes) if self.mla else self.dtype_bytes

    @cached_property
    def dense_ffn_bytes(self) -> int:
        return (
            self.ffn_matrices * self.hidden_size * self.dense_ffn_size
            + self.ffn_bias_count(self.dense_ffn_size)
            + self.hidden_size
        ) * self.dtype_bytes

    @cached_property
    def shared_ffn_bytes(self) -> int:
        if not self.shared_ffn_size:
            return 0
        # Qwen2-MoE's shared expert has a sigmoid gate [1, H]
        gate = self.hidden_size if self.family == "qwen2_moe" else 0
        return (
            self.ffn_matrices * self.hidden_size * self.shared_ffn_size
            + self.ffn_bias_count(self.shared_ffn_size)
            + gate
        ) * self.dtype_bytes

    @cached_property
    def embed_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @cached_property
    def head_bytes(self) -> int:
        return (self.vocab_size * self.hidden_size + self.hidden_size) * self.dtype_bytes

    @cached_property
    def kv_elems_per_token(self) -> int:
        return self.kv_dim or 2 * self.n_kv_heads * self.head_dim

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes of one token in one layer."""
        return self.kv_elems_per_token * self.dtype_bytes

    @property
    def qk_norm(self) -> bool:
        """OLMoE's QK-norm: RMSNorm over the projected q (and k) of all heads at once."""
        return self.family == "olmoe"

    @property
    def mla(self) -> bool:
        """DeepSeek's Multi-head Latent Attention (V2's and V3's), with their float32 routers."""
        return self.family in MLA_FAMILIES

    @property
    def head_qk_norm(self) -> bool:
        """Qwen3-MoE's QK-norm: RMSNorm over each projected q (and k) head, weights [head_dim]."""
        return self.family == "qwen3_moe"

    def tensor_split_error(self, world: int) -> str | None:
        """Why this model's attention cannot be split over `world` tensor-parallel ranks (a
        clause naming the fields), or None. Query heads split evenly; GQA's key/value heads split
        evenly or, fewer than the ranks, each is held by world / n_kv_heads ranks (vLLM's
        replication); MLA's latent stays whole on every rank."""
        if self.n_heads % world:
            return f"n_heads={self.n_heads} does not split evenly over {world} ranks"
        if not self.kv_dim and self.n_kv_heads % world and world % self.n_kv_heads:
            return (
                f"n_kv_heads={self.n_kv_heads} neither splits evenly over {world} ranks nor "
                "divides them (to replicate each kv head)"
            )
        return None

    def is_moe(self, layer: int) -> bool:
        return layer in self._moe_set

    @cached_property
    def _moe_set(self) -> frozenset[int]:
        return frozenset(self.moe_layers)

    def moe_index(self, layer: int) -> int:
        """Position of `layer` among the MoE layers (the routing trace's layer axis)."""
        return self.moe_layers.index(layer)

    def layer_bytes(self, layer: int) -> int:
        """All weights of one decoder layer."""
        if self.is_moe(layer):
            ffn = self.gate_bytes + self.n_experts * self.expert_bytes + self.shared_ffn_bytes
        else:
            ffn = self.dense_ffn_bytes
        return self.attn_bytes + ffn

    @cached_property
    def total_bytes(self) -> int:
        layers = sum(self.layer_bytes(i) for i in range(self.n_layers))
        return layers + self.embed_bytes + self.head_bytes

    # ---- flops (2 per multiply-add) --------------------------------------------------------
    def attention_flops(self, tokens: int, context: int, *, sequences: int) -> float:
        """`tokens` new tokens of `sequences` sequences, each attending to `context` keys on
        average (a decode step: one token a sequence, context = the cached positions). Given
        always: a decode step's MLA cost grows with its sequences."""
        proj = 2.0 * (self.attn_param_count - self.hidden_size) * tokens
        # QK^T over qk dims, then the weighted sum over value dims, per head and context entry
        qk = self.qk_head_dim or self.head_dim
        scores = 2.0 * self.n_heads * (qk + self.head_dim) * tokens * context
        # MLA: the cached positions' latents are expanded again (the new ones are in `proj`;
        # a prefill's context is its own tokens, so it adds nothing)
        again = max(0, sequences * context - tokens)
        return proj + scores + 2.0 * self.latent_expand_params * again

    def gate_flops(self, tokens: int) -> float:
        return 2.0 * self.hidden_size * self.n_experts * tokens

    def expert_flops(self, tokens: int) -> float:
        return 2.0 * self.expert_params * tokens

    def ffn_flops(self, tokens: int, layer: int) -> float:
        size = self.shared_ffn_size if self.is_moe(layer) else self.dense_ffn_size
        return 2.0 * self.ffn_matrices * self.hidden_size * size * tokens

    def head_flops(self, tokens: int) -> float:
        return 2.0 * self.vocab_size * self.hidden_size * tokens

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "model") -> ModelSpec:
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; valid: {sorted(known)}")
        if "moe_layers" not in d and "n_layers" in d:
            n = d["n_layers"]  # a bad one is refused by __post_init__, naming it
            ok = isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_LAYERS
            d["moe_layers"] = tuple(range(n)) if ok else ()
        missing = [
            f.name
            for f in fields(cls)
            if f.name not in d and f.default is MISSING and f.default_factory is MISSING
        ]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing}; add them (see conf/model/)")
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"{where}: {e}") from None

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face `config.json` (file or checkpoint directory): core.hf_config."""
        from core.hf_config import spec_from_hf_config  # it builds ModelSpecs: imports this

        return spec_from_hf_config(path, name)


# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutingConfig:
    source: RoutingSource = RoutingSource.SYNTHETIC
    trace_dir: str = "../shared/traces"  # folder holding esft-dsv2lite/
    tasks: tuple[str, ...] = ()  # ESFT tasks to draw sequences from (empty = all)
    exclude_tasks: tuple[str, ...] = ()  # tasks held out (e.g. the prefetcher's training split)
    skew: float = 1.0  # synthetic: Zipf exponent of per-layer expert popularity
    layer_corr: float = 0.5  # synthetic: probability a token follows the layer transition table
    reuse: float = 0.25  # synthetic: probability a slot repeats the previous token's draw there
    hot_experts: int = 0  # synthetic: if > 0, these many experts are boosted to `hot_share`
    hot_share: float = 0.0  # synthetic: share of selections the hot experts take

    def __post_init__(self) -> None:
        if self.source not in set(RoutingSource):
            valid = ", ".join(str(x) for x in RoutingSource)
            raise ConfigError(f"workload.routing.source={self.source!r} unknown; valid: {valid}")
        object.__setattr__(self, "source", RoutingSource(self.source))
        for f_ in ("tasks", "exclude_tasks"):  # one task given as a string is a list of one
            v = getattr(self, f_)
            object.__setattr__(self, f_, (v,) if isinstance(v, str) else tuple(v))
            named = [t for t in getattr(self, f_) if not isinstance(t, str)]  # [[law]], [{a: 1}]
            if named:
                raise ConfigError(
                    f"workload.routing.{f_}: {named[0]} is not a task's name; pass "
                    f"workload.routing.{f_}=[law,intent]"
                )
            twice = sorted({t for t in getattr(self, f_) if getattr(self, f_).count(t) > 1})
            if twice:  # the same tokens either way, but a sweep's run dir of its own
                raise ConfigError(
                    f"workload.routing.{f_}: {', '.join(map(str, twice))} given twice; name each "
                    "task once"
                )
        for f_ in ("skew", "layer_corr", "reuse", "hot_share"):  # NaN and inf too
            check_span("", f_, getattr(self, f_), f"workload.routing.{f_}")
        check_finite("workload.routing", hot_experts=self.hot_experts)
        integer_field("workload.routing.hot_experts", self.hot_experts, 0, "pass 0 (none) or more")
        if self.hot_experts and not self.hot_share > 0:
            raise ConfigError(
                f"workload.routing.hot_experts={self.hot_experts} needs hot_share > 0 (the share "
                "of selections they take; at 0 they would never be chosen): set both, or neither"
            )
        if self.hot_share > 0 and not self.hot_experts:
            raise ConfigError(
                f"workload.routing.hot_share={self.hot_share} needs hot_experts > 0 (how many "
                "experts take that share; with none the share goes nowhere): set both, or neither"
            )


# a sequence's tokens (prompt + generated): past the longest context any model is trained for
# (10M); a count of 1e12 otherwise ran until the machine's memory ran out
MAX_POSITIONS = 1 << 24


@dataclass(frozen=True)
class Workload:
    batch_size: int  # sequences per batch
    n_batches: int  # batches per group (Klotski's / FlexGen's n)
    prompt_len: int  # prompt tokens per sequence
    gen_len: int  # generated tokens per sequence (step 0 = prefill emits the first)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        for f_ in ("batch_size", "n_batches", "prompt_len", "gen_len"):
            integer_field(f"workload.{f_}", getattr(self, f_), 1, f"pass workload.{f_}=1 or more")
        if self.prompt_len + self.gen_len > MAX_POSITIONS:
            raise ConfigError(
                f"workload.prompt_len={self.prompt_len} + gen_len={self.gen_len} tokens per "
                f"sequence exceed {MAX_POSITIONS}, past any model's context; lower them"
            )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, numbers.Integral)
            or not 0 <= self.seed < 2**64  # the real executor's torch generators take 64 bits
        ):
            fix = "a smaller one" if isinstance(self.seed, int) and self.seed > 0 else "e.g. 0"
            raise ConfigError(
                f"workload.seed must be an integer in [0, 2**64), got {self.seed!r}; pass {fix}"
            )

    @property
    def n_sequences(self) -> int:
        return self.batch_size * self.n_batches

    @property
    def n_steps(self) -> int:
        """Forward passes: the prefill, then one decode step per further generated token."""
        return self.gen_len

    @property
    def seq_positions(self) -> int:
        """Token positions that pass through the model (the last generated token is not fed)."""
        return self.prompt_len + self.gen_len - 1

    @property
    def tokens_generated(self) -> int:
        return self.n_sequences * self.gen_len

    def step_tokens(self, step: int) -> int:
        """Tokens per sequence processed at `step`."""
        return self.prompt_len if step == 0 else 1

    def step_context(self, step: int) -> int:
        """Attention context length (keys per query) at `step`."""
        return self.prompt_len if step == 0 else self.prompt_len + step

    def with_(self, **kw: Any) -> Workload:
        from dataclasses import replace

        return replace(self, **kw)
