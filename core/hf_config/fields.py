"""The config.json fields moepipe reads, their types, and the one checked accessor.

`FIELDS` lists every top-level field read with the type transformers 5.24 gives it (`ROPE_FIELDS`
those of `rope_scaling` / `rope_parameters`); `HFConfig.get` reads a field through its rule, so a
value of another type or range is one line naming the file and the field:
`.../config.json: num_attention_heads must be a positive integer, got 0`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from core.errors import ConfigError, cannot_read
from core.files import TRANSFORMERS_JSON, loads_json_as_owner, note_once, read_small
from core.hf_config.rope_keys import MAX_SCALE, check_rope
from core.spec import MAX_EXPERTS, MAX_LAYERS, MAX_WIDTH
from core.spec_fields import SPANS


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# the fix of a config.json field's line: the model's released file has every field right
RELEASED = "{} it as the model's released config.json has it"
RESAVE = "copy the model's released config.json, or re-save it with save_pretrained"


@dataclass(frozen=True)
class Rule:
    """The type of one config.json field: `ok` accepts a value, `what` says what it must be;
    `nullable`: null reads as absent (the default), as transformers' `X | None` fields do."""

    ok: Callable[[Any], bool]
    what: str
    nullable: bool = False

    def or_null(self) -> Rule:
        return replace(self, what=self.what + " or null", nullable=True)


COUNT = Rule(lambda v: _is_int(v) and v >= 1, "a positive integer")
LAYER_COUNT = Rule(
    lambda v: _is_int(v) and 1 <= v <= MAX_LAYERS, f"a positive integer at most {MAX_LAYERS}"
)
SIZE = Rule(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
# a layer's width or count: past any model's it would only exhaust memory further on
WIDTH = Rule(
    lambda v: _is_int(v) and 1 <= v <= MAX_WIDTH, f"a positive integer at most {MAX_WIDTH}"
)
WIDTH_OR_0 = Rule(lambda v: _is_int(v) and 0 <= v <= MAX_WIDTH, f"an integer in [0, {MAX_WIDTH}]")
EXPERTS = Rule(  # expert ids are int16
    lambda v: _is_int(v) and 1 <= v <= MAX_EXPERTS, f"a positive integer at most {MAX_EXPERTS}"
)
FRACTION = Rule(lambda v: _is_number(v) and 0 < v <= 1, "a number in (0, 1]")
POSITIVE = Rule(lambda v: _is_number(v) and v > 0, "a positive number")
NUMBER = Rule(_is_number, "a number")
# a norm's epsilon and RoPE's base, in the ranges core.spec takes (core.spec_fields.SPANS)
EPS = Rule(SPANS["rms_norm_eps"].holds, SPANS["rms_norm_eps"].words())
THETA = Rule(SPANS["rope_theta"].holds, SPANS["rope_theta"].words())
BETA = Rule(lambda v: _is_number(v) and v >= 0, "a positive number, 0 (the default)")
# yarn's attention factor and mscale, DeepSeek's routed_scaling_factor (rope_keys.MAX_SCALE);
# RoPE's factor is checked there, its lowest depending on the RoPE type
SCALE = Rule(lambda v: _is_number(v) and 0 < v <= MAX_SCALE, "a positive number at most 1e6")
MSCALE = Rule(lambda v: _is_number(v) and abs(v) <= MAX_SCALE, "a number in [-1e6, 1e6]")
FLAG = Rule(lambda v: isinstance(v, bool), "true or false")
TEXT = Rule(lambda v: isinstance(v, str), "a string")
OBJECT = Rule(lambda v: isinstance(v, Mapping), "an object")
FACTORS = Rule(
    lambda v: isinstance(v, list) and bool(v) and all(_is_number(f) and f > 0 for f in v),
    "a list of positive numbers, one per rotated dim pair",
)
LAYERS = Rule(
    lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
    "a list of layer indices (integers >= 0)",
)
LAYER_TYPES = Rule(
    lambda v: isinstance(v, list) and all(t in ("full_attention", "sliding_attention") for t in v),
    'a list of "full_attention" or "sliding_attention", one per layer',
)

# Every top-level field moepipe reads, by the type transformers 5.24's config classes give it.
FIELDS: dict[str, Rule] = {
    "model_type": TEXT,
    "architectures": Rule(
        lambda v: isinstance(v, list) and all(isinstance(a, str) for a in v),
        "a list of model class names",
    ).or_null(),
    "dtype": TEXT.or_null(),  # transformers 5; read before torch_dtype, as transformers does
    "torch_dtype": TEXT.or_null(),
    "num_hidden_layers": LAYER_COUNT,
    "num_layers": LAYER_COUNT,  # Switch's encoder blocks
    "hidden_size": WIDTH,
    "intermediate_size": WIDTH,
    "num_attention_heads": WIDTH,
    "num_key_value_heads": WIDTH.or_null(),
    "head_dim": WIDTH.or_null(),
    "vocab_size": WIDTH,
    "max_position_embeddings": COUNT,
    "rms_norm_eps": EPS,
    "rope_theta": THETA,
    "rope_scaling": OBJECT.or_null(),
    "rope_parameters": OBJECT.or_null(),
    # transformers' quantizers read it as an object (core.hf_config.runtime.fp8_block)
    "quantization_config": OBJECT.or_null(),
    # yarn's and llama3's pretraining length: transformers puts it over the RoPE object's
    "original_max_position_embeddings": COUNT.or_null(),
    "partial_rotary_factor": FRACTION.or_null(),  # transformers moves it into rope_parameters
    "tie_word_embeddings": FLAG,
    "hidden_act": TEXT,
    "num_local_experts": EXPERTS,
    "num_experts": EXPERTS,
    "num_experts_per_tok": EXPERTS,
    "norm_topk_prob": FLAG.or_null(),
    "sliding_window": SIZE.or_null(),  # Qwen2-MoE writes 0 where use_sliding_window is false
    # Qwen2-MoE (and Qwen3-MoE, without the shared expert and qkv_bias)
    "moe_intermediate_size": WIDTH,
    "shared_expert_intermediate_size": WIDTH_OR_0,
    # 0 in a Switch config of more sparse decoder layers than layers (transformers: none sparse)
    "decoder_sparse_step": SIZE,
    "mlp_only_layers": LAYERS.or_null(),
    "qkv_bias": FLAG,
    "use_sliding_window": FLAG,
    "max_window_layers": SIZE,
    "layer_types": LAYER_TYPES.or_null(),
    "is_causal": FLAG,  # false: transformers' masks see both ways, in any family
    # OLMoE
    "clip_qkv": POSITIVE.or_null(),
    "attention_bias": FLAG,
    # DeepSeek-V2
    "n_routed_experts": EXPERTS,
    "n_shared_experts": Rule(
        lambda v: _is_int(v) and 0 <= v <= MAX_EXPERTS, f"an integer in [0, {MAX_EXPERTS}]"
    ).or_null(),
    "first_k_dense_replace": SIZE,
    # 0: transformers' classes ignore the field, DeepSeek's modeling_deepseek.py takes each
    # layer index modulo it (a ZeroDivisionError): no reference defines it
    "moe_layer_freq": Rule(
        COUNT.ok,
        "a positive integer (transformers ignores moe_layer_freq and DeepSeek's "
        "modeling_deepseek.py cannot run 0, so no reference defines it; write 1)",
    ),
    "kv_lora_rank": WIDTH,
    "q_lora_rank": WIDTH.or_null(),
    "qk_rope_head_dim": WIDTH,
    "qk_nope_head_dim": WIDTH,
    "v_head_dim": WIDTH,
    "routed_scaling_factor": SCALE,
    "topk_method": TEXT.or_null(),
    "n_group": COUNT.or_null(),  # group_limited_greedy: expert groups, and those a token uses
    "topk_group": COUNT.or_null(),
    "scoring_func": TEXT.or_null(),
    "mlp_bias": FLAG,
    # DeepSeek-V3: its MLA's RoPE on interleaved pairs (DeepSeek's layout) or on halves
    "rope_interleave": FLAG.or_null(),
    # Switch
    "d_model": WIDTH,
    "d_ff": WIDTH,
    "d_kv": WIDTH,
    "num_heads": WIDTH,
    "encoder_sparse_step": SIZE,  # 0: no sparse block, as decoder_sparse_step
    "num_sparse_encoder_layers": SIZE,
    "num_decoder_layers": SIZE.or_null(),  # T5's decoder, which moepipe's substitute replaces
    "num_sparse_decoder_layers": SIZE,
    "layer_norm_epsilon": EPS,
    "dense_act_fn": TEXT,
    "router_bias": FLAG,
    "router_dtype": TEXT,
}
# The fields of `rope_scaling` / `rope_parameters` (transformers' modeling_rope_utils).
ROPE_FIELDS: dict[str, Rule] = {
    "rope_type": TEXT,
    "type": TEXT,
    "rope_theta": THETA,
    "factor": POSITIVE.or_null(),  # yarn's null: max_position_embeddings over the original's
    "original_max_position_embeddings": COUNT.or_null(),
    "attention_factor": SCALE.or_null(),
    "mscale": MSCALE.or_null(),
    "mscale_all_dim": MSCALE.or_null(),
    # yarn's betas: 0 or null is the default (32, 1), as transformers' `or 32` / `or 1` reads it
    "beta_fast": BETA.or_null(),
    "beta_slow": BETA.or_null(),
    "truncate": FLAG,
    "low_freq_factor": POSITIVE,  # llama3
    "high_freq_factor": POSITIVE,
    "partial_rotary_factor": FRACTION,
    "short_factor": FACTORS,  # longrope: per dim pair, up to original_max_position_embeddings
    "long_factor": FACTORS,  # ... and past it
}
# transformers' attribute_map of each family: another name of a field, which transformers sets
# after the class's own fields, so it wins where config.json gives both
ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_local_experts": "num_experts"},
    "olmoe": {"num_experts": "num_local_experts"},
    # Qwen3-MoE's class field num_experts is stored as num_local_experts (its attribute_map),
    # the name save_pretrained writes and the one transformers keeps where both are given
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "deepseek_v2": {"n_routed_experts": "num_experts"},
    # V3's class fields stored under their attribute_map names, which win where both are given
    "deepseek_v3": {
        "n_routed_experts": "num_local_experts",
        "num_mtp_layers": "num_nextn_predict_layers",
    },
    "switch_transformers": {
        "d_model": "hidden_size",
        "num_heads": "num_attention_heads",
        "num_layers": "num_hidden_layers",
    },
}
_REQUIRED = object()
# transformers 5.24's config-class defaults of the fields moepipe reads without one of its own,
# family by family: a config.json that leaves one out runs it, as transformers does. Those
# without a default there (DeepSeek-V2's num_experts_per_tok, n_group, ...) stay required.
FAMILY_DEFAULTS: dict[str, dict[str, int | bool]] = {
    "mixtral": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    "qwen2_moe": {
        "num_hidden_layers": 24,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "vocab_size": 151936,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "qwen3_moe": {
        "num_hidden_layers": 24,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "vocab_size": 151936,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    "olmoe": {
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "intermediate_size": 2048,
        "num_attention_heads": 16,
        "vocab_size": 50304,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    },
    "deepseek_v2": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_attention_heads": 32,
        "vocab_size": 102400,
        "n_routed_experts": 64,
        "moe_intermediate_size": 1407,
        "max_position_embeddings": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "tie_word_embeddings": False,
    },
    "deepseek_v3": {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_attention_heads": 128,
        "vocab_size": 129280,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "max_position_embeddings": 4096,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "switch_transformers": {
        "d_model": 768,
        "d_ff": 2048,
        "d_kv": 64,
        "num_heads": 12,
        "num_layers": 12,
        "num_experts": 8,
        "vocab_size": 32128,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class HFConfig:
    """A config.json's fields and the file they came from; read them with `get`."""

    fields: Mapping[str, Any]
    where: str  # the file, first in every error
    prefix: str = ""  # "rope_parameters." for a nested object's fields
    rules: Mapping[str, Rule] = field(default_factory=lambda: FIELDS)

    @property
    def family(self) -> str:
        return str(self.fields.get("model_type", ""))

    def get(self, key: str, default: Any = _REQUIRED, rule: Rule | None = None) -> Any:
        """The field's value, checked by its rule (`rule` for a family's stricter one); absent
        (or null where the rule allows it): `default`, else (absent) the family's in
        transformers (`FAMILY_DEFAULTS`), and an error naming it without one."""
        key = self.name(key)
        rule = rule or self.rules[key]  # KeyError: a field read without a rule in the table
        value = self.fields.get(key)
        if value is None and (key not in self.fields or rule.nullable):
            if default is _REQUIRED and not self.prefix and key not in self.fields:
                default = FAMILY_DEFAULTS.get(self.family, {}).get(key, _REQUIRED)
            if default is _REQUIRED:
                who = "" if self.prefix else f"; model_type {self.family!r} needs it"
                raise self.error(f"{self.prefix}{key} is missing{who}; {RELEASED.format('add')}")
            return default
        if not rule.ok(value):
            raise self.error(
                f"{self.prefix}{key} must be {rule.what}, got {value!r}; {RELEASED.format('set')}"
            )
        return value

    def name(self, key: str) -> str:
        """The config.json field `key` is read from: its other name in the family (`ALIASES`)
        where the file has that one, else `key`."""
        alias = "" if self.prefix else ALIASES.get(self.family, {}).get(key, "")
        return alias if alias and alias in self.fields else key  # (a field "" is no alias)

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: {message}")

    def sub(self, key: str) -> HFConfig:
        """A nested object's fields (null or absent: none), read by `ROPE_FIELDS`."""
        return HFConfig(self.get(key, {}), self.where, f"{key}.", ROPE_FIELDS)

    def check(self) -> None:
        """Check every field of the table the file has (and the RoPE objects' fields), so a
        bad one is refused when the file is read, not when a run first needs it."""
        for key in self.fields:
            if key in self.rules:
                self.get(key, None)
        if not self.prefix:
            for key in ("rope_scaling", "rope_parameters"):
                rope = self.sub(key)
                rope.check()
                check_rope(rope, self.family)
            self._note_rope_given_twice()
            self._note_yarn_factor()

    def _note_yarn_factor(self) -> None:
        """One logged line where yarn's factor is not max_position_embeddings over
        original_max_position_embeddings (nor that ratio 1), as transformers' yarn validation
        warns: the explicit factor runs, in both."""
        rope = self.fields.get("rope_scaling") or self.fields.get("rope_parameters")
        if not isinstance(rope, Mapping) or "yarn" not in (rope.get("rope_type"), rope.get("type")):
            return
        factor, longest = rope.get("factor"), self.fields.get("max_position_embeddings")
        original = rope.get(_ORIGINAL, self.fields.get(_ORIGINAL))
        if not (factor and longest and original):  # absent: transformers infers them
            return
        implicit = longest / original
        if implicit not in (factor, 1):
            note_once(
                f"{self.where}: yarn's factor={factor}, but max_position_embeddings={longest} "
                f"over {_ORIGINAL}={original} is {implicit:g}; transformers runs the factor, and "
                f"so does moepipe: set one of them to agree"
            )

    def _note_rope_given_twice(self) -> None:
        """One logged line where config.json gives RoPE twice, differently: rope_scaling and
        rope_parameters (transformers runs `rope_scaling or rope_parameters`), or a top-level
        rope_theta or partial_rotary_factor beside the RoPE object's (its own wins there)."""
        both = [self.fields.get(k) for k in ("rope_scaling", "rope_parameters")]
        if all(both) and both[0] != both[1]:
            note_once(
                f"{self.where}: rope_scaling and rope_parameters differ; transformers runs "
                "rope_scaling's, and so does moepipe: keep one of them"
            )
        rope, key = (both[0], "rope_scaling") if both[0] else (both[1], "rope_parameters")
        if not isinstance(rope, Mapping):  # none (both checked objects or null already)
            return
        for name in ("rope_theta", "partial_rotary_factor"):
            top, own = self.fields.get(name), rope.get(name)
            if top is not None and own is not None and top != own:
                note_once(
                    f"{self.where}: {name}={top} but {key}.{name}={own}; transformers runs "
                    f"{key}'s, and so does moepipe: keep one of them"
                )


_ORIGINAL = "original_max_position_embeddings"


def hf_config_file(path: str | Path) -> Path:
    """A checkpoint directory's `config.json`, or the file given; its folder names the model."""
    p = Path(path)
    # a folder named config.json is the file's place, not a checkpoint: refused as no file
    return p / "config.json" if p.is_dir() and p.name != "config.json" else p


def loads_hf_json(text: str, where: str) -> Any:
    """`json.loads` as transformers reads config.json and generation_config.json: a key given
    twice keeps its last value, logged in one line naming the file and the key."""
    return loads_json_as_owner(text, where, TRANSFORMERS_JSON)


# files of a checkpoint's folder other than its config.json (transformers' names)
_OTHER_FILES = ("generation_config.json", "model.safetensors.index.json", "tokenizer.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _not_another_checkpoint_file(p: Path) -> None:
    """A ConfigError where `p`, given as the model's config.json, is another file of a
    checkpoint (its weights, index or generation settings): read as config.json it was
    refused as not UTF-8 or of the wrong fields, a fix that rewrote the wrong file."""
    if p.name in _OTHER_FILES or p.name.endswith(_WEIGHT_SUFFIXES):
        raise ConfigError(
            f"{p}: a checkpoint's {p.name}, not its config.json; pass the checkpoint's folder "
            f"({p.parent})"
        )


def read_hf_config(path: str | Path) -> HFConfig:
    """A Hugging Face `config.json` (file or checkpoint directory), every field it has that
    moepipe reads checked; a ConfigError naming the file for one that is missing, not UTF-8, not
    JSON, not an object, or a field of another type or range; not a regular file or over 16 MiB.
    A key given twice takes its last value, as transformers' json.loads, in a logged line."""
    p = hf_config_file(path)
    _not_another_checkpoint_file(p)
    try:
        text = read_small(p, fix="point at a checkpoint's config.json").decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: no such file; point at a checkpoint directory with a config.json"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}); {RESAVE}") from None
    except OSError as e:
        raise ConfigError(cannot_read(p, e)) from None
    try:
        fields = loads_hf_json(text, str(p))  # a key given twice: its last value, logged
    except (ValueError, RecursionError) as e:  # JSONDecodeError, an int of 4300+ digits, nesting
        raise ConfigError(
            f"{p}: not valid JSON ({str(e) or 'nested too deeply'}); {RESAVE}"
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"{p}: holds a JSON {type(fields).__name__}, not an object of fields "
            f'({{"model_type": ..., ...}}); {RESAVE}'
        )
    cfg = HFConfig(fields, str(p))
    cfg.check()
    return cfg
