"""What this machine's resources cost, measured: disk reads (O_DIRECT), host-device links, the
tiered store, the executor's per-op overhead and compute per op kind and token count. The
`experiments.calibrate` command fits these into a hardware profile."""

# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.schedule import ScheduleBuilder
from core.spec import ModelSpec, RoutingConfig, Workload
from core.types import OpKind, Resource, RoutingSource, Tensor, Tier
from real.checkpoint import Unit, load_checkpoint, torch_dtype, unit_layout
from real.executor import Executor
from real.model import KVCache, Model, expert_tokens, moe_output, new_slots, put_expert
from real.store import (
    ALIGN,
    DiskReader,
    TieredStore,
    aligned_empty,
)

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
    try:  # a full disk or Ctrl-C while it is written: the file goes, not left filling the disk
        with open(path, "wb") as f:
            block = os.urandom(chunk)
            for _ in range(max(size_mb * (1 << 20) // chunk, 4)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:
        path.unlink(missing_ok=True)
        if isinstance(e, OSError) and not e.filename:  # a write's error names no file: this one
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
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
    ckpt: str, device: torch.device, budget_s: float = 6.0, dtype: str | None = None
) -> dict[str, dict[str, float]]:
    """Disk and h2d timed through the real executor's own path on the checkpoint's units: a
    `TieredStore` reads a unit from the checkpoint into a host buffer (`read_disk`: a slot of
    its host slabs, reused once given back, as in a run), copies it into the device pool
    (`to_device`) and drops both copies, as load/free pairs of a schedule do; device allocation
    and cache misses are in the times. Each pass reads every
    unit in file order back to back (the disk stream), then copies every unit (the copy stream);
    at least one pass after a warm-up pass, more within `budget_s`; per-size medians fitted to
    latency + bytes/bandwidth. `dtype`: the runs' compute dtype (`load_checkpoint`'s)."""
    spec, _ = load_checkpoint(ckpt, dtype)
    store = TieredStore(ckpt, 1 << 62, device=device, dtype=dtype)
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


def measure_op_overhead(
    ckpt: str | None, device: torch.device, n_ops: int = 400, dtype: str | None = None
) -> float:
    """Seconds the real executor spends per op beyond the op's own work: a chain of `n_ops`
    1-byte activation copies alternating between two streams on different resources, each
    waiting for the one before, so every op pays a worker hand-off, the dependency and memory
    checks, the resource lock and the timing. (makespan - summed copy times) / n_ops."""
    if not ckpt:
        return 0.0
    spec, _ = load_checkpoint(ckpt, dtype)
    wl = Workload(
        batch_size=1,
        n_batches=1,
        prompt_len=1,
        gen_len=1,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    store = TieredStore(ckpt, 1 << 40, device=device, dtype=dtype)
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
    """Random weights of the timed units; each in enough copies to rotate out of cache."""
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
    """Time tables: op kind -> [[flops, s], ...] over token counts (prefill-shaped attention)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    units = _random_units(spec, device)
    layer = spec.moe_layers[0] if spec.moe_layers else 0
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
        for kind, flops, fn in _compute_cases(spec, model, w, units, layer, t, device):
            tables.setdefault(str(kind), []).append(
                [float(flops), _timeit(fn, sync, reps=7, budget_s=0.5)]
            )
    for pts in tables.values():
        pts.sort()
    return tables


def _compute_cases(
    spec: ModelSpec,
    model: Model,
    w: Callable[[Unit], dict[str, torch.Tensor]],
    units: Mapping[Unit, Any],
    layer: int,
    t: int,
    device: torch.device,
) -> list[tuple[OpKind, float, Callable[[], Any]]]:
    """(op kind, flops, a call running it) of each compute op of `layer` over `t` tokens, its
    weights read through `w` (a fresh copy each call) from the `units` measure_compute made."""
    h = spec.hidden_size
    dtype = torch_dtype(spec)
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
        put_expert(slots, rows, slot, model.expert(w(Unit(Tensor.EXPERT, layer, 0)), flat[rows]))

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
    return cases
