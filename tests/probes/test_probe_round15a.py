"""Probe round 15a (issue 48): the real, distributed and checkpoint commands. bench.host's
host memory cap follows the machine; make_checkpoint writes float16 checkpoints that load back
as float16; a device named '' or cpu:N is refused, not run elsewhere; a derived head_dim of 0
names the sizes given; a whole number written as a float is named so; calibrate's probe file and
a checkpoint write cut short name their file or option and the fix; a negative seed is told
which way to go; grouped_gemm on a real run is refused by name; bench.real reuses its checkpoint
only for the same model; under torchrun the first rank to fail says its line, and writes it
where torchrun's report shows it."""

from __future__ import annotations

import errno
import io
import json
import os

import pytest
import torch
from omegaconf import OmegaConf, ValidationError
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import experiments.bench.host as bench
from core.errors import MoepipeError
from core.spec import Workload
from experiments import make_checkpoint
from experiments.bench.real import ensure_checkpoint
from experiments.common import hydra_errors
from experiments.common.cli import exit_with
from experiments.common.real_run import real_execute
from experiments.common.schema import WorkloadSchema
from real.calibration import measure_disk
from real.checkpoint import load_checkpoint, reduced_spec, torch_dtype
from real.store import resolve_device
from tests.planners.ep_common import tiny_spec
from tests.probes.conftest import one_line, raises_one_line, real_args, said_by_ranks_1_then_0

SMALL_HOST = dict(batch=2, kv_heads=3, positions=40, head_dim=16, unit_mb="1.5", units=5)


def _no_allocation(*args, **kw):
    raise AssertionError("the bench allocated past the machine's memory")


@pytest.mark.parametrize(
    ("part", "opts", "names"),
    [
        ("kv", dict(batch=8, kv_heads=8, positions=65536, head_dim=128), ["batch=8", "positions"]),
        ("buffers", dict(unit_mb="64", units=64), ["units=64", "unit_mb=64"]),
    ],
)
def test_bench_host_caps_host_memory_at_what_the_machine_has(monkeypatch, part, opts, names):
    """bench.host capped what it holds at 64 GB whatever the machine: a 2 GB machine was sent
    into swap by a 1 GB KV cache (held three times) or 4 GB of buffers. The cap is this
    machine's available RAM, and the line says so."""
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 2 * 10**9)
    monkeypatch.setattr(torch, "randn", _no_allocation)
    monkeypatch.setattr(bench.HostSlabs, "take", _no_allocation)
    slabs = bench.HostSlabs(None)
    fn = bench.kv_lines if part == "kv" else bench.buffer_lines
    try:
        line = raises_one_line(
            lambda: fn({**SMALL_HOST, **opts}, torch.device("cpu"), slabs, 1), *names
        )
    finally:
        slabs.close()
    assert "this machine has 2 GB available" in line, line


def test_make_checkpoint_float16_writes_float16_and_loads_back_as_float16(tmp_path, capsys):
    """make_checkpoint float16=true was refused: config.json "could not carry it back", though
    its torch_dtype "float16" does (transformers' own field). The checkpoint's weights are
    float16 and a run on it computes in float16, as from_pretrained(dtype="auto") does."""
    out = tmp_path / "f16"
    assert make_checkpoint.main(["model=tiny", f"out={out}", "float16=true"]) == 0
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    spec, index = load_checkpoint(out)
    assert spec.float16 and torch_dtype(spec) == torch.float16
    assert {e.dtype for e in index.values()} == {torch.float16}
    # and where the model's bytes cannot be float16's, one line naming both
    bad = tmp_path / "f32"
    assert make_checkpoint.main(["model=mixtral-tiny", f"out={bad}", "float16=true"]) != 0
    assert "float16" in capsys.readouterr().err and not bad.exists()


@pytest.mark.parametrize(
    ("value", "empty_ok", "names"),
    [
        ("", False, ["device='': no device", "leave it unset"]),
        ("cpu:5", False, ["device=cpu:5", "one CPU device", "device=cpu"]),
        ("cpu:1", True, ["device=cpu:1"]),
    ],
)
def test_a_device_torch_would_take_for_another_is_refused(value, empty_ok, names):
    """executor.device='' ran as unset (cuda where there is one), and cpu:5 ran on the one CPU
    device torch has: each a device the user did not name, taken without a word. '' stays the
    unset value of the options whose default it is (bench.host, bench.lanes, validate_lanes)."""
    raises_one_line(lambda: resolve_device(value, "device", empty_ok=empty_ok), *names)
    assert resolve_device("", "device", empty_ok=True).type in ("cpu", "cuda")


def test_a_real_run_refuses_an_empty_executor_device(tiny_ckpt, tmp_path, cli_here):
    r = cli_here("experiments.run", *real_args(tiny_ckpt, tmp_path / "run", "executor.device="))
    one_line(r, "executor.device='': no device")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (dict(n_heads=0), ["n_heads=0: must be a positive integer"]),
        (dict(hidden_size=1), ["hidden_size=1 with n_heads=4", "head_dim", "raise hidden_size"]),
        (dict(hidden_size=2, n_heads=3), ["hidden_size=2 with n_heads=3"]),
    ],
)
def test_make_checkpoints_derived_head_dim_names_what_was_given(overrides, names):
    """make_checkpoint (and bench.real) n_heads=0 was an internal error (ZeroDivisionError in
    the derived head_dim), and hidden_size=1 was named as "head_dim must be a positive number,
    got 0", a field the user never set."""
    raises_one_line(lambda: reduced_spec("tiny", **overrides), *names)


@pytest.mark.parametrize(
    ("value", "names"),
    [
        # a run's workload has no highest (round 27c: the range its own check takes)
        (1e9, ["batch_size=1000000000.0: an integer written as a", "pass batch_size=1000000000"]),
        (8.0, ["batch_size=8.0: an integer written as a float", "pass batch_size=8"]),
        (1e5, ["batch_size=100000.0: an integer written as a float", "pass batch_size=100000"]),
        (1.5, ["batch_size=1.5: must be a positive integer"]),
    ],
)
def test_a_whole_number_written_as_a_float_is_named_so(value, names):
    """An integer option given 1e9 (validate's repeats, calibrate's disk_mb, a run's batch_size)
    was refused as "must be an integer": YAML reads 1e9 as a float, and the line now says so
    and gives the number in digits; one past the field's range names the range (round 26c)."""
    cfg = OmegaConf.structured(WorkloadSchema)
    with pytest.raises(ValidationError) as info:
        cfg.batch_size = value
    line = hydra_errors.one_line(info.value)
    assert line is not None and "\n" not in line
    for name in names:
        assert name in line, line


def test_calibrates_disk_probe_out_of_room_names_its_file(tmp_path, monkeypatch):
    """calibrate under `ulimit -f` (or a full disk) said "error: File too large; ..." naming no
    file: the probe file's write raises an OSError without one. The line names the file in
    disk_dir, and the file is gone."""

    class Full(io.FileIO):
        def write(self, data):
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))

    monkeypatch.setattr("real.calibration.open", lambda p, mode: Full(p, "w"), raising=False)
    raises_one_line(lambda: measure_disk(tmp_path, 1), str(tmp_path / "calib.bin"), "ulimit -f")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("seed", "fix"), [(-1, "pass e.g. 0"), (2**64, "pass a smaller one")])
def test_a_seed_out_of_range_is_told_which_way_to_go(seed, fix):
    """workload.seed=-1 was told "pass a smaller one"."""
    line = raises_one_line(lambda: Workload(1, 1, 1, 1, seed=seed), "workload.seed", fix)
    assert line.endswith(fix), line


def test_a_real_run_refuses_grouped_gemm_before_it_reads_the_checkpoint(tmp_path):
    """planner.params.grouped_gemm=true on a real run (lanes, processes or validate) failed as
    "unit L0.expert-1 is not in this model", an internal unit named for a param the real
    executor does not run. It is refused by name first, whatever the checkpoint."""
    spec = tiny_spec("ep_static", n_devices=2, lanes=True, grouped_gemm=True)
    raises_one_line(
        lambda: real_execute(tmp_path / "none", spec), "planner.params.grouped_gemm=true", "=false"
    )


def test_bench_real_rewrites_its_checkpoint_when_the_model_changed(tmp_path):
    """bench.real reused its checkpoint where the sizes matched: after conf/model's rope_theta
    or rms_norm_eps was edited, the bench ran the old config.json's model without a word. It
    reuses one whose config.json is the one it would write, and writes the others again."""
    out = tmp_path / "tiny"
    ensure_checkpoint(reduced_spec("tiny"), out)
    first = (out / "config.json").stat().st_mtime_ns
    ensure_checkpoint(reduced_spec("tiny"), out)
    assert (out / "config.json").stat().st_mtime_ns == first  # the same model: reused
    ensure_checkpoint(reduced_spec("tiny", rope_theta=12345.0, rms_norm_eps=1e-3), out)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["rope_theta"], cfg["rms_norm_eps"]) == (12345.0, 1e-3)


def test_a_failed_rank_writes_its_line_where_torchrun_reports_it(tmp_path, monkeypatch, capsys):
    """Under torchrun a failed rank's one line was on its stderr only: torchrun's own report
    (its ChildFailedError table, which it prints whatever the ranks do) said "traceback : To
    enable traceback see ...", and with --redirects/--log-dir the line was nowhere on screen.
    The rank writes it to TORCHELASTIC_ERROR_FILE, which torchrun's agent reads into the table
    (torch's own parser reads it back here)."""
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SystemExit):
        exit_with(MoepipeError("checkpoint=x: no such folder"))
    assert capsys.readouterr().err == "error: checkpoint=x: no such folder\n"
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(path))
    table = ChildFailedError("experiments.run", {1: failure}).format_msg()
    assert "traceback : error: checkpoint=x: no such folder" in table, table


def test_under_torchrun_a_line_every_rank_meets_is_said_by_the_first_to_fail(
    tmp_path, monkeypatch, capsys
):
    """A config error every rank meets was left to rank 0: where rank 1 failed first, torchrun
    stopped rank 0, whose line blamed rank 1 for ending "without a line", and the cause (a
    missing checkpoint) was on no screen. Under torchrun's agent the first rank to fail says it
    (the ranks' claim keeps it to one line)."""
    said = said_by_ranks_1_then_0(
        lambda: exit_with(MoepipeError("checkpoint=x: no such folder")),
        tmp_path,
        monkeypatch,
        capsys,
    )
    assert said == [(2, "error: checkpoint=x: no such folder\n"), (2, "")]


def _too_large(*args, **kw):
    raise OSError(errno.EFBIG, "Error while serializing: File too large", "/x/.p-1/a.safetensors")


def test_a_checkpoint_write_cut_short_names_the_option_and_the_fix(tmp_path, monkeypatch, capsys):
    """make_checkpoint under `ulimit -f` said "cannot write the checkpoint (... File too large
    ...)" with no fix, and bench.real named its hidden staging folder's shard, a path the user
    never gave. Each names its option's folder and the fix for the errno."""
    monkeypatch.setattr("experiments.make_checkpoint.write_checkpoint", _too_large)
    assert make_checkpoint.main(["model=tiny", f"out={tmp_path / 'mk'}"]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"out={tmp_path / 'mk'}: cannot write" in err, err
    assert "ulimit -f" in err
    monkeypatch.setattr("experiments.bench.real._write", _too_large)
    out = tmp_path / "bench" / "tiny"
    line = raises_one_line(lambda: ensure_checkpoint(reduced_spec("tiny"), out), "ulimit -f")
    assert line.startswith(f"out_dir={out.parent}: cannot write the checkpoint"), line
    assert not out.exists()
