"""The issue's user path, as commands: make a checkpoint, calibrate this machine, run a planner
for real, validate sim against real. Small sizes; asserts on what each command writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from tests.conftest import ROOT, overridden


def sh(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_checkpoint_calibrate_run_validate(tmp_path):
    ckpt, hw = tmp_path / "ckpt", tmp_path / "calibrated.yaml"
    sh("experiments.make_checkpoint", "model=mixtral-tiny", f"out={ckpt}")
    assert (ckpt / "config.json").exists() and list(ckpt.glob("*.safetensors"))
    sh(
        "experiments.calibrate",
        "hardware.name=calibrated",
        f"checkpoint={ckpt}",
        f"disk_dir={tmp_path / 'calib'}",
        "in_run_s=1",
        f"out={hw}",
    )
    check_profile(hw)

    conf = tmp_path / "conf" / "hardware"
    conf.mkdir(parents=True)
    (conf / "calibrated.yaml").write_text(hw.read_text())
    sh(
        "experiments.run",
        "executor=real",
        f"checkpoint={ckpt}",
        "planner=flexgen",
        "hardware=calibrated",
        "workload=tiny",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["executor"] == "real" and s["throughput_tok_s"] > 0
    # a measured trace's bubble splits over its causes too (core.bubbles), each second once
    assert sum(s["gpu_idle_causes_s"].values()) == pytest.approx(s["gpu_bubble_s"], rel=1e-6)
    assert set(pd.read_parquet(tmp_path / "run" / "trace.parquet")["source"]) == {"real"}

    out = tmp_path / "val"
    sh(
        "experiments.validate",
        f"checkpoint={ckpt}",
        f"hardware={hw}",
        "planners=[sequential,flexgen]",
        "repeats=1",
        f"out={out}",
        "gpu_frac=0.9",
        "cpu_frac=0.5",
    )
    check_validate_table(out)


def check_profile(hw):
    """What calibrate measured and wrote: links, kernel tables, per-kind overheads, provenance,
    and the 2-process terms."""
    prof = yaml.safe_load(hw.read_text())
    assert prof["links"]["disk"]["gbps"] > 0 and prof["links"]["h2d"]["gbps"] > 0
    assert prof["gpu"]["time_tables"]["compute-expert"], "expert time table measured"
    # each compute kind's cost around its kernel, from a real run: the per-op overhead plus what
    # the run measured beyond the kernel tables (0.3-0.9 ms per op on a 2-core VM)
    by_kind = prof["gpu"]["overhead_us_by_kind"]
    assert {"compute-attention", "compute-expert", "compute-gate", "compute-head"} <= set(by_kind)
    assert any(v > prof["gpu"]["overhead_us"] for v in by_kind.values())
    # the disk and h2d bandwidths as the runs' own transfers saw them
    assert "disk_in_run" in prof["sources"] and "h2d_in_run" in prof["sources"]
    assert "commit" in hw.read_text().splitlines()[0]  # provenance: machine, date, commit
    # the link G processes' transfers take (gloo here), for executor.distributed=true runs
    assert prof["links"]["p2p"]["gbps"] > 0 and prof["n_gpus"] == 2
    # and what 2-process runs' ops took beyond that: the routing's wait, each compute kind's
    # scale and start delay, which the profile reads back as hardware.processes
    procs = prof["processes"]
    assert procs["gate_exchange_us"] >= 0
    kinds = {"compute-attention", "compute-expert", "compute-gate", "compute-head"}
    assert kinds <= set(procs["compute_scale_by_kind"]) and kinds <= set(
        procs["start_delay_us_by_kind"]
    )
    from core.hardware import HardwareSpec

    spec = HardwareSpec.from_dict(prof)
    assert (
        spec.processes.scale("compute-expert") == procs["compute_scale_by_kind"]["compute-expert"]
    )
    # a replica copy's share of a process's compute (its memcpy on the cores that compute)
    assert 0 <= procs["copy_share"] < 1 and spec.processes.copy_share == procs["copy_share"]


def check_validate_table(out):
    """validate's table: both planners, both makespans, the error columns, a timeline plot and
    the bubble causes."""
    table = pd.read_csv(out / "validate.csv")
    assert list(table["planner"]) == ["sequential", "flexgen"]
    assert (table["sim_makespan_s"] > 0).all() and (table["real_makespan_s"] > 0).all()
    assert {
        "run_disk_gbps",
        "run_h2d_gbps",
        "err_run_links_makespan_s",
        "err_run_links_gpu_bubble_s",
        "err_probe_makespan_s",
        "err_window_makespan_s",
    } <= set(table)
    assert (out / "timeline_flexgen.png").stat().st_size > 0
    # what the bubble waited for in each, and how far apart the two splits are
    assert table["sim_bubble_waits_on"].str.fullmatch(r"\S.* \d+%").all()
    assert table["bubble_causes_tv"].between(0, 1).all()


@pytest.mark.parametrize(
    "args, names",
    [
        (["out={afile}/ck"], ["out=", "afile"]),
        (["out=/proc/moepipe-ck"], ["out=/proc/moepipe-ck"]),
        (["hidden_size=abc"], ["hidden_size=abc"]),
        (["seed=abc"], ["seed=abc"]),
        (["scale=abc"], ["scale=abc"]),
        (["scale=-1"], ["scale=-1"]),
        (["shard_mb=0"], ["shard_mb=0"]),
        (["norm_topk_prob=maybe"], ["norm_topk_prob=maybe"]),
        (["n_heads=3"], ["n_heads=3", "n_kv_heads=2"]),
        (["hiden_size=64"], ["hiden_size: unknown key", "did you mean 'hidden_size'"]),
        (["activation=gelu"], ["activation=gelu", "swiglu"]),
        (["moe_layers=0,x"], ["moe_layers[1]=x", "must be a non-negative integer"]),
    ],
)
def test_make_checkpoint_bad_input_is_one_line(args, names, tmp_path, capsys):
    """Exit 2 and one `error: ` line naming the argument, before anything is written."""
    from experiments.make_checkpoint import main

    (tmp_path / "afile").write_text("")
    argv = [a.format(afile=tmp_path / "afile") for a in args]
    assert main(overridden(["model=mixtral-tiny", f"out={tmp_path / 'ck'}"], *argv)) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert all(n in lines[0] for n in names), lines[0]
    assert not (tmp_path / "ck").exists()


def test_calibrate_times_a_bf16_model():
    """Every op kind of a bfloat16 model is timed (the replayed gate's host routing arrays are
    float32 whatever the model's dtype; numpy has no bfloat16)."""
    import torch

    from real.calibration import measure_compute
    from real.checkpoint import reduced_spec
    from real.model import Model

    spec = reduced_spec("mixtral-tiny", dtype_bytes=2)
    model = Model(spec)
    tables = measure_compute(spec, model, torch.device("cpu"), budget_s=0.5)
    assert {"compute-attention", "compute-expert", "compute-gate", "compute-head"} <= set(tables)
