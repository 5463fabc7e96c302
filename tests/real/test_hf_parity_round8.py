"""An eighth round: projection biases and keys given twice, on checkpoints transformers writes.

OLMoE's `attention_bias` (q/k/v/o projection biases) and DeepSeek-V2's (its MLA's q_a, kv_a and
o biases; q, q_b and kv_b have none in transformers' module) and `mlp_bias` (the dense layers'
and shared experts' gate/up/down biases; the routed experts have none) ran in transformers and
were refused by moepipe in one line. A key given twice in config.json or generation_config.json
was refused too, where transformers' json.loads takes the last value.

Usage: python -m pytest -q tests/real/test_hf_parity_round8.py
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.hf_config.generation import GENERATION_FILE
from core.spec import ModelSpec
from real.checkpoint import load_checkpoint, load_units
from real.model import ffn_shard, head_shard
from tests.real.test_hf_parity import DTYPES, assert_spec_sizes, hf_config
from tests.real.test_hf_parity_fields import assert_transformers, load_hf

transformers = pytest.importorskip("transformers")

# case -> (family, config.json fields)
BIASED = {
    "olmoe": ("olmoe", {"attention_bias": True}),
    "deepseek_v2": ("deepseek_v2", {"attention_bias": True, "mlp_bias": True}),
    "deepseek_v2-q_lora": ("deepseek_v2", {"attention_bias": True, "q_lora_rank": 16}),
}
# the projections transformers' module gives a bias, by case (its own module names)
HF_BIASED = {
    "olmoe": {"q_proj", "k_proj", "v_proj", "o_proj"},
    "deepseek_v2": {"kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "deepseek_v2-q_lora": {"q_a_proj", "kv_a_proj_with_mqa", "o_proj"},
}


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """(case, dtype) -> (checkpoint, transformers' model loaded from it): a seeded float32 model
    whose biases (transformers initialises them to 0) are drawn at random, cast and saved."""
    root = tmp_path_factory.mktemp("round8")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(case: str, dtype: str = "f32") -> tuple[Path, Any]:
        if (case, dtype) not in made:
            family, fields = BIASED[case]
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config(family, fields))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith(".bias"):
                        p.normal_(0.0, 0.5)
            ckpt = root / f"{case}-{dtype}"
            model.to(DTYPES[dtype]).eval().save_pretrained(ckpt)
            hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=DTYPES[dtype])
            made[case, dtype] = ckpt, hf.eval()
        return made[case, dtype]

    return get


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BIASED)
def test_bias_equals_transformers(case, dtype, biased, prompt):
    """moepipe runs the biases transformers' module has (each saved tensor read: an unread one
    is refused) and gives its greedy tokens, and its logits within 1e-4 in float32; the
    planners' byte counts are the checkpoint's tensors'. Before: refused in one line."""
    ckpt, hf = biased(case, dtype)
    names = {n.split(".")[-2] for n, _ in hf.named_parameters() if n.endswith(".bias")}
    assert names == HF_BIASED[case]
    assert_transformers(ckpt, hf, prompt, dtype)
    assert_spec_sizes(ckpt)


def test_biases_change_the_logits(biased, prompt):
    """The biases count: the same weights with them zeroed give other logits (so parity above
    is not parity of a model whose biases do nothing)."""
    from real.model import reference_generate
    from real.shards import read_header, read_tensor, save_shard

    ckpt, _ = biased("deepseek_v2")
    zeroed = ckpt.parent / "deepseek_v2-zeroed"
    if not zeroed.exists():
        import shutil

        shutil.copytree(ckpt, zeroed)
        file = zeroed / "model.safetensors"
        t = {n: read_tensor(e).clone() for n, e in read_header(file).items()}
        save_shard({n: x.zero_() if n.endswith(".bias") else x for n, x in t.items()}, file, {})
    _, logits = reference_generate(ckpt, prompt, 2)
    _, plain = reference_generate(zeroed, prompt, 2)
    assert (logits - plain).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["olmoe", "deepseek_v2"])
def test_shards_add_an_output_bias_once(case, biased):
    """dense=tensor's parts of attention (head_shard) and of an FFN (ffn_shard) sum to the
    whole: the output projection's bias is on the first shard only, the others' rows cut."""
    ckpt, _ = biased(case)
    spec, units = load_units(ckpt)
    for unit, w in units.items():
        if unit.kind.value == "attention":
            parts = [head_shard(spec, w, (0, 2)), head_shard(spec, w, (2, 4))]
            assert [("o_bias" in p) for p in parts] == [True, False]
            if "q_bias" in w:
                assert torch.equal(torch.cat([p["q_bias"] for p in parts]), w["q_bias"])
        elif "w2_bias" in w:
            half = w["w1"].shape[0] // 2
            parts = [ffn_shard(w, (0, half)), ffn_shard(w, (half, 2 * half))]
            assert [("w2_bias" in p) for p in parts] == [True, False]
            assert torch.equal(torch.cat([p["w1_bias"] for p in parts]), w["w1_bias"])


# The real executor: offloaded, dense=tensor over 2 devices' streams, and 2 processes


@pytest.mark.parametrize(
    "case, planner, params",
    [
        ("olmoe", "flexgen", {}),
        ("deepseek_v2", "flexgen", {}),
        ("olmoe", "ep_static", {"dense": "tensor", "n_devices": 2}),
        ("deepseek_v2", "ep_static", {"dense": "tensor", "n_devices": 2}),
    ],
    ids=["olmoe-offload", "deepseek_v2-offload", "olmoe-tensor", "deepseek_v2-tensor"],
)
def test_a_real_run_with_biases_is_the_in_memory_forward(case, planner, params, biased):
    """Offloaded (weights streamed from disk and host) or dense=tensor (each device's heads and
    FFN columns, the output biases added once in the sum): the in-memory forward's tokens, and
    its logits within 1e-5."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from tests.real.test_executor import OFFLOAD, RESIDENT_2GPU, WORKLOAD, assert_matches_reference

    ckpt, _ = biased(case)
    model, _ = load_checkpoint(ckpt)
    spec = RunSpec(model, RESIDENT_2GPU if params else OFFLOAD, WORKLOAD, planner, params)
    result, out = real_execute(ckpt, spec, "live")
    assert_matches_reference(ckpt, spec, result, out, 1e-5)


def test_a_distributed_run_with_biases_is_the_in_memory_forward(biased):
    """dense=tensor on 2 gloo processes (DeepSeek-V2: MLA's biases, the dense layer's and shared
    experts' FFN biases, each output bias on rank 0's part only): the in-memory forward."""
    from experiments.common.dist_run import run_distributed
    from experiments.common.real_run import prompts_for
    from real.model import reference_generate
    from tests.real.test_distributed import spec_of

    ckpt, _ = biased("deepseek_v2")
    spec = spec_of(ckpt, "ep_static", 2, dense="tensor")
    out = run_distributed(str(ckpt), spec, "live", None, 60)
    wl = spec.workload
    tokens, logits = reference_generate(ckpt, prompts_for(spec.model, wl), wl.gen_len, out.routing)
    assert torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-5)


def test_a_bias_field_another_family_lacks_is_one_line():
    """A model YAML asking for a bias its family has no tensors for is refused naming it."""
    with pytest.raises(ConfigError, match="attention_bias is implemented for olmoe, qwen3_moe, "):
        ModelSpec.from_dict(
            dict(name="m", family="mixtral", n_layers=1, hidden_size=8, expert_ffn_size=8)
            | dict(n_experts=2, top_k=1, n_heads=2, n_kv_heads=2, head_dim=4, vocab_size=8)
            | dict(attention_bias=True)
        )


# A key given twice: transformers' json.loads keeps the last value


def with_twice(text: str, key: str, first: Any) -> str:
    """The JSON object `text` with `key` given once more, first, with the value `first`."""
    return "{" + json.dumps(key) + ": " + json.dumps(first) + ", " + text.lstrip()[1:]


def test_a_key_twice_in_generation_config_takes_the_last(biased, prompt, tmp_path, caplog):
    """generation_config.json giving repetition_penalty twice: transformers' generate() runs the
    last value, and so does moepipe, logging one line naming the file and the key. Before:
    refused ("'repetition_penalty' appears twice")."""
    import shutil

    from tests.real.test_hf_parity_round6 import hf_generate

    ckpt, _ = biased("olmoe")
    twice = tmp_path / "twice"
    shutil.copytree(ckpt, twice)
    gen = twice / GENERATION_FILE
    fields = json.loads(gen.read_text()) | {"repetition_penalty": 8.0}
    gen.write_text(with_twice(json.dumps(fields), "repetition_penalty", 1.0))
    from real.model import reference_generate

    with caplog.at_level(logging.WARNING):
        tokens, logits = reference_generate(twice, prompt, 4)
    lines = [r.getMessage() for r in caplog.records if "appears twice" in r.getMessage()]
    assert lines == [
        f"{gen}: key 'repetition_penalty' appears twice in one JSON object; transformers takes "
        "the last value (json.loads), and so does moepipe: keep one of them"
    ]
    hf_tokens, hf_logits = hf_generate(load_hf(twice), prompt)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    plain, _ = reference_generate(ckpt, prompt, 4)
    assert not torch.equal(tokens, plain)  # the last value (8.0) ran, not the first (1.0)


def test_a_key_twice_in_config_json_takes_the_last(biased, prompt, tmp_path, caplog):
    """config.json giving rms_norm_eps twice (the first a value that would move the logits):
    transformers' PretrainedConfig reads it with json.loads, the last value, and so does
    moepipe, logging one line naming the file and the key. Before: refused."""
    import shutil

    ckpt, _ = biased("olmoe")
    twice = tmp_path / "twice"
    shutil.copytree(ckpt, twice)
    cfg = twice / "config.json"
    cfg.write_text(with_twice(cfg.read_text(), "rms_norm_eps", 0.5))
    with caplog.at_level(logging.WARNING):
        spec, _ = load_checkpoint(twice)
    assert spec.rms_norm_eps == json.loads(cfg.read_text())["rms_norm_eps"] != 0.5
    assert any(
        r.getMessage().startswith(f"{cfg}: key 'rms_norm_eps' appears twice")
        for r in caplog.records
    )
    assert_transformers(twice, load_hf(twice), prompt, "f32")
