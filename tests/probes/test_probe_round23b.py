"""Round 23b of issue 48: a real run's files and faults, probed afresh (204 cases: every file of
the HF layout missing, empty, cut short, a symlink to a file, a folder, nothing or itself, a
folder in its place; sharded indexes naming a file twice, a tensor in two files, paths out of
the folder; tensors of another dtype, extra or missing; config.json and the weights at odds in
each shape field; odd generation_config.json; a finished run's files edited at the same size;
the checkpoint rewritten between runs; a read-only checkpoint; a full disk; SIGKILL, SIGTERM
and SIGINT mid-run, then the same command again). Classes found:

- a checkpoint file that cannot be stat'ed (a symlink to nothing or to itself) stopped a run
  before the checkpoint was read, at the config record's version line, as a bare OSError: a
  dangling or looping generation_config.json, which transformers (and moepipe's own reader)
  ignore, refused the run, and a dangling weights file or index was named without its fix;
- `checkpoint=` (or `model.hf_config=`) naming another file of a checkpoint (its weights, its
  index, its generation settings) was read as config.json: "not UTF-8 text; copy the model's
  released config.json", a fix that rewrote the wrong file;
- a config.json whose quantization_config says fp8 over weights none of which is float8 with
  its scales ran them unscaled without a word (transformers loads them into FP8 layers);
- a YAML file hydra reads (a hardware profile cut or overwritten with NUL bytes, a user's
  group file) holding a character YAML refuses: "not valid YAML (character #x0000 ...); fix
  that file", naming no file (PyYAML's ReaderError has no mark, only the stream's name);
- make_checkpoint over an earlier checkpoint kept its generation_config.json (a user's file,
  by design) without a word, so the new model's runs decoded with the earlier one's settings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from core.hf_config.fields import read_hf_config
from experiments.common.cli import error_line
from experiments.run import model_files_line
from real.checkpoint import load_checkpoint
from tests.probes.conftest import one_line, raises_one_line, real_args

GEN = "generation_config.json"
WEIGHTS = "model.safetensors"


def _dangling(p: Path) -> None:
    p.symlink_to(p.parent / "nowhere")


def _loop(p: Path) -> None:
    p.symlink_to(p)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path) -> Path:
    """A copy of the tiny checkpoint, which the tests below give broken files of their own."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path_factory.mktemp("r23b") / "ck"))


def _with(ckpt: Path, tmp_path: Path, name: str, make: Any) -> Path:
    """A copy of `ckpt` whose file `name` is replaced by what `make` makes in its place."""
    d = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    (d / name).unlink(missing_ok=True)
    make(d / name)
    return d


def _real_cfg(d: Path) -> Any:
    return OmegaConf.create({"executor": {"name": "real"}, "checkpoint": str(d), "model": {}})


@pytest.mark.parametrize("make", [_dangling, _loop], ids=["dangling", "loop"])
@pytest.mark.parametrize("name", [GEN, WEIGHTS])
def test_a_file_that_cannot_be_stated_is_left_to_the_checkpoints_reader(
    ckpt: Path, tmp_path: Path, name: str, make: Any
) -> None:
    d = _with(ckpt, tmp_path, name, make)
    assert "# model files" in model_files_line(_real_cfg(d))  # was a bare OSError
    if name == WEIGHTS:  # the reader names the link and its fix
        raises_one_line(lambda: load_checkpoint(d), WEIGHTS, "symbolic link", "re-copy")


def test_a_generation_config_linking_nowhere_runs_as_transformers_runs(
    ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    d = _with(ckpt, tmp_path, GEN, _dangling)
    r = cli_here("experiments.run", *real_args(d, tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("name", [WEIGHTS, "model.safetensors.index.json", GEN, "x.bin"])
def test_another_file_of_a_checkpoint_given_as_its_config_names_the_folder(
    tmp_path: Path, name: str
) -> None:
    p = tmp_path / name
    p.write_text("{}")  # JSON, but not a config: read as one, it was refused as of no family
    line = raises_one_line(lambda: read_hf_config(p), name, "not its config.json")
    assert f"({tmp_path})" in line


def test_a_run_given_the_weights_file_names_the_checkpoints_folder(
    ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    r = cli_here("experiments.run", *real_args(ckpt / WEIGHTS, tmp_path / "run"))
    one_line(r, WEIGHTS, "not its config.json", str(ckpt))
    assert not (tmp_path / "run").exists()


def test_an_fp8_quantization_config_over_unquantized_weights_is_one_line(
    ckpt: Path, tmp_path: Path
) -> None:
    d = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    }
    (d / "config.json").write_text(json.dumps(cfg))
    raises_one_line(lambda: load_checkpoint(d), "config.json", "quantization_config", "float8")


@pytest.mark.parametrize("text", [b"name: x\nlinks: \x00\n", b"name: x\n\x07: 1\n"])
def test_a_yaml_file_with_a_character_yaml_refuses_is_named_with_its_line(
    tmp_path: Path, text: bytes
) -> None:
    p = tmp_path / "hw.yaml"
    p.write_bytes(text)
    with open(p) as f, pytest.raises(yaml.YAMLError) as info:
        yaml.safe_load(f)
    line = error_line(info.value)
    assert line is not None and line.startswith(f"{p}:2: not valid YAML (character #x00"), line


def test_make_checkpoint_says_it_kept_an_earlier_generation_config(
    ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    d = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    (d / GEN).write_text('{"repetition_penalty": 1.5}')
    args = ["model=mixtral-tiny", f"out={d}", "n_layers=1", "hidden_size=32", "vocab_size=64"]
    r = cli_here("experiments.make_checkpoint", *args, "n_heads=2", "n_kv_heads=1")
    assert r.returncode == 0, r.stderr
    assert f"kept {d / GEN}" in r.stdout and (d / GEN).is_file()


def test_a_profile_that_leaves_out_a_required_field_is_named(tmp_path: Path, cli_here: Any) -> None:
    """A hardware profile cut before its `name:` said "add it to its YAML file", naming no file
    (validate named it): the line names the file the run took the group from."""
    hw = tmp_path / "cut.yaml"
    text = (Path(__file__).parents[2] / "conf" / "hardware" / "tiny.yaml").read_text()
    hw.write_text("".join(x for x in text.splitlines(True) if not x.startswith("name:")))
    args = ["model=tiny", "workload=tiny", "planner=flexgen", f"hardware={hw}"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "hardware.name", f"add it to {hw}")
    assert not (tmp_path / "run").exists()
