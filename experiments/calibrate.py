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
        [executor.dtype=auto|float32|bfloat16]   # with a checkpoint: its runs' compute dtype
"""

# ruff: noqa: B023  (the timed lambdas run inside their loop iteration)
from __future__ import annotations

import contextlib
import copy
import datetime
import fcntl
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from core.errors import CapacityError, MoepipeError
from core.files import cannot_write, memory_filesystem, staging_file
from core.spec import ModelSpec
from core.types import OpKind
from experiments.common.app import command, kv
from experiments.common.cli import (
    as_float,
    as_size_mb,
    exit_command,
    output_dir,
    output_file,
    until_interrupted,
)
from experiments.common.hardware import _ram_bytes, measure_in_run  # noqa: E402
from experiments.common.held_warnings import plan_accepted, say_line
from experiments.common.resolve import long_name_refused  # noqa: E402
from experiments.common.run_dir import remove_empty, topmost_missing  # noqa: E402
from experiments.common.schema import DtypeOption  # noqa: E402
from real.calibration import (  # noqa: E402
    measure_compute,
    measure_disk,
    measure_links,
    measure_op_overhead,
    measure_store,
)
from real.checkpoint import CONF_MODEL_DIR, load_checkpoint, run_dtype
from real.interpreter import cache_freed_memory, cpu_compute_threads
from real.model import Model
from real.store import (
    resolve_device,
)

ROOT = Path(__file__).resolve().parents[1]
# The in-run measurement: the links' rates settle within seconds of real runs
MAX_IN_RUN_S = 3600.0
IN_RUN_WHY = "an hour of real runs; the links' rates settle within seconds"


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


@dataclass
class Measured:
    """What calibrate timed on its own (before the in-run measurement)."""

    h2d: dict[str, float]  # gbps, latency_us
    d2h: dict[str, float]
    disk: dict[str, Any]  # gbps, latency_us, direct (O_DIRECT used)
    tables: dict[str, list[list[float]]]  # the device's kind -> [[flops, seconds], ...]
    cpu_tables: dict[str, list[list[float]]]  # the same on the CPU
    cpu_bw: float  # GB/s of a host memcpy
    overhead_s: float  # the executor's per-op overhead
    threads: int  # torch intra-op threads the timings ran with


def calibrate(
    name: str,
    ckpt: str | None,
    device: str | None,
    disk_dir: Path,
    disk_mb: int,
    in_run_s: float = 20.0,
    dtype: str | None = None,
    on_accepted: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """The hardware profile of this machine (conf/hardware/<name>.yaml's content), its timings
    in the checkpoint's compute `dtype` (executor.dtype). `on_accepted`: called once its inputs
    are (the checkpoint read), before the minutes of measuring."""
    dev = resolve_device(device)
    if ckpt:
        spec, _ = load_checkpoint(ckpt, dtype)
        model = Model.from_checkpoint(ckpt, spec)
    else:
        spec = ModelSpec.from_dict(
            yaml.safe_load((CONF_MODEL_DIR / "mixtral-tiny.yaml").read_text())
        )
        model = Model(spec)
    on_accepted()  # the warnings held (held_warnings) said now, not as the command ends
    t0 = time.perf_counter()
    disk_dir.mkdir(parents=True, exist_ok=True)
    m = _measure(spec, model, ckpt, dev, disk_dir, disk_mb, dtype)
    out = _profile(name, m, dev, spec.name, ckpt, disk_dir, disk_mb)
    _add_p2p(out, m.overhead_s)
    if ckpt:
        try:
            _add_in_run(out, ckpt, dev, in_run_s, m.overhead_s, dtype)
            _add_processes_in_run(out, ckpt, dtype)  # over the costs measured so far
        except CapacityError as e:  # its fix names a workload and memory calibrate sets itself
            raise CapacityError(  # a refusal still: its own fix, none of the run's
                f"checkpoint={ckpt}: calibrate's in-run runs of {spec.name} "
                f"({spec.total_bytes / 1e6:.3g} MB) do not fit the memory they give it, a share "
                f"of the model ({str(e).split(';')[0]}); calibrate on a larger checkpoint (e.g. "
                "python -m experiments.make_checkpoint model=mixtral-tiny) or without one"
            ) from None
    out["sources"]["duration"] = f"{time.perf_counter() - t0:.1f} s"
    return out


def _measure(
    spec: ModelSpec,
    model: Model,
    ckpt: str | None,
    dev: Any,
    disk_dir: Path,
    disk_mb: int,
    dtype: str | None = None,
) -> Measured:
    """Links, disk, compute tables and the per-op overhead, timed with the torch thread count
    the real executor runs them with."""
    threads_before = torch.get_num_threads()
    threads = cpu_compute_threads() if dev.type == "cpu" else threads_before
    if dev.type == "cpu":  # the allocator a CPU-only run uses (real.executor)
        cache_freed_memory()
    torch.set_num_threads(threads)
    try:
        h2d, d2h = measure_links(dev)
        if ckpt:  # the executor's own path on the model's unit sizes replaces the raw timings
            via_store = measure_store(ckpt, dev, dtype=dtype)
            disk, h2d = via_store["disk"], via_store["h2d"]
        else:
            disk = measure_disk(disk_dir, disk_mb)
        tables = measure_compute(spec, model, dev)
        overhead_s = measure_op_overhead(ckpt, dev, dtype=dtype)
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
    return Measured(h2d, d2h, disk, tables, cpu_tables, cpu_bw, overhead_s, threads)


def _compute_entry(
    tables: dict[str, list[list[float]]], mem_bw: float, overhead_s: float
) -> dict[str, Any]:
    """A compute device's profile: its peak (the largest expert op's flops over its time),
    memory bandwidth, per-op overhead and time tables."""
    expert = tables[str(OpKind.EXPERT)][-1]
    return {
        "tflops": round(expert[0] / expert[1] / 1e12, 6),
        "mem_bw_gbps": round(mem_bw, 3),
        "overhead_us": round(overhead_s * 1e6, 1),
        "time_tables": {
            k: [[float(f"{x:.6g}"), float(f"{y:.6g}")] for x, y in v] for k, v in tables.items()
        },
    }


def _profile(
    name: str,
    m: Measured,
    dev: Any,
    model_name: str,
    ckpt: str | None,
    disk_dir: Path,
    disk_mb: int,
) -> dict[str, Any]:
    """The profile's memory, compute and links, and the `sources` that say where each came
    from (the command, machine, date and commit first)."""
    mem_bw = m.cpu_bw if dev.type == "cpu" else 1000.0  # CPU pool: a memcpy is its bandwidth
    if dev.type == "cuda":
        _, total = torch.cuda.mem_get_info(dev)
        gpu_gb, gpu_name = total / 1e9 * 0.9, torch.cuda.get_device_name(dev)
    else:
        gpu_gb, gpu_name = _ram_bytes() / 1e9 * 0.25, "none (device pool = RAM)"
    compute = _compute_entry(m.tables, mem_bw, m.overhead_s)
    links = {"h2d": m.h2d, "d2h": m.d2h, "disk": m.disk, "disk_write": m.disk}
    return {
        "name": name,
        "memory_gb": {
            "gpu": round(gpu_gb, 3),
            "cpu": round(_ram_bytes() / 1e9 * 0.5, 3),
            "disk": round(shutil.disk_usage(disk_dir).free / 1e9 * 0.5, 3),
        },
        "gpu": compute,
        "cpu": (
            copy.deepcopy(compute)
            if dev.type == "cpu"
            else _compute_entry(m.cpu_tables, m.cpu_bw, m.overhead_s)
        ),
        # Every op, transfer or compute, also pays the executor's per-op overhead.
        "links": {
            link: {
                "gbps": round(x["gbps"], 4),
                "latency_us": round(x["latency_us"] + m.overhead_s * 1e6, 2),
            }
            for link, x in links.items()
        },
        "sources": _sources(m, dev, gpu_name, model_name, ckpt, disk_dir, disk_mb),
    }


def _sources(
    m: Measured,
    dev: Any,
    gpu_name: str,
    model_name: str,
    ckpt: str | None,
    disk_dir: Path,
    disk_mb: int,
) -> dict[str, str]:
    machine = (
        f"{platform.node()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, GPU: {gpu_name})"
    )
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    disk_note = (
        "O_DIRECT"
        if m.disk["direct"]
        else "buffered (O_DIRECT unsupported here: page-cache bandwidth)"
    )
    return {
        "calibration": f"python -m experiments.calibrate on {machine}, {date}, "
        f"commit {_git_commit()}",
        "model": f"compute tables of {model_name} "
        f"({ckpt or 'conf/model/mixtral-tiny, random weights'}) on {dev}"
        + (
            "; cpu: the same ops on the CPU (torch's default threads, as a GPU run's CPU ops), "
            "mem_bw_gbps from a host memcpy"
            if dev.type == "cuda"
            else ""
        ),
        "disk": (
            f"{ckpt}'s safetensors files: its units read with {disk_note} back "
            "to back in file order, fitted to latency + bytes/bandwidth"
            if ckpt
            else f"{disk_mb} MB in {disk_dir} read with {disk_note}, 64 KiB .. 16 MiB reads "
            "fitted to latency + bytes/bandwidth"
        ),
        "overhead": f"{m.overhead_s * 1e6:.0f} us per op: a chain of no-op copies through the real "
        "executor (compute overhead_us; added to every link's latency_us)",
        "threads": f"torch intra-op threads {m.threads} (the real executor's on this device)",
        "memory": "gpu: 25% of RAM (CPU device pool) or 90% of GPU memory; cpu: 50% of RAM; "
        "disk: half the free space",
    }


def _add_p2p(out: dict[str, Any], overhead_s: float) -> None:
    """The link a run on G processes moves tokens and replicas over (executor.distributed=true):
    gloo between 2 processes of this machine; 2 "GPUs", the processes it was measured between."""
    from experiments.common.dist_measure import measure_d2d

    d2d = measure_d2d()
    out["n_gpus"] = 2
    out["links"]["p2p"] = {
        "gbps": round(d2d["gbps"], 4),
        "latency_us": round(d2d["latency_us"] + overhead_s * 1e6, 2),
    }
    out["sources"]["p2p"] = (
        "gloo send/recv between 2 processes of this machine (what executor.distributed=true "
        "moves tokens and replica copies over), a ping-pong of 4 KiB .. 32 MiB fitted to "
        "latency + bytes/bandwidth by relative error; n_gpus 2: the processes measured"
    )


def _add_processes_in_run(out: dict[str, Any], ckpt: str, dtype: str | None = None) -> None:
    """What a G-process run's ops see, gloo's and the executor's work around them and the cores
    the processes share: 2-process runs on the checkpoint (`measure_processes_in_run`) replace
    the ping-pong's p2p link and give the profile's `processes` terms."""
    from experiments.common.dist_measure import (
        IN_RUN_PLANNER,
        IN_RUNS,
        measure_copy_share,
        measure_processes_in_run,
    )

    alone = dict(out["links"]["p2p"])
    seen = measure_processes_in_run(ckpt, out, dtype=dtype)
    if seen is None:
        return
    link = seen.link
    out["links"]["p2p"] = {
        "gbps": round(link.bandwidth_bytes_per_s / 1e9, 4),
        "latency_us": round(link.latency_s * 1e6, 2),
    }
    out["processes"] = {
        "gate_exchange_us": round(seen.gate_exchange_s * 1e6, 1),
        "compute_scale_by_kind": {k: round(x, 3) for k, x in seen.compute_scale.items()},
        "start_delay_us_by_kind": {k: round(x * 1e6, 1) for k, x in seen.start_delay_s.items()},
        "copy_share": round(measure_copy_share(), 3),
    }
    out["sources"]["p2p_in_run"] = (
        f"{link.latency_s * 1e6:.0f} us a transfer, {link.bandwidth_bytes_per_s / 1e9:.3f} "
        f"GB/s: what the transfers of {IN_RUNS} 2-process {IN_RUN_PLANNER} runs on the checkpoint "
        "took (latency: the mean of its combines beyond their bytes; rate: its replica "
        f"copies' net of it); the ping-pong alone gave {alone['latency_us']:g} us, "
        f"{alone['gbps']:g} GB/s"
    )
    out["sources"]["processes"] = (
        "the same runs: gate_exchange_us, the mean of their dispatches beyond a combine (a "
        "dispatch waits for its batch's routing from every rank); compute_scale_by_kind, "
        "each compute kind's time in them over this profile's cost for it alone (sums); "
        "start_delay_us_by_kind, the mean time each kind's ops started after they were ready; "
        "copy_share, 1 - a GEMM's time alone over its time while a thread of the same process "
        "moves 16 MB buffers to and from the other (experiments.common.dist_run."
        "measure_copy_share); "
        "applied to expert-parallel schedules whose G devices run as processes"
    )


def _add_in_run(
    out: dict[str, Any],
    ckpt: str,
    dev: Any,
    in_run_s: float,
    overhead_s: float,
    dtype: str | None = None,
) -> None:
    """The executor's cost around each compute op, and the links, measured in real runs."""
    extra, in_run = measure_in_run(ckpt, out, dev, in_run_s, dtype=dtype)
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


@dataclass
class ProfileName:
    name: str = "this-machine"  # the profile's name (and its file's, under conf/hardware/)


@dataclass
class Options:
    hardware: ProfileName = field(default_factory=ProfileName)
    checkpoint: str | None = None  # a checkpoint folder to time (default: a reduced Mixtral)
    executor: DtypeOption = field(default_factory=DtypeOption)  # the checkpoint's runs' dtype
    device: str | None = None  # cuda | cpu; null: cuda if available
    disk_dir: str = "runs/.calib"  # where the disk probe writes its file
    disk_mb: int = 256  # the disk probe's size
    in_run_s: float = 20.0  # seconds of real runs whose transfers measure the links in use
    out: str | None = None  # default conf/hardware/<hardware.name>.yaml


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130; the profile is written only once measured."""
    return int(until_interrupted(lambda: _app(argv)))


MEASURED = b"# Measured by experiments.calibrate"  # the first line of a profile calibrate wrote
# held (flock) by the calibrate measuring this machine; in the temp dir, so every checkout and
# user of the machine meets the same one
MEASURING_LOCK = Path(tempfile.gettempdir()) / "moepipe-calibrate.lock"


@contextmanager
def measuring_alone() -> Iterator[None]:
    """Hold the machine's calibrate lock while measuring and writing the profile: a second
    calibrate waits (saying so on stderr) until the first has written its profile. Two at once
    each measured the other's load (h2d 2.9 against 8.6 GB/s in one such pair here), and both
    wrote the same temporary file."""
    try:
        fd = os.open(MEASURING_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's lock file: still ours to wait on
        fd = os.open(MEASURING_LOCK, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            print(
                f"calibrate: another calibrate{holder} is measuring this machine; "
                "waiting for it to end, so that neither measures the other's load",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):  # a read-only lock file: no pid to tell
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _lock_holder(fd: int) -> str:
    """ " (pid N)" of the calibrate the lock file names, where that process is alive; "" where
    the file names none or one that has ended (a lock held by another program)."""
    try:
        pid = int(os.pread(fd, 32, 0).decode(errors="replace").strip())
        os.kill(pid, 0)  # PermissionError: alive, another user's
    except PermissionError:
        pass
    except (ValueError, OSError):  # no pid written, or its process gone
        return ""
    return f" (pid {pid})"


def _measured(path: Path) -> bool:
    """Does `path` start as a profile calibrate wrote (MEASURED)?"""
    with open(path, "rb") as f:
        return f.read(len(MEASURED)) == MEASURED


def _main(args: Options) -> int:
    opts = kv(args)
    scratch = Path(str(opts["disk_dir"] or ".")).expanduser()
    made = topmost_missing(scratch)
    try:
        return _calibrate_main(opts)
    finally:  # the disk probe's folder, where this made it: no empty folder left behind
        remove_empty(scratch, made)


def _calibrate_main(opts: dict[str, Any]) -> int:
    try:
        name = str(opts["hardware.name"])
        if not re.fullmatch(r"\w[\w.\-]*", name):  # a path (../x, a/b) would write elsewhere
            raise MoepipeError(
                f"hardware.name={name!r}: a profile's name is letters, digits, '_', '-' and '.' "
                "(it becomes conf/hardware/<name>.yaml and hardware=<name>); to write elsewhere "
                "pass out=FILE"
            )
        long_name_refused(name, "hardware.name", "conf/hardware/<name>.yaml")
        disk_mb = int(as_size_mb("disk_mb", opts["disk_mb"], at_least=1))  # and the free disk
        in_run_s = as_float(
            "in_run_s", opts["in_run_s"], at_least=0.0, at_most=MAX_IN_RUN_S, why=IN_RUN_WHY
        )
        resolve_device(opts["device"])
        _unread(opts)
        # every path is checked before the measuring, which its results would be lost after
        out = output_file(opts["out"] or ROOT / "conf" / "hardware" / f"{name}.yaml", "out")
        if out.suffix not in (".yaml", ".yml"):  # the other commands take hardware=FILE.yaml
            raise MoepipeError(
                f"out={out}: a profile is YAML, read as hardware=FILE.yaml; pass out=FILE.yaml"
            )
        if out.is_file() and not _measured(out):  # conf/hardware/tiny.yaml, a user's own
            given = f"out={out}" if opts["out"] else f"hardware.name={name}: {out}"
            raise MoepipeError(
                f"{given} is a file calibrate did not write (a profile's numbers of other "
                "sources), which this would replace; "
                + (
                    "pass out= another FILE.yaml"
                    if opts["out"]
                    else "choose another hardware.name, or pass out=FILE"
                )
            )
        _on_a_disk(opts)
        disk_dir = output_dir(str(opts["disk_dir"]), "disk_dir")
        free_mb = shutil.disk_usage(disk_dir).free // 2**20
        if not opts["checkpoint"] and free_mb < 2:  # no disk_mb fits: 1 was said to
            raise MoepipeError(
                f"disk_dir={disk_dir}: its disk has {free_mb} MB free, no room for the disk "
                "probe's file; free some space there or pass disk_dir= a folder on another disk"
            )
        if not opts["checkpoint"] and disk_mb > free_mb // 2:  # the disk probe's file
            raise MoepipeError(
                f"disk_mb={disk_mb}: the disk under disk_dir={disk_dir} has {free_mb} MB free; "
                f"the probe file may take half of it at most: pass disk_mb={max(free_mb // 2, 1)} "
                "or less"
            )
        with measuring_alone():
            hw = calibrate(
                name,
                opts["checkpoint"],
                opts["device"],
                disk_dir,
                disk_mb,
                in_run_s,
                run_dtype(opts["executor.dtype"]),
                plan_accepted,
            )
            replaced = out.is_file()  # an earlier measurement's, said so below
            header = f"{MEASURED.decode()}: {hw['sources']['calibration']}\n"
            tmp = staging_file(out)
            try:  # whole or not at all: a full disk or Ctrl-C leaves the previous profile
                tmp.write_text(header + yaml.safe_dump(hw, sort_keys=False, width=120))
                os.replace(tmp, out)
            except OSError as e:
                tmp.unlink(missing_ok=True)
                raise MoepipeError(cannot_write(f"out={out}", e)) from None
    except MoepipeError as e:
        say_line(e)
        return 2
    links = hw["links"]
    print(
        f"{'replaced the earlier profile' if replaced else 'wrote'} {out}: "
        f"disk {links['disk']['gbps']:.2f} GB/s, h2d {links['h2d']['gbps']:.2f} GB/s "
        f"+ {links['h2d']['latency_us']:.0f} us, "
        f"expert peak {hw['gpu']['tflops'] * 1e3:.1f} GFLOP/s"
    )
    return 0


def _unread(opts: Any) -> None:
    """Refuse an option given that this calibrate would not read: disk_mb sizes the probe file
    written without a checkpoint (with one the disk is timed reading its files), in_run_s the
    real runs made on a checkpoint."""
    default = Options()
    if opts["checkpoint"] and opts["disk_mb"] != default.disk_mb:
        raise MoepipeError(
            f"disk_mb={opts['disk_mb']}: with checkpoint= the disk is timed reading the "
            "checkpoint's files, and no probe file of disk_mb is written; leave disk_mb out"
        )
    dtype = run_dtype(opts["executor.dtype"])
    if not opts["checkpoint"] and dtype != "auto":
        raise MoepipeError(
            f"executor.dtype={dtype}: the compute dtype of a checkpoint's weights, and none is "
            "given (the reduced Mixtral is timed in its own dtype); pass checkpoint=DIR or "
            "leave executor.dtype out"
        )
    if not opts["checkpoint"] and opts["in_run_s"] != default.in_run_s:
        raise MoepipeError(
            f"in_run_s={opts['in_run_s']:g}: the seconds of real runs on a checkpoint, and none "
            "is given; pass checkpoint=DIR or leave in_run_s out"
        )


def _on_a_disk(opts: Any) -> None:
    """Refuse a disk probe on a filesystem in memory (tmpfs, /proc, ...): it would time memory
    and record it as the disk's bandwidth. With a checkpoint the disk is timed reading it."""
    key = "checkpoint" if opts["checkpoint"] else "disk_dir"
    path = str(opts[key] or "")
    kind = memory_filesystem(path) if path else None
    if kind:
        what = "a checkpoint" if opts["checkpoint"] else "a folder"
        raise MoepipeError(
            f"{key}={path} is on {kind}, a filesystem in memory: its reads would time memory as "
            f"the disk's bandwidth; pass {key}= {what} on the disk to model"
        )


_app = command("calibrate", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
