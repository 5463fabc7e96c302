"""Hardware profiles: find and read a conf/hardware YAML (or a user's file), size its memory to a
model, swap in measured link bandwidths, and measure what ops and links cost inside a real run."""

from __future__ import annotations

import copy
import itertools
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from core.errors import ConfigError, MoepipeError, cannot_read, reworded
from core.files import not_regular, read_small
from core.hardware import PHYSICAL, HardwareSpec
from core.spec import RoutingConfig, Workload
from core.trace import link_bandwidth
from core.types import OpKind, Resource, RoutingSource
from core.yaml_size import UniqueKeyLoader, check_yaml_size, yaml_problem
from experiments.common.app import check_keys
from experiments.common.schema import HardwareSchema
from real.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def with_links(hw: HardwareSpec, bandwidths: dict[Resource, float]) -> HardwareSpec:
    """`hw` with these links at these bandwidths, bytes/s (latencies kept)."""
    links = dict(hw.links)
    for res, bw in bandwidths.items():
        links[res] = replace(hw.link(res), bandwidth_bytes_per_s=bw)
    return replace(hw, links=links)


def hardware_path(name: str) -> Path:
    """A conf/hardware name, or the path of a hardware YAML (e.g. one calibrate wrote elsewhere)."""
    path = (
        Path(name)
        if name.endswith((".yaml", ".yml"))
        else ROOT / "conf" / "hardware" / f"{name}.yaml"
    )
    kind = not_regular(path)  # is_file() would call it absent
    if kind:
        raise MoepipeError(f"hardware={name}: {path}: {kind}; pass a hardware YAML file")
    if not path.is_file():
        fix = (
            f"hardware.name={path.stem} out={path}"
            if name.endswith((".yaml", ".yml"))
            else f"hardware.name={name}"
        )
        raise MoepipeError(
            f"hardware={name}: no such file {path}; run python -m experiments.calibrate {fix}"
        )
    return path


def read_hardware(name: str) -> dict[str, Any]:
    """The hardware YAML of `name` (see `hardware_path`) as a mapping with a memory_gb mapping;
    a MoepipeError naming the file when it is unreadable, empty, not YAML or lacks memory_gb."""
    path = hardware_path(name)
    fix = calibrate_fix(path)
    try:
        text = read_small(path, fix=fix).decode("utf-8")  # a FIFO or /dev/zero: refused
        check_yaml_size(text, str(path), fix)  # a billion laughs: a hang
        d = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 (a safe loader)
    except OSError as e:
        raise MoepipeError(cannot_read(path, e)) from None
    except UnicodeDecodeError as e:
        raise MoepipeError(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except yaml.YAMLError as e:  # a duplicate key (UniqueKeyLoader's)
        problem, line = yaml_problem(e, text)
        at = f":{line}" if line else ""
        raise MoepipeError(f"{path}{at}: not valid YAML ({problem}); {fix}") from None
    if not isinstance(d, dict):
        what = "empty" if d is None else f"a {type(d).__name__}, not a mapping"
        raise MoepipeError(f"{path}: hardware file is {what}; {fix}")
    if not isinstance(d.get("memory_gb"), dict):
        raise MoepipeError(f"{path}: hardware file has no memory_gb mapping; {fix}")
    return dict(check_keys(HardwareSchema, d, str(path)))


def load_hardware(name: str, model_bytes: int, gpu_frac: float, cpu_frac: float) -> HardwareSpec:
    d = with_model_on_disk(read_hardware(name), model_bytes, gpu_frac, cpu_frac)
    return hardware_spec(name, d)


def hardware_spec(name: str, d: dict[str, Any]) -> HardwareSpec:
    """`d`, read from hardware `name`'s file (`read_hardware`), as a HardwareSpec; a value it
    refuses is a MoepipeError naming the file (HardwareSpec's own line names no file)."""
    try:
        return HardwareSpec.from_dict(d)
    except (MoepipeError, TypeError, AttributeError) as e:
        path = hardware_path(name)
        # a field's line ends in its own fix; one line carries one
        fix = "" if isinstance(e, MoepipeError) and "; " in str(e) else "; " + calibrate_fix(path)
        line = f"{path}: {e}{fix}"
        raise (reworded(e, line) if isinstance(e, MoepipeError) else MoepipeError(line)) from None


def calibrate_fix(path: Path) -> str:
    """What to do with a hardware file that is refused: fix it, or let calibrate write it."""
    return f"fix it or write it again with python -m experiments.calibrate out={path}"


def with_model_on_disk(
    hw: dict[str, Any], model_bytes: int, gpu_frac: float, cpu_frac: float
) -> dict[str, Any]:
    """`hw` with the device pool and host RAM set to fractions of the model, and a disk tier of
    at least the model: the real executor reads that tier from the checkpoint, which is on the
    disk already, so the disk's free space (calibrate records half of it) does not bound it."""
    for option, frac, tier in (("gpu_frac", gpu_frac, "gpu"), ("cpu_frac", cpu_frac, "cpu")):
        _share_in_range(option, frac, model_bytes, tier)
    mem = dict(hw["memory_gb"], gpu=gpu_frac * model_bytes / 1e9, cpu=cpu_frac * model_bytes / 1e9)
    if "disk" in mem:
        mem["disk"] = max(float(mem["disk"]), model_bytes / 1e9)
    return dict(hw, memory_gb=mem)


def _share_in_range(option: str, frac: float, model_bytes: int, tier: str) -> None:
    """A ConfigError naming the command's own `option` (the share of the model that sizes
    memory tier `tier`), not the hardware file, where that share makes a tier no machine has:
    the file's number is the option's doing."""
    lo, hi, _ = PHYSICAL[f"memory_gb.{tier}"]
    gb = frac * model_bytes / 1e9
    if lo <= gb <= hi:
        return
    bound, way = (lo, "at least") if gb < lo else (hi, "at most")
    raise ConfigError(
        f"{option}={frac:g}: {gb:.3g} GB of the model's {model_bytes / 1e9:.3g} GB is "
        f"{'under' if gb < lo else 'over'} what a machine's {tier} memory can be ({bound:g} GB); "
        f"pass {option} {way} {_rounded_in(bound * 1e9 / model_bytes, up=gb < lo):.3g}"
    )


def _rounded_in(x: float, up: bool) -> float:
    """`x` rounded to 3 significant digits away from the range's edge it bounds (up for a
    least value), so the value printed is itself in the range."""
    step = 10.0 ** (math.floor(math.log10(x)) - 2)
    return (math.ceil(x / step) if up else math.floor(x / step)) * step


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_in_run(
    ckpt: str,
    hw: dict[str, Any],
    device: torch.device,
    budget_s: float = 20.0,
    runs: int = 3,
    gpu_frac: float = 0.6,
    cpu_frac: float = 0.15,
    dtype: str | None = None,
) -> tuple[dict[str, float], dict[str, float]]:
    """What ops cost inside a real run: small flexgen runs on the checkpoint (2 batches of 2
    sequences, 8-token prompts, 3 tokens; device pool `gpu_frac` and host RAM `cpu_frac` of the
    model, so the disk stream is active), at least `runs` of them and more until `budget_s` has
    passed, their ops pooled. This VM's disk and CPU drift by about 30% over minutes; a window of
    seconds catches one moment of that, a longer one its middle.

    Returns (per compute kind, the median of each op's measured duration minus the cost model's
    for it under `hw`, in seconds; per link ("disk", "h2d") that the runs used, the bandwidth
    its transfers saw, bytes/s, net of the link latency of `hw` (`core.trace.link_bandwidth`)).

    The tables time each kernel alone; in a run the executor's own work around an op (its
    batch's rows, the KV cache, the forced router ids) and the transfer workers on the other
    cores come on top, about half a millisecond per op on a 2-core VM. The links differ too:
    the same 9.4 MB unit read back to back by `measure_store` took 10.8-14.6 ms in six
    calibrations, and 6.4-12.9 ms (15 of 17 planner runs faster) inside validate's runs; its
    copy to the device pool took 1.4 ms alone, and 1.4-1.8 ms (median) but 2.3-3.5 ms (mean)
    in runs, where the copy worker shares two cores with compute and disk reads."""
    from core.cost import CostModel
    from core.hardware import HardwareSpec
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import checkpoint_files, real_execute

    files = checkpoint_files(ckpt)  # each run fails on a change since, not only during it
    spec, _ = load_checkpoint(ckpt, dtype)
    d = with_model_on_disk(copy.deepcopy(hw), spec.total_bytes, gpu_frac, cpu_frac)
    wl = Workload(
        batch_size=2,
        n_batches=2,
        prompt_len=8,
        gen_len=3,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    run = RunSpec(spec, HardwareSpec.from_dict(d), wl, "flexgen", {})
    extra, kinds, traces = [], [], []
    deadline = time.perf_counter() + budget_s
    for i in itertools.count():
        if i >= max(1, runs) and time.perf_counter() > deadline:
            break
        result, _ = real_execute(ckpt, run, "replay", device=str(device), dtype=dtype, files=files)
        predicted = CostModel(run.hardware).durations(result.schedule)
        tr = result.trace
        took = (tr["end_s"] - tr["start_s"]).to_numpy()
        extra.append(took - predicted[tr["op_id"].to_numpy()])
        kinds.append(tr["kind"].astype(str).to_numpy())
        traces.append(tr)
    ex, kd = np.concatenate(extra), np.concatenate(kinds)
    per_kind = {
        str(k): float(np.median(ex[kd == str(k)]))
        for k in (OpKind.ATTENTION, OpKind.GATE, OpKind.EXPERT, OpKind.FFN, OpKind.HEAD)
        if (kd == str(k)).any()
    }
    links = {}
    for res in (Resource.DISK, Resource.H2D):
        bw = link_bandwidth(traces, str(res), d["links"][str(res)]["latency_us"] * 1e-6)
        if bw:
            links[str(res)] = bw
    return per_kind, links
