"""Measure this machine and write conf/hardware/<name>.yaml for the simulator's cost model.

Disk read bandwidth/latency with O_DIRECT (real.store.DiskReader), host->device and device->host
bandwidth/latency (on a CPU-only machine: a memcpy into the RAM device pool, as the real executor
does), and per-op-kind compute time tables ((flops, seconds) against token count) of the real
model pieces for a checkpoint's model (default: conf/model/mixtral-tiny). About a minute.

Usage:
    python -m experiments.calibrate hardware.name=this-machine [checkpoint=DIR] [device=cuda]
        [disk_dir=runs/.calib] [disk_mb=256] [out=conf/hardware/this-machine.yaml]
"""

# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
from __future__ import annotations

import copy
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from core.errors import MoepipeError
from core.spec import ModelSpec
from core.types import OpKind, Tensor
from real.checkpoint import CONF_MODEL_DIR, Unit, load_checkpoint, torch_dtype, unit_layout
from real.model import KVCache, Model
from real.store import ALIGN, DiskReader, aligned_empty

ROOT = Path(__file__).resolve().parents[1]
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _timeit(
    fn: Callable[[], Any], sync: Callable[[], None], reps: int = 5, budget_s: float = 1.0
) -> float:
    """Median seconds of fn() over up to `reps` runs (after one warm-up), within a time budget."""
    fn()
    sync()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < reps and (not times or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares seconds = latency + bytes / bandwidth -> (bandwidth bytes/s, latency s)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return 1.0 / max(slope, 1e-15), max(my - slope * mx, 0.0)


def measure_disk(disk_dir: Path, size_mb: int) -> dict[str, float]:
    """O_DIRECT reads of a fresh file: 4 MiB reads for bandwidth, 4 KiB reads for latency."""
    disk_dir.mkdir(parents=True, exist_ok=True)
    path = disk_dir / "calib.bin"
    chunk = 4 << 20
    n = max(size_mb * (1 << 20) // chunk, 4)
    with open(path, "wb") as f:
        block = os.urandom(chunk)
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    reader = DiskReader(path)
    try:
        buf = aligned_empty(chunk)
        t0 = time.perf_counter()
        for i in range(n):
            reader.read_into(buf, i * chunk)
        bw = n * chunk / (time.perf_counter() - t0)
        small = aligned_empty(ALIGN)
        t0 = time.perf_counter()
        reps = 200
        for i in range(reps):
            reader.read_into(small, ((i * 7919) % (n * chunk // ALIGN)) * ALIGN)
        lat = max((time.perf_counter() - t0) / reps - ALIGN / bw, 0.0)
        return {"gbps": bw / 1e9, "latency_us": lat * 1e6, "direct": float(reader.direct)}
    finally:
        reader.close()
        path.unlink(missing_ok=True)


def measure_links(device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """h2d and d2h: copies of 64 KiB .. 64 MiB, fitted to latency + bytes/bandwidth."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = []
    for direction in ("h2d", "d2h"):
        pts = []
        for size in (1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26):
            host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
            host.fill_(1)
            dev = torch.empty(size, dtype=torch.uint8, device=device)
            if direction == "h2d":

                def fn(dev=dev, host=host) -> None:
                    dev.copy_(host, non_blocking=True)
            else:

                def fn(dev=dev, host=host) -> None:
                    host.copy_(dev, non_blocking=True)

            pts.append((float(size), _timeit(fn, sync, reps=7)))
        bw, lat = _fit(pts)
        out.append({"gbps": bw / 1e9, "latency_us": lat * 1e6})
    return out[0], out[1]


def _random_units(spec: ModelSpec, device: torch.device) -> dict[Unit, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    dtype = torch_dtype(spec)
    units: dict[Unit, dict[str, torch.Tensor]] = {}
    want = {Tensor.ATTENTION, Tensor.GATE, Tensor.EXPERT, Tensor.FFN, Tensor.HEAD}
    for unit, tensors in unit_layout(spec).items():
        if unit.kind not in want or unit.layer not in (-1, *spec.moe_layers[:1], 0):
            continue
        if unit.kind == Tensor.EXPERT and unit.expert != 0:
            continue
        units[unit] = {
            k: (torch.randn(ts.shape, generator=g) * 0.02).to(dtype).to(device)
            for k, ts in tensors.items()
        }
    return units


def measure_compute(
    spec: ModelSpec, model: Model, device: torch.device, budget_s: float = 40.0
) -> dict[str, list[list[float]]]:
    """Time tables: op kind -> [[flops, seconds], ...] over token counts (prefill-shaped attention)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    units = _random_units(spec, device)
    layer = spec.moe_layers[0] if spec.moe_layers else 0
    h = spec.hidden_size
    dtype = torch_dtype(spec)
    tables: dict[str, list[list[float]]] = {}
    deadline = time.perf_counter() + budget_s
    torch.set_grad_enabled(False)
    for t in TOKENS:
        if time.perf_counter() > deadline:
            break
        x = torch.randn(1, t, h, dtype=dtype, device=device)
        flat = x[0]
        kv = KVCache.allocate(spec, 1, t, device)
        pos = torch.arange(t)
        attn = units[Unit(Tensor.ATTENTION, layer)]
        cases: list[tuple[OpKind, float, Callable[[], Any]]] = [
            (
                OpKind.ATTENTION,
                spec.attention_flops(t, (t + 1) // 2),
                lambda: model.attention(layer, attn, x, kv, pos),
            ),
            (
                OpKind.EXPERT,
                spec.expert_flops(t),
                lambda: model.expert(units[Unit(Tensor.EXPERT, layer, 0)], flat),
            ),
            (
                OpKind.HEAD,
                spec.head_flops(t),
                lambda: model.head(units[Unit(Tensor.HEAD)], x.view(t, 1, h)),
            ),
        ]
        if spec.is_moe(layer):
            cases.append(
                (
                    OpKind.GATE,
                    spec.gate_flops(t),
                    lambda: model.gate(layer, units[Unit(Tensor.GATE, layer)], x),
                )
            )
        ffn = units.get(Unit(Tensor.FFN, layer)) or units.get(Unit(Tensor.FFN, 0))
        if ffn is not None:
            ffn_layer = layer if Unit(Tensor.FFN, layer) in units else 0
            fn = (
                (lambda: model.shared_ffn(ffn, flat))
                if spec.is_moe(ffn_layer)
                else (lambda: model.dense_ffn(ffn, x))
            )
            cases.append((OpKind.FFN, spec.ffn_flops(t, ffn_layer), fn))
        for kind, flops, fn in cases:
            tables.setdefault(str(kind), []).append(
                [float(flops), _timeit(fn, sync, reps=5, budget_s=0.5)]
            )
    for pts in tables.values():
        pts.sort()
    return tables


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(
    name: str, ckpt: str | None, device: str | None, disk_dir: Path, disk_mb: int
) -> dict[str, Any]:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if ckpt:
        spec, _ = load_checkpoint(ckpt)
        model = Model.from_checkpoint(ckpt, spec)
    else:
        spec = ModelSpec.from_dict(
            yaml.safe_load((CONF_MODEL_DIR / "mixtral-tiny.yaml").read_text())
        )
        model = Model(spec)
    t0 = time.perf_counter()
    disk = measure_disk(disk_dir, disk_mb)
    h2d, d2h = measure_links(dev)
    tables = measure_compute(spec, model, dev)
    expert = tables[str(OpKind.EXPERT)][-1]
    peak = expert[0] / expert[1]
    mem_bw = (
        h2d["gbps"] if dev.type == "cpu" else 1000.0
    )  # CPU pool: a memcpy is the memory bandwidth
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        gpu_gb = total / 1e9 * 0.9
        gpu_name = torch.cuda.get_device_name(dev)
    else:
        gpu_gb = _ram_bytes() / 1e9 * 0.25
        gpu_name = "none (device pool = RAM)"
    compute = {"tflops": round(peak / 1e12, 6), "mem_bw_gbps": round(mem_bw, 3), "overhead_us": 0,
               "time_tables": {k: [[float(f"{x:.6g}"), float(f"{y:.6g}")] for x, y in v] for k, v in tables.items()}}  # fmt: skip
    machine = f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, GPU: {gpu_name})"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    disk_note = (
        "O_DIRECT"
        if disk["direct"]
        else "buffered (O_DIRECT unsupported here: page-cache bandwidth)"
    )
    return {
        "name": name,
        "memory_gb": {
            "gpu": round(gpu_gb, 3),
            "cpu": round(_ram_bytes() / 1e9 * 0.5, 3),
            "disk": round(shutil.disk_usage(disk_dir).free / 1e9 * 0.5, 3),
        },
        "gpu": compute,
        "cpu": copy.deepcopy(compute) if dev.type == "cpu" else {**compute, "time_tables": {}},
        "links": {
            "h2d": {"gbps": round(h2d["gbps"], 4), "latency_us": round(h2d["latency_us"], 2)},
            "d2h": {"gbps": round(d2h["gbps"], 4), "latency_us": round(d2h["latency_us"], 2)},
            "disk": {"gbps": round(disk["gbps"], 4), "latency_us": round(disk["latency_us"], 2)},
            "disk_write": {
                "gbps": round(disk["gbps"], 4),
                "latency_us": round(disk["latency_us"], 2),
            },
        },
        "sources": {
            "calibration": f"python -m experiments.calibrate on {machine}, {date}, commit {_git_commit()}",
            "model": f"compute tables of {spec.name} ({ckpt or 'conf/model/mixtral-tiny, random weights'}) on {dev}",
            "disk": f"{disk_mb} MB in {disk_dir} read with {disk_note}",
            "memory": "gpu: 25% of RAM (CPU device pool) or 90% of GPU memory; cpu: 50% of RAM; disk: half the free space",
            "duration": f"{time.perf_counter() - t0:.1f} s",
        },
    }


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    opts = {
        "hardware.name": "this-machine",
        "checkpoint": None,
        "device": None,
        "disk_dir": "runs/.calib",
        "disk_mb": "256",
        "out": None,
    }
    try:
        for arg in argv:
            key, sep, value = arg.partition("=")
            if not sep or key not in opts:
                raise MoepipeError(
                    f"argument {arg!r}: expected key=value with key in {sorted(opts)}"
                )
            opts[key] = value
        name = str(opts["hardware.name"])
        out = Path(opts["out"] or ROOT / "conf" / "hardware" / f"{name}.yaml")
        hw = calibrate(
            name,
            opts["checkpoint"],
            opts["device"],
            Path(str(opts["disk_dir"])),
            int(str(opts["disk_mb"])),
        )
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    header = f"# Measured by experiments.calibrate: {hw['sources']['calibration']}\n"
    out.write_text(header + yaml.safe_dump(hw, sort_keys=False, width=120))
    links = hw["links"]
    print(
        f"wrote {out}: disk {links['disk']['gbps']:.2f} GB/s, h2d {links['h2d']['gbps']:.2f} GB/s "
        f"+ {links['h2d']['latency_us']:.0f} us, expert peak {hw['gpu']['tflops'] * 1e3:.1f} GFLOP/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
