"""Replication lanes, simulator vs real: which lanes model predicts G lanes on one device.

Runs each expert-parallel planner's G lanes of one device for real and simulates the same schedule
with lanes that partition the device and lanes that share it; prints and writes validate_lanes.csv
and .md (real makespan and expert phases beside each model's prediction and error). What it
measures and how the device is sized: docs/commands.md#validate_lanes.

Usage:
    python -m experiments.validate_lanes checkpoint=DIR hardware=this-machine|FILE.yaml
        [planners=[ep_static,predictive_replication]] [lanes=4] [replica_slots=1] [batch_size=4]
        [n_batches=4] [prompt_len=32] [repeats=3] [device=] [out=runs/validate_lanes/<time>]
        [executor.dtype=auto|float32|bfloat16]
"""

from __future__ import annotations

import datetime
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from core.args import (
    MAX_REPEATS,
    MAX_TOKENS,
    REPEATS_WHY,
    TOKENS_WHY,
    naming,
    not_a_run_folder,
    not_the_checkpoint,
)
from core.errors import MoepipeError
from core.hardware import HardwareSpec
from core.shown import error, fixed
from core.spec import RoutingConfig, Workload
from core.types import OpKind, RoutingSource
from experiments.common.app import command, kv
from experiments.common.cli import (
    as_int,
    checked_names,
    exit_command,
    output_dir,
    print_or_exit,
)
from experiments.common.deferred import written_together
from experiments.common.dir_lock import dir_locked
from experiments.common.hardware import hardware_spec, read_hardware
from experiments.common.held_warnings import plan_accepted
from experiments.common.option_names import VALIDATE_LANES_OPTIONS, named_as
from experiments.common.pipeline import RunSpec, simulate_run
from experiments.common.real_run import real_execute
from experiments.common.run_dir import OUTPUTS_BUSY
from experiments.common.schema import DtypeOption
from experiments.common.tables import markdown
from planners.registry import planner_names
from real.checkpoint import load_checkpoint, run_dtype
from real.store import resolve_device

EP_PLANNERS = ("ep_static", "eplb", "predictive_replication", "oracle_replication")


@dataclass
class Options:
    checkpoint: str | None = None  # the checkpoint folder the real runs read
    hardware: str = "this-machine"  # conf/hardware/<name>.yaml or a FILE.yaml (calibrate's)
    planners: list[str] = field(default_factory=lambda: ["ep_static", "predictive_replication"])
    lanes: int = 4
    replica_slots: int = 1
    batch_size: int = 4
    n_batches: int = 4
    prompt_len: int = 32
    repeats: int = 3
    device: str = ""  # cuda | cpu; empty: cuda if available
    out: str | None = None  # default runs/validate_lanes/<time>
    executor: DtypeOption = field(default_factory=DtypeOption)  # the real runs' compute dtype


_DEFAULTS: dict[str, Any] = kv(Options())


def expert_phases_s(trace: pd.DataFrame) -> float:
    """Seconds of expert phases: per (step, layer, batch), first expert start to last end."""
    ex = trace[trace["kind"].astype(str) == str(OpKind.EXPERT)]
    g = ex.groupby(["step", "layer", "batch"], observed=True)
    return float((g["end_s"].max() - g["start_s"].min()).sum())


def device_hardware(name: str, model_bytes: int, device: torch.device) -> HardwareSpec:
    """The hardware file with memory for the whole model, and the CUDA device's SM count where
    the file has none."""
    d = read_hardware(name)
    need = 3 * model_bytes / 1e9
    d["memory_gb"] = {k: max(float(v), need) for k, v in dict(d["memory_gb"]).items()}
    if device.type == "cuda" and not dict(d["gpu"]).get("sms"):
        d["gpu"] = dict(
            d["gpu"], sms=torch.cuda.get_device_properties(device).multi_processor_count
        )
    return hardware_spec(name, d)


def report(opts: dict[str, Any]) -> list[str]:
    if not opts["checkpoint"]:
        raise MoepipeError(
            "checkpoint=DIR is required (python -m experiments.make_checkpoint makes one)"
        )
    planners = str(opts["planners"]).split(",") if opts["planners"] else []
    for p in planners:
        if p not in EP_PLANNERS:
            known = p in planner_names()
            raise MoepipeError(
                f"planners={opts['planners']}: {p!r} is "
                f"{'not expert-parallel' if known else 'unknown'}; "
                f"valid: {', '.join(EP_PLANNERS)}"
            )
    checked_names("planners", planners, EP_PLANNERS)  # none, or one twice
    lanes = as_int("lanes", opts["lanes"], at_least=2)
    slots = as_int("replica_slots", opts["replica_slots"], at_least=0, at_most=MAX_TOKENS)
    repeats = as_int("repeats", opts["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
    sizes = {
        k: as_int(k, opts[k], at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
        for k in ("batch_size", "n_batches", "prompt_len")
    }
    wl = Workload(
        **sizes,
        gen_len=1,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    ckpt = str(opts["checkpoint"])
    dtype = run_dtype(opts["executor.dtype"])
    model = load_checkpoint(ckpt, dtype)[0]
    if lanes > model.n_experts:  # each lane (device) holds at least one expert
        raise MoepipeError(
            f"lanes={lanes}: more than the model's {model.n_experts} experts (each lane holds "
            f"one at least); pass lanes=2 to {model.n_experts}"
        )
    device = resolve_device(str(opts["device"]), "device", empty_ok=True)
    hw = device_hardware(str(opts["hardware"]), model.total_bytes, device)
    where = opts["out"] or f"runs/validate_lanes/{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}"
    not_the_checkpoint(where, "out", ckpt)
    not_a_run_folder(where, "out", own=("validate_lanes.csv",))
    fresh = not Path(where).exists()
    out = output_dir(where, "out")
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    try:
        rows = [
            _planner_row(ckpt, model, hw, wl, p, lanes, slots, repeats, device, dtype)
            for p in planners
        ]
        table = pd.DataFrame(rows)
        head = _written(out, table, model, hw, wl, lanes, repeats, device)
    except BaseException:  # a failed or stopped run leaves no empty folder that looks like one
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise
    lines = [head, table.round(4).to_string(index=False)]
    for r in rows:
        better = min(("partition", "shared"), key=lambda s: abs(r[f"{s}_err"]))
        lines.append(
            f"{r['planner']}: makespan error partition {error(r['partition_err'], 0)}, shared "
            f"{error(r['shared_err'], 0)} (closer: {better}); expert phases "
            f"{error(r['partition_phase_err'], 0)} / {error(r['shared_phase_err'], 0)}"
        )
    lines.append(f"wrote {out}/validate_lanes.csv, validate_lanes.md")
    return lines


def _written(
    out: Path,
    table: pd.DataFrame,
    model: Any,
    hw: Any,
    wl: Workload,
    lanes: int,
    repeats: int,
    device: Any,
) -> str:
    """validate_lanes.csv and .md written into `out`, each whole or not at all (a full disk
    left a cut-short table beside an earlier one lost), and the two of one run: a stop or a
    failure between them, or a second validate_lanes into `out`, left one run's csv beside
    another's md. The table's heading line."""
    sm_bw = hw.gpu.sm_mem_bw_bytes_per_s or hw.gpu.mem_bw_bytes_per_s / max(hw.gpu.sms, 1)
    head = (
        f"{model.name} ({fixed(model.total_bytes / 1e6, 0)} MB) as {lanes} lanes on {device} "
        f"({hw.name}, sms {hw.gpu.sms or 'unknown'}, sm_mem_bw {sm_bw / 1e9:.0f} GB/s), "
        f"batch {wl.batch_size} x {wl.n_batches}, prompt {wl.prompt_len}, "
        f"{repeats} real run(s)"
    )
    csv, md = out / "validate_lanes.csv", out / "validate_lanes.md"
    with dir_locked(out, OUTPUTS_BUSY), written_together(csv, md) as (csv_tmp, md_tmp):
        with naming(csv):  # the file that failed, not the last one of the pair
            csv_tmp.write_text(table.to_csv(index=False))
        with naming(md):
            md_tmp.write_text(f"# {head}\n\n{markdown(table)}\n")  # rounded once, by markdown
    return head


def _planner_row(
    ckpt: str,
    model: Any,
    hw: Any,
    wl: Workload,
    p: str,
    lanes: int,
    slots: int,
    repeats: int,
    device: Any,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Planner `p` on `lanes` lanes: the real runs (lanes sharing the GPU) at their median, and
    the simulator under each lane-sharing model with its error against them."""
    base = dict(n_devices=lanes, lanes=True, grouped_gemm=False)
    if p != "ep_static":
        base["replica_slots"] = slots
    spec = {
        s: RunSpec(model, hw, wl, p, {**base, "lane_sharing": s}) for s in ("partition", "shared")
    }
    real = [
        real_execute(ckpt, spec["shared"], "replay", device=str(device), dtype=dtype)
        for _ in range(repeats)
    ]
    routing = real[0][1].routing
    make = np.array([r.trace["end_s"].max() for r, _ in real])
    phase = np.array([expert_phases_s(r.trace) for r, _ in real])
    # what the executor adds to the schedule's own bound with the durations it measured
    # (the lanes' ops by their share of the GPU: core.trace.work_s)
    dag = np.array([r.summary["dag_lower_bound_s"] for r, _ in real])
    row: dict[str, Any] = dict(
        planner=p,
        real_ms=1e3 * float(np.median(make)),
        real_spread=float((make.max() - make.min()) / np.median(make)),
        real_phase_ms=1e3 * float(np.median(phase)),
        real_over_dag_lb=float(np.median(make / dag)),
    )
    for s, sp in spec.items():
        sim = simulate_run(sp, routing)
        row[f"{s}_ms"] = 1e3 * float(sim.trace["end_s"].max())
        row[f"{s}_err"] = row[f"{s}_ms"] / row["real_ms"] - 1
        row[f"{s}_phase_ms"] = 1e3 * expert_phases_s(sim.trace)
        row[f"{s}_phase_err"] = row[f"{s}_phase_ms"] / row["real_phase_ms"] - 1
    return row


def _main(args: Options) -> int:
    def named() -> list[str]:  # a planner's line names this command's options
        with named_as(VALIDATE_LANES_OPTIONS):
            return report(kv(args))

    print_or_exit(named)
    return 0


main = command("validate_lanes", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
