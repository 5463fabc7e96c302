"""The RoPE object's (`rope_scaling` / `rope_parameters`) relations that transformers' rope
validation only warns about, refused when config.json is read: a key its type does not take, a
scaling field without a type, `type` and `rope_type` that disagree, a factor below 1 (but for the
types that divide every frequency by it), beta_fast below beta_slow, llama3's high_freq_factor not
above low_freq_factor."""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.errors import quoted
from core.hf_config.coverage import NO_EFFECT, ROPE_COVERAGE
from core.spec import MLA_FAMILIES

# float32's largest finite number: RoPE's frequencies are computed in float32
# a multiplier of the activations or positions (RoPE's factor, yarn's attention factor and
# mscale, DeepSeek's routed_scaling_factor): released models' are 0.1 to 64; past 1e6 the
# logits overflow half and float32 (1e308 ran a simulated model without a word, a real one to NaN)
MAX_SCALE = 1e6

if TYPE_CHECKING:
    from core.hf_config.fields import HFConfig

_ANY = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
_YARN = {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}
_ORIG = "original_max_position_embeddings"
# the keys each RoPE type takes (transformers' modeling_rope_utils validation functions)
TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": _ANY,
    "linear": _ANY | {"factor"},
    "dynamic": _ANY | {"factor", _ORIG},
    "yarn": _ANY | {"factor", _ORIG} | _YARN,
    "llama3": _ANY | {"factor", _ORIG, "low_freq_factor", "high_freq_factor"},
    "longrope": _ANY | {"factor", _ORIG, "attention_factor", "short_factor", "long_factor"},
    "proportional": _ANY | {"factor"},
}
_SCALING = frozenset().union(*TYPE_KEYS.values()) - _ANY
# DeepSeek-V2's and V3's attention scale their softmax by yarn_get_mscale(factor,
# mscale_all_dim)^2 under any scaled type (transformers' yarn_apply_mscale), so these types
# take it there too; longrope and proportional, where that fails or moepipe does not, do not
_MLA_KEYS = {k: frozenset({"mscale_all_dim"}) for k in ("linear", "dynamic", "llama3")}
# the types whose factor divides every frequency, and nothing else: below 1 they rotate faster,
# which transformers warns about and runs
_DIVIDE = frozenset({"linear", "proportional"})
# keys no family reads (multimodal RoPE's): transformers' logits are the same
_QUIET = frozenset(k for k, (how, _) in ROPE_COVERAGE.items() if how == NO_EFFECT)


def check_rope(p: HFConfig, family: str) -> None:
    """Check one RoPE object's (`p`, read by ROPE_FIELDS, its fields already typed) of a
    `family`'s config.json relations; a type moepipe does not know is left to the real model,
    which refuses it."""
    key = p.prefix.rstrip(".")
    kinds = {k: p.fields[k] for k in ("rope_type", "type") if p.fields.get(k) is not None}
    if len(set(kinds.values())) > 1:
        raise p.error(
            f"{key}.rope_type={kinds['rope_type']!r} but {key}.type={kinds['type']!r}; "
            "transformers runs rope_type's: give one type"
        )
    kind = next(iter(kinds.values()), None)
    if kind is None:
        scaling = sorted(k for k in p.fields if k in _SCALING)
        if scaling:
            raise p.error(
                f"{key} has {scaling[0]} but no rope_type; name the RoPE type it scales "
                f"({', '.join(k for k in TYPE_KEYS if k != 'default')})"
            )
        return
    if kind not in TYPE_KEYS:
        return
    takes = TYPE_KEYS[kind] | (
        _MLA_KEYS.get(kind, frozenset()) if family in MLA_FAMILIES else set()
    )
    unknown = sorted(k for k in p.fields if k not in takes | _QUIET)
    if unknown:
        raise p.error(
            f"{key}.{quoted(unknown[0])} is not a key of {kind} RoPE; it takes "
            f"{', '.join(sorted(takes))}: remove or rename it"
        )
    _check_values(p, key, kind)


def _check_values(p: HFConfig, key: str, kind: str) -> None:
    factor = p.fields.get("factor")
    if factor is not None and factor < 1 and kind not in _DIVIDE:
        raise p.error(
            f"{key}.factor={factor} must be >= 1 (the context's stretch); set the model's own"
        )
    if factor is not None and factor > MAX_SCALE:  # 1e39: inf in float32, every angle 0
        raise p.error(
            f"{key}.factor={factor} must be in [1, 1e6]: released models' stretch the context "
            "64x at most, and past float32's range no position is rotated; set the model's own"
        )
    fast, slow = yarn_betas(p)
    if fast < slow:
        raise p.error(
            f"{key}.{_as_written(p, 'beta_fast', fast)} is below "
            f"{_as_written(p, 'beta_slow', slow)}; yarn's ramp runs from beta_fast down to "
            "beta_slow: swap them"
        )
    low, high = p.fields.get("low_freq_factor"), p.fields.get("high_freq_factor")
    if low is not None and high is not None and high <= low:
        raise p.error(
            f"{key}.high_freq_factor={high} must be above low_freq_factor={low} "
            "(llama3 interpolates between them)"
        )


def yarn_betas(p: HFConfig) -> tuple[float, float]:
    """yarn's (beta_fast, beta_slow) as transformers reads them: absent, null or 0 is the
    default, 32 and 1 (`get("beta_fast") or 32`)."""
    return p.get("beta_fast", None) or 32, p.get("beta_slow", None) or 1


def _as_written(p: HFConfig, name: str, read: float) -> str:
    """`name=value` as config.json has it, with the default transformers reads (`read`) where
    that is not what was written: 0 or null (`beta_fast=0 (transformers' default 32)`)."""
    if name not in p.fields:
        return f"{name} (absent: transformers' default {read:g})"
    raw = p.fields[name]
    if raw:
        return f"{name}={raw}"
    return f"{name}={'null' if raw is None else raw} (transformers' default {read:g})"
