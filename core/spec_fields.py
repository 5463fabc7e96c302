"""The working range of a model's and a routing's float fields and counts past any width (a
finite value that passes its type check but is meaningless further on: `rms_norm_eps=1e308`
normalises every activation to 0), and which families read the fields only some families
have (`q_lora_rank` on a Mixtral is read by no code that runs it). core.spec checks both.

Usage:
    check_span("model tiny: ", "rms_norm_eps", 1e308, "model.rms_norm_eps")  # ConfigError
    SPANS["rope_theta"].words()  # "a number in [1, 1e+12]"
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError


@dataclass(frozen=True)
class Span:
    """A float field's working range: `low` to `high`, each end taken or not (`*_open`)."""

    low: float
    high: float
    low_open: bool  # the low end itself refused
    high_open: bool
    why: str  # what the range follows from, as a line says it
    example: str  # a value a line's fix passes

    def holds(self, v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            return False
        v = float(v)
        above = v > self.low if self.low_open else v >= self.low
        below = v < self.high if self.high_open else v <= self.high
        return above and below

    def words(self) -> str:
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"a number in {left}{self.low:g}, {self.high:g}{right}"


# the float fields of core.spec's ModelSpec and RoutingConfig, by name
SPANS: dict[str, Span] = {
    # x / sqrt(mean(x^2) + eps): an eps of 1 or more drowns the activations it divides
    "rms_norm_eps": Span(
        0.0, 1.0, True, True, "a norm's epsilon: released models' 1e-5/1e-6", "1e-5"
    ),
    # RoPE's base: below 1 its frequencies rise with the dim; past any model's (Qwen's 1e7)
    # only float32's 3.4e38 is left, which a cast to the real executor's tensors overflows
    "rope_theta": Span(1.0, 1e12, False, False, "RoPE's base: released models' 1e4 to 1e7", "1e6"),
    # Zipf exponent: past 64 every expert but the most popular gets under 2^-64 of the picks
    "skew": Span(0.0, 64.0, False, False, "a Zipf exponent; 0 = even, 64 = all on one", "1.0"),
    **dict.fromkeys(
        ("layer_corr", "reuse", "hot_share"),
        Span(0.0, 1.0, False, False, "a probability", "0.5"),
    ),
}
# a layer's attention or latent-expansion weights: past the largest whole models' (2^40, 1.1T)
MAX_LAYER_PARAMS = 1 << 40


def check_span(at: str, name: str, value: Any, key: str) -> None:
    """`value` of float field `name` within `SPANS[name]`, else a ConfigError naming `key` (as
    the user sets it: `model.rms_norm_eps`) after `at` (`model tiny: `)."""
    span = SPANS[name]
    if not span.holds(value):
        why = f" ({span.why})" if span.why else ""
        raise ConfigError(
            f"{at}{key}={value}: must be {span.words()}{why}; pass e.g. {key}={span.example}"
        )


MLA = ("deepseek_v2", "deepseek_v3")
# fields only some families read, with the value that means "none" (the dataclass default):
# the real executor and config.json's writer read them for these families alone (kv_dim and
# attn_params are not here: the simulator sizes any family's KV cache and attention by them, a
# knob for an attention no shipped model has; make_checkpoint refuses them where config.json
# cannot say them)
FAMILY_ONLY: dict[str, tuple[tuple[str, ...], Any]] = {
    "qk_rope_head_dim": (MLA, 0),
    "q_lora_rank": (MLA, 0),
    "qk_head_dim": (MLA, 0),
    "latent_expand_params": (MLA, 0),
    "shared_ffn_size": (("qwen2_moe", *MLA), 0),  # shared experts
    "qkv_bias": (("qwen2_moe",), True),  # Qwen2-MoE's q/k/v biases; others follow attention_bias
    "rope_theta": (("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", *MLA), 1e6),  # Switch: no RoPE
    # refused first by core.spec's own line (`attention_bias is implemented for ...`)
    "attention_bias": (("olmoe", "qwen3_moe", *MLA), False),
    "mlp_bias": (MLA, False),
}


def family_reads(family: str, names: list[str]) -> list[str]:
    """The fields of `names` (a spec's, in order) that `family` reads."""
    return [n for n in names if n not in FAMILY_ONLY or family in FAMILY_ONLY[n][0]]


def check_family_fields(at: str, family: str, given: dict[str, Any], names: list[str]) -> None:
    """No field of `given` (a spec's values) set, against its default, that `family` does not
    read: it would be accepted and change nothing that runs, or size a model no family has."""
    for key, (families, none) in FAMILY_ONLY.items():
        value = given[key]
        default = value == none and isinstance(value, bool) == isinstance(none, bool)
        if family not in families and not default:
            raise ConfigError(
                f"{at}{key}={value} is read by {', '.join(families)} only, not by family "
                f"{family}, which reads: {', '.join(family_reads(family, names))}; remove "
                f"{key}, or set model.family"
            )
