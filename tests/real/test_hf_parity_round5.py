"""A fifth round: every field transformers' config classes of the five families take is
classified in core.hf_config.coverage, and the table is proven on checkpoints transformers
writes (tests/real/test_hf_parity.py builds them the same way): a NO_EFFECT field leaves
transformers' own logits as they are and moepipe still gives them, a refused one is refused in
one line naming it, and READ fields no earlier round compared are compared here. Fields it found
moepipe ignored where transformers differs: return_dict false, is_encoder_decoder true,
pad_token_id outside the vocabulary, Switch's router_dtype, transformers_weights, and Switch's
sizes under their attribute_map names.

Usage: python -m pytest -q tests/real/test_hf_parity_round5.py
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.hf_config.coverage import (
    COVERAGE,
    EXTRA_COVERAGE,
    NO_EFFECT,
    REFUSED,
    ROPE_COVERAGE,
    Handling,
)
from real.model import reference_generate
from tests.real.test_hf_parity import GEN, hf_greedy
from tests.real.test_hf_parity_fields import edit_config, load_hf, save

transformers = pytest.importorskip("transformers")

CLASSES = {
    "mixtral": "MixtralConfig",
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "olmoe": "OlmoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
    "switch_transformers": "SwitchTransformersConfig",
}
CAUSAL = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"]


SWITCH = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=32, num_heads=4, num_experts=4)
SWITCH_LAYERS = dict(num_layers=2, num_decoder_layers=2)
SWITCH_SPARSE = dict(num_sparse_encoder_layers=1, num_sparse_decoder_layers=1)


def logits_of(hf: Any, prompt: torch.Tensor) -> torch.Tensor:
    """transformers' forward logits over the prompt (Switch: the prompt on both sides)."""
    extra = {"decoder_input_ids": prompt} if hf.config.model_type == "switch_transformers" else {}
    with torch.inference_mode():
        out = hf(prompt, **extra)
    return out[0] if isinstance(out, tuple) else out.logits


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """family -> (checkpoint, transformers' model from it), float32, built on first use."""
    root = tmp_path_factory.mktemp("round5")
    made: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in made:
            if family == "switch_transformers":
                cfg = transformers.SwitchTransformersConfig(
                    **SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE
                )
                torch.manual_seed(0)
                model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
                model.save_pretrained(root / family)
                made[family] = root / family, model
            else:
                made[family] = save(family, {}, root / family)
        return made[family]

    return get


# What the base checkpoints give (the prompt fixture is one seeded prompt): by (checkpoint, what)
_OF_BASE: dict[tuple[Path, str], Any] = {}


def of_base(ckpt: Path, what: str, make: Callable[[], Any]) -> Any:
    """`make()` for the module's base checkpoint `ckpt`, computed once: the NO_EFFECT tests
    compare each edited checkpoint with the same base run."""
    if (ckpt, what) not in _OF_BASE:
        _OF_BASE[ckpt, what] = make()
    return _OF_BASE[ckpt, what]


def edited(ckpt: Path, to: Path, **fields: Any) -> Path:
    shutil.copytree(ckpt, to)
    edit_config(to, **fields)
    return to


# The table against transformers' classes


def class_fields(family: str) -> set[str]:
    """The fields transformers' config class of the family takes (its __init__) and a default
    instance writes (to_dict: the base's model_type and output_attentions, derived ones)."""
    cls = getattr(transformers, CLASSES[family])
    taken = set(inspect.signature(cls.__init__).parameters) - {"self"}
    return (taken | set(cls().to_dict())) - {"_name_or_path"}


@pytest.mark.parametrize("family", CLASSES)
def test_the_table_classifies_every_field_of_transformers_class(family):
    """COVERAGE names exactly the fields transformers' class takes: a field transformers adds
    (a new version) fails here until it is classified, as does one the table names in vain."""
    fields = class_fields(family)
    table = set(COVERAGE[family])
    assert not fields - table, f"unclassified {family} fields: {sorted(fields - table)}"
    assert not table - fields, f"{family} fields transformers has not: {sorted(table - fields)}"
    hows = {how for how, _ in COVERAGE[family].values()}
    assert (Handling.SUBSTITUTED in hows) == (family == "switch_transformers")


def test_the_rope_table_classifies_every_rope_parameter():
    """ROPE_COVERAGE names exactly the keys of transformers' RopeParameters."""
    from transformers.modeling_rope_utils import RopeParameters

    assert set(ROPE_COVERAGE) == set(RopeParameters.__annotations__)


def test_citations_name_existing_tests():
    """Each `file::test` a table entry cites is a test function of tests/ (a `...` ending: its
    prefix), and each `case in file::test_equals_transformers` a case of that file's table."""
    from tests.real import (
        test_hf_parity,
        test_hf_parity_round4,
        test_hf_parity_round10,
        test_hf_parity_round10b,
        test_hf_parity_round12,
    )

    cases = {
        "test_hf_parity.py": test_hf_parity.CASES,
        "test_hf_parity_round4.py": test_hf_parity_round4.MATCHED,
        "test_hf_parity_round10.py": test_hf_parity_round10.CASES,
        "test_hf_parity_round10b.py": test_hf_parity_round10b.CASES,
        "test_hf_parity_round12.py": test_hf_parity_round12.CASES,
        "test_hf_parity_round5.py": READ_CASES,
    }
    tables = [*COVERAGE.values(), ROPE_COVERAGE, EXTRA_COVERAGE]
    sources = {p.name: p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py")}
    checked = 0
    for why in (why for table in tables for _, why in table.values()):
        for file, name in re.findall(r"(test_\w+\.py)::(\w+)", why):
            assert f"def {name}" in sources[file], why
            checked += 1
        for case, file in re.findall(r"([\w*]+-\w+) in (test_\w+\.py)::test_", why):
            assert case.startswith("*") or case in cases[file], why
    assert checked > 50  # the pattern still finds the citations


@pytest.mark.parametrize("family", CLASSES)
def test_aliases_are_transformers_attribute_maps(family):
    """core.hf_config's other names of fields are each class's attribute_map, every one, from
    the field the class declares to its other name (Qwen3-MoE declares num_experts, which its
    attribute_map stores as num_local_experts; the others the map's target): a config.json
    giving a field under its other name is read as transformers reads it."""
    from core.hf_config.fields import ALIASES

    cls = getattr(transformers, CLASSES[family])
    declared = set(cls.__annotations__)
    pairs = [(a, b) if a in declared else (b, a) for a, b in cls.attribute_map.items()]
    assert ALIASES.get(family, {}) == dict(pairs)


# NO_EFFECT: transformers' logits unchanged, moepipe's still them

# a value other than the class's default for each NO_EFFECT field
NON_DEFAULT: dict[str, Any] = {
    "transformers_version": "4.40.0",
    "output_hidden_states": True,
    "output_attentions": True,
    "chunk_size_feed_forward": 2,
    "id2label": {"0": "A", "1": "B", "2": "C"},
    "label2id": {"A": 0, "B": 1, "C": 2},
    "problem_type": "regression",
    "use_cache": False,
    "pad_token_id": 5,
    "bos_token_id": 9,
    "eos_token_id": 7,
    "initializer_range": 0.5,
    "attention_dropout": 0.5,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.5,
    "router_jitter_noise": 0.5,
    "pretraining_tp": 2,
    "head_dim": 24,  # DeepSeek-V2's, overwritten by qk_rope_head_dim
    "qk_head_dim": 7,
    "num_mtp_layers": 2,  # DeepSeek-V3's multi-token prediction layers, not built
    "num_nextn_predict_layers": 2,
    "router_ignore_padding_tokens": True,
    "dropout_rate": 0.5,
    "router_z_loss_coef": 0.5,
    "initializer_factor": 3.0,
    "add_router_probs": True,
}
QUIET = [(f, k) for f in CLASSES for k, (how, _) in COVERAGE[f].items() if how == NO_EFFECT]


@pytest.mark.parametrize("family, field", QUIET, ids=[f"{f}-{k}" for f, k in QUIET])
def test_no_effect_field_leaves_transformers_logits(family, field, base, prompt, tmp_path):
    """A NO_EFFECT field at another value than its default: transformers' model loaded from the
    edited checkpoint gives its forward logits unchanged (the claim is observed, not assumed),
    and moepipe runs it: transformers' greedy tokens and last logits within 1e-5 (Switch, a
    substitute of its own: moepipe's tokens and logits as without the field)."""
    ckpt, hf = base(family)
    value = NON_DEFAULT[field]
    assert COVERAGE[family][field][0] == NO_EFFECT
    changed = edited(ckpt, tmp_path / "edited", **{field: value})
    assert json.loads((changed / "config.json").read_text())[field] == value
    if family == "switch_transformers":
        cls = transformers.SwitchTransformersForConditionalGeneration
        other = cls.from_pretrained(changed, dtype=torch.float32).eval()
        reference = of_base(ckpt, "moepipe", lambda: reference_generate(ckpt, prompt, GEN))
    else:
        other = load_hf(changed)
        reference = of_base(ckpt, "greedy", lambda: hf_greedy(hf, prompt))
    assert torch.equal(
        logits_of(other, prompt), of_base(ckpt, "logits", lambda: logits_of(hf, prompt))
    )
    tokens, logits = reference_generate(changed, prompt, GEN)
    assert torch.equal(tokens, reference[0])
    torch.testing.assert_close(logits, reference[1], atol=1e-5, rtol=0)


# RoPE keys no family reads (multimodal RoPE's), over default RoPE and yarn
QUIET_ROPE = {"mrope_section": [2, 2, 4]}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "rope_theta": 1e6,
    "original_max_position_embeddings": 8,
}


@pytest.mark.parametrize("key", [k for k, (how, _) in ROPE_COVERAGE.items() if how == NO_EFFECT])
def test_no_effect_rope_key_leaves_transformers_logits(key, prompt, tmp_path):
    """A NO_EFFECT key of rope_parameters leaves transformers' logits unchanged, with default
    RoPE and with yarn, and moepipe gives them within 1e-5."""
    for kind, rope in (("default", {"rope_type": "default", "rope_theta": 1e6}), ("yarn", YARN)):
        ckpt, hf = save("mixtral", {"rope_parameters": rope}, tmp_path / kind)
        edit_config(ckpt, rope_parameters=rope | {key: QUIET_ROPE[key]})
        assert torch.equal(logits_of(load_hf(ckpt), prompt), logits_of(hf, prompt))
        tokens, logits = reference_generate(ckpt, prompt, GEN)
        hf_tokens, hf_logits = hf_greedy(hf, prompt)
        assert torch.equal(tokens, hf_tokens)
        torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", CAUSAL)
def test_per_layer_config_leaves_transformers_logits(family, base, prompt, tmp_path):
    """per_layer_config (transformers' heterogeneous layers) skipping layer 1's MLP: no class of
    these families applies it, so transformers' logits are unchanged, and moepipe's are them."""
    ckpt, hf = base(family)
    changed = edited(ckpt, tmp_path / "per_layer", per_layer_config={"1": {"skip": ["mlp"]}})
    assert torch.equal(logits_of(load_hf(changed), prompt), logits_of(hf, prompt))
    tokens, logits = reference_generate(changed, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)


# Refused: one line naming the field

# a value each REFUSED field is refused at (its own default runs: every other test's checkpoint)
REFUSE: dict[str, Any] = {
    "router_bias": True,
    "router_dtype": "bfloat16",
    "return_dict": False,
    "is_encoder_decoder": True,
    "head_dim": 24,  # DeepSeek-V3's, where qk_rope_head_dim is 8
}
REFUSED_FIELDS = [(f, k) for f in CLASSES for k, (how, _) in COVERAGE[f].items() if how == REFUSED]


@pytest.mark.parametrize(
    "family, field", REFUSED_FIELDS, ids=[f"{f}-{k}" for f, k in REFUSED_FIELDS]
)
def test_refused_field_is_one_line_naming_it(family, field, base, prompt, tmp_path):
    """A REFUSED_UNLESS_DEFAULT field at another value is refused in one line naming the file
    and the field, before any weight is read."""
    ckpt, _ = base(family)
    bad = edited(ckpt, tmp_path / "bad", **{field: REFUSE[field]})
    with pytest.raises(ConfigError) as e:
        reference_generate(bad, prompt, GEN)
    assert "\n" not in str(e.value)
    assert f"config.json: {field}=" in str(e.value)


# (family, value) each refused field outside the classes is refused at
REFUSE_EXTRA: dict[str, tuple[str, Any]] = {
    "is_causal": ("mixtral", False),
    "attention_chunk_size": ("olmoe", 4),
    "layer_types": ("mixtral", ["sliding_attention", "full_attention"]),
    "sliding_window": ("deepseek_v2", 3),
    "scoring_func": ("deepseek_v2", "sigmoid"),
    "transformers_weights": ("olmoe", "weights.safetensors"),
}
EXTRA_REFUSED = [
    k for k, (how, _) in EXTRA_COVERAGE.items() if how == REFUSED and k != "partial_rotary_factor"
]


@pytest.mark.parametrize("field", EXTRA_REFUSED)
def test_refused_extra_field_is_one_line_naming_it(field, base, prompt, tmp_path):
    """A refused field outside the classes (partial_rotary_factor: round 3's test) is refused
    in one line naming the file and the field."""
    family, value = REFUSE_EXTRA[field]
    bad = edited(base(family)[0], tmp_path / "bad", **{field: value})
    with pytest.raises(ConfigError) as e:
        reference_generate(bad, prompt, GEN)
    assert "\n" not in str(e.value)
    assert f"config.json: {field}" in str(e.value)


@pytest.mark.parametrize("family", CLASSES)
def test_return_dict_false_is_refused(family, base, prompt, tmp_path):
    """return_dict false in config.json: transformers' forward fails in every family (its inner
    model then returns a tuple, read as an output object); moepipe ran it, ignoring the field.
    It is refused in one line naming it. Null, which transformers runs returning a tuple of the
    same logits, runs."""
    ckpt, hf = base(family)
    cls = type(hf)
    bad = edited(ckpt, tmp_path / "false", return_dict=False)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute"):
        logits_of(cls.from_pretrained(bad, dtype=torch.float32).eval(), prompt)
    with pytest.raises(ConfigError, match=r"config.json: return_dict=false: transformers' "):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, return_dict=None)
    null = cls.from_pretrained(bad, dtype=torch.float32).eval()
    assert torch.equal(logits_of(null, prompt), logits_of(hf, prompt))
    assert torch.equal(
        reference_generate(bad, prompt, GEN)[0], reference_generate(ckpt, prompt, GEN)[0]
    )


@pytest.mark.parametrize("family", CAUSAL)
def test_is_encoder_decoder_true_is_refused(family, base, prompt, tmp_path):
    """is_encoder_decoder true in a decoder-only family: transformers' forward gives the same
    logits but its generate() takes the model as an encoder-decoder and fails (no decoder
    inputs, or no start token for them); moepipe generated, ignoring the field. It is refused
    in one line naming it; false runs."""
    ckpt, hf = base(family)
    bad = edited(ckpt, tmp_path / "enc_dec", is_encoder_decoder=True)
    assert torch.equal(logits_of(load_hf(bad), prompt), logits_of(hf, prompt))
    with pytest.raises(ValueError, match="input_ids or inputs_embeds|encoder-decoder generation"):
        hf_greedy(load_hf(bad), prompt)
    with pytest.raises(ConfigError, match=r"config.json: is_encoder_decoder=true: transformers'"):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, is_encoder_decoder=1)  # truthy, as transformers takes it
    with pytest.raises(ConfigError, match=r"config.json: is_encoder_decoder=1: transformers'"):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, is_encoder_decoder=False)
    assert torch.equal(reference_generate(bad, prompt, GEN)[0], hf_greedy(hf, prompt)[0])


@pytest.mark.parametrize("family", CAUSAL)
def test_pad_token_id_outside_the_vocabulary_is_refused(family, base, prompt, tmp_path):
    """pad_token_id 128 of a vocabulary of 128: transformers cannot build the causal families'
    embedding (torch refuses the padding index); moepipe ran it. It is refused in one line
    naming the field; -1, which torch takes as the last token, runs in both."""
    ckpt, hf = base(family)
    bad = edited(ckpt, tmp_path / "pad", pad_token_id=128)
    with pytest.raises(AssertionError, match="Padding_idx must be within num_embeddings"):
        load_hf(bad)
    with pytest.raises(ConfigError, match=r"config.json: pad_token_id=128 is outside the vocab"):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, pad_token_id=-1)
    assert torch.equal(logits_of(load_hf(bad), prompt), logits_of(hf, prompt))
    assert torch.equal(reference_generate(bad, prompt, GEN)[0], hf_greedy(hf, prompt)[0])


def test_switch_pad_token_id_outside_the_vocabulary_runs(base, prompt, tmp_path):
    """Switch's embedding (T5's) takes no padding index, so transformers runs a pad_token_id
    outside the vocabulary with the same logits, and moepipe runs it as without it."""
    ckpt, hf = base("switch_transformers")
    far = edited(ckpt, tmp_path / "pad", pad_token_id=500)
    cls = transformers.SwitchTransformersForConditionalGeneration
    assert torch.equal(logits_of(cls.from_pretrained(far).eval(), prompt), logits_of(hf, prompt))
    assert torch.equal(
        reference_generate(far, prompt, GEN)[1], reference_generate(ckpt, prompt, GEN)[1]
    )


def test_switch_router_dtype_other_than_float32_is_refused(base, prompt, tmp_path):
    """Switch's router_dtype bfloat16: transformers' router computes its logits and softmax in
    bfloat16, which moves its forward's logits (here a float32 model's); moepipe routed in
    float32, ignoring the field. It is refused in one line naming it."""
    ckpt, hf = base("switch_transformers")
    bad = edited(ckpt, tmp_path / "bf16", router_dtype="bfloat16")
    cls = transformers.SwitchTransformersForConditionalGeneration
    other = cls.from_pretrained(bad, dtype=torch.float32).eval()
    assert not torch.equal(logits_of(other, prompt), logits_of(hf, prompt))
    with pytest.raises(ConfigError, match=r"config.json: router_dtype='bfloat16'; switch_trans"):
        reference_generate(bad, prompt, GEN)
    edit_config(bad, router_dtype="float32")
    assert reference_generate(bad, prompt, GEN)[0].shape == (2, GEN)


def test_transformers_weights_of_another_file_is_refused(base, prompt, tmp_path):
    """config.json's transformers_weights names the file transformers loads the weights from:
    beside model.safetensors, another model's weights.safetensors it names are what
    transformers runs (other logits); moepipe ran model.safetensors, ignoring the field. It is
    refused in one line naming it; naming model.safetensors runs as without it."""
    ckpt, hf = base("mixtral")
    two = edited(ckpt, tmp_path / "two", transformers_weights="weights.safetensors")
    torch.manual_seed(1)
    other = transformers.AutoModelForCausalLM.from_config(hf.config).eval()
    other.save_pretrained(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "model.safetensors", two / "weights.safetensors")
    assert not torch.equal(logits_of(load_hf(two), prompt), logits_of(hf, prompt))
    with pytest.raises(ConfigError, match=r"config.json: transformers_weights='weights.safeten"):
        reference_generate(two, prompt, GEN)
    edit_config(two, transformers_weights="model.safetensors")
    assert torch.equal(logits_of(load_hf(two), prompt), logits_of(hf, prompt))
    tokens, logits = reference_generate(two, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)


# READ: moepipe's logits are transformers'

# case -> (family, fields over the family's): READ fields no earlier round compared
READ_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-rms_norm_eps": ("mixtral", {"rms_norm_eps": 0.5}),
    "qwen2_moe-rms_norm_eps": ("qwen2_moe", {"rms_norm_eps": 0.5}),
    "mixtral-tied": ("mixtral", {"tie_word_embeddings": True}),
    "olmoe-tied": ("olmoe", {"tie_word_embeddings": True}),
    "deepseek_v2-tied": ("deepseek_v2", {"tie_word_embeddings": True}),
    # layer 1 slides: the rule without layer_types (even layers below max_window_layers) would
    # slide layer 0
    "qwen2_moe-layer_types": (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 2, "max_window_layers": 2}
        | {"layer_types": ["full_attention", "sliding_attention"]},
    ),
}


@pytest.mark.parametrize("case", READ_CASES)
def test_read_field_equals_transformers(case, prompt, tmp_path):
    """A READ field at another value than its default: moepipe's greedy tokens are
    transformers' and its last float32 logits within 1e-5; every field named is READ."""
    family, fields = READ_CASES[case]
    assert all(COVERAGE[family][k][0] == Handling.READ for k in fields)
    ckpt, hf = save(family, fields, tmp_path / "ckpt")
    for key, value in fields.items():
        assert json.loads((ckpt / "config.json").read_text())[key] == value
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)


def test_switch_sizes_under_their_other_names_are_read(base, prompt, tmp_path):
    """Switch's config.json giving d_model, num_heads and num_layers as hidden_size,
    num_attention_heads and num_hidden_layers (its attribute_map) is the same model to
    transformers (the same logits) and now to moepipe (the same spec and tokens); before,
    moepipe sized it by the class's defaults (d_model 768) and refused its weights."""
    from real.checkpoint import load_checkpoint

    ckpt, hf = base("switch_transformers")
    renamed = edited(ckpt, tmp_path / "renamed")
    cfg = json.loads((renamed / "config.json").read_text())
    for own, other in (("d_model", "hidden_size"), ("num_heads", "num_attention_heads")):
        cfg[other] = cfg.pop(own)
    cfg["num_hidden_layers"] = cfg.pop("num_layers")
    (renamed / "config.json").write_text(json.dumps(cfg))
    cls = transformers.SwitchTransformersForConditionalGeneration
    assert torch.equal(
        logits_of(cls.from_pretrained(renamed).eval(), prompt), logits_of(hf, prompt)
    )
    spec = load_checkpoint(renamed)[0]
    assert spec == dataclasses.replace(load_checkpoint(ckpt)[0], name=spec.name)
    tokens, logits = reference_generate(renamed, prompt, GEN)
    base_tokens, base_logits = reference_generate(ckpt, prompt, GEN)
    assert torch.equal(tokens, base_tokens)
    assert torch.equal(logits, base_logits)


def test_switch_sparse_step_of_num_hidden_layers_is_transformers():
    """A Switch config.json of num_hidden_layers 4 (num_layers' other name), 2 sparse encoder
    blocks and no encoder_sparse_step: transformers derives the step from num_layers' default
    (12 // 2 = 6, set before the other name), so block 1 alone is sparse, and so moepipe reads it
    (its step from 4 // 2 made blocks 1 and 3 sparse)."""
    from core.hf_config import hf_config_to_spec

    fields = dict(SWITCH, num_hidden_layers=4, num_sparse_encoder_layers=2)
    fields["model_type"] = "switch_transformers"
    config = transformers.SwitchTransformersConfig.from_dict(fields)
    model = transformers.SwitchTransformersEncoderModel(config)
    sparse = tuple(i for i, b in enumerate(model.encoder.block) if b.is_sparse)
    assert sparse == (1,)
    assert hf_config_to_spec(fields, "s").moe_layers == sparse
