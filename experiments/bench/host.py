"""Host memory of the real executor on this device: what its two host-side layouts buy
(position-major KV spans, exact-size pinned slabs) against PyTorch's defaults, every copy checked
against its source. It prints its measurements and writes no files; what each part times:
docs/commands.md#bench_host.

Usage:
    python -m experiments.bench.host [device=cuda|cpu] [batch=8] [kv_heads=8] [positions=2048]
        [head_dim=128] [unit_mb=16.5] [units=8] [repeats=5]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.args import MAX_REPEATS, MAX_TOKENS, REPEATS_WHY, TOKENS_WHY, as_float, as_int
from core.errors import MoepipeError
from experiments.common import pipeline
from experiments.common.app import kv, timed_command
from experiments.common.cli import exit_command  # noqa: E402
from experiments.common.held_warnings import plan_accepted
from real.store import ALIGN, HostSlabs, aligned_empty, resolve_device, round_up


@dataclass
class Options:
    device: str = ""  # cuda | cpu; empty: cuda if available
    batch: int = 8
    kv_heads: int = 8
    positions: int = 2048
    head_dim: int = 128
    unit_mb: float = 16.5
    units: int = 8
    repeats: int = 5


_DEFAULTS: dict[str, Any] = kv(Options())

MAX_UNITS = 4096


def check_host_bytes(need: int, what: str, fix: str) -> None:
    """A MoepipeError where the bench would hold more host memory at once than this machine has
    available (past it the machine swaps, and the figures measure the swap): the cap follows the
    machine, MemAvailable where /proc/meminfo has it, else its physical RAM."""
    avail = pipeline._available_ram_bytes()
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > avail:
        raise MoepipeError(
            f"{what} would hold {need / 1e9:.3g} GB of host memory, and this machine has "
            f"{avail / 1e9:.3g} GB available; {fix}"
        )


def timed(copy: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median seconds the copy takes, median seconds the call holds the host), `repeats` runs
    after one warm-up; on CUDA the first from events on the current stream."""
    cuda = device.type == "cuda"
    took, held = [], []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        copy()
        t1 = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
            gpu = start.elapsed_time(end) / 1e3
        else:
            gpu = t1 - t0
        if i:
            took.append(gpu)
            held.append(t1 - t0)
    return statistics.median(took), statistics.median(held)


def slab_tensor(slabs: HostSlabs, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A host tensor of `shape` in a slab of its own (pinned where the slabs are), as the
    executor holds a KV cache."""
    n = dtype.itemsize * int(torch.Size(shape).numel())
    return slabs.lend(n).view(dtype).view(shape)


def kv_lines(
    opts: dict[str, Any], device: torch.device, slabs: HostSlabs, repeats: int
) -> list[str]:
    b, h, m, d = (
        as_int(k, opts[k], at_least=low, at_most=MAX_TOKENS, why=TOKENS_WHY)
        for k, low in (("batch", 1), ("kv_heads", 1), ("positions", 2), ("head_dim", 1))
    )
    cache = 2 * b * h * m * d  # bytes of the bf16 cache, held three times over below
    dt, pin = torch.bfloat16, device.type == "cuda"
    # its source, the two host layouts, and on a CPU the device's copy (float32 while drawn: as
    # much as two more, before the layouts are made)
    check_host_bytes(
        cache * (3 if pin else 4),
        f"batch={b} kv_heads={h} positions={m} head_dim={d}: a {cache / 1e9:.3g} GB cache",
        "lower batch, kv_heads, positions or head_dim",
    )
    g = torch.Generator().manual_seed(0)
    src = torch.randn(b, h, m, d, generator=g).to(dt)  # [B, H, M, D] the cache's contents
    strided = src.pin_memory() if pin else src.clone()  # the device's layout, pinned
    major = slab_tensor(slabs, (m, b, h, d), dt)  # the executor's: position-major, in a slab
    major.copy_(src.movedim(2, 0))
    span, last = slice(0, m - 1), slice(m - 1, m)  # a decode step's load, and its store
    dev = torch.zeros(b, h, m, d, dtype=dt, device=device)
    dev[:, :, last] = src[:, :, last].to(device)  # the step's new position, to store

    def dev_span() -> torch.Tensor:
        return dev[:, :, span]

    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.movedim(0, 2)

    # name: (copy, its destination as [B, H, M', D], the source's contents there)
    copies = {
        "load, strided host": (
            lambda: dev[:, :, span].copy_(strided[:, :, span], non_blocking=pin),
            dev_span,
            src[:, :, span],
        ),
        "load, position-major host": (
            lambda: dev.movedim(2, 0)[span].copy_(major[span], non_blocking=pin),
            dev_span,
            src[:, :, span],
        ),
        "store, strided host": (
            lambda: strided[:, :, last].copy_(dev[:, :, last], non_blocking=pin),
            lambda: strided[:, :, last],
            src[:, :, last],
        ),
        "store, position-major host": (
            lambda: major[last].copy_(dev.movedim(2, 0)[last], non_blocking=pin),
            lambda: moved(major[last]),
            src[:, :, last],
        ),
    }
    nbytes = {"load": b * h * (m - 1) * d * dt.itemsize, "store": b * h * d * dt.itemsize}
    lines = [
        f"KV cache of one layer: {b} sequences x {h} kv heads x {m} positions x {d}, {dt}; "
        f"load = positions [0, {m - 1}), store = position {m - 1}",
        f"{'copy':<28} {'bytes':>10} {'time_us':>9} {'GB/s':>7} {'host_held_us':>12}",
    ]
    for name, (copy, dst, want) in copies.items():
        dst().zero_()  # each copy is checked on its own
        took, held = timed(copy, device, repeats)
        if pin:
            torch.cuda.synchronize(device)
        if not torch.equal(dst().cpu(), want):
            raise RuntimeError(f"bench_host: the copy '{name}' did not reproduce its source")
        n = nbytes[name.split(",")[0]]
        lines.append(
            f"{name:<28} {n:>10} {1e6 * took:>9.1f} {n / took / 1e9:>7.2f} {1e6 * held:>12.1f}"
        )
    return lines


def buffer_lines(
    opts: dict[str, Any], device: torch.device, slabs: HostSlabs, repeats: int
) -> list[str]:
    # at least a page: the buffers are ALIGN-aligned, a smaller unit times the page, not itself
    unit_mb = as_float(
        "unit_mb",
        opts["unit_mb"],
        at_least=ALIGN / 2**20,
        low_why=f"a buffer is {ALIGN} bytes at least",
        at_most=4096.0,
        why="one expert's weights",
    )
    unit = round_up(int(unit_mb * 2**20), ALIGN)
    n = as_int("units", opts["units"], at_least=1, at_most=MAX_UNITS, why="each is a slab slot")
    # the slots, and PyTorch's pinned copy of one unit
    check_host_bytes(
        (n + 1) * unit,
        f"units={n} x unit_mb={opts['unit_mb']}: {n * unit / 1e9:.3g} GB of host buffers",
        "lower either",
    )
    before = slabs.reserved_bytes
    slots = [slabs.take(unit) for _ in range(n)]
    held = slabs.reserved_bytes - before
    rounded = n * (1 << (unit + ALIGN - 1).bit_length())  # aligned_empty asks unit + ALIGN
    pin = device.type == "cuda"
    lines = [
        f"host buffers: {n} units of {unit / 2**20:.2f} MiB = {n * unit / 2**20:.1f} MiB: "
        f"PyTorch's pinned allocator {rounded / 2**20:.1f} MiB (x{rounded / (n * unit):.2f}, "
        f"computed), the store's slabs {held / 2**20:.1f} MiB (x{held / (n * unit):.2f}, measured)"
        + ("" if pin else "; not pinned here"),
    ]
    torch_pinned = aligned_empty(unit, pin=pin)
    src = {"slab slot": slots[0], "PyTorch-pinned tensor": torch_pinned}
    for buf in src.values():
        buf.copy_(torch.randint(0, 256, (unit,), dtype=torch.uint8))
    dst = torch.empty(unit, dtype=torch.uint8, device=device)
    for name, buf in src.items():
        took, host = timed(lambda buf=buf: dst.copy_(buf, non_blocking=pin), device, repeats)
        if pin:
            torch.cuda.synchronize(device)
        if not torch.equal(dst.cpu(), buf):
            raise RuntimeError(f"bench_host: the copy from the {name} did not reproduce it")
        lines.append(
            f"host -> {device.type} from a {name:<22} {unit / took / 1e9:>7.2f} GB/s, the call "
            f"held the host {1e6 * host:.1f} us of {1e6 * took:.1f}"
            + (f" (pinned: {buf.is_pinned()})" if pin else "")
        )
    for s in slots:
        slabs.give(s)
    return lines


def report(opts: dict[str, Any]) -> list[str]:
    """The measurements (module doc); warnings held until the device and repeats are accepted,
    as a run's until its plan is (`held_warnings`)."""
    device = resolve_device(str(opts["device"]), "device", empty_ok=True)
    repeats = as_int("repeats", opts["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
    plan_accepted()
    slabs = HostSlabs(device if device.type == "cuda" else None)
    try:
        return [
            f"device: {device}" + ("" if device.type == "cuda" else " (no CUDA: a dry run)"),
            *kv_lines(opts, device, slabs, repeats),
            *buffer_lines(opts, device, slabs, repeats),
        ]
    finally:
        slabs.close()


main = timed_command("bench_host", Options, report, __doc__)

if __name__ == "__main__":
    exit_command(main)
