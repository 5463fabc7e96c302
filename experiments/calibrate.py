"""Measure this machine and write conf/hardware/<name>.yaml for the simulator's cost model.

Disk read bandwidth/latency with O_DIRECT (real.store.DiskReader), host->device and device->host
bandwidth/latency (on a CPU-only machine: a memcpy into the RAM device pool, as the real executor
does), and per-op-kind compute time tables ((flops, seconds) against token count) of the real
model pieces for a checkpoint's model (default: conf/model/mixtral-tiny). With a checkpoint, the
executor's per-op overhead (a chain of no-op copies) and, per compute kind, what an op costs in a
few small real runs beyond its kernel (`measure_in_run` -> overhead_us_by_kind), and the disk and
h2d bandwidths those runs' transfers saw, over `in_run_s` seconds. About 30 s here.

Usage:
    python -m experiments.calibrate hardware.name=this-machine [checkpoint=DIR] [device=cuda]
        [disk_dir=runs/.calib] [disk_mb=256] [in_run_s=20] [out=conf/hardware/this-machine.yaml]
"""

# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
from __future__ import annotations

import copy
import datetime
import itertools
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from core.errors import MoepipeError
from core.schedule import ScheduleBuilder
from core.spec import ModelSpec, RoutingConfig, Workload
from core.trace import link_bandwidth
from core.types import OpKind, Resource, RoutingSource, Tensor, Tier
from experiments.app import command, kv
from experiments.cli import (
    as_float,
    as_int,
    output_dir,
    output_file,
    run_command,
    until_interrupted,
)
from real.checkpoint import CONF_MODEL_DIR, Unit, load_checkpoint, torch_dtype, unit_layout
from real.executor import Executor, cpu_compute_threads
from real.model import KVCache, Model, expert_tokens, moe_output, new_slots, put_expert
from real.store import (
    ALIGN,
    DiskReader,
    TieredStore,
    aligned_empty,
    resolve_device,
)

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
    """O_DIRECT reads of 64 KiB .. 16 MiB at spread offsets of a fresh file of `size_mb` MB,
    fitted to latency + bytes/bandwidth (without a checkpoint; with one, `measure_store` reads
    the checkpoint's units instead)."""
    disk_dir.mkdir(parents=True, exist_ok=True)
    path = disk_dir / "calib.bin"
    chunk = 4 << 20
    with open(path, "wb") as f:
        block = os.urandom(chunk)
        for _ in range(max(size_mb * (1 << 20) // chunk, 4)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    reader = DiskReader(path)
    try:
        span = path.stat().st_size
        pts = []
        for size in (1 << 16, 1 << 20, 1 << 22, 1 << 23, 1 << 24):
            if size > span:
                break
            buf = aligned_empty(size)
            slots = max((span - size) // ALIGN, 1)
            times = []
            for i in range(9):
                t0 = time.perf_counter()
                reader.read_into(buf, ((i * 7919 * 257) % slots) * ALIGN)
                times.append(time.perf_counter() - t0)
            pts.append((float(size), statistics.median(times)))
        bw, lat = _fit(pts)
        return {"gbps": bw / 1e9, "latency_us": lat * 1e6, "direct": float(reader.direct)}
    finally:
        reader.close()
        path.unlink(missing_ok=True)


def _llc_bytes() -> int:
    """Last-level cache size (Linux sysfs); 32 MiB where unknown."""
    try:
        idx = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))[-1]
        text = (idx / "size").read_text().strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
        return int(text.rstrip("KM")) * mult
    except (OSError, IndexError, ValueError):
        return 32 << 20


def _copies(nbytes: int) -> int:
    """How many copies of a buffer to rotate over so that each use finds it out of cache, as the
    executor does (a unit is read once per use: it was just written by a DMA or a memcpy)."""
    return min(max(-(-2 * _llc_bytes() // max(nbytes, 1)), 1), 64)


def measure_links(device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """h2d and d2h: copies of 64 KiB .. 16 MiB into a fresh destination (the store allocates one
    per unit), from sources rotated out of cache; fitted to latency + bytes/bandwidth."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    out = []
    for direction in ("h2d", "d2h"):
        pts = []
        for size in (1 << 16, 1 << 20, 1 << 22, 1 << 23, 1 << 24):
            src_dev = device if direction == "d2h" else torch.device("cpu")
            dst_dev = torch.device("cpu") if direction == "d2h" else device
            pin = device.type == "cuda"
            srcs = [
                torch.ones(size, dtype=torch.uint8, device=src_dev).pin_memory()
                if pin and src_dev.type == "cpu"
                else torch.ones(size, dtype=torch.uint8, device=src_dev)
                for _ in range(_copies(size))
            ]
            it = iter(range(1 << 30))

            def fn(srcs=srcs, size=size, dst_dev=dst_dev, it=it) -> None:
                dst = torch.empty(
                    size,
                    dtype=torch.uint8,
                    device=dst_dev,
                    pin_memory=pin and dst_dev.type == "cpu",
                )
                dst.copy_(srcs[next(it) % len(srcs)], non_blocking=pin)

            pts.append((float(size), _timeit(fn, sync, reps=9, budget_s=1.0)))
        bw, lat = _fit(pts)
        out.append({"gbps": bw / 1e9, "latency_us": lat * 1e6})
    return out[0], out[1]


def measure_store(
    ckpt: str, device: torch.device, budget_s: float = 6.0
) -> dict[str, dict[str, float]]:
    """Disk and h2d timed through the real executor's own path on the checkpoint's units: a
    `TieredStore` reads a unit from the checkpoint into a host buffer (`read_disk`: a slot of
    its host slabs, reused once given back, as in a run), copies it into the device pool
    (`to_device`) and drops both copies, as load/free pairs of a schedule do; device allocation
    and cache misses are in the times. Each pass reads every
    unit in file order back to back (the disk stream), then copies every unit (the copy stream);
    at least one pass after a warm-up pass, more within `budget_s`; per-size medians fitted to
    latency + bytes/bandwidth."""
    spec, _ = load_checkpoint(ckpt)
    store = TieredStore(ckpt, 1 << 62, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    # File order is layer order: a forward pass reads the checkpoint front to back, so the
    # passes below do too (a scattered order measured half the bandwidth the runs see here).
    order = sorted(
        store.records, key=lambda u: (str(store.records[u].reads[0].file), store.records[u].offset)
    )
    times: dict[int, tuple[list[float], list[float]]] = {}
    deadline = time.perf_counter() + budget_s
    try:
        for rep in range(4):
            # The disk stream's worker reads unit after unit; timed the same way, back to back
            # (reads interleaved with copies measured up to 1.6x slower here than reads alone).
            for u in order:
                t0 = time.perf_counter()
                store.read_disk(u)
                t1 = time.perf_counter()
                store.evict(u, Tier.CPU)
                if rep:  # the first pass warms the allocator
                    times.setdefault(store.unit_bytes(u), ([], []))[0].append(t1 - t0)
            for u in order:  # the copy stream: host -> device of a unit already in host memory
                store.read_disk(u)
                t1 = time.perf_counter()
                store.to_device(u)
                sync()
                t2 = time.perf_counter()
                store.evict(u, Tier.GPU)
                store.evict(u, Tier.CPU)
                if rep:
                    times[store.unit_bytes(u)][1].append(t2 - t1)
            if rep and time.perf_counter() > deadline:
                break
    finally:
        store.close()
    disk = [(float(size), statistics.median(td)) for size, (td, _) in sorted(times.items())]
    h2d = [(float(size), statistics.median(th)) for size, (_, th) in sorted(times.items())]
    out = {}
    for name, pts in (("disk", disk), ("h2d", h2d)):
        bw, lat = _fit(pts) if len(pts) > 1 else (pts[0][0] / pts[0][1], 0.0)
        out[name] = {"gbps": bw / 1e9, "latency_us": lat * 1e6, "direct": float(store.disk.direct)}
    return out


def measure_op_overhead(ckpt: str | None, device: torch.device, n_ops: int = 400) -> float:
    """Seconds the real executor spends per op beyond the op's own work: a chain of `n_ops`
    1-byte activation copies alternating between two streams on different resources, each
    waiting for the one before, so every op pays a worker hand-off, the dependency and memory
    checks, the resource lock and the timing. (makespan - summed copy times) / n_ops."""
    if not ckpt:
        return 0.0
    spec, _ = load_checkpoint(ckpt)
    wl = Workload(
        batch_size=1,
        n_batches=1,
        prompt_len=1,
        gen_len=1,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    store = TieredStore(ckpt, 1 << 40, device=device)
    try:
        ex = Executor(store, Model(spec), wl, torch.zeros(1, 1, dtype=torch.long))
        b = ScheduleBuilder({Tier.GPU: 1 << 40, Tier.CPU: 1 << 40, Tier.DISK: 1 << 40})
        streams = (b.stream("a", Resource.H2D), b.stream("b", Resource.D2H))
        prev = None
        for i in range(n_ops):
            src, dst = (Tier.CPU, Tier.GPU) if i % 2 == 0 else (Tier.GPU, Tier.CPU)
            prev = b.add(
                OpKind.LOAD,
                streams[i % 2],
                [prev],
                tensor=Tensor.HIDDEN,
                nbytes=1,
                src=src,
                dst=dst,
            )
        ex.run_timing(b.build())  # warm-up: threads, scratch buffers
        start, end = ex.run_timing(b.build())
    finally:
        store.close()
    return max((float(end.max()) - float((end - start).sum())) / n_ops, 0.0)


def _random_units(
    spec: ModelSpec, device: torch.device
) -> dict[Unit, list[dict[str, torch.Tensor]]]:
    """Random weights of the units calibration times; each in enough copies to rotate out of cache."""
    g = torch.Generator().manual_seed(0)
    dtype = torch_dtype(spec)
    units: dict[Unit, list[dict[str, torch.Tensor]]] = {}
    want = {Tensor.ATTENTION, Tensor.GATE, Tensor.EXPERT, Tensor.FFN, Tensor.HEAD}
    for unit, tensors in unit_layout(spec).items():
        if unit.kind not in want or unit.layer not in (-1, *spec.moe_layers[:1], 0):
            continue
        if unit.kind == Tensor.EXPERT and unit.expert != 0:
            continue
        one = {
            k: (torch.randn(ts.shape, generator=g) * 0.02).to(dtype).to(device)
            for k, ts in tensors.items()
        }
        nbytes = sum(t.numel() * t.element_size() for t in one.values())
        units[unit] = [one] + [
            {k: t.clone() for k, t in one.items()} for _ in range(_copies(nbytes) - 1)
        ]
    return units


@torch.no_grad()
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
    turn = iter(range(1 << 30))

    def w(unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's next copy: every timed call reads its weights from memory, not cache."""
        copies = units[unit]
        return copies[next(turn) % len(copies)]

    for t in TOKENS:
        if time.perf_counter() > deadline:
            break
        x = torch.randn(1, t, h, dtype=dtype, device=device)
        flat = x[0]
        kv = KVCache.allocate(spec, 1, t, device)
        attn = Unit(Tensor.ATTENTION, layer)
        # Each op kind is timed with the bookkeeping the real executor does inside that op (the
        # schedule shows no op for it): an attention or head first adds the previous MoE layer's
        # expert outputs to the hidden state; an expert gathers its tokens and scatters its
        # output; a gate also allocates the output slots and hands its routing to the host.
        k = spec.top_k
        ids = torch.zeros(t, k, dtype=torch.long, device=device)  # [T, k]: every token -> expert 0
        ids[:, 1:] = torch.arange(1, k, device=device) % max(spec.n_experts, 1)
        gw = torch.full((t, k), 1.0 / k, dtype=dtype, device=device)  # [T, k]
        slots = new_slots(flat, k)  # [T, k, H]

        def attention() -> Any:
            hid = moe_output(x, slots, gw, None)
            return model.attention(layer, w(attn), hid, kv, torch.arange(t))

        def expert() -> None:
            rows, slot = expert_tokens(ids, 0)
            put_expert(
                slots, rows, slot, model.expert(w(Unit(Tensor.EXPERT, layer, 0)), flat[rows])
            )

        def head() -> Any:
            hid = moe_output(x, slots, gw, None)
            return model.head(w(Unit(Tensor.HEAD)), hid.view(t, 1, h)).argmax(-1)

        # a replayed gate gets its forced routing from the trace's host arrays (int64 ids,
        # float32 weights whatever the model's dtype), as Executor._gate does
        ids_host = ids.cpu().numpy()
        gw_host = gw.float().cpu().numpy()

        def gate() -> None:
            fi = torch.from_numpy(ids_host.copy())
            fw = torch.from_numpy(gw_host.copy())
            normed, chosen, _ = model.gate(layer, w(Unit(Tensor.GATE, layer)), x, fi, fw)
            new_slots(normed, k)
            np.bincount(chosen.cpu().flatten().numpy(), minlength=spec.n_experts)

        cases: list[tuple[OpKind, float, Callable[[], Any]]] = [
            (OpKind.ATTENTION, spec.attention_flops(t, (t + 1) // 2, sequences=1), attention),
            (OpKind.EXPERT, spec.expert_flops(t), expert),
            (OpKind.HEAD, spec.head_flops(t), head),
        ]
        if spec.is_moe(layer):
            cases.append((OpKind.GATE, spec.gate_flops(t), gate))
        ffn_layer = layer if Unit(Tensor.FFN, layer) in units else 0
        ffn = Unit(Tensor.FFN, ffn_layer)
        if ffn in units:
            fn = (
                (lambda: model.shared_ffn(w(ffn), flat))
                if spec.is_moe(ffn_layer)
                else (lambda: model.dense_ffn(w(ffn), x))
            )
            cases.append((OpKind.FFN, spec.ffn_flops(t, ffn_layer), fn))
        for kind, flops, fn in cases:
            tables.setdefault(str(kind), []).append(
                [float(flops), _timeit(fn, sync, reps=7, budget_s=0.5)]
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


def measure_in_run(
    ckpt: str,
    hw: dict[str, Any],
    device: torch.device,
    budget_s: float = 20.0,
    runs: int = 3,
    gpu_frac: float = 0.6,
    cpu_frac: float = 0.15,
) -> tuple[dict[str, float], dict[str, float]]:
    """What ops cost inside a real run: small flexgen runs on the checkpoint (2 batches of 2
    sequences, 8-token prompts, 3 tokens; device pool `gpu_frac` and host RAM `cpu_frac` of the
    model, so the disk stream is active), at least `runs` of them and more until `budget_s` has passed, their
    ops pooled. This VM's disk and CPU drift by about 30% over minutes; a window of seconds
    catches one moment of that, a longer one its middle.

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
    from core.spec import HardwareSpec
    from experiments.pipeline import RunSpec
    from experiments.real_run import real_execute

    spec, _ = load_checkpoint(ckpt)
    d = copy.deepcopy(hw)
    d["memory_gb"] = dict(
        d["memory_gb"],
        gpu=gpu_frac * spec.total_bytes / 1e9,
        cpu=cpu_frac * spec.total_bytes / 1e9,
    )
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
        result, _ = real_execute(ckpt, run, "replay", device=str(device))  # cuda:N kept
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


def calibrate(
    name: str,
    ckpt: str | None,
    device: str | None,
    disk_dir: Path,
    disk_mb: int,
    in_run_s: float = 20.0,
) -> dict[str, Any]:
    dev = resolve_device(device)
    if ckpt:
        spec, _ = load_checkpoint(ckpt)
        model = Model.from_checkpoint(ckpt, spec)
    else:
        spec = ModelSpec.from_dict(
            yaml.safe_load((CONF_MODEL_DIR / "mixtral-tiny.yaml").read_text())
        )
        model = Model(spec)
    t0 = time.perf_counter()
    data_file = ckpt
    disk_dir.mkdir(parents=True, exist_ok=True)
    # Time transfers and compute with the torch thread count the real executor runs them with.
    threads_before = torch.get_num_threads()
    threads = cpu_compute_threads() if dev.type == "cpu" else threads_before
    torch.set_num_threads(threads)
    try:
        h2d, d2h = measure_links(dev)
        if ckpt:  # the executor's own path on the model's unit sizes replaces the raw timings
            via_store = measure_store(ckpt, dev)
            disk, h2d = via_store["disk"], via_store["h2d"]
        else:
            disk = measure_disk(disk_dir, disk_mb)
        tables = measure_compute(spec, model, dev)
        overhead_s = measure_op_overhead(ckpt, dev)
        # The CPU's own compute (fiddler-style planners run experts there), timed where a GPU run
        # runs it: torch's default thread count; a memcpy between pageable buffers is its memory
        # bandwidth. On a CPU-only machine the device pool is the CPU, timed above.
        cpu_tables, cpu_bw = (
            (
                measure_compute(spec, model, torch.device("cpu"), budget_s=15.0),
                measure_links(torch.device("cpu"))[0]["gbps"],
            )
            if dev.type == "cuda"
            else (tables, h2d["gbps"])
        )
    finally:
        torch.set_num_threads(threads_before)

    def roofline(tables: dict[str, list[list[float]]]) -> float:
        """Peak flop/s: the largest expert op's flops over its time."""
        expert = tables[str(OpKind.EXPERT)][-1]
        return expert[0] / expert[1]

    mem_bw = cpu_bw if dev.type == "cpu" else 1000.0  # CPU pool: a memcpy is the memory bandwidth
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        gpu_gb = total / 1e9 * 0.9
        gpu_name = torch.cuda.get_device_name(dev)
    else:
        gpu_gb = _ram_bytes() / 1e9 * 0.25
        gpu_name = "none (device pool = RAM)"

    def entry(tables: dict[str, list[list[float]]], mem_bw: float) -> dict[str, Any]:
        return {
            "tflops": round(roofline(tables) / 1e12, 6),
            "mem_bw_gbps": round(mem_bw, 3),
            "overhead_us": round(overhead_s * 1e6, 1),
            "time_tables": {
                k: [[float(f"{x:.6g}"), float(f"{y:.6g}")] for x, y in v] for k, v in tables.items()
            },
        }

    compute = entry(tables, mem_bw)
    machine = f"{platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, GPU: {gpu_name})"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    disk_note = (
        "O_DIRECT"
        if disk["direct"]
        else "buffered (O_DIRECT unsupported here: page-cache bandwidth)"
    )
    out: dict[str, Any] = {
        "name": name,
        "memory_gb": {
            "gpu": round(gpu_gb, 3),
            "cpu": round(_ram_bytes() / 1e9 * 0.5, 3),
            "disk": round(shutil.disk_usage(disk_dir).free / 1e9 * 0.5, 3),
        },
        "gpu": compute,
        "cpu": copy.deepcopy(compute) if dev.type == "cpu" else entry(cpu_tables, cpu_bw),
        # Every op, transfer or compute, also pays the executor's per-op overhead.
        "links": {
            name: {
                "gbps": round(m["gbps"], 4),
                "latency_us": round(m["latency_us"] + overhead_s * 1e6, 2),
            }
            for name, m in (("h2d", h2d), ("d2h", d2h), ("disk", disk), ("disk_write", disk))
        },
        "sources": {
            "calibration": f"python -m experiments.calibrate on {machine}, {date}, commit {_git_commit()}",
            "model": f"compute tables of {spec.name} ({ckpt or 'conf/model/mixtral-tiny, random weights'}) on {dev}"
            + (
                "; cpu: the same ops on the CPU (torch's default threads, as a GPU run's CPU ops), "
                "mem_bw_gbps from a host memcpy"
                if dev.type == "cuda"
                else ""
            ),
            "disk": (
                f"{data_file}'s safetensors files: its units read with {disk_note} back "
                "to back in file order, fitted to latency + bytes/bandwidth"
                if data_file
                else f"{disk_mb} MB in {disk_dir} read with {disk_note}, 64 KiB .. 16 MiB reads "
                "fitted to latency + bytes/bandwidth"
            ),
            "overhead": f"{overhead_s * 1e6:.0f} us per op: a chain of no-op copies through the real executor "
            "(compute overhead_us; added to every link's latency_us)",
            "threads": f"torch intra-op threads {threads} (the real executor's on this device)",
            "memory": "gpu: 25% of RAM (CPU device pool) or 90% of GPU memory; cpu: 50% of RAM; disk: half the free space",
        },
    }
    # the link a run on G processes moves tokens and replicas over (executor.distributed=true):
    # gloo between 2 processes of this machine; 2 "GPUs", the processes it was measured between
    from experiments.dist_run import measure_d2d

    d2d = measure_d2d()
    out["n_gpus"] = 2
    out["links"]["p2p"] = {
        "gbps": round(d2d["gbps"], 4),
        "latency_us": round(d2d["latency_us"] + overhead_s * 1e6, 2),
    }
    out["sources"]["p2p"] = (
        "gloo send/recv between 2 processes of this machine (what executor.distributed=true "
        "moves tokens and replica copies over), a ping-pong of 64 KiB .. 32 MiB fitted to "
        "latency + bytes/bandwidth; n_gpus 2: the processes measured"
    )
    if ckpt:  # the executor's cost around each compute op, and the links, measured in runs
        extra, in_run = measure_in_run(ckpt, out, dev, in_run_s)
        by_kind = {k: round(overhead_s * 1e6 + max(0.0, x) * 1e6, 1) for k, x in extra.items()}
        for dev_key in ("gpu", "cpu") if dev.type == "cpu" else ("gpu",):
            out[dev_key]["overhead_us_by_kind"] = dict(by_kind)
        out["sources"]["overhead_by_kind"] = (
            f"overhead_us plus the median extra time of each compute kind in real flexgen runs "
            f"for {in_run_s:g} s (2 x 2 sequences, 8-token prompts, 3 tokens, disk tier active) "
            "over the tables: "
            + ", ".join(f"{k} +{1e3 * max(0.0, x):.2f} ms" for k, x in extra.items())
        )
        for link, bw in in_run.items():
            alone = out["links"][link]["gbps"]
            for key in ("disk", "disk_write") if link == "disk" else (link,):
                out["links"][key]["gbps"] = round(bw / 1e9, 4)
            out["sources"][f"{link}_in_run"] = (
                f"gbps {bw / 1e9:.3f}: what the same runs' {link} transfers delivered (bytes over "
                f"their time net of latency); timed alone they gave {alone:.3f} GB/s"
            )
    out["sources"]["duration"] = f"{time.perf_counter() - t0:.1f} s"
    return out


@dataclass
class ProfileName:
    name: str = "this-machine"  # the profile's name (and its file's, under conf/hardware/)


@dataclass
class Options:
    hardware: ProfileName = field(default_factory=ProfileName)
    checkpoint: str | None = None  # a checkpoint folder to time (default: a reduced Mixtral)
    device: str | None = None  # cuda | cpu; null: cuda if available
    disk_dir: str = "runs/.calib"  # where the disk probe writes its file
    disk_mb: int = 256  # the disk probe's size
    in_run_s: float = 20.0  # seconds of real runs whose transfers measure the links in use
    out: str | None = None  # default conf/hardware/<hardware.name>.yaml


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130; the profile is written only once measured."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(args: Options) -> int:
    opts = kv(args)
    try:
        name = str(opts["hardware.name"])
        if not re.fullmatch(r"\w[\w.\-]*", name):  # a path (../x, a/b) would write elsewhere
            raise MoepipeError(
                f"hardware.name={name!r}: a profile's name is letters, digits, '_', '-' and '.' "
                "(it becomes conf/hardware/<name>.yaml and hardware=<name>); to write elsewhere "
                "pass out=FILE"
            )
        disk_mb = as_int("disk_mb", opts["disk_mb"], at_least=1)
        in_run_s = as_float("in_run_s", opts["in_run_s"], at_least=0.0)
        resolve_device(opts["device"])
        # every path is checked before the measuring, which its results would be lost after
        out = output_file(opts["out"] or ROOT / "conf" / "hardware" / f"{name}.yaml", "out")
        disk_dir = output_dir(str(opts["disk_dir"]), "disk_dir")
        hw = calibrate(name, opts["checkpoint"], opts["device"], disk_dir, disk_mb, in_run_s)
        header = f"# Measured by experiments.calibrate: {hw['sources']['calibration']}\n"
        try:
            out.write_text(header + yaml.safe_dump(hw, sort_keys=False, width=120))
        except OSError as e:
            raise MoepipeError(f"out={out}: cannot write it ({e.strerror or e})") from None
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    links = hw["links"]
    print(
        f"wrote {out}: disk {links['disk']['gbps']:.2f} GB/s, h2d {links['h2d']['gbps']:.2f} GB/s "
        f"+ {links['h2d']['latency_us']:.0f} us, expert peak {hw['gpu']['tflops'] * 1e3:.1f} GFLOP/s"
    )
    return 0


_app = command("calibrate", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(run_command(main))
