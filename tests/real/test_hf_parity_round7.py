"""A seventh round: saved and compute dtypes, generation_config.json's fallbacks, and the
logit-changing fields of each family.

A checkpoint saved in float16, bfloat16 or float32 (`save_pretrained` after `.to(dtype)`) runs
in float32 or bfloat16 as transformers' `from_pretrained(dtype=...)` runs it, the weights
upcast or rounded as they load (the in-memory forward and the real executor's tiers alike);
before, float16 weights were refused and bfloat16 ones ran only in bfloat16.

Usage: python -m pytest -q tests/real/test_hf_parity_round7.py
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from core.errors import ConfigError
from core.hf_config.generation import GENERATION_FILE
from real.checkpoint import load_checkpoint, load_units
from real.model import reference_generate
from tests.real.test_hf_parity import GEN, hf_config, hf_generate_out, hf_greedy
from tests.real.test_hf_parity_fields import assert_transformers, edit_config, save
from tests.real.test_hf_parity_round6 import hf_generate, load_hf, with_generation

transformers = pytest.importorskip("transformers")

CAUSAL = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"]
SAVED = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
RUN = {"f32": "float32", "bf16": "bfloat16"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(family, saved dtype) -> checkpoint: one seeded float32 model per family, cast and saved
    by transformers in each dtype, built on first use."""
    root = tmp_path_factory.mktemp("round7")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, dtype: str) -> Path:
        if (family, dtype) not in made:
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(hf_config(family, {}))
            made[family, dtype] = root / f"{family}-{dtype}"
            model.to(SAVED[dtype]).eval().save_pretrained(made[family, dtype])
        return made[family, dtype]

    return get


@pytest.fixture(scope="module")
def hf_run(saved):
    """(family, saved, run) -> transformers' model loaded from the checkpoint in the run's
    dtype, as a user asks from_pretrained(dtype=...), built on first use."""
    made: dict[tuple[str, str, str], Any] = {}

    def get(family: str, dtype: str, run: str) -> Any:
        if (family, dtype, run) not in made:
            ckpt = saved(family, dtype)
            model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=SAVED[run])
            made[family, dtype, run] = model.eval()
        return made[family, dtype, run]

    return get


@pytest.mark.parametrize("run", RUN)
@pytest.mark.parametrize("dtype", SAVED)
@pytest.mark.parametrize("family", CAUSAL)
def test_any_saved_dtype_runs_in_the_asked_one(family, dtype, run, saved, hf_run, prompt):
    """Saved float16/bfloat16/float32 x run float32/bfloat16: transformers' greedy tokens, its
    float32 logits within 1e-4 (bfloat16: one bf16 step of |logit| < 4). Before, float16 was
    refused ("torch_dtype float16 is not supported") and a checkpoint ran in its saved dtype
    only, so a bfloat16 one could not be run in float32."""
    ckpt = saved(family, dtype)
    tokens, logits = reference_generate(ckpt, prompt, GEN, dtype=RUN[run])
    hf_tokens, hf_logits = hf_greedy(hf_run(family, dtype, run), prompt)
    assert torch.equal(tokens, hf_tokens)
    tol = 1e-4 if run == "f32" else 2**-6
    torch.testing.assert_close(logits, hf_logits, atol=tol, rtol=0)


@pytest.mark.parametrize("family", CAUSAL)
def test_the_spec_carries_the_compute_dtype(family, saved):
    """The spec's dtype_bytes (and float16), not the saved dtype, is the compute dtype (float16
    compute: test_hf_parity_round9.py)."""
    ckpt = saved(family, "f16")
    assert load_checkpoint(ckpt)[0].float16  # auto: the saved one
    assert not load_checkpoint(ckpt, "bfloat16")[0].float16
    assert load_checkpoint(ckpt, "bfloat16")[0].dtype_bytes == 2
    assert load_checkpoint(ckpt, "float32")[0].dtype_bytes == 4
    assert load_checkpoint(saved(family, "bf16"))[0].dtype_bytes == 2  # auto: the saved one
    _, units = load_units(saved(family, "bf16"), "float32")
    assert {t.dtype for w in units.values() for t in w.values()} == {torch.float32}


# (family, saved dtype, device pool GB, host GB): small enough that experts come from disk
EXECUTOR = [("mixtral", "f16", 0.0006, 0.0003), ("deepseek_v2", "bf16", 0.0008, 0.0004)]


@pytest.mark.parametrize("family, dtype, gpu_gb, cpu_gb", EXECUTOR, ids=[c[0] for c in EXECUTOR])
def test_the_executor_runs_a_saved_dtype_in_float32(family, dtype, gpu_gb, cpu_gb, saved, hf_run):
    """The real executor over the offload tiers (experts read from disk with O_DIRECT into the
    host tier, then the device pool) runs float16 and bfloat16 weights in float32: transformers'
    tokens (live routing), and the in-memory forward's float32 logits. The disk tier reads the
    saved bytes; the host and device tiers hold the compute dtype's, whose byte sizes the spec
    (and so the schedule) counts, and every tensor there is the saved one upcast."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import prompts_for, real_execute
    from real.store import TieredStore
    from tests.real.test_executor import WORKLOAD, hardware

    ckpt = saved(family, dtype)
    model, _ = load_checkpoint(ckpt, "float32")
    assert model.dtype_bytes == 4
    spec = RunSpec(model, hardware(gpu_gb, cpu_gb), WORKLOAD, "layer_prefetch")
    result, out = real_execute(ckpt, spec, "live", dtype="float32")
    assert result.summary["bytes_moved"].get("disk", 0) > 0
    wl = WORKLOAD.with_(n_batches=result.summary["n_batches"])
    prompts = prompts_for(model, wl)
    tokens, logits = reference_generate(ckpt, prompts, wl.gen_len, dtype="float32")
    assert torch.equal(out.tokens, tokens)
    torch.testing.assert_close(out.logits, logits, atol=1e-4, rtol=1e-4)
    hf_out = hf_generate_out(hf_run(family, dtype, "f32"), prompts, wl.gen_len)
    hf_tokens = hf_out.sequences[:, prompts.shape[1] :]
    assert torch.equal(out.tokens, hf_tokens)
    _, units = load_units(ckpt, "float32")
    store = TieredStore(ckpt, 1 << 30, dtype="float32")
    try:
        for unit, weights in units.items():
            rec = store.records[unit]
            payload = [
                sum(d.itemsize * torch.Size(sh).numel() for _, d, sh, _ in ts)
                for ts in (rec.staged, rec.tensors)
            ]
            assert 2 * payload[0] == payload[1] <= store.unit_bytes(unit)  # 2 bytes read, 4 held
            got = store.to_device(unit) if store.read_disk(unit) else None
            assert got is not None
            for key, t in weights.items():
                assert torch.equal(got[key], t)
    finally:
        store.close()


def test_the_run_command_takes_executor_dtype(saved, cli_here, tmp_path):
    """`experiments.run executor=real executor.dtype=float32` on float16 weights writes the
    in-memory forward's float32 tokens, and with `auto` its float16 ones; a dtype that is none
    is one line naming the key, with no run dir."""
    from safetensors.torch import load_file

    from tests.probes.conftest import TINY, one_line

    ckpt = saved("mixtral", "f16")
    args = ["executor=real", f"checkpoint={ckpt}", *TINY[1:]]
    live = ["executor.routing_mode=live", "executor.dtype=float32"]
    r = cli_here("experiments.run", *args, *live, f"hydra.run.dir={tmp_path}/r")
    assert r.returncode == 0, r.stderr
    out = load_file(tmp_path / "r" / "tokens.safetensors")
    tokens, _ = reference_generate(ckpt, out["prompts"], out["tokens"].shape[1], dtype="float32")
    assert torch.equal(out["tokens"], tokens)
    r = cli_here(
        "experiments.run", *args, "executor.routing_mode=live", f"hydra.run.dir={tmp_path}/h"
    )
    assert r.returncode == 0, r.stderr
    out = load_file(tmp_path / "h" / "tokens.safetensors")
    tokens, _ = reference_generate(ckpt, out["prompts"], out["tokens"].shape[1])
    assert torch.equal(out["tokens"], tokens)
    r = cli_here("experiments.run", *args, "executor.dtype=int8", f"hydra.run.dir={tmp_path}/no")
    one_line(r, "executor.dtype=int8")
    assert not (tmp_path / "no").exists()


# generation_config.json: what transformers ignores or falls back from, moepipe too

# field -> its value from the base checkpoint's greedy tokens [B, GEN]: ids transformers'
# processors ignore beside ones that move the tokens (or alone, where the field is ignored)
IGNORED: dict[str, Callable[[torch.Tensor], Any]] = {
    "suppress_tokens": lambda t: [int(t[0, 1]), 128, -1, 2.5, float(t[1, 1])],
    "begin_suppress_tokens": lambda t: [1000, int(t[0, 0]), -128],
    "no_repeat_ngram_size": lambda t: -1,
    "forced_bos_token_id": lambda t: 500,
}


@pytest.mark.parametrize("field", IGNORED)
def test_what_transformers_ignores_runs_with_one_line(
    field, saved, hf_run, prompt, tmp_path, caplog
):
    """An id outside the vocabulary in suppress_tokens / begin_suppress_tokens (transformers'
    torch.isin over the vocabulary's ids suppresses nothing for it, and a fraction matches no
    id), a negative no_repeat_ngram_size (no processor), a forced_bos_token_id outside it with
    a prompt of more than one token (applied at length 1 only): transformers' generate() tokens
    and logits, and one line naming what was ignored. Before, each was refused in one line."""
    ckpt = saved("mixtral", "f32")
    want, _ = hf_generate(hf_run("mixtral", "f32", "f32"), prompt)
    changed = with_generation(ckpt, tmp_path / field, **{field: IGNORED[field](want)})
    hf_tokens, hf_logits = hf_generate(load_hf(changed, "f32"), prompt)
    with caplog.at_level(logging.WARNING):
        tokens, logits = reference_generate(changed, prompt, GEN)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    lines = [
        r.getMessage() for r in caplog.records if "ignored, as transformers'" in r.getMessage()
    ]
    assert len(lines) == 1 and field in lines[0] and "\n" not in lines[0]


def test_an_outside_forced_bos_is_refused_for_a_one_token_prompt(saved, hf_run, tmp_path):
    """A 1-token prompt is where transformers applies forced_bos_token_id: outside the
    vocabulary it fails there (IndexError), and moepipe refuses it in one line; -1 indexes the
    last token in both."""
    ckpt = saved("mixtral", "f32")
    one = torch.tensor([[7], [9]])
    bad = with_generation(ckpt, tmp_path / "bad", forced_bos_token_id=500)
    with pytest.raises(ConfigError, match=r"forced_bos_token_id=500 is not a token id below"):
        reference_generate(bad, one, GEN)
    last = with_generation(ckpt, tmp_path / "last", forced_bos_token_id=-1)
    tokens, _ = reference_generate(last, one, GEN)
    assert torch.equal(tokens, hf_generate(load_hf(last, "f32"), one)[0])
    assert (tokens[:, 0] == 127).all()


# what takes generation_config.json's place, and how transformers' load fails to read it
FALLBACK = {
    "not-json": lambda f: f.write_text('{"repetition_penalty": 1.2'),
    "empty": lambda f: f.write_text(""),
    "not-utf8": lambda f: f.write_bytes(b'{"repetition_penalty": "\xff"}'),
    "a-folder": lambda f: f.mkdir(),
    "dangling-link": lambda f: f.symlink_to(f.parent / "nowhere.json"),
}


@pytest.mark.parametrize("case", FALLBACK)
def test_an_unreadable_generation_config_falls_back_to_config_json(
    case, saved, prompt, tmp_path, caplog
):
    """A generation_config.json transformers cannot read as JSON (its OSError: not JSON, not
    UTF-8, no file there) makes it read config.json's generation fields instead (here
    no_repeat_ngram_size 1, which moves the tokens): moepipe does too, with one line saying the
    file was ignored. Before, each was refused in one line."""
    import shutil

    ckpt = with_generation(saved("mixtral", "f32"), tmp_path / "ckpt")
    edit_config(ckpt, no_repeat_ngram_size=1)
    (ckpt / GENERATION_FILE).unlink()
    FALLBACK[case](ckpt / GENERATION_FILE)
    hf_tokens, hf_logits = hf_generate(load_hf(ckpt, "f32"), prompt)
    with caplog.at_level(logging.WARNING):
        tokens, logits = reference_generate(ckpt, prompt, GEN)
    assert torch.equal(tokens, hf_tokens)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    plain = with_generation(saved("mixtral", "f32"), tmp_path / "plain")
    assert not torch.equal(tokens, reference_generate(plain, prompt, GEN)[0])  # it moved them
    lines = [
        r.getMessage() for r in caplog.records if "ignored: transformers then" in r.getMessage()
    ]
    assert len(lines) == 1 and lines[0].startswith(str(ckpt / GENERATION_FILE))
    shutil.rmtree(ckpt)


# config.json fields that change transformers' logits: equal to it, or refused in one line

ACTS = ["gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu", "relu", "sigmoid", "tanh"]
# (family, hidden_act): every activation in Mixtral, gelu and gelu_new in the others
ACT_CASES = [("mixtral", a) for a in ACTS] + [
    (f, a) for f in CAUSAL[1:] for a in ("gelu", "gelu_new")
]


@pytest.mark.parametrize("family, act", ACT_CASES, ids=[f"{f}-{a}" for f, a in ACT_CASES])
def test_hidden_act_equals_transformers(family, act, prompt, tmp_path):
    """transformers runs hidden_act's ACT2FN function in every family's gated experts, shared
    experts and dense FFNs (act(gate) * up): moepipe gives its tokens and float32 logits within
    1e-4. Before, every activation but silu was refused ("only 'silu' is implemented")."""
    ckpt, hf = save(family, {"hidden_act": act}, tmp_path / "ckpt")
    assert_transformers(ckpt, hf, prompt, "f32")


def test_an_activation_not_implemented_is_one_line(tmp_path, prompt):
    """A name transformers' ACT2FN does not have (relu3) is refused naming the field and
    those moepipe runs (round 12's test_an_activation_of_learned_weights_is_one_line: the
    ACT2FN names it does not run)."""
    ckpt, _ = save("olmoe", {}, tmp_path / "ckpt")
    edit_config(ckpt, hidden_act="relu3")
    with pytest.raises(ConfigError, match=r"config.json: hidden_act='relu3' is not implemented"):
        reference_generate(ckpt, prompt, GEN)


THETA = {"mixtral": 1e6, "qwen2_moe": 1e4, "qwen3_moe": 1e4, "olmoe": 1e4}
THETA |= {"deepseek_v2": 1e4, "deepseek_v3": 1e4}


@pytest.mark.parametrize("family", CAUSAL)
def test_partial_rotary_factor_of_default_rope_is_ignored_as_transformers(
    family, saved, hf_run, prompt, tmp_path
):
    """Each family's default RoPE (its RotaryEmbedding's own compute_default_rope_parameters)
    rotates the whole head whatever partial_rotary_factor says, in rope_parameters or at the
    top level: transformers' logits are those without it, and moepipe's equal them."""
    import shutil

    want_tokens, want_logits = hf_greedy(hf_run(family, "f32", "f32"), prompt)
    rope = {"rope_type": "default", "rope_theta": THETA[family], "partial_rotary_factor": 0.5}
    for name, edit in [
        ("nested", {"rope_parameters": rope}),
        ("top", {"partial_rotary_factor": 0.5}),
    ]:
        ckpt = Path(shutil.copytree(saved(family, "f32"), tmp_path / name))
        edit_config(ckpt, **edit)
        hf_tokens, hf_logits = hf_greedy(load_hf(ckpt, "f32"), prompt)
        torch.testing.assert_close(hf_logits, want_logits, atol=0, rtol=0)
        tokens, logits = reference_generate(ckpt, prompt, GEN)
        assert torch.equal(tokens, hf_tokens)
        torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("run", RUN)
@pytest.mark.parametrize("dtype", SAVED)
def test_switch_runs_any_saved_dtype_in_the_asked_one(dtype, run, prompt, tmp_path):
    """Switch (moepipe's causal substitute, which transformers' encoder-decoder is no reference
    for) saved in float16/bfloat16/float32 and run in float32/bfloat16: bit for bit the run of
    its weights cast to the run's dtype first and saved in it (a cast at load is a cast)."""
    from tests.real.test_hf_parity_round5 import SWITCH, SWITCH_LAYERS, SWITCH_SPARSE

    cfg = transformers.SwitchTransformersConfig(**SWITCH, **SWITCH_LAYERS, **SWITCH_SPARSE)
    torch.manual_seed(0)
    model = transformers.SwitchTransformersForConditionalGeneration(cfg).to(SAVED[dtype])
    model.save_pretrained(tmp_path / "saved")
    model.to(SAVED[run]).save_pretrained(tmp_path / "cast")
    tokens, logits = reference_generate(tmp_path / "saved", prompt, GEN, dtype=RUN[run])
    want_tokens, want_logits = reference_generate(tmp_path / "cast", prompt, GEN)
    assert torch.equal(tokens, want_tokens) and torch.equal(logits, want_logits)


def test_a_distributed_run_takes_executor_dtype(saved, tmp_path, capsys, monkeypatch):
    """`executor.distributed=true executor.dtype=float32` on bfloat16 weights: its 2 ranks
    (expert-parallel, live routing) load the checkpoint in float32 each and write the
    in-memory forward's float32 tokens."""
    from safetensors.torch import load_file

    from experiments import run as run_module
    from tests.conftest import command_here
    from tests.real.test_distributed import command

    ckpt = saved("olmoe", "bf16")
    more = ["planner=eplb", "executor.routing_mode=live", "executor.dtype=float32"]
    argv = command(ckpt, tmp_path / "r", *more)[3:]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    proc = command_here(run_module.main, argv, capsys, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = load_file(tmp_path / "r" / "tokens.safetensors")
    tokens, _ = reference_generate(ckpt, out["prompts"], out["tokens"].shape[1], dtype="float32")
    assert torch.equal(out["tokens"], tokens)
