"""The thirteenth round (issue 48): fields that earlier rounds ran one at a time, here together
on one checkpoint as a release combines them, and the config.json forms of RoPE that older
transformers versions and other families' tools write.

A probe of 844 cases (every field the six causal families' forwards read, one at a time and in
combinations; float32, bfloat16 and float16 saves, sharded saves, compute dtypes other than the
saved one, klotski's and fiddler's real runs, generation_config.json's processors, ten prompts
of eight greedy steps in bfloat16; Switch's fields for tracebacks) found each checkpoint
transformers 5.24 writes and runs equal to it, refused in one line, or (DeepSeek-V2's
norm_topk_prob) run as DeepSeek's code with a warning. The one mismatch it showed was the
parity tests' own: their generate() call masked prompt tokens equal to pad_token_id.
These cases pin the combinations and forms no round ran: DeepSeek's q_lora_rank beside
attention_bias and mlp_bias, V3's low-rank queries under YaRN with half-split RoPE, one expert
group scaled without renormalising, Qwen3-MoE's biased MQA of narrow heads in a sliding window,
OLMoE's clip_qkv beside its renormalised, biased YaRN model, Qwen2-MoE unbiased with wide heads
and no shared expert, Mixtral's window under dynamic NTK with one key/value head; RoPE as legacy
`rope_scaling` (with `type`, `rope_type` or both, rope_theta at the top level) and with
original_max_position_embeddings at the top level (Phi-3's longrope form).

Usage: python -m pytest -q tests/real/test_hf_parity_round13.py
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, hf_greedy
from tests.real.test_hf_parity_fields import assert_transformers, edit_config, load_hf, save_cast
from tests.real.test_hf_parity_round10 import randomise

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32}  # test_hf_parity's families at half width
ORIG = 4  # original_max_position_embeddings: the 12-token prompt runs past it


def rope(kind: str, **keys: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 1e4, **keys}}


_YARN = rope("yarn", factor=4.0, original_max_position_embeddings=ORIG)
_DYNAMIC = {"max_position_embeddings": ORIG} | rope("dynamic", factor=4.0)
# case -> (family, config fields over test_hf_parity's family ones, a prompt past ORIG)
CASES: dict[str, tuple[str, dict[str, Any], bool]] = {
    "deepseek_v2-q_lora_biases": (
        "deepseek_v2",
        {"q_lora_rank": 16, "attention_bias": True, "mlp_bias": True},
        False,
    ),
    "deepseek_v3-q_lora_yarn_half": (
        "deepseek_v3",
        {"q_lora_rank": 16, "rope_interleave": False, "attention_bias": True}
        | {"rope_parameters": _YARN["rope_parameters"] | {"mscale": 1.0, "mscale_all_dim": 0.8}},
        True,
    ),
    "deepseek_v3-one_group_scaled": (
        "deepseek_v3",
        {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 2.5},
        False,
    ),
    "qwen3_moe-biased_mqa_window": (
        "qwen3_moe",
        {"attention_bias": True, "num_key_value_heads": 1, "head_dim": 8}
        | {"use_sliding_window": True, "sliding_window": 4},
        True,
    ),
    "olmoe-clip_norm_bias_yarn": (
        "olmoe",
        {"clip_qkv": 0.4, "norm_topk_prob": True, "attention_bias": True} | _YARN,
        True,
    ),
    "qwen2_moe-unbiased_wide_unshared": (
        "qwen2_moe",
        {"qkv_bias": False, "head_dim": 32, "norm_topk_prob": True}
        | {"shared_expert_intermediate_size": 0},
        False,
    ),
    "mixtral-window_dynamic_mqa": (
        "mixtral",
        {"sliding_window": 4, "num_key_value_heads": 1} | _DYNAMIC,
        True,
    ),
}
BF16 = ["deepseek_v3-q_lora_yarn_half", "qwen3_moe-biased_mqa_window"]
RUNS = [(c, "f32") for c in CASES] + [(c, "bf16") for c in BF16]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("round13")


@pytest.fixture
def long_prompt() -> torch.Tensor:
    """[B=1, P=12] token ids < 128: past ORIG, so scaled RoPE and the windows act."""
    return torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("case, dtype", RUNS, ids=[f"{c}-{d}" for c, d in RUNS])
def test_combined_fields_equal_transformers(case, dtype, root, prompt, long_prompt):
    """moepipe's greedy tokens are transformers', its last logits within 1e-4 in float32 (one
    bf16 step in bfloat16; observed: below 1e-6, and 0)."""
    family, fields, long = CASES[case]
    cast = DTYPES[dtype]
    built = save_cast(family, TINY | fields, root / f"{case}-{dtype}", cast, cast, randomise)
    assert_transformers(*built, long_prompt if long else prompt, dtype)


@pytest.fixture(scope="module")
def base(root):
    """family -> (a float32 checkpoint of plain RoPE, its greedy logits on the long prompt),
    saved by transformers on first use: the RoPE forms below rewrite its config.json."""
    made: dict[str, tuple[Path, torch.Tensor]] = {}
    prompt = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))

    def get(family: str) -> tuple[Path, torch.Tensor]:
        if family not in made:
            ckpt, hf = save_cast(family, TINY, root / family, *[torch.float32] * 2, randomise)
            made[family] = ckpt, hf_greedy(hf, prompt)[1]
        return made[family]

    return get


def _half(family: str) -> int:
    """Rotated dim pairs of a head: longrope's factor lists are this long."""
    return 16 if family == "qwen3_moe" else 8


def _forms(family: str) -> dict[str, dict[str, Any]]:
    """form -> the config.json fields that replace rope_parameters (null: transformers reads
    rope_scaling and the top-level fields instead)."""
    legacy = {"rope_parameters": None, "rope_theta": 1e4}
    half = _half(family)
    factors = {"short_factor": [1.0] * half, "long_factor": [1.0 + i for i in range(half)]}
    return {
        "legacy_type": legacy | {"rope_scaling": {"type": "linear", "factor": 2.0}},
        "legacy_both_names": legacy
        | {"rope_scaling": {"type": "dynamic", "rope_type": "dynamic", "factor": 4.0}}
        | {"max_position_embeddings": ORIG},
        "legacy_yarn_top_orig": legacy
        | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
        | {"original_max_position_embeddings": ORIG},
        "longrope_top_orig": rope("longrope", **factors)
        | {"original_max_position_embeddings": ORIG},
    }


FORMS = [(f, form) for f in ("mixtral", "qwen3_moe") for form in _forms(f)]


@pytest.mark.parametrize("family, form", FORMS, ids=[f"{f}-{form}" for f, form in FORMS])
def test_rope_form_equals_transformers(family, form, base, long_prompt, tmp_path):
    """Each form runs as transformers reads it: its greedy tokens, float32 logits within 1e-4,
    and other logits than plain RoPE's (the scaling is read, not dropped)."""
    ckpt, plain_logits = base(family)
    edited = Path(shutil.copytree(ckpt, tmp_path / form))
    edit_config(edited, **_forms(family)[form])
    assert_transformers(edited, load_hf(edited), long_prompt, "f32")
    _, logits = reference_generate(edited, long_prompt, GEN)
    assert (logits - plain_logits).abs().max() > 0.01


def test_a_prompt_holding_the_pad_id_equals_transformers_unmasked(base, prompt):
    """moepipe runs a prompt unpadded, as transformers' generate() with an all-ones
    attention_mask (`hf_generate_out`'s call). Without one, generate() masks each prompt token
    equal to pad_token_id, and a prompt holding it decodes otherwise (observed: 0.5 to 2.8 off,
    tokens differing, in every family): a parity check must pass the mask. Before, the parity
    tests' call passed none, so a prompt holding 0 failed them with moepipe right."""
    ckpt, _ = base("mixtral")
    hf = load_hf(ckpt)
    holding = prompt.clone()
    holding[0, 2] = 0  # the pad_token_id hf_generate_out passes
    assert_transformers(ckpt, hf, holding, "f32")
    with torch.inference_mode():
        masked = hf.generate(
            holding,
            max_new_tokens=1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    _, logits = reference_generate(ckpt, holding, 1)
    assert (masked.logits[0].float() - logits)[0].abs().max() > 0.05
    torch.testing.assert_close(masked.logits[0].float()[1], logits[1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["olmoe-clip_norm_bias_yarn", "deepseek_v3-q_lora_yarn_half"])
def test_klotski_run_of_combined_fields_equals_transformers(case, root):
    """A real run (live routing, klotski streaming the experts from disk) of a combination:
    transformers' greedy tokens, its float32 logits within 1e-4 (the 6-token prompts run past
    ORIG, so YaRN stretches them). At test_hf_parity's full width, which the helper's memory
    sizes to stream."""
    from tests.real.test_hf_parity_round10 import assert_run_is_transformers

    family, fields, _ = CASES[case]
    f32 = torch.float32
    built = save_cast(family, fields, root / f"{case}-klotski", f32, f32, randomise)
    assert_run_is_transformers(built, "klotski", {})
