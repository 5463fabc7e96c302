"""The twelfth round: a sweep of every config field of the seven families' transformers classes
against the parity tests, each field no round ran in a family run there at a value its real
models ship or an edge value the class takes.

New here: Qwen3-MoE and DeepSeek-V3 under dynamic and llama3 RoPE, DeepSeek's mscale_all_dim
under llama3 and linear RoPE (its softmax scale; before, refused as no key of theirs), the
YaRN forms their releases ship (DeepSeek-V3's legacy rope_scaling, mscale 1 and mscale_all_dim
1, factor 40), DeepSeek-V2's shipped YaRN (mscale 0.707), one key/value head (MQA) in every
GQA family, vocab_size 131 (not a multiple of 8), rms_norm_eps in Qwen3-MoE (its per-head
QK-norm too) and DeepSeek-V3, DeepSeek-V3 with two shared experts and no dense layer, and with
one expert group and no shared expert; through moepipe's forward and klotski's real run,
float32 and bfloat16. And every name of transformers' ACT2FN as hidden_act: each runs as
transformers computes it (before, 13 were refused) but prelu and xielu, whose learned weights
moepipe does not load, refused in one line. Fields released config.json files carry that no
class takes and nothing reads (DeepSeek's aux_loss_alpha, seq_aux, ep_size, auto_map; Qwen3's
max_window_layers; Switch's feed_forward_proj, is_gated_act, router_type) leave transformers'
logits and moepipe's as they are.

Usage: python -m pytest -q tests/real/test_hf_parity_round12.py
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.hf_config.runtime import GATED_ACTS, LEARNED_ACTS
from real.activations import ACTIVATIONS
from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, dynamic, hf_greedy, llama3
from tests.real.test_hf_parity_fields import assert_transformers, edit_config, load_hf, save_cast
from tests.real.test_hf_parity_round4 import linear
from tests.real.test_hf_parity_round10 import (
    assert_case_is_transformers,
    assert_run_is_transformers,
    randomise,
)

transformers = pytest.importorskip("transformers")

ROPE = ("rope_parameters",)


def shipped_yarn(factor: float, **more: float) -> dict[str, Any]:
    """YaRN as a release ships it, from 4 positions (so the 6-token prompt is stretched):
    DeepSeek-V3's and V2's with their mscale pair and factor 40, Qwen3's with the factor
    alone (betas left to their defaults)."""
    rope = {"rope_type": "yarn", "factor": factor, "rope_theta": 1e4}
    return {"rope_parameters": rope | {"original_max_position_embeddings": 4, **more}}


def with_mscale(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields`' RoPE object with mscale_all_dim 0.7 (DeepSeek-V2's release: 0.707)."""
    return {"rope_parameters": fields["rope_parameters"] | {"mscale_all_dim": 0.7}}


_BETAS = {"beta_fast": 32.0, "beta_slow": 1.0}
# one key/value head (MQA) and a vocabulary of 131 (not a multiple of 8), with an ACT2FN name
# moepipe refused before
_MQA = {"num_key_value_heads": 1, "vocab_size": 131}
# case -> (family, config.json fields over test_hf_parity's family ones, fields whose absence
# moves the logits)
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "qwen3_moe-dynamic": ("qwen3_moe", dynamic(1e4), ROPE),
    "qwen3_moe-llama3": ("qwen3_moe", llama3(1e4), ROPE),
    "qwen3_moe-yarn_shipped": ("qwen3_moe", shipped_yarn(4.0), ROPE),
    "qwen3_moe-mqa": ("qwen3_moe", _MQA | {"rms_norm_eps": 0.5, "hidden_act": "mish"}, ()),
    "deepseek_v3-dynamic": ("deepseek_v3", dynamic(1e4), ROPE),
    # DeepSeek's softmax takes mscale_all_dim under any scaled type, not yarn's alone
    "deepseek_v3-llama3_mscale": ("deepseek_v3", with_mscale(llama3(1e4)), ROPE),
    "deepseek_v2-linear_mscale": ("deepseek_v2", with_mscale(linear(1e4)), ROPE),
    "deepseek_v3-yarn_shipped": (
        "deepseek_v3",
        shipped_yarn(40.0, mscale=1.0, mscale_all_dim=1.0, **_BETAS),
        ROPE,
    ),
    # layer 0 MoE too, two shared experts beside the routed ones
    "deepseek_v3-shared": (
        "deepseek_v3",
        {"n_shared_experts": 2, "first_k_dense_replace": 0, "rms_norm_eps": 0.5}
        | {"vocab_size": 131},
        ("rms_norm_eps",),
    ),
    # one group (Kimi's and Moonlight's n_group 1), no shared expert
    "deepseek_v3-one_group": (
        "deepseek_v3",
        {"n_group": 1, "topk_group": 1, "n_shared_experts": 0, "hidden_act": "gelu_10"},
        (),
    ),
    "deepseek_v2-yarn_shipped": (
        "deepseek_v2",
        shipped_yarn(40.0, mscale=0.707, mscale_all_dim=0.707, **_BETAS),
        ROPE,
    ),
    "deepseek_v2-vocab": ("deepseek_v2", {"vocab_size": 131, "hidden_act": "leaky_relu"}, ()),
    "mixtral-mqa": ("mixtral", _MQA | {"hidden_act": "relu2"}, ()),
    "qwen2_moe-mqa": ("qwen2_moe", _MQA | {"hidden_act": "gelu_fast"}, ()),
    "olmoe-mqa": ("olmoe", _MQA | {"hidden_act": "laplace"}, ()),
}
# the cases run in bfloat16 too: MQA with a new activation, V3's shipped YaRN and its experts
BF16 = ["qwen3_moe-mqa", "mixtral-mqa", "deepseek_v3-yarn_shipped", "deepseek_v3-shared"]
RUNS = [(c, "f32") for c in CASES] + [(c, "bf16") for c in BF16]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(case, dtype) -> (checkpoint, transformers' model loaded from it), `randomise`d (round
    10's: norm weights and biases drawn), built on first use."""
    root = tmp_path_factory.mktemp("round12")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(case: str, dtype: str = "f32") -> tuple[Path, Any]:
        if (case, dtype) not in made:
            family, fields, _ = CASES[case]
            cast, to = DTYPES[dtype], root / f"{case}-{dtype}"
            made[case, dtype] = save_cast(family, fields, to, cast, cast, randomise)
        return made[case, dtype]

    return get


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("case, dtype", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_field_equals_transformers(case, dtype, built, prompt, tmp_path):
    """moepipe's greedy tokens are transformers', its last logits within 1e-4 in float32 (one
    bf16 step in bfloat16; observed: below 1e-6, and 0); in float32 the spec sizes the
    checkpoint and a field under test moves the logits from its absence (RoPE: from plain
    RoPE of its base). Before: the cases with a new ACT2FN name were refused
    ("hidden_act='relu2' is not implemented"), the others already equal."""
    assert_case_is_transformers(built(case, dtype), CASES[case][2], prompt, tmp_path)


def test_v3_shipped_legacy_rope_scaling_equals_transformers(built, prompt, tmp_path):
    """DeepSeek-V3's config.json as released: YaRN under rope_scaling with `type`, rope_theta
    at the top level, no rope_parameters. transformers reads it as the rope_parameters case
    (the same logits) and so does moepipe."""
    ckpt, hf = built("deepseek_v3-yarn_shipped")
    legacy = Path(shutil.copytree(ckpt, tmp_path / "legacy"))
    rope = dict(CASES["deepseek_v3-yarn_shipped"][1]["rope_parameters"])
    theta = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    edit_config(legacy, rope_parameters=None, rope_scaling=rope, rope_theta=theta)
    hf_legacy = load_hf(legacy)
    _, want = hf_greedy(hf, prompt)
    torch.testing.assert_close(hf_greedy(hf_legacy, prompt)[1], want, atol=0, rtol=0)
    assert_transformers(legacy, hf_legacy, prompt, "f32")


@pytest.mark.parametrize("case", ["deepseek_v3-llama3_mscale", "deepseek_v2-linear_mscale"])
def test_deepseek_mscale_all_dim_of_any_scaled_rope_counts(case, built, prompt, tmp_path):
    """mscale_all_dim under llama3 or linear RoPE in DeepSeek moves the logits (transformers'
    yarn_apply_mscale scales the softmax under any type but default; the cases above match
    them). Before: refused, "mscale_all_dim is not a key of llama3 RoPE"."""
    from real.model import live_routing

    ckpt, _ = built(case)
    plain = Path(shutil.copytree(ckpt, tmp_path / "plain"))
    rope = dict(CASES[case][1]["rope_parameters"])
    del rope["mscale_all_dim"]
    edit_config(plain, rope_parameters=rope)
    _, logits = reference_generate(ckpt, prompt, 2)
    _, plain_logits = reference_generate(plain, prompt, 2, live_routing(ckpt, prompt, 2))
    assert (logits - plain_logits).abs().max() > 0.05


# the real executor: klotski streaming the experts from disk
ON_KLOTSKI = [("qwen3_moe-mqa", "bf16"), ("deepseek_v3-shared", "f32")]


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("case, dtype", ON_KLOTSKI, ids=[f"{c}-{d}" for c, d in ON_KLOTSKI])
def test_klotski_run_equals_transformers(case, dtype, built):
    """A real run (live routing, klotski streaming the experts from disk) of an MQA checkpoint
    of a new activation and of DeepSeek-V3's shared experts: transformers' greedy tokens, its
    float32 logits within 1e-4."""
    assert_run_is_transformers(built(case, dtype), "klotski", {})


# hidden_act: every ACT2FN name


def test_every_act2fn_name_runs_or_is_refused():
    """moepipe runs each ACT2FN name of transformers but those with learned weights, which it
    refuses; a name a newer transformers adds fails here until it is run or refused."""
    from transformers.activations import ACT2CLS

    assert set(GATED_ACTS) | set(LEARNED_ACTS) == set(ACT2CLS)
    assert not set(GATED_ACTS) & set(LEARNED_ACTS)
    assert set(ACTIVATIONS) == set(GATED_ACTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", GATED_ACTS)
def test_activation_is_act2fn_bit_for_bit(act, dtype):
    """Each activation moepipe runs is transformers' ACT2FN module, op for op: the same values
    bit for bit in float32 and bfloat16 over inputs across [-12, 12] (gelu_10's clip, relu6's
    and hardswish's corners, laplace's erf)."""
    from transformers.activations import ACT2FN

    g = torch.Generator().manual_seed(0)
    x = (torch.rand(4096, generator=g) * 24 - 12).to(DTYPES[dtype])
    with torch.no_grad():
        assert torch.equal(ACTIVATIONS[act](x), ACT2FN[act](x))


@pytest.mark.parametrize("act", LEARNED_ACTS)
def test_an_activation_of_learned_weights_is_one_line(act, built, tmp_path):
    """prelu and xielu keep weights of their own beside each FFN's (act_fn.weight, act_fn.beta,
    ...), which no family ships: hidden_act and Switch's dense_act_fn of either are refused in
    one line naming the field, the value and transformers' class."""
    from core.hf_config import HFConfig, hf_config_to_spec, hf_runtime
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    ckpt = Path(shutil.copytree(built("mixtral-mqa")[0], tmp_path / "act"))
    edit_config(ckpt, hidden_act=act)
    message = rf"hidden_act='{act}' is transformers' {LEARNED_ACTS[act]}, an activation with"
    with pytest.raises(ConfigError, match=message) as info:
        reference_generate(ckpt, torch.zeros(1, 2, dtype=torch.long), 1)
    assert "\n" not in str(info.value)
    fields = {"model_type": "switch_transformers", **SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE}
    fields["dense_act_fn"] = act
    with pytest.raises(ConfigError, match=rf"dense_act_fn='{act}' is transformers'"):
        hf_runtime(HFConfig(fields, "config.json"), hf_config_to_spec(fields, "s"))


# fields released config.json files carry that no class of theirs takes and nothing reads
# (DeepSeek's own code's training and parallelism settings, its remote-code map; the
# Qwen2-MoE field Qwen3-30B-A3B's file keeps)
UNREAD = {
    "deepseek_v3-shared": {"aux_loss_alpha": 0.001, "seq_aux": True, "ep_size": 8}
    | {"auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}},
    "qwen3_moe-mqa": {"max_window_layers": 1},
}


@pytest.mark.parametrize("case", UNREAD)
def test_a_released_field_no_class_takes_is_ignored(case, built, prompt, tmp_path):
    """Each field of UNREAD leaves transformers' logits as they are (bit for bit), and moepipe
    accepts it and gives those logits and tokens (EXTRA_COVERAGE: NO_EFFECT)."""
    from core.hf_config.coverage import EXTRA_COVERAGE, NO_EFFECT

    assert all(EXTRA_COVERAGE[k][0] == NO_EFFECT for k in UNREAD[case])
    ckpt, hf = built(case)
    edited = Path(shutil.copytree(ckpt, tmp_path / "edited"))
    edit_config(edited, **UNREAD[case])
    hf_edited = load_hf(edited)
    torch.testing.assert_close(hf_greedy(hf_edited, prompt)[1], hf_greedy(hf, prompt)[1])
    assert_transformers(edited, hf_edited, prompt, "f32")


def test_switch_t5_feed_forward_fields_are_ignored(prompt, tmp_path):
    """T5's feed_forward_proj and is_gated_act and Switch's router_type, which switch-base-8's
    config.json carries and neither SwitchTransformersConfig nor its model reads: transformers'
    logits are the same with a gated activation named, and so are moepipe's."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE, logits_of

    cfg = transformers.SwitchTransformersConfig(**SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path / "base")
    edited = Path(shutil.copytree(tmp_path / "base", tmp_path / "edited"))
    fields = {"feed_forward_proj": "gated-gelu", "is_gated_act": True, "router_type": "x"}
    edit_config(edited, **fields)
    cls = transformers.SwitchTransformersForConditionalGeneration
    assert torch.equal(
        logits_of(cls.from_pretrained(edited).eval(), prompt), logits_of(model, prompt)
    )
    tokens, logits = reference_generate(edited, prompt, 2)
    base_tokens, base_logits = reference_generate(tmp_path / "base", prompt, 2)
    assert torch.equal(tokens, base_tokens) and torch.equal(logits, base_logits)
