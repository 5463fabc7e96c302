"""Probe round 19a (issue 48): the checkpoint boundary, by class.

A real run read its checkpoint's config.json twice: first to check its options and record its
model in config.yaml, then to run it; its check that nothing changed the checkpoint began at the
second read, so a rewrite between the two ran one config.json and recorded another. The state of
the files is taken before the first read now and compared at the run's end, their change time
with it (an edit that keeps the size and puts the modification time back moves it). The class
beyond one run: validate's planners, calibrate's runs and a bench's systems (each in a child of
its own) each read the checkpoint again; a rewrite between two of them compared two checkpoints.
Each is checked from the command's first read.

A safetensors index whose `metadata` was a list, null or a string (transformers'
from_pretrained fails on it) ran without a word, and so did one whose `total_size` was wrong,
a string, negative or absent: the first is one line, the second one logged line; so is a
safetensors file beside the index that it does not name.

config.json's dtype read as transformers' getattr(torch, dtype) reads it: an empty string was
taken for no dtype (transformers fails on it), and torch's `float` and `half` were refused.
A `quantization_config` that is no object was said as a quantization method; `architectures`
naming a class of no family moepipe runs (LlamaForCausalLM under mixtral) ran without a word.
`q_lora_rank`, or a bias flag set true, under a family whose class has no such field ran as if
absent: refused, as another family's sizes are. RoPE given twice, differently (rope_scaling
and rope_parameters, a top-level rope_theta beside the object's) ran transformers' choice
without a word: it still does, in one logged line, as does yarn's factor where it is not the
positions' ratio (transformers warns there too). A shard that is no safetensors file (JSON
text, torch's zip or pickle under its name) was said to be a truncated one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from experiments import run as run_module
from real.checkpoint import INDEX_FILE, load_checkpoint, reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.probes.conftest import TINY, one_line, raises_one_line


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A copy of the probes' tiny checkpoint, to edit."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))


def _rewrite_config(ckpt: Path, keep_mtime: bool) -> None:
    """config.json given another rope_theta in place, at the same size; with `keep_mtime`, its
    modification time put back (as `touch -r` or a copy that keeps times does)."""
    config = ckpt / "config.json"
    st = config.stat()
    text = config.read_text()
    assert '"rope_theta": 1000000.0' in text
    config.write_text(text.replace('"rope_theta": 1000000.0', '"rope_theta": 2000000.0'))
    if keep_mtime:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))


# -- a checkpoint rewritten between a run's first read of it and its own load ----------------


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["edited", "mtime-put-back"])
def test_a_rewrite_between_the_runs_two_reads_is_one_line(
    ckpt: Path, tmp_path: Path, keep_mtime: bool, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json rewritten after the run read it to check its options (and record its model)
    but before the run loaded it: the run ran the new file, recorded the old one, exit 0."""
    checked = run_module.check_routing_overrides

    def then_rewritten(cfg: Any, spec: Any) -> None:
        checked(cfg, spec)  # the first read of config.json
        _rewrite_config(ckpt, keep_mtime)

    monkeypatch.setattr(run_module, "check_routing_overrides", then_rewritten)
    run_dir = tmp_path / "run"
    r = cli_here(
        "experiments.run",
        "executor=real",
        f"checkpoint={ckpt}",
        *TINY[1:],
        f"hydra.run.dir={run_dir}",
    )
    one_line(r, str(ckpt / "config.json"), "changed while the run read")
    assert not (run_dir / "summary.json").exists()


# -- a sharded checkpoint's index: its metadata, read as transformers reads it ---------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The probes' tiny model in three shards and an index."""
    spec = reduced_spec(
        "mixtral-tiny", hidden_size=64, n_heads=4, expert_ffn_size=32, vocab_size=128, n_layers=2
    )
    out = tmp_path_factory.mktemp("r19a") / "sharded"
    return write_checkpoint(spec, out, seed=0, shard_bytes=200_000)


@pytest.fixture
def index_of(sharded: Path, tmp_path: Path) -> Callable[[Any], Path]:
    """A copy of `sharded` whose index's metadata is the value given (DROP: none)."""

    def edit(meta: Any) -> Path:
        d = Path(shutil.copytree(sharded, tmp_path / "ck"))
        data = json.loads((d / INDEX_FILE).read_text())
        data.pop("metadata")
        if meta is not DROP:
            data["metadata"] = meta
        (d / INDEX_FILE).write_text(json.dumps(data))
        return d

    return edit


DROP = "<no metadata>"


@pytest.mark.parametrize("meta", [[], None, "x", 3], ids=["list", "null", "string", "number"])
def test_an_index_whose_metadata_is_no_object_is_one_line(
    index_of: Callable[[Any], Path], meta: Any
) -> None:
    """transformers' from_pretrained takes index["metadata"] and fails on anything but an
    object (a TypeError); moepipe ran it without a word."""
    d = index_of(meta)
    raises_one_line(lambda: load_checkpoint(d), str(d / INDEX_FILE), "metadata is", "not an object")


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        (DROP, "no metadata.total_size"),
        ({}, "no metadata.total_size"),
        ({"total_size": 1}, "metadata.total_size is 1, but"),
        ({"total_size": "562432"}, 'metadata.total_size is "562432", but'),
        ({"total_size": -5}, "metadata.total_size is -5, but"),
        ({"total_size": True}, "metadata.total_size is true, but"),
    ],
    ids=["absent", "no total_size", "wrong", "a string", "negative", "true"],
)
def test_an_index_whose_total_size_is_not_its_tensors_bytes_says_so(
    index_of: Callable[[Any], Path], meta: Any, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stale or hand-made index (its tensors are each checked in their shard) loads, as in
    transformers, which does not read total_size, but not without a word: one line names it."""
    d = index_of(meta)
    with caplog.at_level(logging.WARNING):
        load_checkpoint(d)
    lines = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert len(lines) == 1 and str(d / INDEX_FILE) in lines[0], caplog.text


def test_an_index_as_save_pretrained_writes_it_says_nothing(
    sharded: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        load_checkpoint(sharded)
    assert "total_size" not in caplog.text


# -- config.json's dtype as transformers reads it: getattr(torch, value) ----------------------


def _config(ckpt: Path, **fields: Any) -> Path:
    config = ckpt / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | fields))
    return ckpt


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"torch_dtype": ""}, "torch_dtype ''"),
        ({"dtype": ""}, "dtype ''"),  # beside torch_dtype float32: dtype is read
    ],
    ids=["torch_dtype empty", "dtype empty"],
)
def test_an_empty_dtype_is_one_line(ckpt: Path, fields: dict, names: str) -> None:
    """An empty string was read as no dtype (the weights' own, or torch_dtype's), where
    transformers' getattr(torch, "") fails: nothing says what the file meant."""
    raises_one_line(lambda: load_checkpoint(_config(ckpt, **fields)), "config.json", names)


def test_torchs_other_name_of_a_dtype_reads_as_transformers_reads_it(ckpt: Path) -> None:
    """ "float" is torch.float32 to transformers (getattr(torch, "float")); it was refused as
    a dtype with no byte size."""
    assert load_checkpoint(_config(ckpt, torch_dtype="float"))[0].dtype_bytes == 4


# -- config.json's architectures: a class of no family moepipe runs --------------------------


@pytest.mark.parametrize(
    ("archs", "said"),
    [
        (["LlamaForCausalLM"], "LlamaForCausalLM"),
        (["MixtralForCausalLM", "FooModel"], "FooModel"),
        (["MixtralForCausalLM"], None),
        (["MixtralModel"], None),
        ([], None),
    ],
    ids=["llama", "second unknown", "own", "own model", "empty"],
)
def test_an_architecture_of_no_family_is_said(
    ckpt: Path, archs: list, said: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """LlamaForCausalLM under model_type mixtral ran as Mixtral without a word (transformers'
    AutoModelForCausalLM builds Mixtral too; the weights decide): it loads, in one line."""
    with caplog.at_level(logging.WARNING):
        load_checkpoint(_config(ckpt, architectures=archs))
    lines = [r.getMessage() for r in caplog.records if "architectures names" in r.getMessage()]
    if said is None:
        assert not lines, lines
    else:
        assert len(lines) == 1 and said in lines[0] and "'mixtral'" in lines[0], lines


# -- a command running a checkpoint more than once: each run from the command's first read ----


def test_validate_fails_where_the_checkpoint_changed_between_two_planners(
    ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """validate read the checkpoint, then ran each planner on it; a rewrite between two
    planners' runs was inside neither run's check, and the table compared runs of two
    checkpoints (calibrate's runs are checked alike, from its first read)."""
    from core.errors import MoepipeError
    from experiments import validate as v

    real = v.real_execute
    ran: list[str] = []

    def then_rewritten(*a: Any, **kw: Any) -> Any:
        out = real(*a, **kw)
        ran.append(a[1].planner)
        _rewrite_config(ckpt, keep_mtime=True)
        return out

    monkeypatch.setattr(v, "real_execute", then_rewritten)
    sizes = dict(batch_size=1, n_batches=1, prompt_len=4, gen_len=1, links="calibrated")
    opts = dict(v._DEFAULTS, checkpoint=str(ckpt), hardware="tiny", repeats=1, **sizes)
    opts |= dict(gpu_frac=2.0, cpu_frac=0.5)
    opts |= dict(planners="sequential,flexgen", out=str(tmp_path / "out"))
    with pytest.raises(MoepipeError, match="changed while the run read"):
        v.validate(opts)
    assert ran == ["sequential"] and not (tmp_path / "out").exists()


def test_a_bench_fails_where_the_checkpoint_changed_between_its_systems(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """bench.accelerate (and bench.real, through the same children) runs moepipe and then
    accelerate, each loading the checkpoint in a child of its own: a rewrite between the two
    children was inside neither's check, and the table compared two checkpoints' runs."""
    from core.errors import MoepipeError
    from experiments.bench import accelerate as acc
    from experiments.common.schema import BenchAccelerateOptions

    class Room:
        def options(self, d: dict) -> dict:
            return d

    def compared(*a: Any) -> tuple[list, list[str]]:
        _rewrite_config(ckpt, keep_mtime=True)  # between one system's child and the next's
        return [], ["header"]

    monkeypatch.setattr(acc, "measure_room", lambda *a: Room())
    monkeypatch.setattr(acc, "compare", compared)
    opts = BenchAccelerateOptions(checkpoint=str(ckpt), hardware="tiny", cgroup=False)
    with pytest.raises(MoepipeError, match="changed while the run read"):
        acc._bench(opts)
    assert "header" not in capsys.readouterr().out


# -- config.json: another family's field that sizes attention or adds biases -----------------

_MODELS = {
    "mixtral": "mixtral-tiny",
    "qwen2_moe": "qwen1.5-moe-a2.7b",
    "qwen3_moe": "qwen3-30b-a3b",
    "olmoe": "olmoe-1b-7b",
}


@pytest.mark.parametrize(
    ("family", "fields", "said"),
    [
        ("mixtral", {"q_lora_rank": 16}, "q_lora_rank is a field of deepseek_v2"),
        ("mixtral", {"qkv_bias": True}, "qkv_bias is true, but it is a field of qwen2_moe"),
        ("mixtral", {"attention_bias": True}, "attention_bias is true"),
        ("qwen2_moe", {"attention_bias": True}, "not of model_type 'qwen2_moe'"),
        ("olmoe", {"mlp_bias": True}, "mlp_bias is true"),
        ("mixtral", {"attention_bias": False, "mlp_bias": False}, None),  # as Llama's template
        ("qwen3_moe", {"attention_bias": True}, None),  # its own
    ],
    ids=[
        "q_lora_rank",
        "qkv_bias",
        "attention_bias",
        "qwen2 attn bias",
        "mlp_bias",
        "false",
        "own",
    ],
)
def test_another_familys_attention_field_is_refused(
    family: str, fields: dict, said: str | None
) -> None:
    """q_lora_rank, or a bias flag set true, under a family whose transformers class has no
    such field ran as if absent (transformers ignores them): the file describes another model
    than the one run, as another family's sizes do (round 13's FAMILY_FIELDS)."""
    from core.hf_config import hf_config_to_spec, spec_to_hf_config

    cfg = spec_to_hf_config(reduced_spec(_MODELS[family])) | fields
    if said is None:
        assert hf_config_to_spec(cfg, "m", "config.json").family == family
    else:
        raises_one_line(lambda: hf_config_to_spec(cfg, "m", "config.json"), "config.json", said)


# -- config.json giving RoPE twice, differently ----------------------------------------------

_LINEAR = {"rope_type": "linear", "factor": 2.0}
YARN_IDS = ["yarn factor not the ratio", "yarn factor the ratio", "yarn ratio 1"]


def _yarn(factor: float, original: int) -> dict:
    """Fields of yarn RoPE of `factor` from `original` positions to 4096."""
    rope = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    return {"max_position_embeddings": 4096, "rope_scaling": rope}


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        (
            {"rope_scaling": _LINEAR, "rope_parameters": {**_LINEAR, "factor": 4.0}},
            "rope_scaling and rope_parameters differ",
        ),
        (
            {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
            "rope_theta=1000000.0 but rope_parameters.rope_theta=500.0",
        ),
        (
            {"partial_rotary_factor": 0.5, "rope_scaling": {**_LINEAR, "partial_rotary_factor": 1}},
            "partial_rotary_factor=0.5 but rope_scaling.partial_rotary_factor=1",
        ),
        ({"rope_theta": 1e6, "rope_scaling": _LINEAR, "rope_parameters": _LINEAR}, None),
        (_yarn(4.0, 99999), "yarn's factor=4.0, but max_position_embeddings=4096 over"),
        (_yarn(4.0, 1024), None),  # 4096 / 1024
        (_yarn(4.0, 4096), None),  # a ratio of 1: transformers' own inference, said by none
    ],
    ids=["two objects", "rope_theta", "partial_rotary_factor", "the same", *YARN_IDS],
)
def test_rope_given_twice_differently_is_said(
    tmp_path: Path, fields: dict, said: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """transformers runs `rope_scaling or rope_parameters`, and the RoPE object's rope_theta
    over the top-level one, without a word; so did moepipe, where the file says two things.
    yarn's factor other than the positions' ratio: transformers warns, moepipe said nothing."""
    from core.hf_config import hf_config_to_spec, spec_to_hf_config

    cfg = spec_to_hf_config(reduced_spec("mixtral-tiny")) | fields
    where = str(tmp_path / "config.json")  # its own line: each is said once a process
    with caplog.at_level(logging.WARNING):
        hf_config_to_spec(cfg, "m", where)
    lines = [r.getMessage() for r in caplog.records if where in r.getMessage()]
    if said is None:
        assert not lines, lines
    else:
        assert len(lines) == 1 and said in lines[0], lines


# -- a weights file that is no safetensors file at all ---------------------------------------


@pytest.mark.parametrize(
    "data",
    [b'{\n  "model_type": "mixtral"\n}\n' * 4, b"PK\x03\x04" + bytes(200), b"\x80\x02}q\x00." * 9],
    ids=["json text", "torch.save zip", "a pickle"],
)
def test_a_weights_file_of_another_format_says_so(ckpt: Path, data: bytes) -> None:
    """A JSON file, or torch's zip or pickle, under a shard's name read its first 8 bytes as a
    header length past the file and said "truncated safetensors file (header cut off)", which
    no re-copy fixes: it is no safetensors file, which the line says now."""
    (ckpt / "model.safetensors").write_bytes(data)
    raises_one_line(lambda: load_checkpoint(ckpt), "model.safetensors", "not a safetensors file")


def test_a_shard_the_index_does_not_name_is_said(
    sharded: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier sharding's file left beside the index (transformers reads only the files
    the index names, and so does moepipe) was passed over without a word."""
    d = Path(shutil.copytree(sharded, tmp_path / "ck"))
    shutil.copyfile(d / "model-00001-of-00003.safetensors", d / "model-00001-of-00002.safetensors")
    with caplog.at_level(logging.WARNING):
        load_checkpoint(d)
    lines = [r.getMessage() for r in caplog.records if "does not name" in r.getMessage()]
    assert len(lines) == 1 and "model-00001-of-00002.safetensors" in lines[0], caplog.text
