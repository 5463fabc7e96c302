"""A sixth round: generation_config.json, the forms save_pretrained writes, and bfloat16.

moepipe runs transformers' `generate(do_sample=False, max_new_tokens=gen_len,
eos_token_id=None)` with an unpadded prompt (`hf_greedy`) on the checkpoint's folder: every
field of transformers' GenerationConfig is classified in core.hf_config.generation; the fields
that change greedy tokens are honoured (tokens and logits against transformers' generate()
reading the same folder, float32 and bfloat16), the ones the call sets are logged once as not
applied, the rest refused in one line naming the file and the field. Before, moepipe read no
generation_config.json: a checkpoint's repetition_penalty, bad_words_ids, ... went unapplied
without a word.

Usage: python -m pytest -q tests/real/test_hf_parity_round6.py
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError, MoepipeError
from core.hf_config.coverage import NO_EFFECT, READ, REFUSED, Handling
from core.hf_config.generation import GENERATION_COVERAGE, GENERATION_FILE
from real.model import reference_generate
from tests.real.test_hf_parity import DTYPES, GEN, assert_spec_sizes, hf_config
from tests.real.test_hf_parity_fields import save

transformers = pytest.importorskip("transformers")

CAUSAL = ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(family, dtype) -> (checkpoint, transformers' model from it), built on first use."""
    root = tmp_path_factory.mktemp("round6")
    made: dict[tuple[str, str], tuple[Path, Any]] = {}

    def get(family: str, dtype: str = "f32") -> tuple[Path, Any]:
        if (family, dtype) not in made:
            made[family, dtype] = save(family, {}, root / f"{family}-{dtype}", dtype)
        return made[family, dtype]

    return get


def with_generation(ckpt: Path, to: Path, **fields: Any) -> Path:
    """A copy of the checkpoint whose generation_config.json has `fields` over its own."""
    shutil.copytree(ckpt, to)
    gen = json.loads((to / GENERATION_FILE).read_text())
    (to / GENERATION_FILE).write_text(json.dumps(gen | fields))
    return to


def hf_generate(model: Any, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' generate() as moepipe runs (its USER fields set by the call): greedy, GEN
    new tokens past any eos, no time limit, one sequence a prompt, every prompt token attended.
    Returns (tokens [B, GEN], the last step's raw logits [B, V] float32)."""
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=GEN,
            eos_token_id=None,
            pad_token_id=0,
            max_time=None,
            num_return_sequences=1,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, prompt.shape[1] :], out.logits[-1].float()


def load_hf(ckpt: Path, dtype: str) -> Any:
    cls = transformers.AutoModelForCausalLM
    return cls.from_pretrained(ckpt, dtype=DTYPES[dtype]).eval()


# The table against transformers' GenerationConfig


def test_the_table_classifies_every_generation_field():
    """GENERATION_COVERAGE names exactly the fields of transformers' GenerationConfig: a field a
    new version adds fails here until it is classified, as does one the table names in vain."""
    fields = set(transformers.GenerationConfig().to_dict())
    table = set(GENERATION_COVERAGE)
    assert not fields - table, f"unclassified: {sorted(fields - table)}"
    assert not table - fields, f"not transformers': {sorted(table - fields)}"
    assert {how for how, _ in GENERATION_COVERAGE.values()} == {
        READ,
        NO_EFFECT,
        REFUSED,
        Handling.USER,
    }


def test_generation_citations_name_existing_tests():
    """Each `file::test` the table cites is a test function of tests/ (`...`: its prefix)."""
    import re

    sources = {p.name: p.read_text() for p in Path(__file__).parents[1].rglob("test_*.py")}
    cited = [
        (file, name)
        for _, why in GENERATION_COVERAGE.values()
        for file, name in re.findall(r"(test_\w+\.py)::(\w+)", why)
    ]
    assert len(cited) == len(GENERATION_COVERAGE)
    for file, name in cited:
        assert f"def {name}" in sources[file], name


# Honoured: moepipe's tokens are transformers' generate()'s on the same folder

# field -> its value, from the base checkpoint's greedy tokens [B, GEN] (chosen to move them)
HONOURED: dict[str, Callable[[torch.Tensor], Any]] = {
    "repetition_penalty": lambda t: 8.0,
    "no_repeat_ngram_size": lambda t: 1,
    "bad_words_ids": lambda t: [[int(t[0, 0])], [int(t[1, 0]), int(t[1, 1])]],
    "suppress_tokens": lambda t: [int(t[0, 1]), int(t[1, 1])],
    "begin_suppress_tokens": lambda t: [int(t[0, 0]), int(t[1, 0])],
    "forced_eos_token_id": lambda t: [5, 7],
    "forced_bos_token_id": lambda t: 9,
}
# every READ field of the table is a case
assert set(HONOURED) == {k for k, (how, _) in GENERATION_COVERAGE.items() if how == READ}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("field", HONOURED)
@pytest.mark.parametrize("family", CAUSAL)
def test_honoured_field_equals_transformers_generate(family, field, dtype, base, prompt, tmp_path):
    """A generation_config.json field that changes greedy tokens: moepipe's tokens are
    transformers' generate()'s on the same folder, in float32 and bfloat16, and the last
    logits of each are the same; the field moves the tokens from the base checkpoint's (where
    moepipe ignored it before). forced_bos_token_id acts on a 1-token prompt alone."""
    if field == "forced_bos_token_id":
        prompt = prompt[:, :1]
    ckpt, hf = base(family, dtype)
    base_tokens = reference_generate(ckpt, prompt, GEN)[0]
    assert torch.equal(base_tokens, hf_generate(hf, prompt)[0])
    changed = with_generation(ckpt, tmp_path / "gen", **{field: HONOURED[field](base_tokens)})
    tokens, logits = reference_generate(changed, prompt, GEN)
    hf_tokens, hf_logits = hf_generate(load_hf(changed, dtype), prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if dtype == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)
    assert not torch.equal(tokens, base_tokens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", CAUSAL)
def test_honoured_fields_together_equal_transformers_generate(
    family, dtype, base, prompt, tmp_path
):
    """Every honoured field at once, in generate()'s order (a forced token first, then the
    suppressions over it): transformers' tokens; with a 1-token prompt, forced_bos_token_id
    moves begin_suppress_tokens' step one later, as transformers' begin index does."""
    ckpt, _ = base(family, dtype)
    for p in (prompt, prompt[:, :1]):
        base_tokens = reference_generate(ckpt, p, GEN)[0]
        fields = {k: make(base_tokens) for k, make in HONOURED.items()}
        fields["begin_suppress_tokens"] = [int(base_tokens[0, 1]), 9]
        both = with_generation(ckpt, tmp_path / f"all-{p.shape[1]}", **fields)
        tokens, _ = reference_generate(both, p, GEN)
        assert torch.equal(tokens, hf_generate(load_hf(both, dtype), p)[0])
        assert not torch.equal(tokens, base_tokens)


def test_switch_applies_the_settings_to_its_own_decoding(prompt, tmp_path):
    """Switch (moepipe's causal substitute, no transformers reference) applies the folder's
    settings too: the tokens it chose, suppressed, are never chosen."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    cfg = transformers.SwitchTransformersConfig(**SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE)
    torch.manual_seed(0)
    transformers.SwitchTransformersForConditionalGeneration(cfg).save_pretrained(tmp_path / "s")
    tokens = reference_generate(tmp_path / "s", prompt, GEN)[0]
    banned = sorted({int(t) for t in tokens.flatten()})
    changed = with_generation(tmp_path / "s", tmp_path / "banned", suppress_tokens=banned)
    again = reference_generate(changed, prompt, GEN)[0]
    assert not set(again.flatten().tolist()) & set(banned)


def test_config_json_generation_fields_apply_without_generation_config(base, prompt, tmp_path):
    """Without generation_config.json transformers reads config.json's generation fields (its
    older place for them): moepipe does too, with transformers' tokens; a refused one there is
    refused naming config.json. Beside a generation_config.json both ignore them."""
    ckpt, _ = base("mixtral")
    both = with_generation(ckpt, tmp_path / "both")
    config = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps(config | {"no_repeat_ngram_size": 1}))
    assert torch.equal(
        reference_generate(both, prompt, GEN)[0], hf_generate(load_hf(ckpt, "f32"), prompt)[0]
    )
    (both / GENERATION_FILE).unlink()
    tokens = reference_generate(both, prompt, GEN)[0]
    assert torch.equal(tokens, hf_generate(load_hf(both, "f32"), prompt)[0])
    assert not torch.equal(tokens, reference_generate(ckpt, prompt, GEN)[0])
    (both / "config.json").write_text(json.dumps(config | {"num_beams": 2}))
    with pytest.raises(ConfigError, match=r"config.json: num_beams=2: moepipe decodes greedily"):
        reference_generate(both, prompt, GEN)


# Refused: one line naming the file and the field

# a value each REFUSED field is refused at
REFUSE: dict[str, Any] = {
    "num_beams": 2,
    "num_beam_groups": 2,
    "diversity_penalty": 0.5,
    "penalty_alpha": 0.6,
    "dola_layers": "high",
    "guidance_scale": 1.5,
    "sequence_bias": [[[5], 2.0]],
    "exponential_decay_length_penalty": [2, 1.5],
    "encoder_repetition_penalty": 1.5,
    "encoder_no_repeat_ngram_size": 2,
    "force_words_ids": [[5]],
    "constraints": [{"token_ids": [5]}],
    "watermarking_config": {"greenlist_ratio": 0.25},
    "token_healing": True,
    "stop_strings": ["ab"],
    "prompt_lookup_num_tokens": 3,
    "assistant_early_exit": 1,
    "use_mtp": True,
    "speculation_type": "prompt_lookup",
    "compile_config": {"fullgraph": False},
    "is_assistant": True,
}
assert set(REFUSE) == {k for k, (how, _) in GENERATION_COVERAGE.items() if how == REFUSED}


@pytest.mark.parametrize("field", REFUSE)
def test_refused_field_is_one_line_naming_it(field, base, prompt, tmp_path):
    """A refused generation_config.json field at another value than its default is refused in
    one line naming the file and the field, before any weight is read; its default runs."""
    ckpt, _ = base("olmoe")
    bad = with_generation(ckpt, tmp_path / "bad", **{field: REFUSE[field]})
    with pytest.raises(ConfigError) as e:
        reference_generate(bad, prompt, GEN)
    assert "\n" not in str(e.value)
    assert f"{GENERATION_FILE}: {field}=" in str(e.value)
    default = transformers.GenerationConfig()._get_default_generation_params().get(field)
    with_generation(ckpt, tmp_path / "default", **{field: default})
    reference_generate(tmp_path / "default", prompt, 1)


# Set by moepipe's call: logged once, not applied

USER_VALUES: dict[str, Any] = {
    "do_sample": True,
    "temperature": 0.3,
    "top_k": 3,
    "top_p": 0.5,
    "min_p": 0.2,
    "typical_p": 0.5,
    "top_h": 0.5,
    "epsilon_cutoff": 0.01,
    "eta_cutoff": 0.01,
    "max_new_tokens": 1,
    "max_length": 7,
    "min_new_tokens": 3,
    "min_length": 9,
    "max_time": 0.001,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "num_return_sequences": 1,
}
assert set(USER_VALUES) == {k for k, (h, _) in GENERATION_COVERAGE.items() if h == Handling.USER}


def test_user_field_is_logged_not_applied(base, prompt, tmp_path, caplog):
    """The fields moepipe's own call sets (greedy, gen_len steps, no eos stop, an unpadded
    prompt) are logged in one line naming the file and each, once however often the folder is
    loaded, and change nothing: the tokens are transformers' generate() with that call."""
    ckpt, hf = base("qwen2_moe")
    user = with_generation(ckpt, tmp_path / "user", **USER_VALUES)
    with caplog.at_level(logging.WARNING, logger="core.hf_config.generation"):
        tokens, logits = reference_generate(user, prompt, GEN)
        reference_generate(user, prompt, GEN)
    lines = [r.getMessage() for r in caplog.records if GENERATION_FILE in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert all(f"{k}=" in lines[0] for k in USER_VALUES), lines[0]
    assert "not applied" in lines[0]
    hf_tokens, hf_logits = hf_generate(load_hf(user, "f32"), prompt)
    assert torch.equal(tokens, hf_tokens)
    assert torch.equal(tokens, reference_generate(ckpt, prompt, GEN)[0])


# NO_EFFECT: transformers' greedy tokens and logits are the same with the field

QUIET: dict[str, Any] = {
    "length_penalty": 2.0,
    "early_stopping": True,
    "remove_invalid_values": True,
    "renormalize_logits": True,
    "bos_token_id": 7,
    "decoder_start_token_id": 7,
    "output_attentions": True,
    "output_hidden_states": True,
    "output_scores": True,
    "output_logits": False,
    "return_dict_in_generate": False,
    "use_cache": False,
    "cache_implementation": "dynamic",
    "cache_config": {"max_cache_len": 64},
    "max_cache_len": 64,
    "low_memory": True,
    "prefill_chunk_size": 2,
    "disable_compile": True,
    "continuous_batching_config": {"block_size": 16},
    "num_assistant_tokens": 3,
    "num_assistant_tokens_schedule": "heuristic",
    "assistant_confidence_threshold": 0.2,
    "assistant_lookbehind": 3,
    "target_lookbehind": 3,
    "assistant_ensemble_weight": 0.5,
    "max_matching_ngram_size": 3,
    "transformers_version": "4.0.0",
    "_from_model_config": False,
}
assert set(QUIET) == {k for k, (how, _) in GENERATION_COVERAGE.items() if how == NO_EFFECT}


@pytest.mark.filterwarnings("ignore:Passing ContinuousBatchingConfig through GenerationConfig")
def test_no_effect_field_leaves_transformers_tokens(base, prompt, tmp_path):
    """Each NO_EFFECT field at another value: transformers' generate() gives the base
    checkpoint's greedy tokens and logits, and moepipe gives them, without a word of it."""
    ckpt, hf = base("deepseek_v2")
    want_tokens, want_logits = hf_generate(hf, prompt)
    for field, value in QUIET.items():
        quiet = with_generation(ckpt, tmp_path / field, **{field: value})
        got_tokens, got_logits = hf_generate(load_hf(quiet, "f32"), prompt)
        assert torch.equal(got_tokens, want_tokens), field
        torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=0, msg=field)
        tokens, logits = reference_generate(quiet, prompt, GEN)
        assert torch.equal(tokens, want_tokens), field
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)


# Malformed: one line naming the file (and the field)

# (what the file holds, words the line names)
MALFORMED = {
    "a-list": ("[1, 2]", ("holds a JSON list",)),
    "penalty-text": ('{"repetition_penalty": "1.2"}', ("repetition_penalty must be",)),
    "penalty-0": ('{"repetition_penalty": 0.0}', ("repetition_penalty must be a positive",)),
    # transformers' processor fails on an integer penalty (1, which it skips, runs)
    "penalty-int": ('{"repetition_penalty": 2}', ("repetition_penalty must be a positive float",)),
    "bad-words-flat": ('{"bad_words_ids": [5, 6]}', ("bad_words_ids must be",)),
    "bad-words-outside": ('{"bad_words_ids": [[128]]}', ("bad_words_ids", "below 128")),
    "suppress-text": ('{"suppress_tokens": "5"}', ("suppress_tokens must be",)),
    "suppress-flags": ('{"suppress_tokens": [true]}', ("suppress_tokens must be",)),
    "ngram-fraction": ('{"no_repeat_ngram_size": 1.5}', ("no_repeat_ngram_size must be",)),
    "deep": ("[" * 100_000 + "]" * 100_000, ("nested too deeply",)),
    "eos-empty": ('{"forced_eos_token_id": []}', ("forced_eos_token_id must be a token id",)),
    "eos-outside": ('{"forced_eos_token_id": 128}', ("forced_eos_token_id must be a token id",)),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_generation_config_is_one_line(case, base, prompt, tmp_path):
    """A generation_config.json of JSON that is not an object (or nested too deep to parse), or
    a field of another type or out of the vocabulary where transformers' processors fail or
    index past the logits, is refused in one line naming the file, before any weight is read.
    Forms transformers falls back from or ignores: test_hf_parity_round7.py."""
    ckpt, _ = base("mixtral")
    bad = with_generation(ckpt, tmp_path / "bad")
    text, words = MALFORMED[case]
    (bad / GENERATION_FILE).write_text(text)
    with pytest.raises(MoepipeError) as e:
        reference_generate(bad, prompt, GEN)
    line = str(e.value)
    assert "\n" not in line and line.startswith(str(bad / GENERATION_FILE) + ": ")
    assert all(w in line for w in words), line


# The real executor picks its tokens the same way

# a run's settings that each move the tokens (the workload's prompts repeat no token)
RUN_SETTINGS = {"repetition_penalty": 8.0, "no_repeat_ngram_size": 1, "suppress_tokens": [3, 4]}


@pytest.mark.parametrize(
    "planner, params",
    [("flexgen", {}), ("ep_static", {"dense": "tensor", "n_devices": 2})],
    ids=["offload", "dense=tensor"],
)
def test_real_run_applies_generation_config(planner, params, base, tmp_path):
    """A real run (live routing; its HEAD ops in one process, or dense=tensor's vocabulary
    parts gathered on 2 devices) picks each token with the folder's generation settings: the
    in-memory reference's and transformers' generate()'s tokens, not the plain argmax's."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from real.checkpoint import load_checkpoint
    from tests.real.test_executor import OFFLOAD, RESIDENT_2GPU, WORKLOAD

    ckpt, _ = base("mixtral")
    changed = with_generation(ckpt, tmp_path / "gen", **RUN_SETTINGS)
    model, _ = load_checkpoint(changed)
    hw = RESIDENT_2GPU if params else OFFLOAD
    spec = RunSpec(model, hw, WORKLOAD, planner, params)
    _, out = real_execute(changed, spec, "live")
    prompts = prompts_for(model, WORKLOAD)
    tokens, _ = reference_generate(changed, prompts, WORKLOAD.gen_len)
    assert torch.equal(out.tokens, tokens)
    assert not torch.equal(tokens, reference_generate(ckpt, prompts, WORKLOAD.gen_len)[0])
    hf = load_hf(changed, "f32")
    with torch.inference_mode():
        hf_tokens = hf.generate(
            prompts,
            do_sample=False,
            max_new_tokens=WORKLOAD.gen_len,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones_like(prompts),
        )[:, prompts.shape[1] :]
    assert torch.equal(out.tokens, hf_tokens)


def test_a_real_run_refuses_a_refused_field_in_one_line(base, tmp_path):
    """experiments.run with executor=real on a folder whose generation_config.json asks for
    beam search exits non-zero with one line naming the file and the field, no traceback."""
    from tests.probes.conftest import one_line, real_run

    ckpt, _ = base("mixtral")
    bad = with_generation(ckpt, tmp_path / "beams", num_beams=4)
    r = real_run(bad, tmp_path / "run")
    one_line(r, f"{GENERATION_FILE}: num_beams=4", "greedily")


# The forms save_pretrained writes

# form -> (config fields, save_pretrained's arguments)
FORMS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sharded": ({}, {"max_shard_size": "20KB"}),  # an index and 15 to 25 shards
    "tied": ({"tie_word_embeddings": True}, {}),  # no lm_head tensor
    "fused": ({}, {"save_original_format": False}),  # experts as transformers' modules hold them
}


def save_form(family: str, form: str, dtype: str, to: Path) -> tuple[Path, Any]:
    fields, how = FORMS[form]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family, fields))
    model.to(DTYPES[dtype]).eval().save_pretrained(to, **how)
    return to, load_hf(to, dtype)


def tensor_names(ckpt: Path) -> set[str]:
    from real.shards import read_header

    return {n for f in ckpt.glob("*.safetensors") for n in read_header(f)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family", CAUSAL)
def test_saved_form_equals_transformers(family, form, dtype, prompt, tmp_path):
    """Each form save_pretrained writes, in float32 and bfloat16: moepipe's greedy tokens are
    transformers' from the same folder, logits within 1e-4 (float32) or a bf16 step (observed:
    0 in every case). Before, the fused experts (`save_original_format=False`:
    `mlp.experts.gate_up_proj` [E, 2F, H], `down_proj` [E, H, F], Mixtral's router as
    `mlp.gate`), which transformers loads, were refused as tensors nothing reads."""
    ckpt, hf = save_form(family, form, dtype, tmp_path / "ckpt")
    names = tensor_names(ckpt)
    if form == "sharded":
        assert (ckpt / "model.safetensors.index.json").is_file()
        assert len(list(ckpt.glob("model-*.safetensors"))) > 2
    if form == "tied":
        assert "lm_head.weight" not in names
    if form == "fused":
        assert "model.layers.1.mlp.experts.gate_up_proj" in names
    tokens, logits = reference_generate(ckpt, prompt, GEN)
    hf_tokens, hf_logits = hf_generate(hf, prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if dtype == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)
    assert_spec_sizes(ckpt)


def test_fused_experts_run_in_the_real_executor(tmp_path):
    """A fused-experts checkpoint offloaded (flexgen: experts read from disk through the
    store, each expert a byte range of the fused tensors) gives the reference's tokens."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from real.checkpoint import load_checkpoint
    from tests.real.test_executor import WORKLOAD, assert_matches_reference, hardware

    ckpt, _ = save_form("qwen2_moe", "fused", "f32", tmp_path / "ckpt")
    offload = hardware(0.0008, 0.0004)  # 0.8 MB device, 0.4 MB host: experts come from disk
    spec = RunSpec(load_checkpoint(ckpt)[0], offload, WORKLOAD, "flexgen")
    result, out = real_execute(ckpt, spec, "live")
    assert result.summary["bytes_moved"].get("disk", 0) > 0
    assert_matches_reference(ckpt, spec, result, out)


def test_fused_experts_without_their_pair_are_one_line(tmp_path):
    """A fused gate_up_proj without its down_proj is refused naming both."""
    from real.checkpoint import load_checkpoint
    from real.shards import read_header, read_tensor, save_shard

    ckpt, _ = save_form("olmoe", "fused", "f32", tmp_path / "ckpt")
    file = ckpt / "model.safetensors"
    tensors = {n: read_tensor(e).clone() for n, e in read_header(file).items()}
    del tensors["model.layers.0.mlp.experts.down_proj"]
    save_shard(tensors, file, {"format": "pt"})
    with pytest.raises(ConfigError, match=r"gate_up_proj is in the checkpoint without .*down_pr"):
        load_checkpoint(ckpt)


def test_a_variant_or_pickle_is_one_line(tmp_path):
    """save_pretrained(variant="bf16") writes model.bf16.safetensors, which transformers loads
    only given variant=: refused naming the file and the rename (before: "no weights"), as is
    an older save_pretrained's pytorch_model.bin (safe_serialization=False)."""
    from real.checkpoint import load_checkpoint

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config("mixtral", {}))
    model.save_pretrained(tmp_path / "variant", variant="bf16")
    with pytest.raises(ConfigError, match=r"but model.bf16.safetensors, a save_pretrained var"):
        load_checkpoint(tmp_path / "variant")
    (tmp_path / "pickled").mkdir()
    shutil.copy(tmp_path / "variant" / "config.json", tmp_path / "pickled")
    torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"but pytorch_model.bin, torch's pickled weights"):
        load_checkpoint(tmp_path / "pickled")


@pytest.mark.parametrize("dtype", DTYPES)
def test_switch_saved_forms_run_as_its_one_file(dtype, prompt, tmp_path):
    """Switch sharded and with fused-free original names, in float32 and bfloat16: the same
    tokens and logits as its single file (transformers' Switch is an encoder-decoder, so
    moepipe's causal substitute is compared with itself)."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    cfg = transformers.SwitchTransformersConfig(**SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).to(DTYPES[dtype])
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    one = reference_generate(tmp_path / "one", prompt, GEN)
    sharded = reference_generate(tmp_path / "sharded", prompt, GEN)
    assert torch.equal(one[0], sharded[0]) and torch.equal(one[1], sharded[1])


def test_the_accelerate_peer_generates_what_moepipe_runs(base, prompt, tmp_path, monkeypatch):
    """bench_accelerate's peer generates gen_len tokens a sequence whatever the folder's
    generation_config.json sets that moepipe's call does not apply (max_time); before, its
    generate() stopped at the file's time limit, timing less work than moepipe's."""
    from experiments.common.peers import run_accelerate

    made = []
    generate = transformers.GenerationMixin.generate

    def spy(self, *args, **kwargs):
        made.append(generate(self, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy)
    timed = with_generation(base("mixtral")[0], tmp_path / "timed", max_time=1e-9)
    run_accelerate(str(timed), 2**30, 2**30, prompt, 2, GEN, "false")
    assert made and made[0].shape == (2, prompt.shape[1] + GEN)
