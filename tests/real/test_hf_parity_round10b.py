"""The tenth round's second family: DeepSeek-V3 (`model_type: deepseek_v3`) end to end, on
checkpoints transformers' DeepseekV3ForCausalLM writes.

DeepSeek-V3 was refused in one line ("not supported"). It now runs as transformers runs it: the
sigmoid router with its e_score_correction_bias (kept in float32, as the router's weight),
groups ranked by their best two scores (n_group, topk_group), norm_topk_prob then
routed_scaling_factor on every weight, first_k_dense_replace, MLA shared with V2 (q_lora_rank,
attention_bias, MLA sizes), its RoPE on interleaved pairs (rope_interleave, or rotate_half
without it), YaRN's softmax scale; through moepipe's forward and the real executor's planners,
in float32 and bfloat16.

Usage: python -m pytest -q tests/real/test_hf_parity_round10b.py
"""

from __future__ import annotations

import shutil

import pytest
import torch

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from real.model import live_routing, reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, hf_greedy, yarn
from tests.real.test_hf_parity_fields import edit_config
from tests.real.test_hf_parity_round10 import (
    ON_EXECUTORS,
    Cases,
    assert_case_is_transformers,
    assert_run_is_transformers,
    built_cases,
)

transformers = pytest.importorskip("transformers")

# case -> (config.json fields over test_hf_parity's deepseek_v3 ones, the fields whose effect
# the test checks by their absence)
CASES: Cases = {
    # absent, routed_scaling_factor is 2.5
    "deepseek_v3": ({"routed_scaling_factor": 1.5}, ("routed_scaling_factor",)),
    "deepseek_v3-q_lora_rank": ({"q_lora_rank": 24, "attention_bias": True}, ()),
    # every MLA size independent of the others
    "deepseek_v3-mla_dims": (
        {"qk_nope_head_dim": 12, "qk_rope_head_dim": 4, "v_head_dim": 20, "kv_lora_rank": 24},
        (),
    ),
    "deepseek_v3-rope_half": ({"rope_interleave": False}, ("rope_interleave",)),
    # a top-1 weight scaled, not renormalised
    "deepseek_v3-no_norm_top1": (
        {"norm_topk_prob": False, "num_experts_per_tok": 1, "routed_scaling_factor": 2.0},
        (),
    ),
    "deepseek_v3-yarn": (yarn(1e4, mscale=1.0, mscale_all_dim=0.5), ("rope_parameters",)),
}


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    return built_cases(tmp_path_factory.mktemp("round10b"), "deepseek_v3", CASES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_deepseek_v3_equals_transformers(case, dtype, v3, prompt, tmp_path):
    """moepipe's greedy tokens are transformers' in float32 and bfloat16, its last logits within
    1e-4 in float32 and one bf16 step in bfloat16 (observed: 0 in both); the spec sizes each
    layer (the router's float32 weight and correction bias included) as the checkpoint holds
    it; a field under test moves the logits from its absence. Before: `model_type
    'deepseek_v3' is not supported`."""
    ckpt, hf = v3(case, dtype)
    assert hf.config.model_type == "deepseek_v3"
    assert_case_is_transformers((ckpt, hf), CASES[case][1], prompt, tmp_path)


def test_deepseek_v3_correction_bias_moves_the_routing(v3, prompt, tmp_path):
    """e_score_correction_bias chooses experts: the checkpoint with it zeroed routes other
    tokens to other experts (its weights are the unbiased scores, so only the choice moves)."""
    from real.shards import read_header, read_tensor, save_shard

    ckpt, _ = v3("deepseek_v3")
    zeroed = tmp_path / "zeroed"
    shutil.copytree(ckpt, zeroed)
    file = zeroed / "model.safetensors"
    t = {n: read_tensor(e).clone() for n, e in read_header(file).items()}
    biases = [n for n in t if n.endswith("e_score_correction_bias")]
    assert biases and all(t[n].dtype == torch.float32 for n in biases)
    save_shard({n: x.zero_() if n in biases else x for n, x in t.items()}, file, {})
    ids = live_routing(ckpt, prompt, GEN).expert_ids
    assert (ids != live_routing(zeroed, prompt, GEN).expert_ids).any()


def test_deepseek_v3_reads_its_layers_and_router(v3):
    """The spec and runtime of the base case: first_k_dense_replace 1 leaves layer 0 dense, one
    shared expert, 4 groups of which 2 are kept, the sigmoid router renormalised (the class's
    default) then scaled 1.5 times, its RoPE on interleaved pairs."""
    from core.hf_config import hf_runtime
    from real.checkpoint import hf_config

    ckpt, _ = v3("deepseek_v3")
    spec, _ = load_checkpoint(ckpt)
    run = hf_runtime(hf_config(ckpt), spec)
    assert (spec.moe_layers, spec.shared_ffn_size, spec.dense_ffn_size) == ((1,), 32, 48)
    assert (run.expert_groups, run.renormalize, run.routed_scaling) == ((4, 2), True, 1.5)
    assert run.sigmoid_router and run.mla_rope == "interleave"
    assert spec.gate_bytes == (spec.hidden_size + 1) * 8 * 4 + spec.hidden_size * 4


@ON_EXECUTORS
def test_deepseek_v3_real_executor_equals_transformers(planner, params, dtype, v3):
    """A real run (live routing) of the q_lora_rank checkpoint gives transformers' greedy
    tokens, and its last logits within 1e-4 of transformers' in float32: klotski streaming the
    experts from disk, ep_static on 2 GPUs' streams, eplb with dense=tensor (each GPU's heads
    of MLA, its latent whole on each)."""
    assert_run_is_transformers(v3("deepseek_v3-q_lora_rank", dtype), planner, params)


# config.json's refusals, each one line naming the field

REFUSED = [
    ({"n_group": 3}, "n_routed_experts=8 is not a multiple of n_group=3"),
    ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
    ({"n_group": 8, "topk_group": 1}, "n_group=8 leaves fewer than 2 experts a group"),
    ({"n_group": None}, "n_group is null: DeepSeek-V3's router always groups its experts"),
    ({"topk_group": None}, "topk_group is null: DeepSeek-V3's router always groups"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 with num_attention_heads=4 and v_"),
]


@pytest.mark.parametrize("fields, match", REFUSED, ids=[next(iter(f)) for f, _ in REFUSED])
def test_deepseek_v3_refusals_are_one_line(fields, match, v3, tmp_path):
    """Groups transformers' router cannot form (it fails on each) and key/value heads MLA does
    not have are refused naming the field."""
    base, _ = v3("deepseek_v3")
    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    edit_config(bad, **fields)
    with pytest.raises(ConfigError, match=match) as e:
        reference_generate(bad, torch.zeros(1, 4, dtype=torch.long), 2)
    assert "\n" not in str(e.value)


def test_deepseek_v3_float32_router_in_bfloat16_weights_runs(v3, prompt, tmp_path):
    """DeepSeek-V3's bfloat16 releases save the router's weight and correction bias in float32,
    which transformers loads and keeps in float32: moepipe's forward and a real run (klotski,
    from disk) give transformers' tokens, the forward its logits (before: "tensor ... is
    torch.float32, config.json says torch.bfloat16"), and another tensor saved in float32 is
    still named."""
    from real.shards import read_header, read_tensor, save_shard

    ckpt, _ = v3("deepseek_v3", "bf16")
    mixed = tmp_path / "mixed"
    shutil.copytree(ckpt, mixed)
    file = mixed / "model.safetensors"
    t = {n: read_tensor(e).clone() for n, e in read_header(file).items()}
    router = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
    save_shard({n: x.float() if n.endswith(router) else x for n, x in t.items()}, file, {})
    hf = transformers.AutoModelForCausalLM.from_pretrained(mixed, dtype=torch.bfloat16).eval()
    tokens, logits = reference_generate(mixed, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=2**-6, rtol=0)
    assert_run_is_transformers((mixed, hf), "klotski", {})  # the disk tier converts them
    t["model.norm.weight"] = t["model.norm.weight"].float()
    save_shard({n: x.float() if n.endswith(router) else x for n, x in t.items()}, file, {})
    with pytest.raises(ConfigError, match="model.norm.weight is torch.float32, config.json says"):
        load_checkpoint(mixed)


@pytest.mark.parametrize("name", ["deepseek-v3", "qwen3-30b-a3b"])
def test_the_model_yaml_is_a_run_config(name):
    """conf/model/deepseek-v3.yaml gives q_lora_rank and qk_rope_head_dim, spec fields the run
    schema left out: `experiments.run model=deepseek-v3` refused them as unknown keys. Every
    spec field but the compute dtype's (float16, executor.dtype's) is now a schema key, and
    both new models' files resolve to their specs."""
    from dataclasses import fields

    from omegaconf import OmegaConf

    from core.spec import ModelSpec
    from experiments.common.resolve import model_spec
    from experiments.common.schema import ModelSchema
    from real.checkpoint import CONF_MODEL_DIR, reduced_spec

    assert {f.name for f in fields(ModelSpec)} - {f.name for f in fields(ModelSchema)} == {
        "float16"
    }
    model = OmegaConf.merge(ModelSchema, OmegaConf.load(CONF_MODEL_DIR / f"{name}.yaml"))
    assert model_spec(OmegaConf.create({"model": model})) == reduced_spec(name)
