"""Round 27 (issue 48): what round 26's seeded sweep left refused though transformers 5.24 runs
it, now run as transformers does, or refused where transformers' own result is not defined.

- DeepSeek MLA with num_key_value_heads below num_attention_heads: transformers' default sdpa
  attention runs it as MLA itself (one key/value head a query head) wherever key and value
  heads are one width, and fails elsewhere (so does its eager attention, always).
- A linear (or proportional) RoPE factor below 1: transformers warns and runs it.
- A layer layout with no MoE layer (first_k_dense_replace past the layers, mlp_only_layers over
  all of them, decoder_sparse_step past them): a dense model, which every planner runs.
- DeepSeek-V2's group_limited_greedy with a top-k past the kept groups' experts: the others
  are taken at weight 0, which changes nothing; DeepSeek-V3's takes experts tied at -inf in an
  order torch.topk does not define, weighed by their scores: refused, saying so.

A seeded sweep (`draw27`, slow but for one configuration a family) draws these fields over round
26's, in float32, bfloat16 and float16: of 144 configurations, 66 ran as transformers before, 69
were refused and 9 failed in both; now 132 run as transformers, 3 are refused (DeepSeek-V2's
moe_layer_freq, DeepSeek's layout, over layers transformers saved experts of) and 9 fail in both.

Usage: python -m pytest -q tests/real/test_hf_parity_round27.py
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError, MoepipeError
from real.checkpoint import load_checkpoint
from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, hf_generate_out
from tests.real.test_hf_parity_fields import assert_transformers, save_cast
from tests.real.test_hf_parity_round10 import randomise
from tests.real.test_hf_parity_round26 import CLS, draw

transformers = pytest.importorskip("transformers")

TINY = {"hidden_size": 32}  # test_hf_parity's families at half width: 4 heads, 16 + 8 qk dims
F32 = torch.float32


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_mla_with_fewer_key_value_heads_runs_as_transformers_sdpa(family, prompt, tmp_path):
    """num_key_value_heads=2 of 4 heads, v_head_dim 24 = qk_nope_head_dim + qk_rope_head_dim:
    transformers' sdpa runs one key/value head a query head (as with 4); moepipe does too.
    Before: refused. At v_head_dim 16, transformers fails, and moepipe refuses in one line
    saying so."""
    fields = TINY | {"v_head_dim": 24, "num_key_value_heads": 2}
    ckpt, hf = save_cast(family, fields, tmp_path / "v24", F32, F32, randomise)
    assert_transformers(ckpt, hf, prompt, "f32")
    fields = TINY | {"v_head_dim": 16, "num_key_value_heads": 2}
    ckpt, hf = save_cast(family, fields, tmp_path / "v16", F32, F32, randomise)
    with pytest.raises(RuntimeError, match="must match the size"):
        hf_generate_out(hf, prompt, GEN)
    with pytest.raises(ConfigError, match="v_head_dim=16 != qk_nope_head_dim") as e:
        reference_generate(ckpt, prompt, GEN)
    assert "\n" not in str(e.value) and "num_key_value_heads=2" in str(e.value)
    assert "transformers' " in str(e.value) and "fails on it" in str(e.value)


SLOWER = [
    ("mixtral", {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e4}),
    ("deepseek_v3", {"rope_type": "linear", "factor": 0.5, "mscale_all_dim": 0.7}),
    ("mixtral", {"rope_type": "proportional", "factor": 0.25, "partial_rotary_factor": 0.5}),
]


@pytest.mark.parametrize(("family", "rope"), SLOWER, ids=["linear", "mla_mscale", "proportional"])
def test_a_dividing_rope_factor_below_1_runs_as_transformers(family, rope, prompt, tmp_path):
    """A factor below 1 of RoPE types that divide each frequency by it (positions rotate
    faster): transformers warns and runs it, and so does moepipe. Before: refused ("must be
    >= 1")."""
    fields = TINY | {"rope_parameters": {"rope_theta": 1e4} | rope}
    ckpt, hf = save_cast(family, fields, tmp_path / family, F32, F32, randomise)
    assert_transformers(ckpt, hf, prompt, "f32")


def test_a_scaling_rope_factor_below_1_is_still_refused(prompt, tmp_path):
    """yarn's factor below 1 stays refused (its ramp and mscale assume a stretch)."""
    rope = {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8}
    fields = TINY | {"rope_parameters": {"rope_theta": 1e4} | rope}
    ckpt, _ = save_cast("mixtral", fields, tmp_path / "yarn", F32, F32)
    with pytest.raises(ConfigError, match=r"factor=0.5 must be >= 1"):
        reference_generate(ckpt, prompt, GEN)


# a layout of 2 layers with no MoE layer, a family's way
DENSE: dict[str, tuple[str, dict[str, Any]]] = {
    "v2_first_k": ("deepseek_v2", {"first_k_dense_replace": 2}),
    "v3_first_k_past": ("deepseek_v3", {"first_k_dense_replace": 5}),
    "qwen2_mlp_only": ("qwen2_moe", {"mlp_only_layers": [0, 1]}),
    "qwen3_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 3}),
}


@pytest.mark.parametrize("case", DENSE)
def test_a_layout_with_no_moe_layer_runs_as_a_dense_model(case, prompt, tmp_path):
    """transformers runs a dense model; moepipe now reads one (no MoE layer) and matches it.
    Before: refused ("leaves no MoE layer among num_hidden_layers=2")."""
    family, fields = DENSE[case]
    ckpt, hf = save_cast(family, TINY | fields, tmp_path / case, F32, F32, randomise)
    assert load_checkpoint(ckpt)[0].moe_layers == ()
    assert_transformers(ckpt, hf, prompt, "f32")


def _planners() -> list[str]:
    from planners.registry import planner_names

    return planner_names()


@pytest.mark.parametrize("planner", _planners())
def test_every_planner_runs_a_dense_model(planner, tmp_path_factory):
    """Each planner's real run (oracle_replication: simulated, it replays only) of a dense
    DeepSeek-V3 equals transformers' greedy tokens and logits within 1e-4. Before: a
    traceback in the synthetic routing, the routing counts, fiddler's and
    mixtral_offloading's per-layer shares and klotski's prefetch table (all divided or
    reshaped by 0 MoE layers)."""
    from experiments.common.pipeline import RunSpec, simulate_run
    from experiments.common.real_run import prompts_for, real_execute
    from tests.conftest import RESIDENT
    from tests.real.test_executor import FIDDLER, OFFLOAD, REPLAY_ONLY, RESIDENT_2GPU, WORKLOAD

    root = tmp_path_factory.getbasetemp() / "round27-dense"
    ckpt, hf = root, None
    if not (root / "config.json").exists():
        save_cast("deepseek_v3", TINY | {"first_k_dense_replace": 2}, root, F32, F32, randomise)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root, dtype=F32).eval()
    model, _ = load_checkpoint(ckpt)
    hw = RESIDENT_2GPU if planner in RESIDENT else FIDDLER if planner == "fiddler" else OFFLOAD
    spec = RunSpec(model, hw, WORKLOAD, planner)
    if planner in REPLAY_ONLY:
        assert simulate_run(spec).summary["tokens_generated"] > 0
        return
    result, out = real_execute(ckpt, spec, "live")
    wl = WORKLOAD.with_(n_batches=result.summary["n_batches"])
    prompts = prompts_for(model, wl)
    hf_out = hf_generate_out(hf, prompts, wl.gen_len)
    assert torch.equal(out.tokens, hf_out.sequences[:, prompts.shape[1] :])
    torch.testing.assert_close(out.logits, hf_out.logits[-1].float(), atol=1e-4, rtol=0)


GROUPS = {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 4}  # 2 experts kept, top-4


def test_v2_top_k_past_the_kept_groups_runs_as_transformers(prompt, tmp_path):
    """DeepSeek-V2's group_limited_greedy, top-4 of 8 experts from 1 of 4 groups (2 experts):
    transformers zeroes the dropped groups' scores, so 2 of the 4 it takes weigh 0; moepipe
    weighs them 0 too. Before: refused ("exceeds the 2 experts of topk_group=1 groups")."""
    fields = TINY | GROUPS | {"topk_method": "group_limited_greedy"}
    ckpt, hf = save_cast("deepseek_v2", fields, tmp_path / "v2", F32, F32, randomise)
    assert_transformers(ckpt, hf, prompt, "f32")


def test_v3_top_k_past_the_kept_groups_is_refused_saying_why(prompt, tmp_path):
    """DeepSeek-V3's router masks the dropped groups to -inf and weighs what it takes by the
    unmasked scores: which of the tied experts it takes is torch.topk's undefined order. The
    refusal says so in one line."""
    ckpt, _ = save_cast("deepseek_v3", TINY | GROUPS, tmp_path / "v3", F32, F32, randomise)
    with pytest.raises(ConfigError, match="order torch.topk leaves undefined") as e:
        reference_generate(ckpt, prompt, GEN)
    assert "\n" not in str(e.value) and "num_experts_per_tok=4" in str(e.value)


# -- the seeded sweep of round 26, drawing the fields round 27 runs ----------------------------

DTYPES3 = DTYPES | {"f16": torch.float16}


def draw27(family: str, seed: int) -> tuple[dict[str, Any], torch.Tensor]:
    """Round 26's `draw`, and from a stream of its own: MLA's num_key_value_heads below the
    heads (v_head_dim at qk_nope_head_dim + qk_rope_head_dim half the time), a linear RoPE
    factor below 1, a layout with no MoE layer, DeepSeek-V2's top-k past the kept groups,
    moe_layer_freq."""
    fields, prompt = draw(family, seed)
    r = random.Random(f"{family}-{seed}-27")
    layers, heads = fields["num_hidden_layers"], fields["num_attention_heads"]
    if family.startswith("deepseek"):
        fields["num_key_value_heads"] = r.randint(1, heads)
        if r.random() < 0.5:
            fields["v_head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        if r.random() < 0.3:
            fields["first_k_dense_replace"] = r.randint(layers, layers + 2)
        if r.random() < 0.3:
            fields["moe_layer_freq"] = r.choice([2, 3])
        experts = fields["n_routed_experts"]
        groups = [g for g in (2, 4) if experts % g == 0]
        if family == "deepseek_v2" and groups and r.random() < 0.6:
            fields |= dict(topk_method="group_limited_greedy", n_group=r.choice(groups))
            fields["topk_group"] = r.randint(1, fields["n_group"])
            fields["num_experts_per_tok"] = r.randint(1, experts)
    elif family in ("qwen2_moe", "qwen3_moe") and r.random() < 0.3:
        dense = r.choice([{"mlp_only_layers": list(range(layers))}, {"decoder_sparse_step": 4}])
        fields |= dense
    if r.random() < 0.25:
        fields["rope_parameters"] = {"rope_type": "linear", "factor": r.choice([0.25, 0.5, 0.9])}
        fields["rope_parameters"]["rope_theta"] = r.choice([1e4, 100.0])
    return fields, prompt


SLOW = pytest.mark.slow
SWEEP27 = [
    pytest.param(family, seed, dtype, marks=() if seed == 0 and dtype == "f32" else SLOW)
    for family in CLS
    for seed in range(8)
    for dtype in DTYPES3
]


def sweep_case(family: str, seed: int, dtype: str, to: Path) -> str:
    """`draw27`'s configuration saved by transformers in the dtype, run by both: "match"
    (greedy tokens equal, float32 logits within 1e-4, half precision's within 2^-5), "refused"
    (one line naming config.json; where transformers fails too, "both fail"), "non-finite"
    (both overflow); an AssertionError otherwise. DeepSeek-V2's moe_layer_freq leaving a layer
    dense is refused: transformers' class, which ignores the field, saves that layer's
    experts."""
    fields, prompt = draw27(family, seed)
    cast = DTYPES3[dtype]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, CLS[family])(**fields)
    )
    randomise(model)
    model.to(cast).eval().save_pretrained(to)
    hf = transformers.AutoModelForCausalLM.from_pretrained(to, dtype=cast).eval()
    return judged(hf, to, prompt, dtype)


def judged(hf: Any, to: Path, prompt: torch.Tensor, dtype: str) -> str:
    """transformers' `hf` and moepipe's reference on the checkpoint `to` it saved, compared as
    `sweep_case` says (rounds 27 and 28 share it)."""
    try:
        out = hf_generate_out(hf, prompt, GEN)
    except RuntimeError:
        out = None
    try:
        tokens, logits = reference_generate(to, prompt, GEN)
    except ConfigError as e:
        assert "\n" not in str(e) and "config.json" in str(e), e
        return "refused" if out is not None else "both fail"
    except MoepipeError as e:
        assert out is not None and "non-finite" in str(e), e
        assert not torch.isfinite(torch.stack(out.logits)).all(), e
        return "non-finite"
    assert out is not None, "transformers fails where moepipe runs"
    assert torch.equal(tokens, out.sequences[:, prompt.shape[1] :])
    tol = 1e-4 if dtype == "f32" else 2**-5
    torch.testing.assert_close(logits, out.logits[-1].float(), atol=tol, rtol=0)
    return "match"


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
@pytest.mark.parametrize("family, seed, dtype", SWEEP27)
def test_seeded_configuration_with_round_27s_fields(family, seed, dtype, tmp_path):
    """A seeded configuration (`draw27`) in float32, bfloat16 or float16: moepipe matches
    transformers, or refuses in one line (where transformers fails too, or names why); never a
    traceback or a silent difference (observed over the 144: 132 match; 3 refused, DeepSeek-V2's
    moe_layer_freq over layers transformers saved experts of; 9 where both fail, MLA's key/value
    heads at v_head_dim other than the qk dims)."""
    outcome = sweep_case(family, seed, dtype, tmp_path)
    assert outcome in {"match", "refused", "both fail", "non-finite"}


# -- dense=tensor and micro_batches on round 27's shapes ----------------------------------------

SHAPES = {
    "dense_v3": ("deepseek_v3", {"first_k_dense_replace": 2}),
    "mla_kv2": ("deepseek_v2", {"v_head_dim": 24, "num_key_value_heads": 2}),
    "v2_groups_past_k": ("deepseek_v2", GROUPS | {"topk_method": "group_limited_greedy"}),
}
EP = {"tensor": {"dense": "tensor"}, "micro_batches": {"micro_batches": 2}}


@SLOW
@pytest.mark.parametrize("ep", EP)
@pytest.mark.parametrize("shape", SHAPES)
def test_expert_parallel_variants_run_round_27s_shapes(shape, ep, tmp_path):
    """eplb on 2 GPUs with dense=tensor (each GPU's heads and FFN columns) or two micro-batches
    of a batch of 4, on a dense model, MLA with fewer key/value heads and DeepSeek-V2's top-k
    past the kept groups: transformers' greedy tokens, float32 logits within 1e-4 (observed:
    below 1e-6). In half precision dense=tensor rounds each GPU's part (docs/commands.md): 4 of
    40 such runs of every family took another token at a near tie."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from tests.real.test_executor import WORKLOAD, hardware

    family, fields = SHAPES[shape]
    ckpt, hf = save_cast(family, TINY | fields, tmp_path / shape, F32, F32, randomise)
    model, _ = load_checkpoint(ckpt)
    wl = WORKLOAD.with_(batch_size=4)
    spec = RunSpec(model, hardware(0.05, 0.05, n_gpus=2), wl, "eplb", EP[ep] | {"n_devices": 2})
    result, out = real_execute(ckpt, spec, "live")
    wl = wl.with_(n_batches=result.summary["n_batches"])
    prompts = prompts_for(model, wl)
    hf_out = hf_generate_out(hf, prompts, wl.gen_len)
    assert torch.equal(out.tokens, hf_out.sequences[:, prompts.shape[1] :])
    torch.testing.assert_close(out.logits, hf_out.logits[-1].float(), atol=1e-4, rtol=0)
