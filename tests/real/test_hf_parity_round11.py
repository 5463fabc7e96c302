"""The eleventh round: the newest families' loose ends, on checkpoints transformers writes.

generation_config.json on Qwen3-MoE and DeepSeek-V3 (round 6's checks, which ran on the four
older families); DeepSeek-V3's moe_layer_freq, scoring_func and topk_method (transformers'
class ignores them, DeepSeek's code reads them: moepipe follows transformers, its stated
reference for V3, and warns); Switch's float16 clamp, which transformers decides over its whole
batch and a real run's ops over their own sequences (a warning where that differs); and
DeepSeek-V3's FP8 release (float8_e4m3fn weights, a float32 weight_scale_inv per block),
dequantized at load as transformers does.

Usage: python -m pytest -q tests/real/test_hf_parity_round11.py
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from real.checkpoint import load_checkpoint
from real.model import reference_generate
from tests.real.fp8_ckpt import FP8_BLOCK, write_fp8
from tests.real.test_hf_parity import DTYPES, GEN, dynamic, hf_greedy, yarn
from tests.real.test_hf_parity_fields import save
from tests.real.test_hf_parity_round6 import (
    HONOURED,
    hf_generate,
    load_hf,
    save_form,
    with_generation,
)

transformers = pytest.importorskip("transformers")

NEWEST = ["qwen3_moe", "deepseek_v3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(family, dtype) -> (checkpoint, transformers' model from it) of test_hf_parity's fields
    of the family, `randomise`d (round 10's), built on first use."""
    from tests.real.test_hf_parity_round10 import built_cases

    root = tmp_path_factory.mktemp("round11")
    made = {f: built_cases(root, f, {f: ({}, ())}) for f in NEWEST}
    return lambda family, dtype="f32": made[family](family, dtype)


# 1. generation_config.json on the newest families


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", NEWEST)
def test_generation_config_equals_transformers_generate(family, dtype, base, prompt, tmp_path):
    """Every honoured generation_config.json field at once (round 6's fields, which each alone
    give transformers' tokens too): the tokens of transformers' generate() on the same folder,
    the last logits within 1e-4 (a bf16 step), moved from the plain greedy tokens."""
    ckpt, hf = base(family, dtype)
    base_tokens = reference_generate(ckpt, prompt, GEN)[0]
    assert torch.equal(base_tokens, hf_generate(hf, prompt)[0])
    tol = 1e-4 if dtype == "f32" else 2**-6
    fields = {k: make(base_tokens) for k, make in HONOURED.items()}
    changed = with_generation(ckpt, tmp_path / "gen", **fields)
    tokens, logits = reference_generate(changed, prompt, GEN)
    hf_tokens, hf_logits = hf_generate(load_hf(changed, dtype), prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)
    assert not torch.equal(tokens, base_tokens)


@pytest.mark.parametrize("form", ["tied", "fused"])
@pytest.mark.parametrize("family", NEWEST)
def test_saved_form_equals_transformers(family, form, prompt, tmp_path):
    """The family-specific forms save_pretrained writes (a tied head, fused experts) of the newest
    families: transformers' greedy tokens, logits within 1e-4 in float32 (observed: 1e-6)."""
    ckpt, hf = save_form(family, form, "f32", tmp_path / "ckpt")
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_generate(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", NEWEST)
def test_real_run_applies_generation_config(family, base, tmp_path):
    """Round 6's real run (flexgen, live routing) on the newest families: a run whose folder
    sets repetition_penalty, no_repeat_ngram_size and suppress_tokens picks each token with
    them, the in-memory forward's and transformers' generate()'s tokens."""
    from tests.real import test_hf_parity_round6 as round6

    round6.test_real_run_applies_generation_config("flexgen", {}, lambda _: base(family), tmp_path)


# 3. DeepSeek-V3's moe_layer_freq: transformers' reading, with a warning


def test_deepseek_v3_moe_layer_freq_follows_transformers_and_warns(prompt, tmp_path, caplog):
    """moe_layer_freq 2 on DeepSeek-V3: transformers' class ignores it (every layer from
    first_k_dense_replace on is MoE) and so does moepipe, its stated reference for V3, with
    transformers' tokens and logits and one warning naming the field and DeepSeek's other
    reading (before: silent). A checkpoint of DeepSeek's layout (layer 1 a dense FFN) is
    refused naming the fields and the reading (before: its dense tensors, "a field moepipe
    does not model")."""
    from real.shards import read_header, read_tensor, save_shard

    ckpt, hf = save("deepseek_v3", {"moe_layer_freq": 2}, tmp_path / "v3")
    with caplog.at_level(logging.WARNING, logger="real.reference_notes"):
        tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    lines = [r.getMessage() for r in caplog.records if "moe_layer_freq is 2" in r.getMessage()]
    assert len(lines) == 1 and "transformers' DeepseekV3 class does" in lines[0]
    spec, _ = load_checkpoint(ckpt)
    dense = tmp_path / "deepseek-layout"
    shutil.copytree(ckpt, dense)
    file = dense / "model.safetensors"
    t = {n: read_tensor(e) for n, e in read_header(file).items()}
    t = {n: x for n, x in t.items() if not n.startswith("model.layers.1.mlp.")}
    h, f = spec.hidden_size, spec.dense_ffn_size
    for proj, shape in (("gate", (f, h)), ("up", (f, h)), ("down", (h, f))):
        t[f"model.layers.1.mlp.{proj}_proj.weight"] = torch.zeros(shape)
    save_shard(t, file, {"format": "pt"})
    with pytest.raises(ConfigError, match=r"layer\(s\) \[1\] are MoE by first_k_dense_replace"):
        load_checkpoint(dense)


def test_deepseek_v3_router_fields_of_deepseeks_code_warn(base, prompt, tmp_path, caplog):
    """scoring_func and topk_method, which transformers' DeepseekV3 class does not have (it
    scores by sigmoid and ranks groups, always) and DeepSeek's V3 code implements at sigmoid
    and noaux_tc alone: at another value moepipe runs transformers' router, with its tokens
    and logits, and warns once naming each field (before: silent)."""
    from tests.real.test_hf_parity_fields import edit_config

    ckpt, _ = base("deepseek_v3")
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    edit_config(other, scoring_func="softmax", topk_method="greedy")
    with caplog.at_level(logging.WARNING, logger="real.reference_notes"):
        tokens, logits = reference_generate(other, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(load_hf(other, "f32"), prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    lines = [r.getMessage() for r in caplog.records if "DeepseekV3 class does" in r.getMessage()]
    assert len(lines) == 2 and "scoring_func='softmax'" in lines[0]
    assert "topk_method='greedy'" in lines[1] and "noaux_tc" in lines[1]


# 2. Switch in float16: transformers clamps over the whole batch, an executor's op over its part


@pytest.fixture(scope="module")
def switch_split(tmp_path_factory):
    return switch_split_ckpt(tmp_path_factory.mktemp("round11-switch") / "split")


def switch_split_ckpt(ckpt: Path) -> Path:
    """A float16 Switch (its head untied) whose token 44 embeds 65000 and token 36 65504 in
    dimension 3, and whose dense block's wo writes 30 times the sum of its activations there:
    at that block's FFN add a sequence holding 36 overflows, one holding 44 alone keeps a
    value within 1000 of float16's max. The executor's prompts hold 44 in batch 0 alone and
    36 in batch 1 alone."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    layers = SWITCH_LAYERS | SWITCH_SPARSE
    cfg = transformers.SwitchTransformersConfig(**SWITCH, **layers, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.shared.weight[44, 3], model.shared.weight[36, 3] = 65000.0, 65504.0
        model.encoder.block[0].layer[-1].mlp.wo.weight[3, :] = 30.0
    model.to(torch.float16).save_pretrained(ckpt)
    return ckpt


def test_switch_float16_clamp_split_over_ops_warns(switch_split, caplog):
    """transformers' block decides its float16 clamp over its whole batch (max - 1000 where
    any value is infinite), moepipe's forward over the batch it is given (round 10's
    test_switch_float16_clamps_as_transformers_block, two sequences), an executor's op over
    the sequences it holds. A real run whose 4 sequences are one batch clamps as the forward
    does, its logits bit for bit; in 2 batches, one overflowing and the other keeping 65000,
    the ops cannot decide together: the run warns in one line naming the layer and the step
    (before: silent), and here its logits are still the forward's (the norms wash the one
    value out)."""
    import dataclasses

    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from tests.real.test_executor import OFFLOAD, WORKLOAD

    spec, _ = load_checkpoint(switch_split)
    prompts = prompts_for(spec, WORKLOAD)
    assert (prompts[:2] == 44).any() and not (prompts[2:] == 44).any()
    assert (prompts[2:] == 36).any() and not (prompts[:2] == 36).any()
    tokens, logits = reference_generate(switch_split, prompts, WORKLOAD.gen_len)
    whole = dataclasses.replace(WORKLOAD, batch_size=4, n_batches=1)
    for wl, warned in ((whole, False), (WORKLOAD, True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="real.ops"):
            _, out = real_execute(switch_split, RunSpec(spec, OFFLOAD, wl, "klotski", {}), "live")
        assert torch.equal(out.tokens, tokens) and torch.equal(out.logits, logits)
        lines = [r.getMessage() for r in caplog.records if "overflowed float16" in r.getMessage()]
        assert len(lines) == warned, lines
    assert lines[0].startswith("layer 0 (FFN) at step 0 ") and "\n" not in lines[0]


# 4. DeepSeek-V3's FP8 release: float8_e4m3fn weights, a float32 weight_scale_inv per block


def dequantized(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """DeepSeek's weight_dequant (its inference/kernel.py) of q [R, C]: each block of q, the
    last of a dimension cut short, times its scale, in float32."""
    r, c = q.shape
    g = torch.zeros(scale.shape[0] * block, scale.shape[1] * block)
    g[:r, :c] = q.float()
    g = g.reshape(scale.shape[0], block, scale.shape[1], block) * scale[:, None, :, None]
    return g.flatten(0, 1).flatten(1, 2)[:r, :c].contiguous()


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory):
    """dtype -> (DeepSeek-V3's q_lora_rank checkpoint in FP8 blocks, transformers' model
    loaded from it: without a GPU, dequantized to the dtype), built on first use."""
    from tests.real.test_hf_parity_round10 import built_cases
    from tests.real.test_hf_parity_round10b import CASES

    root = tmp_path_factory.mktemp("round11-fp8")
    plain = built_cases(root, "deepseek_v3", CASES)
    made: dict[str, tuple[Path, Any]] = {}

    def get(dtype: str = "f32") -> tuple[Path, Any]:
        if dtype not in made:
            ckpt = write_fp8(plain("deepseek_v3-q_lora_rank", dtype)[0], root / f"fp8-{dtype}")
            made[dtype] = ckpt, load_hf(ckpt, dtype)
        return made[dtype]

    return get


@pytest.mark.filterwarnings("ignore")  # transformers: "requires a GPU ... dequantizing"
@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_v3_fp8_equals_transformers(dtype, v3_fp8, prompt):
    """DeepSeek-V3's FP8 form (float8_e4m3fn weights, a float32 weight_scale_inv per 8x8
    block): moepipe dequantizes each weight at load as transformers does (the weight in
    float32 times its block's scale, cast to the run's dtype), with transformers' greedy
    tokens and its logits within 1e-4 in float32 (one bf16 step in bfloat16; observed: 0 in
    both). Before: "quantization_config (quant_method 'fp8'): quantized checkpoints are not
    implemented"."""
    ckpt, hf = v3_fp8(dtype)
    assert hf.model.layers[1].self_attn.o_proj.weight.dtype == DTYPES[dtype]
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if dtype == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("planner", ["klotski", "eplb"])
def test_deepseek_v3_fp8_real_executor_equals_transformers(planner, v3_fp8):
    """A real run of the FP8 checkpoint, streaming its experts from disk (klotski: the disk
    tier reads the float8 bytes and their scales and dequantizes them into the host buffer) or
    with dense=tensor on 2 GPUs (eplb: each GPU's heads of the dequantized MLA): transformers'
    greedy tokens and last logits within 1e-4."""
    from tests.real.test_hf_parity_round10 import TENSOR, assert_run_is_transformers

    assert_run_is_transformers(v3_fp8("f32"), planner, TENSOR if planner == "eplb" else {})


@pytest.mark.filterwarnings("ignore")
def test_deepseek_v3_fp8_partial_blocks_dequantize_as_deepseeks_kernel(prompt, tmp_path):
    """A block that does not divide a weight (the release's kv_a_proj_with_mqa: 576 rows in
    blocks of 128; here 72, 24 and 96 in blocks of 16) leaves its last block short, as
    DeepSeek's weight_dequant reads it (transformers 5.24's CPU dequantizer fails on such a
    grid: "issues during automatic conversion"). moepipe's tokens and logits are, bit for bit,
    those of the float32 checkpoint holding the weights DeepSeek's kernel dequantizes."""
    from real.shards import read_header, read_tensor, save_shard
    from tests.real.test_hf_parity_round10 import built_cases
    from tests.real.test_hf_parity_round10b import CASES

    plain = built_cases(tmp_path, "deepseek_v3", CASES)("deepseek_v3-q_lora_rank")[0]
    fp8 = write_fp8(plain, tmp_path / "fp8", 16)
    t = {n: read_tensor(e) for n, e in read_header(fp8 / "model.safetensors").items()}
    assert t["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 4)
    file = plain / "model.safetensors"
    save_shard(
        {
            n: dequantized(x, t[n + "_scale_inv"], 16) if n + "_scale_inv" in t else x
            for n, x in t.items()
            if not n.endswith("_scale_inv")
        },
        file,
        {"format": "pt"},
    )
    tokens, logits = reference_generate(fp8, prompt, GEN)
    want_tokens, want_logits = reference_generate(plain, prompt, GEN)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


# quantization_config or FP8 tensors moepipe does not run: one line naming the field or tensor
FP8_REFUSED = {
    "method": ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    "per-tensor": ({"weight_block_size": None}, "weight_block_size=None: fp8 weights run with"),
    "block-3": ({"weight_block_size": [8, 8, 8]}, "weight_block_size=\\[8, 8, 8\\]"),
    "e5m2": ({"fmt": "e5m2"}, "quantization_config.fmt='e5m2': moepipe runs fp8"),
    "static": ({"activation_scheme": "static"}, "activation_scheme='static'"),
    "unknown": ({"group_size": 64}, "quantization_config.group_size: not a field"),
    "grid": ({"weight_block_size": [16, 8]}, "weight_block_size \\[16, 8\\] over"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("case", FP8_REFUSED)
def test_deepseek_v3_fp8_refusals_are_one_line(case, v3_fp8, tmp_path):
    """A quantization_config moepipe does not run (another method, per-tensor scales, e5m2,
    static activation scales, a field it does not know) or a block that does not make the
    saved scale grid is refused in one line naming the field (or the tensor)."""
    from tests.real.test_hf_parity_fields import edit_config

    base, _ = v3_fp8("f32")
    bad = tmp_path / "bad"
    shutil.copytree(base, bad)
    fields, match = FP8_REFUSED[case]
    quant = json.loads((bad / "config.json").read_text())["quantization_config"]
    edit_config(bad, quantization_config=quant | fields)
    with pytest.raises(ConfigError, match=match) as e:
        load_checkpoint(bad)
    assert "\n" not in str(e.value)


@pytest.mark.filterwarnings("ignore")
def test_deepseek_v3_fp8_tensors_without_their_pair_are_one_line(v3_fp8, tmp_path):
    """A float8 weight whose weight_scale_inv is missing, or scales without their float8
    weight, are refused in one line naming the tensor."""
    from real.shards import read_header, read_tensor, save_shard

    base, _ = v3_fp8("f32")
    name = "model.layers.1.self_attn.o_proj.weight"
    for drop, match in ((name + "_scale_inv", "has no"), (name, "scales no float8_e4m3fn")):
        bad = tmp_path / drop
        shutil.copytree(base, bad)
        file = bad / "model.safetensors"
        t = {n: read_tensor(e) for n, e in read_header(file).items() if n != drop}
        if drop == name:
            t[name] = torch.zeros(t[name + "_scale_inv"].shape[0] * FP8_BLOCK, 64)
        save_shard(t, file, {"format": "pt"})
        with pytest.raises(ConfigError, match=match) as e:
            load_checkpoint(bad)
        assert "\n" not in str(e.value) and name in str(e.value)


# 5. Other field values of the newest families, probed against transformers (all equal)


def linear(theta: float) -> dict[str, Any]:
    """Linear RoPE scaling (position interpolation) 4x."""
    return {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": theta}}


# case -> (family, config.json fields over test_hf_parity's family ones)
PROBED: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe-linear": ("qwen3_moe", linear(1e6)),
    "qwen3_moe-dynamic": ("qwen3_moe", dynamic(1e6)),
    "qwen3_moe-window-yarn": (
        "qwen3_moe",
        {"use_sliding_window": True, "sliding_window": 4} | yarn(1e6),
    ),
    "deepseek_v3-n_group1": ("deepseek_v3", {"n_group": 1, "topk_group": 1}),
    "deepseek_v3-first_k0": ("deepseek_v3", {"first_k_dense_replace": 0, "n_shared_experts": 2}),
    "deepseek_v3-dynamic": ("deepseek_v3", dynamic(1e4) | {"num_experts_per_tok": 3}),
}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """family -> (case, dtype) -> (checkpoint, transformers' model) of PROBED's fields."""
    from tests.real.test_hf_parity_round10 import built_cases

    root = tmp_path_factory.mktemp("round11-probed")
    return {
        f: built_cases(root, f, {k: (v, ()) for k, (g, v) in PROBED.items() if g == f})
        for f in NEWEST
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PROBED)
def test_probed_field_values_equal_transformers(case, dtype, probed, prompt, tmp_path):
    """Field values of the newest families no earlier round ran (linear and dynamic RoPE,
    a window with YaRN; one expert group, no dense layer, top-3 with dynamic RoPE): greedy
    tokens equal transformers', logits within 1e-4 in float32 (observed: 6e-7 and 0)."""
    from tests.real.test_hf_parity_round10 import assert_case_is_transformers

    family = PROBED[case][0]
    assert_case_is_transformers(probed[family](case, dtype), (), prompt, tmp_path)
