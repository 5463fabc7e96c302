"""A ninth round: Switch's dense_act_fn, longrope and proportional RoPE, float16 compute, and
DeepSeek-V2's fields its transformers class ignores, on checkpoints transformers writes.

Switch's dense_act_fn other than relu, longrope and proportional RoPE, and float16 compute
(executor.dtype=float16, or auto on float16 weights) were refused in one line; each now runs
as transformers runs it. DeepSeek-V2's router weights, which transformers keeps in float32 at
any dtype, were rounded to the compute dtype; moe_layer_freq's warning had no test.

Usage: python -m pytest -q tests/real/test_hf_parity_round9.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from core.hf_config.runtime import GATED_ACTS
from real.checkpoint import Tensor, load_checkpoint, load_units
from real.model import Model, reference_generate
from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def switch(tmp_path_factory):
    """dense_act_fn -> (checkpoint, transformers' model) of one seeded Switch, built on first
    use (the same weights under each activation)."""
    root = tmp_path_factory.mktemp("round9-switch")
    made: dict[str, tuple[Path, Any]] = {}

    def get(act: str) -> tuple[Path, Any]:
        if act not in made:
            sizes = SWITCH | SWITCH_LAYERS | SWITCH_SPARSE
            cfg = transformers.SwitchTransformersConfig(**sizes, dense_act_fn=act)
            torch.manual_seed(0)
            model = transformers.SwitchTransformersForConditionalGeneration(cfg).eval()
            model.save_pretrained(root / act)
            made[act] = root / act, model
        return made[act]

    return get


# the ACT2FN names run end to end as Switch's dense_act_fn: the first nine and the clipped
# gelu_10 (round 12's test_activation_is_act2fn_bit_for_bit checks every function)
SWITCH_ACTS = (*GATED_ACTS[:9], "gelu_10")


@pytest.mark.parametrize("act", SWITCH_ACTS)
def test_switch_dense_act_fn_is_transformers(act, switch, prompt):
    """ACT2FN names the causal families run, as Switch's dense_act_fn: moepipe's experts
    and dense FFNs (wo(act(wi x))) equal transformers' SwitchTransformersDenseActDense on the
    saved weights within 1e-6, and a generation runs with it (moepipe's Switch is a causal
    substitute, so its logits are its own). Before: refused ("only 'relu' experts")."""
    ckpt, hf = switch(act)
    spec, units = load_units(ckpt)
    model = Model.from_checkpoint(ckpt, spec)
    assert model.hidden_act == act
    x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    blocks = hf.encoder.block
    checked = 0
    for unit, w in units.items():
        if unit.kind == Tensor.EXPERT:
            mlp = blocks[unit.layer].layer[-1].mlp.experts[f"expert_{unit.expert}"]
            ours = model.expert(w, x)
        elif unit.kind == Tensor.FFN:
            mlp = blocks[unit.layer].layer[-1].mlp
            ours = model._ffn(w, x)
        else:
            continue
        with torch.no_grad():
            torch.testing.assert_close(ours, mlp(x), atol=1e-6, rtol=0)
        checked += 1
    assert checked == spec.n_experts + 1  # one sparse layer's experts, one dense layer
    tokens, _ = reference_generate(ckpt, prompt, 2)
    assert tokens.shape == (2, 2)


def test_switch_dense_act_fn_changes_the_logits(switch, prompt):
    """The activation runs: gelu's logits differ from relu's on the same weights."""
    _, relu = reference_generate(switch("relu")[0], prompt, 2)
    _, gelu = reference_generate(switch("gelu")[0], prompt, 2)
    assert (relu - gelu).abs().max() > 1e-3


def test_switch_unknown_dense_act_fn_is_one_line(switch, tmp_path):
    """A name transformers' ACT2FN does not have is refused naming the field."""
    import shutil

    from core.errors import ConfigError
    from tests.real.test_hf_parity_fields import edit_config

    shutil.copytree(switch("relu")[0], tmp_path / "c")
    edit_config(tmp_path / "c", dense_act_fn="relu3")
    with pytest.raises(ConfigError, match="dense_act_fn='relu3' is not implemented for switch"):
        load_checkpoint(tmp_path / "c")


# RoPE types: every key of transformers 5.24's ROPE_INIT_FUNCTIONS (longrope and proportional
# were refused), over prompts shorter and longer than longrope's original length

CAUSAL = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"]
ORIG = 7  # longrope's original_max_position_embeddings: the 6-token prompt's decode crosses it


def rope_fields(family: str, kind: str) -> dict[str, Any]:
    """config.json's RoPE of `kind` for a family (DeepSeek rotates 8 dims, Qwen3-MoE 32, the
    others 16)."""
    dim = {"deepseek_v2": 8, "deepseek_v3": 8, "qwen3_moe": 32}.get(family, 16)
    if kind == "proportional":  # the first half of the pairs rotated, at half the frequency
        rope = {"rope_type": kind, "partial_rotary_factor": 0.5, "factor": 2.0}
    else:
        g = torch.Generator().manual_seed(3)
        rope = {
            "rope_type": kind,
            "short_factor": (1 + torch.rand(dim // 2, generator=g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(dim // 2, generator=g)).tolist(),
            "original_max_position_embeddings": ORIG,
        }
    return {"rope_parameters": {"rope_theta": 1e4, **rope}}


@pytest.fixture(scope="module")
def roped(tmp_path_factory):
    """(family, RoPE type) -> (checkpoint, transformers' model loaded from it), float32."""
    from tests.real.test_hf_parity_fields import save

    root = tmp_path_factory.mktemp("round9-rope")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(family: str, kind: str) -> tuple[Path, Any]:
        if (family, kind) not in made:
            made[family, kind] = save(family, rope_fields(family, kind), root / f"{family}-{kind}")
        return made[family, kind]

    return get


def test_every_rope_type_transformers_initialises_runs():
    """The types moepipe runs are default and every key of transformers' ROPE_INIT_FUNCTIONS, so
    a type a new transformers adds fails here until it is implemented or refused."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from real.attention import ROPE_TYPES

    assert set(ROPE_TYPES) == {"default", *ROPE_INIT_FUNCTIONS}


def long_prompt() -> torch.Tensor:
    """[B=2, P=10] token ids: a prompt longer than ORIG, so its prefill runs long factors."""
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("length", ["short", "long"])
@pytest.mark.parametrize("kind", ["longrope", "proportional"])
@pytest.mark.parametrize("family", CAUSAL)
def test_rope_type_is_transformers(family, kind, length, roped, prompt):
    """longrope (short_factor up to original_max_position_embeddings, long_factor past it,
    chosen per forward by the step's last position as transformers' generate does: the short
    prompt's prefill and first decode steps run short factors, its last ones long) and
    proportional (partial_rotary_factor of the pairs rotated, the rest not): transformers'
    greedy tokens, its float32 logits within 1e-4. Before: refused ("rope_type='longrope' is
    not implemented")."""
    from tests.real.test_hf_parity_fields import assert_transformers

    ckpt, hf = roped(family, kind)
    assert_transformers(ckpt, hf, prompt if length == "short" else long_prompt(), "f32")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_longrope_switches_factors_mid_generation(family, roped, prompt, tmp_path):
    """The switch counts: with long_factor set to short_factor the short prompt's last decode
    step (positions past ORIG) gives other logits, and so does proportional's plain twin."""
    import json
    import shutil

    from tests.real.test_hf_parity_fields import edit_config

    ckpt, _ = roped(family, "longrope")
    _, logits = reference_generate(ckpt, prompt, 4)
    same = tmp_path / "same"
    shutil.copytree(ckpt, same)
    rope = json.loads((ckpt / "config.json").read_text())["rope_parameters"]
    edit_config(same, rope_parameters=rope | {"long_factor": rope["short_factor"]})
    _, short_only = reference_generate(same, prompt, 4)
    assert (logits - short_only).abs().max() > 1e-3
    _, first_steps = reference_generate(ckpt, prompt, 1)  # the prefill, under ORIG: short
    _, first_same = reference_generate(same, prompt, 1)
    assert torch.equal(first_steps, first_same)


def test_longrope_top_level_original_length_and_attention_factor(roped, prompt, tmp_path):
    """A top-level original_max_position_embeddings (Phi-3 keeps it there) wins over the RoPE
    object's, as transformers' standardize_rope_params has it, and a given attention_factor
    replaces the one derived from max_position_embeddings / that length: transformers' tokens
    and logits on the edited checkpoint, whose last two steps now run long factors."""
    import json
    import shutil

    from tests.real.test_hf_parity_fields import assert_transformers, edit_config, load_hf

    ckpt, _ = roped("qwen2_moe", "longrope")
    edited = tmp_path / "edited"
    shutil.copytree(ckpt, edited)
    rope = json.loads((ckpt / "config.json").read_text())["rope_parameters"]
    fields = {"original_max_position_embeddings": 8, "attention_factor": 1.3}
    edit_config(edited, original_max_position_embeddings=5, rope_parameters=rope | fields)
    assert_transformers(edited, load_hf(edited), prompt, "f32")
    _, logits = reference_generate(edited, prompt, 4)
    assert (logits - reference_generate(ckpt, prompt, 4)[1]).abs().max() > 1e-3


def test_a_longrope_factor_list_of_another_length_is_one_line(roped, tmp_path):
    """A factor list not of one factor per rotated dim pair is refused naming it (transformers
    warns, then fails multiplying the frequencies)."""
    import json
    import shutil

    from core.errors import ConfigError
    from tests.real.test_hf_parity_fields import edit_config

    ckpt, _ = roped("olmoe", "longrope")
    shutil.copytree(ckpt, tmp_path / "c")
    rope = json.loads((ckpt / "config.json").read_text())["rope_parameters"]
    edit_config(tmp_path / "c", rope_parameters=rope | {"long_factor": [1.0, 2.0]})
    with pytest.raises(ConfigError, match=r"long_factor has 2 factors; .* 8 here"):
        reference_generate(tmp_path / "c", torch.zeros(1, 4, dtype=torch.long), 1)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v2"])
def test_a_real_run_with_longrope_is_the_in_memory_forward(family, roped):
    """Offloaded (flexgen: experts from disk and host), the workload's 6-token prompts and 3
    steps, the last past ORIG: the in-memory forward's tokens, its logits within 1e-5."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from tests.real.test_executor import OFFLOAD, WORKLOAD, assert_matches_reference

    ckpt, _ = roped(family, "longrope")
    model, _ = load_checkpoint(ckpt)
    spec = RunSpec(model, OFFLOAD, WORKLOAD, "flexgen", {})
    result, out = real_execute(ckpt, spec, "live")
    assert_matches_reference(ckpt, spec, result, out, 1e-5)


# float16 compute: transformers' from_pretrained(dtype=torch.float16) on CPU

SAVED = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
# float16 logits' bound: one float16 step of a logit in [2, 4) (measured: 0 on these
# checkpoints, DeepSeek-V2's float32 router included; docs/commands.md, "Saved and compute
# dtypes")
F16_TOL = 2**-9


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """(family, saved dtype) -> (checkpoint, transformers' model loaded from it in float16): one
    seeded float32 model per family, cast and saved by transformers, built on first use."""
    root = tmp_path_factory.mktemp("round9-f16")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(family: str, dtype: str) -> tuple[Path, Any]:
        if (family, dtype) not in made:
            from tests.real.test_hf_parity_fields import save_cast

            to = root / f"{family}-{dtype}"
            made[family, dtype] = save_cast(family, {}, to, SAVED[dtype], torch.float16)
        return made[family, dtype]

    return get


@pytest.mark.parametrize("dtype", SAVED)
@pytest.mark.parametrize("family", CAUSAL)
def test_float16_compute_is_transformers(family, dtype, halves, prompt):
    """Saved float16/bfloat16/float32, run in float16 (executor.dtype=float16; auto on float16
    weights): transformers' greedy tokens in float16, its logits within F16_TOL. Before:
    refused ("float16 compute is not implemented")."""
    from tests.real.test_hf_parity import GEN, hf_greedy

    ckpt, hf = halves(family, dtype)
    spec, _ = load_checkpoint(ckpt, "float16")
    assert (spec.dtype_bytes, spec.float16) == (2, True)
    tokens, logits = reference_generate(
        ckpt, prompt, GEN, dtype=None if dtype == "f16" else "float16"
    )
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=F16_TOL, rtol=0)


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v2"])
def test_a_dense_tensor_run_in_float16_rounds_its_parts(family, halves):
    """dense=tensor over 2 devices in float16: as in bfloat16 (docs/replication-model.md), each
    device's part of a row-parallel projection is rounded before the all-reduce sums them, so
    the logits are the in-memory forward's within 4 float16 steps of a logit in [2, 4), not bit
    for bit (measured: 2^-9 to 2^-8); its tokens here are the forward's."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from tests.real.test_executor import RESIDENT_2GPU, WORKLOAD

    ckpt, _ = halves(family, "f16")
    model, _ = load_checkpoint(ckpt)
    params = {"dense": "tensor", "n_devices": 2}
    result, out = real_execute(
        ckpt, RunSpec(model, RESIDENT_2GPU, WORKLOAD, "ep_static", params), "live"
    )
    wl = WORKLOAD.with_(n_batches=result.summary["n_batches"])
    tokens, logits = reference_generate(ckpt, prompts_for(model, wl), wl.gen_len, out.routing)
    assert torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logits, logits, atol=4 * F16_TOL, rtol=0)


@pytest.mark.slow
def test_a_distributed_run_in_float16_is_the_in_memory_forward(halves):
    """Expert-parallel on 2 gloo processes, float16 weights run as auto: each rank computes in
    float16 (its dispatch and combine carry float16 rows) and the run is the in-memory float16
    forward's tokens and logits, bit for bit."""
    from experiments.common.dist_run import run_distributed
    from experiments.common.real_run import prompts_for
    from tests.real.test_distributed import spec_of

    ckpt, _ = halves("olmoe", "f16")
    spec = spec_of(ckpt, "ep_static", 2)
    assert spec.model.float16
    out = run_distributed(str(ckpt), spec, "live", None, 60)
    wl = spec.workload
    tokens, logits = reference_generate(ckpt, prompts_for(spec.model, wl), wl.gen_len, out.routing)
    assert torch.equal(out.tokens, tokens) and torch.equal(out.logits, logits)


def test_auto_runs_float16_weights_in_float16_and_bad_dtypes_are_one_line(halves):
    """auto computes in the saved dtype, float16 too (every tensor float16); bfloat16 weights
    run as bfloat16, not float16; an unknown executor.dtype is one line naming the choices."""
    from core.errors import ConfigError

    ckpt, _ = halves("olmoe", "f16")
    spec, units = load_units(ckpt)
    assert spec.float16 and {t.dtype for w in units.values() for t in w.values()} == {torch.float16}
    assert not load_checkpoint(halves("olmoe", "bf16")[0])[0].float16
    with pytest.raises(ConfigError, match=r"executor.dtype=int8: not a compute dtype; .*float16"):
        load_checkpoint(ckpt, "int8")


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v2"])
def test_a_real_run_in_float16_is_the_in_memory_forward(family, halves):
    """The real executor over the offload tiers (flexgen: experts from disk and host) on float16
    weights, dtype auto: the in-memory float16 forward's tokens and logits."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from tests.real.test_executor import OFFLOAD, WORKLOAD, assert_matches_reference

    ckpt, _ = halves(family, "f16")
    model, _ = load_checkpoint(ckpt)
    assert model.float16
    spec = RunSpec(model, OFFLOAD, WORKLOAD, "flexgen", {})
    result, out = real_execute(ckpt, spec, "live")
    assert_matches_reference(ckpt, spec, result, out, 0.0)


# DeepSeek-V2's fields transformers 5.24's class ignores and DeepSeek's own code honours


def test_deepseek_moe_layer_freq_follows_deepseek_and_warns_in_one_line(prompt, tmp_path, caplog):
    """transformers' DeepseekV2 puts experts in every layer from first_k_dense_replace on
    (moe_layer_freq is not even its config's field); DeepSeek's modeling_deepseek.py only in
    every moe_layer_freq-th, which moepipe follows. A 3-layer model whose layers 0-1 are dense
    and 2 MoE, saved by transformers (first_k_dense_replace 2), relabelled DeepSeek's way
    (first_k_dense_replace 1, moe_layer_freq 2: layer 1 dense, 2 MoE): moepipe runs it as
    transformers runs the original, and warns once, in one line naming the field, the
    reference and the difference."""
    import json
    import logging
    import shutil

    from tests.real.test_hf_parity import GEN, hf_greedy
    from tests.real.test_hf_parity_fields import edit_config, save

    ckpt, hf = save(
        "deepseek_v2", {"num_hidden_layers": 3, "first_k_dense_replace": 2}, tmp_path / "o"
    )
    freq = tmp_path / "freq"
    shutil.copytree(ckpt, freq)
    edit_config(freq, first_k_dense_replace=1, moe_layer_freq=2)
    assert "moe_layer_freq" not in json.loads((ckpt / "config.json").read_text())
    with caplog.at_level(logging.WARNING, logger="real.reference_notes"):
        tokens, logits = reference_generate(freq, prompt, GEN)
        reference_generate(freq, prompt, GEN)
    lines = [r.getMessage() for r in caplog.records if r.name == "real.reference_notes"]
    assert lines == [
        f"{freq / 'config.json'}: moe_layer_freq is 2: moepipe leaves the layers between MoE "
        "layers dense as DeepSeek's modeling_deepseek.py does; transformers' DeepseekV2 class "
        "ignores the field, so its logits differ"
    ]
    hf_tokens, hf_logits = hf_greedy(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)


def test_deepseek_norm_topk_prob_warning_is_one_line(prompt, tmp_path, caplog):
    """norm_topk_prob true (transformers' DeepseekV2TopkRouter still ignores it; DeepSeek's
    MoEGate renormalises, as moepipe does: test_hf_parity.py compares both): the warning is
    one line naming the field, the reference chosen and the difference."""
    import logging

    from tests.real.test_hf_parity_fields import save

    ckpt, _ = save("deepseek_v2", {"norm_topk_prob": True}, tmp_path / "n")
    with caplog.at_level(logging.WARNING, logger="real.reference_notes"):
        reference_generate(ckpt, prompt, 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "real.reference_notes"]
    assert len(lines) == 1 and "\n" not in lines[0]
    for words in ("norm_topk_prob is true", "DeepSeek's modeling_deepseek.py", "transformers'"):
        assert words in lines[0]


@pytest.mark.parametrize("run", ["float16", "bfloat16"])
def test_deepseek_router_weights_stay_float32(run, halves, prompt):
    """transformers keeps DeepSeek-V2's gate.weight in float32 at any dtype
    (_keep_in_fp32_modules_strict), so float32-saved router weights are not rounded; moepipe
    keeps them so too, in memory and in the planners' byte counts, and its float16 logits
    equal transformers' bit for bit. Before: rounded to the compute dtype (float16 logits 2^-10
    off)."""
    from tests.real.test_hf_parity import GEN, hf_greedy

    ckpt, hf = halves("deepseek_v2", "f32")
    assert hf.model.layers[1].mlp.gate.weight.dtype == torch.float32
    spec, units = load_units(ckpt, run)
    _, full = load_units(ckpt, "float32")
    for unit, w in units.items():
        if unit.kind == Tensor.GATE:
            assert w["router"].dtype == torch.float32
            assert torch.equal(w["router"], full[unit]["router"])
            assert w["post_norm"].dtype == getattr(torch, run)
            assert sum(t.nbytes for t in w.values()) == spec.gate_bytes
    if run == "float16":
        tokens, logits = reference_generate(ckpt, prompt, GEN, dtype=run)
        hf_tokens, hf_logits = hf_greedy(hf, prompt)
        assert torch.equal(tokens, hf_tokens) and torch.equal(logits, hf_logits)


def test_switch_runs_in_float16(switch, prompt, tmp_path):
    """Switch (moepipe's causal substitute, which transformers' encoder-decoder is no reference
    for) saved in float32 and run with executor.dtype=float16: bit for bit the run of its
    weights saved in float16 (auto), every tensor float16."""
    ckpt, hf = switch("relu")
    type(hf).from_pretrained(ckpt, dtype=torch.float16).save_pretrained(tmp_path / "half")
    tokens, logits = reference_generate(ckpt, prompt, 4, dtype="float16")
    want_tokens, want_logits = reference_generate(tmp_path / "half", prompt, 4)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)
    spec, units = load_units(tmp_path / "half")
    assert spec.float16 and {t.dtype for w in units.values() for t in w.values()} == {torch.float16}


def test_a_float16_spec_of_another_width_is_one_line():
    """float16 names the 2-byte compute dtype: with dtype_bytes 4 it is refused naming both."""
    from core.errors import ConfigError
    from core.spec import ModelSpec

    fields = dict(name="m", family="mixtral", n_layers=1, hidden_size=8, expert_ffn_size=8)
    fields |= dict(n_experts=2, top_k=1, n_heads=2, n_kv_heads=2, head_dim=4, vocab_size=8)
    with pytest.raises(ConfigError, match="float16 with dtype_bytes=4; float16 weights are 2"):
        ModelSpec.from_dict(fields | dict(dtype_bytes=4, float16=True))
    assert ModelSpec.from_dict(fields | dict(dtype_bytes=2, float16=True)).float16
