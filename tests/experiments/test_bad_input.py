"""A user's mistake in a command's arguments is one line on stderr, `error: ` and the argument or
file at fault, exit status 2, before any long work (an output path that cannot be written is
refused before the measuring or simulating whose results it would lose)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from experiments import (
    calibrate,
    convert_traces,
    prefetch_eval,
    reproduce_klotski,
    routing_stats,
    validate,
)
from experiments.bench import accelerate as bench_accelerate
from experiments.bench import sim as bench_sim
from real.checkpoint import reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.conftest import NEEDS_TRACES, overridden

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="device=cuda is valid here")


def one_error(capsys: pytest.CaptureFixture[str], *names: str) -> str:
    """The one stderr line, checked to start with `error: ` and name each of `names`."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture
def afile(tmp_path: Path) -> Path:
    """A plain file: a path under it cannot be created."""
    (tmp_path / "afile").write_text("")
    return tmp_path / "afile"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = reduced_spec("mixtral-tiny", hidden_size=64, expert_ffn_size=32, vocab_size=128)
    return write_checkpoint(spec, tmp_path_factory.mktemp("ck") / "ck", seed=0)


@pytest.mark.parametrize(
    "args, names",
    [
        (["out={afile}/x.yaml"], ["out=", "afile"]),
        (["out={tmp}/a/b.yaml", "disk_dir={afile}/d"], ["disk_dir=", "afile"]),
        (["disk_mb=abc", "out={tmp}/x.yaml"], ["disk_mb=abc"]),
        (["disk_mb=0", "out={tmp}/x.yaml"], ["disk_mb=0"]),
        (["in_run_s=-1", "out={tmp}/x.yaml"], ["in_run_s=-1"]),
        (["in_run_s=soon", "out={tmp}/x.yaml"], ["in_run_s=soon"]),
        (["device=tpu", "out={tmp}/x.yaml"], ["device=tpu"]),
        pytest.param(["device=cuda", "out={tmp}/x.yaml"], ["device=cuda"], marks=NO_CUDA),
        (["out={tmp}"], ["out=", "folder"]),
    ],
)
def test_calibrate(args, names, tmp_path, afile, capsys):
    argv = [a.format(afile=afile, tmp=tmp_path) for a in args]
    assert calibrate.main(["hardware.name=t", *argv]) == 2
    one_error(capsys, *names)
    assert not (tmp_path / "x.yaml").exists()


def _hw_files(tmp: Path) -> None:
    (tmp / "empty.yaml").write_text("")
    (tmp / "partial.yaml").write_text("name: x\ngpu: {tflops: 1}\n")
    (tmp / "syntax.yaml").write_text("name: x\n  gpu: [\n")
    (tmp / "nolinks.yaml").write_text("name: x\nmemory_gb: {gpu: 1, cpu: 1, disk: 1}\n")


@pytest.mark.parametrize(
    "args, names",
    [
        (["hardware={tmp}/empty.yaml"], ["empty.yaml", "empty"]),
        (["hardware={tmp}/partial.yaml"], ["partial.yaml", "memory_gb"]),
        (["hardware={tmp}/syntax.yaml"], ["syntax.yaml:2", "YAML"]),
        (["hardware={tmp}/nosuch.yaml"], ["nosuch.yaml", "out={tmp}/nosuch.yaml"]),
        (["batch_size=abc"], ["batch_size=abc"]),
        (["gpu_frac=abc"], ["gpu_frac=abc"]),
        (["repeats=0"], ["repeats=0"]),
        (["planners=[flexgen,nosuch]"], ["planners=", "nosuch", "flexgen, klotski"]),
    ],
)
def test_validate_before_the_checkpoint(args, names, tmp_path, capsys):
    _hw_files(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in args]
    assert validate.main([f"checkpoint={tmp_path}/no-ckpt", f"out={tmp_path}/v", *argv]) == 2
    one_error(capsys, *[n.format(tmp=tmp_path) for n in names])
    assert not (tmp_path / "v").exists()


@pytest.mark.parametrize(
    "args, names",
    [
        (["out={afile}/v"], ["out=", "afile"]),
        (["hardware={tmp}/nolinks.yaml"], ["nolinks.yaml", "links"]),
    ],
)
def test_validate_with_a_checkpoint(args, names, ckpt, tmp_path, afile, capsys):
    _hw_files(tmp_path)
    argv = [a.format(afile=afile, tmp=tmp_path) for a in args]
    base = [f"checkpoint={ckpt}", "hardware=tiny", "planners=flexgen"]
    assert validate.main(overridden(base, *argv)) == 2
    one_error(capsys, *names)


@pytest.mark.parametrize(
    "args, names",
    [
        (["batch_size=abc"], ["batch_size=abc"]),
        (["n_batches=1.5"], ["n_batches=1.5"]),
        (["cpu_frac=x"], ["cpu_frac=x"]),
        (["hardware={tmp}/empty.yaml"], ["empty.yaml"]),
    ],
)
def test_bench_accelerate(args, names, tmp_path, capsys):
    _hw_files(tmp_path)
    argv = [a.format(tmp=tmp_path) for a in args]
    assert bench_accelerate.main([f"checkpoint={tmp_path}/no-ckpt", "cold=false", *argv]) == 2
    one_error(capsys, *names)


@pytest.mark.parametrize(
    "args, names",
    [
        (["jobs=0"], ["jobs=0"]),
        (["jobs=-1"], ["jobs=-1"]),
        (["out={afile}/rk"], ["out=", "afile"]),
        (["jbos=2"], ["jbos", "did you mean 'jobs'"]),
        (["jobs=two"], ["jobs=two: must be an integer in [1, ", "per core"]),
    ],
)
def test_reproduce_klotski(args, names, tmp_path, afile, capsys):
    argv = [a.format(afile=afile) for a in args]
    out = [f"out={tmp_path / 'rk'}"]
    assert reproduce_klotski.main(overridden(["quick=true", "only=[auto_n]", *out], *argv)) == 2
    one_error(capsys, *names)


@pytest.mark.parametrize(
    "args, names",
    [
        (["group_seqs=0"], ["group_seqs=0"]),
        pytest.param(
            ["group_seqs=100000000"], ["group_seqs=100000000", "intent"], marks=NEEDS_TRACES
        ),
        (["k=-1"], ["k=-1"]),
        (["out={afile}/pf.csv"], ["out=", "afile"]),
        (["trace_dir={tmp}/none"], ["trace_dir=", "none"]),
        pytest.param(
            ["train=[law,sumary]"], ["train=[law,sumary]", "'sumary'"], marks=NEEDS_TRACES
        ),
    ],
)
def test_prefetch_eval(args, names, tmp_path, afile, capsys):
    argv = [a.format(afile=afile, tmp=tmp_path) for a in args]
    assert prefetch_eval.main(overridden(["train=[law]", "test=[intent]"], *argv)) == 2
    line = one_error(capsys, *names)
    assert "workload.routing" not in line


@pytest.mark.parametrize(
    "args, names",
    [
        (["out={afile}/rs.json"], ["out=", "afile"]),
        (["trace_dir={tmp}/none", "out={tmp}/rs.json"], ["trace_dir=", "none"]),
    ],
)
def test_routing_stats(args, names, tmp_path, afile, capsys):
    argv = [a.format(afile=afile, tmp=tmp_path) for a in args]
    assert routing_stats.main(argv) == 2
    one_error(capsys, *names)


def test_bench_sim_unknown_planner(capsys):
    assert bench_sim.main(["planner=nosuch", "repeat=1"]) == 2
    one_error(capsys, "nosuch", "flexgen")


def _esft_dir(root: Path, layer_files: tuple[int, ...] = tuple(range(1, 27))) -> Path:
    (root / "law").mkdir(parents=True)
    line = "\t".join(map(str, range(6))) + "\t\t" + "\t".join(["0.1"] * 6) + "\n"
    for layer in layer_files:
        (root / "law" / f"expert_weights_{layer}.txt").write_text(line)
    return root


def test_convert_traces_bad_input(tmp_path, afile, capsys):
    good = _esft_dir(tmp_path / "good")
    assert convert_traces.main([f"src={good}", f"out={afile}/o.npz"]) == 2
    one_error(capsys, "afile")
    garbage = tmp_path / "garbage"
    (garbage / "law").mkdir(parents=True)
    (garbage / "law" / "expert_weights_0.txt").write_text("garbage line\n")
    assert convert_traces.main([f"src={garbage}", f"out={tmp_path / 'o.npz'}"]) == 2
    one_error(capsys, "garbage", "not an ESFT routing dump")
    for layer in range(1, 27):  # every layer the CLI requires, unparseable
        (garbage / "law" / f"expert_weights_{layer}.txt").write_text("garbage line\n")
    (garbage / "law" / "expert_weights_0.txt").unlink()
    assert convert_traces.main([f"src={garbage}", f"out={tmp_path / 'o.npz'}"]) == 2
    one_error(capsys, "expert_weights_1.txt line 1", "not an ESFT routing dump")
    assert convert_traces.main([f"src={good}", f"out={tmp_path}"]) == 2
    one_error(capsys, str(tmp_path), "folder")


def test_convert_traces_names_the_file_it_wrote(tmp_path, capsys):
    """numpy adds .npz to an output path without it; the `wrote` line names that file."""
    good = _esft_dir(tmp_path / "good")
    assert convert_traces.main([f"src={good}", f"out={tmp_path / 'sub' / 'o6'}"]) == 0
    written = tmp_path / "sub" / "o6.npz"
    assert capsys.readouterr().out.strip() == f"wrote {written}"
    assert np.load(written)["expert_ids"].shape == (1, 26, 6)
