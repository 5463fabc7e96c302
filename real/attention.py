"""RoPE as config.json sets it (plain, `linear`, `dynamic`, `yarn`, `llama3`, `longrope` or
`proportional`) and the
attention variants `Model` runs, as pure functions of explicit weights: grouped-query attention
(with OLMoE's QK-norm and clip_qkv, Qwen3-MoE's QK-norm per head) and DeepSeek-V2's Multi-head
Latent Attention.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from core.hf_config import HFConfig, mla_dims, rope_theta_of
from core.hf_config.rope_keys import yarn_betas
from core.spec import MLA_FAMILIES, ModelSpec

# Shape legend: B batch, S tokens per sequence this step, H hidden, Hq query heads, Hkv
# key/value heads, D head dim. MLA (DeepSeek-V2): C latent (kv_lora_rank), R RoPE part of a
# query/key head (qk_rope), Dn its other part (qk_nope), Dv value head dim.
#
# DeepSeek-V2 runs Multi-head Latent Attention as transformers' DeepseekV2Attention does (with q
# compressed where config.json sets q_lora_rank), caching the normalised latent and the RoPE'd
# shared key (spec.kv_dim = C + R per token) and up-projecting them with kv_b_proj at every step.

Weights = Mapping[str, torch.Tensor]  # one unit's tensors by short key


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotary_dim(spec: ModelSpec) -> int:
    """How many dims of a query/key head RoPE rotates: R for DeepSeek-V2's MLA, else D."""
    return mla_dims(spec)["qk_rope_head_dim"] if spec.mla else spec.head_dim


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for stretching the context `scale` times (transformers'
    yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# the rope_type values run: every key of transformers 5.24's ROPE_INIT_FUNCTIONS, and default
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "proportional")


@dataclass(frozen=True)
class DynamicNTK:
    """transformers' `dynamic` RoPE scaling (NTK-aware): a step whose sequence, cache included, is
    longer than max_position_embeddings raises the RoPE base with that length."""

    theta: float  # the RoPE base up to max_positions
    dim: int  # rotated dims of a head
    factor: float  # config.json's rope factor
    max_positions: int  # config.json's max_position_embeddings

    def base(self, seq_len: int | torch.Tensor) -> Any:
        """The base at `seq_len` >= max_positions, in the arithmetic transformers' types give it:
        Python floats at init (seq_len an int), float32 tensors in the forward (a tensor)."""
        stretch = self.factor * seq_len / self.max_positions - (self.factor - 1)
        return self.theta * stretch ** (self.dim / (self.dim - 2))

    def inv_freq(self, seq_len: int) -> torch.Tensor:
        """[dim / 2] float32 for a step whose sequence is `seq_len` long, as transformers'
        _compute_dynamic_ntk_parameters computes it in the forward, op for op."""
        base = self.base(torch.tensor(seq_len, dtype=torch.int64))  # 0-dim float32
        return 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))


@dataclass(frozen=True, eq=False)
class Rope:
    """RoPE as config.json sets it (one of `ROPE_TYPES`), computed in the same float32 ops as
    transformers' rotary embedding (modeling_rope_utils), so the bits agree."""

    inv_freq: torch.Tensor  # [rotary_dim / 2] float32, radians per position of each dim pair
    # Multiplies cos and sin (YaRN's mscale ratio, longrope's attention_factor); times 1.0 is
    # exact, so plain RoPE keeps its bits
    attention_factor: float = 1.0
    # DeepSeek-V2 multiplies its softmax scale by this squared (transformers' yarn_apply_mscale)
    softmax_mscale: float = 1.0
    # `dynamic`: the frequencies of a step past max_position_embeddings; None: inv_freq always
    ntk: DynamicNTK | None = None
    # `longrope`: (original_max_position_embeddings, the long factors' frequencies), which a step
    # whose sequence is longer than that runs; None: inv_freq (the short factors') always
    long: tuple[int, torch.Tensor] | None = None
    # frequencies per (device, sequence length past max_position_embeddings or 0), copied once:
    # an attention op on a CUDA stream must not wait on a blocking host->device copy of the same
    # 32 floats at every layer
    _on: dict[tuple[torch.device, int], torch.Tensor] = field(
        default_factory=dict, repr=False, compare=False
    )

    def inv_freq_on(self, device: torch.device, positions: torch.Tensor) -> torch.Tensor:
        """The frequencies [dims / 2] on `device` of a step at `positions` [S] (consecutive).

        Dynamic NTK takes the step's sequence length, its last position + 1, as transformers'
        rotary embedding does in each forward (max(position_ids) + 1). That is transformers'
        result in every step of a generation whose earlier steps were no longer, the case of a
        model's first generate and of any whose prompt fits max_position_embeddings; a
        transformers model keeps its longest length seen until a sequence shorter than
        max_position_embeddings resets it, which moepipe does not imitate. Longrope takes the
        long factors' in a step whose sequence is longer than original_max_position_embeddings,
        the short ones' otherwise, as transformers' longrope_frequency_update does in each
        forward (the cache keeps the keys rotated as their step rotated them)."""
        end = int(positions[-1]) + 1
        seq_len = 0  # 0: inv_freq; > 0: dynamic NTK's at that length; -1: longrope's long ones
        if self.ntk is not None and end > self.ntk.max_positions:
            seq_len = end
        elif self.long is not None and end > self.long[0]:
            seq_len = -1
        key = (device, seq_len)
        if key not in self._on:
            self._on[key] = self._freqs(seq_len).to(device)
        return self._on[key]

    def _freqs(self, seq_len: int) -> torch.Tensor:
        if seq_len > 0 and self.ntk is not None:
            return self.ntk.inv_freq(seq_len)
        if seq_len < 0 and self.long is not None:
            return self.long[1]
        return self.inv_freq

    @classmethod
    def plain(cls, dim: int, theta: float) -> Rope:
        """Unscaled RoPE of `dim` rotated dims with base `theta`."""
        return cls(1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    @classmethod
    def from_config(
        cls, cfg: HFConfig | Mapping[str, Any], spec: ModelSpec, where: str = ""
    ) -> Rope:
        """The RoPE of a config.json (an HFConfig, or its fields and `where` they are from):
        legacy `rope_scaling` ({"type": ...}) or transformers 5's `rope_parameters`
        ({"rope_type": ..., "rope_theta": ...}), read with transformers' precedence. Another type
        (longrope, ...) or a malformed field: a ConfigError naming the file and the field."""
        c = cfg if isinstance(cfg, HFConfig) else HFConfig(cfg, where or "config.json")
        key = "rope_scaling" if c.get("rope_scaling", None) else "rope_parameters"
        p = c.sub(key)
        _refuse_per_layer_type(c, p, key, spec.family)
        type_key = "rope_type" if p.get("rope_type", None) else "type"
        kind = p.get(type_key, "default")
        theta = rope_theta_of(c, spec.rope_theta)
        dim = rotary_dim(spec)
        if kind == "default":
            return cls.plain(dim, theta)
        if kind not in ROPE_TYPES:
            raise c.error(
                f"{key}.{type_key}={kind!r} is not implemented by the real model; it runs "
                f"{', '.join(map(repr, ROPE_TYPES))} (the simulator, which runs no RoPE, still "
                "runs this checkpoint's spec)"
            )
        if kind == "proportional":
            return cls(_proportional(c, p, key, dim, theta))
        _refuse_scaled(c, p, key, kind, spec.family)
        orig = _original_max_positions(c, p)
        if kind == "longrope":
            return cls._longrope(c, p, key, dim, theta, orig)
        if kind == "yarn" and "factor" in p.fields and p.get("factor", None) is None:
            # null (absent: refused, as transformers does): DeepSeek-V3's way, as transformers
            factor = c.get("max_position_embeddings") / orig  # the stretch over the original
        else:
            factor = _required(c, p, key, "factor", kind)
        mscale_all_dim = p.get("mscale_all_dim", 0)
        softmax_mscale = yarn_mscale(factor, mscale_all_dim) if mscale_all_dim else 1.0
        if kind == "linear":  # positions / factor, done on the frequencies as transformers does
            return cls(cls.plain(dim, theta).inv_freq / factor, softmax_mscale=softmax_mscale)
        if kind == "dynamic":
            return cls._dynamic(c, key, dim, theta, factor, softmax_mscale)
        if kind == "llama3":
            low = _required(c, p, key, "low_freq_factor", kind)
            high = _required(c, p, key, "high_freq_factor", kind)
            return cls(_llama3(dim, theta, factor, orig, low, high), softmax_mscale=softmax_mscale)
        if theta <= 1:  # yarn's ramp divides by log(theta)
            raise c.error(f"rope_theta={theta} with {key} yarn; yarn needs a RoPE base above 1")
        inv_freq, attention_factor = _yarn(p, dim, theta, factor, orig)
        return cls(inv_freq, attention_factor, softmax_mscale)

    @classmethod
    def _dynamic(
        cls, c: HFConfig, key: str, dim: int, theta: float, factor: float, softmax_mscale: float
    ) -> Rope:
        """Dynamic NTK: plain RoPE of transformers' init base (the base at
        max_position_embeddings, in Python floats) up to max_position_embeddings, and a base
        growing with the sequence past it."""
        if dim <= 2:  # the base's exponent divides by dim - 2
            raise c.error(f"{key} dynamic with {dim} rotated dims; dynamic NTK needs more than 2")
        max_positions = c.get("max_position_embeddings")
        ntk = DynamicNTK(theta, dim, factor, max_positions)
        init = cls.plain(dim, ntk.base(max_positions)).inv_freq
        return cls(init, softmax_mscale=softmax_mscale, ntk=ntk)

    @classmethod
    def _longrope(
        cls, c: HFConfig, p: HFConfig, key: str, dim: int, theta: float, orig: int
    ) -> Rope:
        """transformers' _compute_longrope_parameters, op for op: the short factors'
        frequencies up to `orig` positions, the long factors' past them, and cos and sin
        times attention_factor (absent: sqrt(1 + ln(factor) / ln(orig)), factor absent:
        max_position_embeddings / orig)."""
        factor = p.get("factor", None)
        if factor is None:
            factor = c.get("max_position_embeddings") / orig
        attention_factor = p.get("attention_factor", None)
        if attention_factor is None:
            if factor > 1.0 and orig == 1:  # transformers divides by log(orig) and fails
                raise c.error(f"{key}.original_max_position_embeddings=1 with longrope; raise it")
            scale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
            attention_factor = scale
        shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]

        def freqs(name: str) -> torch.Tensor:
            ext = p.get(name, None)
            if ext is None or len(ext) != dim // 2:
                has = "is missing" if ext is None else f"has {len(ext)} factors"
                raise c.error(
                    f"{key}.{name} {has}; longrope takes one per rotated dim pair, {dim // 2} here"
                )
            return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**shape)

        short, long = freqs("short_factor"), freqs("long_factor")
        return cls(short, float(attention_factor), long=(orig, long))


def _proportional(c: HFConfig, p: HFConfig, key: str, dim: int, theta: float) -> torch.Tensor:
    """transformers' _compute_proportional_rope_parameters, op for op: inv_freq [dim/2], the
    first partial_rotary_factor of the pairs at the frequencies of a `dim`-wide head, the
    others 0 (not rotated), all divided by factor (absent: 1)."""
    partial, _ = _partial_rotary_factor(c, p, key)
    angles = int(partial * dim // 2)
    rotated = 1.0 / (
        theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).to(dtype=torch.float) / dim)
    )
    inv_freq = torch.cat((rotated, torch.zeros(dim // 2 - angles, dtype=torch.float32)))
    return inv_freq / p.get("factor", 1.0)


def _refuse_per_layer_type(c: HFConfig, p: HFConfig, key: str, family: str) -> None:
    """Refuse RoPE parameters nested by layer type ({"full_attention": {...}, ...}): these
    families run one RoPE on every layer, and transformers' class fails on the nesting where
    config.json declares layer_types (Qwen2-MoE's always) and runs default RoPE, the nested
    objects unread, where it does not; moepipe read them as default RoPE too."""
    nested = [k for k, v in p.fields.items() if isinstance(v, Mapping)]
    if nested:
        raise c.error(
            f"{key}.{nested[0]} is an object: RoPE parameters per layer type, which {family} "
            f"does not run (one RoPE for every layer); write one flat {key} object"
        )


def _refuse_scaled(c: HFConfig, p: HFConfig, key: str, kind: str, family: str) -> None:
    """Refuse a scaled RoPE's fields transformers' class of the family fails on, which moepipe
    would run: a partial_rotary_factor below 1 (these families rotate whole heads), and for
    DeepSeek-V2 yarn's null factor with mscale_all_dim (its softmax scale takes the factor)."""
    partial, partial_key = _partial_rotary_factor(c, p, key)
    if partial != 1.0:  # default RoPE: ignored, as transformers
        raise c.error(
            f"{partial_key}={partial} with {kind} RoPE; these families rotate whole heads "
            "(transformers fails on it too): remove it"
        )
    null_factor = "factor" in p.fields and p.get("factor", None) is None
    if family in MLA_FAMILIES and null_factor and p.get("mscale_all_dim", 0):
        raise c.error(
            f"{key}.factor is null with mscale_all_dim={p.get('mscale_all_dim')}: transformers' "
            "DeepseekV2 scales its softmax by the factor and fails on null; write the factor"
        )


def _partial_rotary_factor(c: HFConfig, p: HFConfig, key: str) -> tuple[float, str]:
    """(partial_rotary_factor, the field it is read from): the RoPE object's, else config.json's
    top-level one, which transformers moves into the RoPE object; 1.0 where neither has one."""
    inner = p.get("partial_rotary_factor", None)
    if inner is not None:
        return float(inner), f"{key}.partial_rotary_factor"
    return float(c.get("partial_rotary_factor", 1.0)), "partial_rotary_factor"


def _original_max_positions(c: HFConfig, p: HFConfig) -> int:
    """The context length yarn and llama3 stretch, as transformers' standardize_rope_params
    picks it: config.json's top-level original_max_position_embeddings (Phi-3 keeps it there)
    over the RoPE object's, else max_position_embeddings (or the family's default of it)."""
    top = c.get("original_max_position_embeddings", None)
    return int(
        top or p.get("original_max_position_embeddings", None) or c.get("max_position_embeddings")
    )


def _required(c: HFConfig, p: HFConfig, key: str, name: str, kind: str) -> Any:
    value = p.get(name, None)
    if value is None:
        raise c.error(f"{key}.{name} is missing; {kind} needs a positive number")
    return value


def _llama3(
    dim: int, theta: float, factor: float, orig: int, low: float, high: float
) -> torch.Tensor:
    """transformers' _compute_llama3_parameters, op for op: inv_freq [dim/2]. Wavelengths below
    orig / high_freq_factor are kept, those above orig / low_freq_factor divided by factor, and
    those between interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim/2]
    low_wavelen, high_wavelen = orig / low, orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    p: HFConfig, dim: int, theta: float, factor: float, orig: int
) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters, op for op: (inv_freq [dim/2], attention_factor).
    Frequencies that turn fewer than beta_slow times over `orig` positions are divided by
    factor, those turning more than beta_fast times are kept, with a linear ramp in between."""
    mscale, mscale_all_dim = p.get("mscale", None), p.get("mscale_all_dim", None)
    attention_factor = p.get("attention_factor", None)
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = yarn_betas(p)

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoids dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim/2] 1: the frequency as is, 0: divided by factor
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # [dim/2]
    kept, divided = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    return divided * (1 - keep) + kept * keep, float(attention_factor)


def rope(x: torch.Tensor, positions: torch.Tensor, r: Rope) -> torch.Tensor:
    """HF-style rotate-half RoPE. x [B, Hx, S, D], positions [S]."""
    d = x.shape[-1]
    assert r.inv_freq.shape == (d // 2,), f"RoPE has {r.inv_freq.shape} frequencies for dim {d}"
    inv_freq = r.inv_freq_on(x.device, positions)  # [D/2]
    freqs = positions.to(x.device).float()[:, None] * inv_freq[None, :]  # [S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, D]
    cos = (emb.cos() * r.attention_factor).to(x.dtype)
    sin = (emb.sin() * r.attention_factor).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rope_pairs(x: torch.Tensor, positions: torch.Tensor, r: Rope) -> torch.Tensor:
    """DeepSeek-V2's RoPE as transformers computes it: adjacent pairs (x[2i], x[2i+1]) rotated as
    complex numbers in float32. x [B, Hx, S, R], positions [S]."""
    assert r.inv_freq.shape == (x.shape[-1] // 2,), f"RoPE has {r.inv_freq.shape} frequencies"
    inv_freq = r.inv_freq_on(x.device, positions)  # [R/2]
    freqs = positions.to(x.device).float()[:, None] * inv_freq[None, :]  # [S, R/2]
    cis = torch.polar(torch.ones_like(freqs), freqs) * r.attention_factor  # [S, R/2] complex64
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # [B, Hx, S, R/2]
    return torch.view_as_real(pairs * cis).flatten(3).type_as(x)


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, r: Rope) -> torch.Tensor:
    """DeepSeek-V3's RoPE as transformers' apply_rotary_pos_emb_interleave computes it: pairs
    (x[2i], x[2i+1]) rotated in the input's dtype, the even dims' results first, then the odd
    ones'. x [B, Hx, S, R], positions [S]."""
    d = x.shape[-1]
    assert r.inv_freq.shape == (d // 2,), f"RoPE has {r.inv_freq.shape} frequencies for dim {d}"
    freqs = positions.to(x.device).float()[:, None] * r.inv_freq_on(x.device, positions)
    emb = torch.cat([freqs, freqs], dim=-1)  # [S, R], as transformers' rotary embedding
    cos = (emb.cos() * r.attention_factor).to(x.dtype)[..., : d // 2]
    sin = (emb.sin() * r.attention_factor).to(x.dtype)[..., : d // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# MLA's RoPE layouts (`Model.mla_rope`): V2's pairs, V3's interleave, or rotate_half
MLA_ROPE = {"pairs": rope_pairs, "interleave": rope_interleaved, "half": rope}


def causal_mask(
    positions: torch.Tensor, end: int, device: torch.device, window: int | None = None
) -> torch.Tensor:
    """[S, end] bool: the query at position p sees cache entries 0..p, or with a sliding
    `window` the latest `window` of them, p - window < i <= p (transformers' sliding_window)."""
    p, i = positions[:, None].to(device), torch.arange(end, device=device)
    seen = p >= i
    return seen if window is None else seen & (i > p - window)


def attention_mask(
    positions: torch.Tensor, end: int, device: torch.device, window: int | None
) -> torch.Tensor | None:
    """The attention mask of queries at `positions` [S] over cache entries [0, end): None
    where a single query sees them all (a decode step inside the window), as transformers
    passes none there; SDPA with and without a mask rounds differently in bf16. `window`: the
    sliding window (`Model.sliding_window`)."""
    if len(positions) == 1 and (window is None or end <= window):
        return None
    return causal_mask(positions, end, device, window)


def qk_norm(
    spec: ModelSpec,
    w: Weights,
    q: torch.Tensor,
    k: torch.Tensor,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMoE's QK-norm: RMSNorm over the projected q [B, S, Hq * D] of all heads at once, and
    over k alike. A `head_shard` holds some heads' columns (and norm weights): it sums their
    squares, `reduce` adds up every shard's sums (one all-reduce of [B, S, 2] floats), and it
    divides its columns by the whole's root mean square. A kv head that several shards hold
    (world > n_kv_heads) has its squares counted once: each holder adds its share."""
    s, eps = spec, spec.rms_norm_eps
    full_q, full_k = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    if q.shape[-1] == full_q:
        return rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    assert reduce is not None, "a head shard's QK-norm needs `reduce` over the shards"
    holders = k.shape[-1] * full_q // (full_k * q.shape[-1])  # shards holding these kv heads
    qf, kf = q.float(), k.float()
    sums = reduce(torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1) / holders], -1))
    ms_q, ms_k = (sums[..., :1] / full_q, sums[..., 1:] / full_k)  # [B, S, 1] each
    return (
        (qf * torch.rsqrt(ms_q + eps)).to(q.dtype) * w["q_norm"],
        (kf * torch.rsqrt(ms_k + eps)).to(k.dtype) * w["k_norm"],
    )


def gqa(
    spec: ModelSpec,
    rot: Rope,
    w: Weights,
    x: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    positions: torch.Tensor,
    window: int | None = None,
    clip_qkv: float | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Grouped-query attention: normed x [B, S, H] -> heads' outputs [B, S, Hq * D], Hq and
    Hkv as many as `w` holds (a `head_shard` holds whole groups, or heads of one group). `window`,
    `clip_qkv`: `Model`'s; `reduce`: as `qk_norm`'s."""
    s = spec
    b, n, _ = x.shape
    n_q, n_kv = w["q"].shape[0] // s.head_dim, w["k"].shape[0] // s.head_dim
    proj = {key: F.linear(x, w[key], w.get(f"{key}_bias")) for key in "qkv"}  # [B, S, n * D]
    if s.head_qk_norm:  # Qwen3-MoE: each head [D] normed by one weight shared by all heads
        for key in "qk":
            by_head = proj[key].view(b, n, -1, s.head_dim)  # [B, S, n, D]
            proj[key] = rms_norm(by_head, w[f"{key}_norm"], s.rms_norm_eps).flatten(2)
    elif "q_norm" in w:
        proj["q"], proj["k"] = qk_norm(spec, w, proj["q"], proj["k"], reduce)
    if clip_qkv is not None:  # OLMoE: after QK-norm, as transformers' OlmoeAttention
        proj = {key: t.clamp(-clip_qkv, clip_qkv) for key, t in proj.items()}

    def heads(key: str, n_heads: int) -> torch.Tensor:  # -> [B, n_heads, S, D]
        return proj[key].view(b, n, n_heads, s.head_dim).transpose(1, 2)

    q = rope(heads("q", n_q), positions, rot)  # [B, Hq, S, D]
    k = rope(heads("k", n_kv), positions, rot)  # [B, Hkv, S, D]
    v = heads("v", n_kv)
    k_cache, v_cache = cache
    start, end = int(positions[0]), int(positions[-1]) + 1
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    rep = n_q // n_kv
    keys = k_cache[:, :, :end].repeat_interleave(rep, dim=1)  # [B, Hq, end, D]
    values = v_cache[:, :, :end].repeat_interleave(rep, dim=1)
    mask = attention_mask(positions, end, keys.device, window)  # [S, end] or None
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, Hq, S, D]
    return out.transpose(1, 2).reshape(b, n, n_q * s.head_dim)


def mla(
    spec: ModelSpec,
    rot: Rope,
    w: Weights,
    x: torch.Tensor,
    cache: tuple[torch.Tensor, ...],
    positions: torch.Tensor,
    window: int | None = None,
    layout: str = "pairs",
) -> torch.Tensor:
    """DeepSeek-V2's and V3's Multi-head Latent Attention in transformers' op order: normed x
    [B, S, H] -> heads' outputs [B, S, Hq * Dv], Hq as many as `w` holds. Caches the compressed
    latent and the shared RoPE key. Cq: the query's compression rank (q_lora_rank). layout:
    the RoPE's (`MLA_ROPE`)."""
    m = mla_dims(spec)
    nope, r, dv, c = (
        m["qk_nope_head_dim"],
        m["qk_rope_head_dim"],
        m["v_head_dim"],
        m["kv_lora_rank"],
    )
    b, n, _ = x.shape
    if "q" in w:
        q = F.linear(x, w["q"])  # [B, S, Hq * (Dn+R)]
    else:  # compressed: q_a [Cq, H], its norm (RMSNorm's default eps, as HF's), q_b
        q_a = F.linear(x, w["q_a"], w.get("q_a_bias"))  # [B, S, Cq]; biases: attention_bias
        q = F.linear(rms_norm(q_a, w["q_a_norm"], 1e-6), w["q_b"])
    n_q = q.shape[-1] // (nope + r)
    q = q.view(b, n, n_q, nope + r).transpose(1, 2)  # [B, Hq, S, Dn+R]
    q_nope, q_rope = q.split([nope, r], dim=-1)
    kv_a = F.linear(x, w["kv_a"], w.get("kv_a_bias"))  # [B, S, C + R]
    latent, k_rope = kv_a.split([c, r], dim=-1)  # [B, S, C], [B, S, R]
    # HF's kv_a_layernorm keeps RMSNorm's default eps, not config.rms_norm_eps
    latent = rms_norm(latent, w["kv_a_norm"], 1e-6).view(b, 1, n, c)  # [B, 1, S, C]
    rotate = MLA_ROPE[layout]
    q_rope = rotate(q_rope, positions, rot)  # [B, Hq, S, R]
    k_rope = rotate(k_rope.view(b, 1, n, r), positions, rot)  # [B, 1, S, R]
    latent_cache, k_rope_cache = cache
    start, end = int(positions[0]), int(positions[-1]) + 1
    latent_cache[:, :, start:end] = latent
    k_rope_cache[:, :, start:end] = k_rope
    kv = F.linear(latent_cache[:, :, :end], w["kv_b"])  # [B, 1, end, Hq * (Dn+Dv)]
    kv = kv.view(b, end, n_q, nope + dv).transpose(1, 2)  # [B, Hq, end, Dn+Dv]
    k_nope, values = kv.split([nope, dv], dim=-1)
    k_rope_heads = k_rope_cache[:, :, :end].expand(-1, n_q, -1, -1)  # [B, Hq, end, R]
    keys = torch.cat([k_nope, k_rope_heads], dim=-1)  # [B, Hq, end, Dn+R]
    query = torch.cat([q_nope, q_rope], dim=-1)  # [B, Hq, S, Dn+R]
    mask = attention_mask(positions, end, keys.device, window)  # [S, end] or None
    # YaRN's magnitude correction also sharpens the softmax (1 without it), in HF's op order
    scale = (nope + r) ** -0.5 * rot.softmax_mscale * rot.softmax_mscale
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale
    )  # [B, Hq, S, Dv]
    return out.transpose(1, 2).reshape(b, n, n_q * dv)
