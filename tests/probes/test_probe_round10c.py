"""Probe round 10c (issue 48), the real executor's commands as a new user runs them.

Lines naming the wrong fix: a device pool below a plan's working set named workload keys, not
gpu_frac (validate, bench.accelerate) and keys calibrate does not take; sizes of "0.0 GB";
make_checkpoint's and the expert-parallel params' refusals named keys no one types; a full
disk asked for the disk_mb given; a dtype the real executor refuses listed as supported; a
routing knob refused "for mixtral-8x7b", the config's model, not the checkpoint's.
Taken and dropped: bench.accelerate's children's options, calibrate's disk_mb with a
checkpoint and in_run_s without, routing knobs under live gates, a disk tier in /dev/shm.
Lost or broken: validate's out= in the checkpoint folder, bench.real's out_dir holding a
model it did not write, a seed past 64 bits, a make_checkpoint no run could read, a run
moved by hydra.job.chdir=true into its run dir, away from its relative paths."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from experiments.common.hardware import read_hardware
from real.checkpoint import reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.probes.conftest import ROOT, TINY, cli, one_line, raises_one_line


@pytest.mark.parametrize(
    "planner, more",
    [("flexgen", ["gpu_frac=0.01"]), ("eplb", ["executor.distributed=true", "gpu_frac=0.6"])],
)
def test_a_device_pool_below_the_working_set_names_gpu_frac(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, planner: str, more: list[str]
) -> None:
    """validate's device pool is gpu_frac of the model: the line said "lower prompt_len or
    batch_size (or n_batches)" alone (flexgen), or "use hardware with more GPU memory" (eplb,
    whose experts all stay resident), though raising gpu_frac is what makes it fit."""
    args = [f"checkpoint={tiny_ckpt}", "hardware=tiny", f"planners=[{planner}]", "repeats=1"]
    more = [*more, "links=calibrated", f"out={tmp_path / 'v'}"]
    line = one_line(cli_here("experiments.validate", *args, *more), "raise gpu_frac")
    assert "workload." not in line and "hardware." not in line


def test_calibrate_on_a_checkpoint_too_small_for_its_runs_names_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """calibrate checkpoint=<model=tiny's> measured for seconds, then said "lower
    workload.prompt_len or workload.batch_size": keys calibrate does not take, of runs it
    sizes itself. The measuring before the in-run runs is stubbed out here."""
    from experiments import calibrate

    ck = write_checkpoint(reduced_spec("tiny"), tmp_path / "ck", seed=0)
    monkeypatch.setattr(calibrate, "_measure", lambda *a: SimpleNamespace(overhead_s=0.0))
    monkeypatch.setattr(calibrate, "_profile", lambda *a: {**read_hardware("tiny"), "sources": {}})
    monkeypatch.setattr(calibrate, "_add_p2p", lambda *a: None)
    line = raises_one_line(
        lambda: calibrate.calibrate("x", str(ck), "cpu", tmp_path, 1, 0.0),
        f"checkpoint={ck}",
        "larger checkpoint",
    )
    assert "workload." not in line


def test_bench_accelerates_routing_refusal_names_its_routing_option() -> None:
    """routing=trace on a model of another shape said "use workload.routing.source=synthetic",
    a run's key; the bench's option is routing=synthetic."""
    from experiments.common.option_names import BENCH_OPTIONS, own_names

    why = "trace esft-dsv2lite has (26 layers, 64 experts, top-6); model m has (4, 8, 2); use "
    line = own_names(why + "workload.routing.source=synthetic for this model", BENCH_OPTIONS)
    assert "use routing=synthetic" in line and "workload." not in line


def test_calibrate_on_a_full_disk_does_not_ask_for_the_disk_mb_given(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no MB free under disk_dir, disk_mb=1 was refused with "pass disk_mb=1 or less"."""
    from experiments import calibrate

    full = SimpleNamespace(total=1 << 30, used=1 << 30, free=1 << 19)
    monkeypatch.setattr(calibrate.shutil, "disk_usage", lambda p: full)
    monkeypatch.setattr(calibrate, "_on_a_disk", lambda opts: None)
    args = [f"disk_dir={tmp_path / 'd'}", "disk_mb=1", f"out={tmp_path / 'hw.yaml'}"]
    line = one_line(cli_here("experiments.calibrate", *args), "disk_dir=", "free some space")
    assert "disk_mb=1 or less" not in line


@pytest.mark.parametrize(
    "args, name",
    [(["checkpoint={ck}", "disk_mb=64"], "disk_mb=64"), (["in_run_s=5"], "in_run_s=5")],
)
def test_a_calibrate_option_it_would_not_read_is_refused(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, args: list[str], name: str
) -> None:
    """disk_mb with a checkpoint (its files are timed, no probe file is written) and in_run_s
    without one (no real runs are made) were taken and dropped: the profile said nothing of
    them. docs/results/distributed-validation.md's own command passed disk_mb=64 so."""
    args = [a.format(ck=tiny_ckpt) for a in args]
    r = cli_here("experiments.calibrate", *args, f"out={tmp_path / 'hw.yaml'}")
    one_line(r, name, "leave")
    assert not (tmp_path / "hw.yaml").exists()


def test_a_disk_tier_read_from_a_checkpoint_in_memory_is_said(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint in /dev/shm with a disk tier ran without a word: tmpfs takes O_DIRECT
    (Linux 6.6 on), so DiskReader's fallback warning never came, and the run's disk reads,
    which timed RAM, went into its trace and summary as the disk's. (The mount table here
    says the checkpoint's folder is tmpfs.)"""
    from core import files

    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tiny_ckpt.parent} tmpfs rw 0 0\n")
    monkeypatch.setattr(files, "MOUNTS", str(mounts))
    run = tmp_path / "run"
    memory = ["hardware.memory_gb.gpu=0.0006", "hardware.memory_gb.cpu=0.0002"]
    args = ["executor=real", f"checkpoint={tiny_ckpt}", *TINY[1:], *memory, f"hydra.run.dir={run}"]
    r = cli_here("experiments.run", *args)
    assert r.returncode == 0, r.stderr
    log = (run / "run.log").read_text()
    placement = json.loads((run / "summary.json").read_text())["plan"]["placement"]
    assert "disk" in placement["expert_layers"]  # the disk tier was read
    assert f"checkpoint={tiny_ckpt} is on tmpfs, a filesystem in memory" in log


def test_dense_weights_that_fit_no_tier_give_their_size_and_the_keys_to_raise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.real model=mixtral-tiny budget_gb=0.008 said "attention/gate/embedding weights
    (0.0 GB) fit neither GPU nor CPU memory": a size printed to one decimal of a GB, and no
    key that makes them fit."""
    from experiments.bench import real as bench_real

    args = ["model=mixtral-tiny", "hardware=tiny", "budget_gb=0.008", f"out_dir={tmp_path}"]
    assert bench_real.main(args) == 2
    line = capsys.readouterr().err.strip()
    assert "weights (0.00133 GB) fit neither" in line and line.count("raise budget_gb") == 1, line
    assert "hardware." not in line and "budget_gb or budget_gb" not in line


def test_a_dtype_the_real_executor_does_not_run_is_not_listed_as_supported(
    tmp_path: Path, tiny_ckpt: Path
) -> None:
    """torch_dtype "auto" in a checkpoint's config.json said "supported: bfloat16, float16,
    float32, float8_e4m3fn" (the simulator's sizes), two of which the real executor refuses."""
    import shutil

    from real.checkpoint import load_checkpoint

    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg.pop("dtype", None)
    (ck / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "auto"}))
    line = raises_one_line(lambda: load_checkpoint(ck), "config.json", "auto", "bfloat16")
    assert "float16," not in line and "float8" not in line


@pytest.mark.parametrize(
    "override, names",
    [
        ("executor.routing_mode=live", ["executor.routing_mode=live"]),
        ("workload.routing.source=live", ["source=live for ck"]),
    ],
)
def test_a_routing_knob_a_real_runs_live_gates_do_not_read_is_refused(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, override: str, names: list[str]
) -> None:
    """executor.routing_mode=live workload.routing.skew=2 ran (exit 0): the model's own gates
    route, and the generator's skew only shaped a dry plan. Beside workload.routing.source=live
    the same knob was refused "for mixtral-8x7b", the config's model, not the checkpoint's."""
    run = tmp_path / "r"
    args = ["executor=real", f"checkpoint={tiny_ckpt}", *TINY[1:], override]
    r = cli_here("experiments.run", *args, "workload.routing.skew=2", f"hydra.run.dir={run}")
    line = one_line(r, "workload.routing.skew", *names)
    assert "mixtral-8x7b" not in line
    assert not run.exists()


@pytest.mark.parametrize(
    "module, more",
    [
        ("experiments.validate", ["planners=[flexgen]", "links=calibrated"]),
        ("experiments.validate_lanes", ["lanes=2", "device=cpu"]),
    ],
)
def test_an_output_folder_that_is_the_checkpoints_is_refused(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, module: str, more: list[str]
) -> None:
    """out= the checkpoint's folder wrote validate.csv, timelines and every planner's run dirs
    in among the weights (a run refuses its run dir there)."""
    import shutil

    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    args = [f"checkpoint={ck}", "hardware=tiny", "repeats=1", *more, f"out={ck}"]
    one_line(cli_here(module, *args), f"out={ck}", "checkpoint=")
    assert sorted(p.name for p in ck.iterdir()) == ["config.json", "model.safetensors"]


def test_bench_real_keeps_a_checkpoint_it_did_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """out_dir=<a folder of downloaded models>: bench.real found <out_dir>/mixtral-tiny
    "unusable" and deleted it to write its random one (make_checkpoint refuses such a folder)."""
    import torch
    from safetensors.torch import save_file

    from experiments.bench import real as bench_real

    theirs = tmp_path / "mixtral-tiny"
    theirs.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(theirs / "model.safetensors"))
    (theirs / "config.json").write_text('{"model_type": "mixtral", "hidden_size": 10}')
    args = ["model=mixtral-tiny", "hardware=tiny", "budget_gb=0.011", f"out_dir={tmp_path}"]
    assert bench_real.main([*args, "peers=none"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: ") and "\n" not in line, line
    assert "did not write" in line and "out_dir=" in line
    assert sorted(p.name for p in theirs.iterdir()) == ["config.json", "model.safetensors"]
    assert (theirs / "config.json").read_text().endswith("10}")


def test_a_seed_past_64_bits_is_refused_not_an_internal_error(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any
) -> None:
    """workload.seed=99999999999999999999 ran simulated (numpy takes any size) and failed a
    real run as an internal error: torch's generator, which seeds the prompts, takes 64 bits."""
    args = ["executor=real", f"checkpoint={tiny_ckpt}", *TINY[1:], f"hydra.run.dir={tmp_path}/r"]
    r = cli_here("experiments.run", *args, "workload.seed=99999999999999999999")
    one_line(r, "workload.seed", "2**64")
    assert "internal error" not in r.stderr


@pytest.mark.parametrize(
    "param, names",
    [
        (
            "n_devices=-1",
            ["n_devices=-1", "0 = hardware.n_gpus", "pass planner.params.n_devices=0"],
        ),
        ("dense=pipeline", ["planner.params.dense='pipeline' unknown"]),
    ],
)
def test_an_expert_parallel_param_refused_names_its_key_and_fix(
    tmp_path: Path, cli_here: Any, param: str, names: list[str]
) -> None:
    """n_devices=-1 was told to "lower n_devices"; dense=pipeline was "planner dense=..."
    (no planner.params key)."""
    args = [*TINY[:3], "planner=eplb", f"+planner.params.{param}", f"hydra.run.dir={tmp_path}/r"]
    line = one_line(cli_here("experiments.run", *args), *names)
    assert "lower n_devices" not in line


def test_make_checkpoint_refuses_a_checkpoint_no_run_could_read(
    tmp_path: Path, cli_here: Any
) -> None:
    """head_dim=3 wrote a checkpoint that every run then refused ("head_dim=3 is odd"), as
    transformers does: the time and disk it took were for nothing."""
    out = tmp_path / "ck"
    r = cli_here("experiments.make_checkpoint", "model=tiny", f"out={out}", "head_dim=3")
    one_line(r, "head_dim=3", "odd")
    assert not out.exists()


def test_make_checkpoints_errors_name_its_own_options(tmp_path: Path, cli_here: Any) -> None:
    """make_checkpoint's options are hidden_size=, top_k=, ...: its refusals said
    model.hidden_size and "set model.top_k <= model.n_experts", a run's keys."""
    for arg, names in (("hidden_size=0", ["hidden_size"]), ("n_experts=1", ["set top_k <="])):
        r = cli_here("experiments.make_checkpoint", "model=tiny", f"out={tmp_path / 'c'}", arg)
        assert "model." not in one_line(r, *names)


def test_a_real_runs_routing_resolves_by_its_checkpoints_model(
    tmp_path: Path, cli_here: Any
) -> None:
    """On a checkpoint of DeepSeek-V2-Lite's shape (which replays the ESFT trace), tasks=[law]
    was refused as "the ESFT trace's knob, but this run's routing is synthetic (... for
    mixtral-8x7b)": the knob check resolved routing by the config's model, not the
    checkpoint's. (Its trace_dir holds no trace: the run then fails naming it.)"""
    sizes = dict(hidden_size=64, expert_ffn_size=16, vocab_size=128, n_heads=2)
    ck = write_checkpoint(reduced_spec("deepseek-v2-lite", **sizes), tmp_path / "ck", seed=0)
    args = ["executor=real", f"checkpoint={ck}", *TINY[1:], f"hydra.run.dir={tmp_path / 'r'}"]
    routing = ["workload.routing.tasks=[law]", f"workload.routing.trace_dir={tmp_path}"]
    line = one_line(cli_here("experiments.run", *args, *routing))
    assert "mixtral-8x7b" not in line and "knob" not in line
    assert str(tmp_path / "esft-dsv2lite") in line


def test_a_run_that_hydra_would_move_into_its_run_dir_is_refused(
    tmp_path: Path, tiny_ckpt: Path
) -> None:
    """hydra.job.chdir=true with checkpoint= a relative path was refused as "the folder of
    checkpoint=ck" (the run dir, where hydra had moved the run), and a DeepSeek-V2-Lite run
    looked for the default ../shared/traces beside its run dir."""
    run, ck = tmp_path / "r", os.path.relpath(tiny_ckpt, ROOT)  # the commands run from ROOT
    args = ["executor=real", f"checkpoint={ck}", *TINY[1:], f"hydra.run.dir={run}"]
    r = cli("experiments.run", *args, "hydra.job.chdir=true")
    one_line(r, "hydra.job.chdir=true", "leave hydra.job.chdir false")
    assert not run.exists()
