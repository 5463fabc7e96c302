"""Real-scale benchmark: moepipe Klotski against Hugging Face accelerate on a random-weight
checkpoint of a model's real shape, at a memory budget well below the model's size.

Prints each system's tok/s, the simulator's prediction, the physical bound per resource and last
`moepipe / best peer`, `moepipe / physical bound` and the simulator's error. Writes the checkpoint
(out_dir/<model>[-L<n_layers>]/) and, when calibrating, conf/hardware/<hardware>.yaml. Details:
docs/commands.md#bench_real; results: docs/results/bench_real.md.

Usage:
    python -m experiments.bench.real model=NAME budget_gb=G [gen_len=4] [out_dir=runs/bench_real]
        [n_layers=L] [batch_size=8] [prompt_len=16] [hardware=this-machine] [peers=best|all|none]
        [cold=once|pass] [room=cgroup|tiers] [n=0] [routing=auto|trace|synthetic]
        [trace_dir=../shared/traces] [calib_layers=6] [peer_limit=3]
e.g. model=olmoe-1b-7b budget_gb=4; model=deepseek-v2-lite budget_gb=8 (its routing replayed
from the ESFT trace); model=deepseek-v2-lite budget_gb=4 n_layers=8 (a cut of its 27 layers,
stated in the output).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from core.args import (
    MAX_SIZE_MB,
    MAX_TOKENS,
    PEER_LIMIT,
    PEER_LIMIT_WHY,
    TOKENS_WHY,
    as_float,
    as_int,
    as_size_mb,
)
from core.errors import MoepipeError, did_you_mean
from core.files import staging_file
from experiments.common import peers as pe
from experiments.common.app import command, kv
from experiments.common.bench_memory import check_trace_routing, checked_room
from experiments.common.cli import exit_command, os_error_fix
from experiments.common.held_warnings import plan_accepted
from experiments.common.option_names import BENCH_OPTIONS, named_as
from experiments.common.schema import BenchAccelerateOptions, BenchRealOptions
from real.checkpoint import reduced_spec

PEERS = ("best", "all", "none")
DEVICE_SHARE = 0.8  # of the budget: the device pool; the rest is host RAM
SHARD_BYTES = 1 << 30  # checkpoint shards: one in memory at a time while writing
HEADERS_SHARE = 0.01  # of the tensors' bytes: safetensors headers and config.json stay under it
# left free on the disk past the checkpoint: a disk filled to its last block fails every later
# write there, the bench's own and other processes'
DISK_HEADROOM_BYTES = 64 << 20


def _progress(msg: str) -> None:
    print(f"[bench_real {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the checkpoint --------------------------------------------------------------------------


def ensure_checkpoint(spec: Any, out: Path) -> Path:
    """`out` holding a seeded random checkpoint of `spec`: reused when it loads (headers, sizes,
    shapes and dtypes as config.json says), else written shard by shard into a temporary folder
    beside it that becomes `out` only when whole. A disk without room for it: a MoepipeError
    before anything is written."""
    from core.hf_config import spec_to_hf_config
    from real.checkpoint import hf_config, load_checkpoint
    from real.checkpoint_write import foreign_checkpoint

    if out.is_dir():
        try:
            load_checkpoint(out)
            # config.json as this bench writes it for `spec`: equal sizes alone reused a
            # checkpoint of another rope_theta or rms_norm_eps (conf/model edited between runs)
            if dict(hf_config(out).fields) == json.loads(json.dumps(spec_to_hf_config(spec))):
                _progress(f"reusing checkpoint {out}")
                return out
            why = "holds another model (its config.json differs)"
        except MoepipeError as e:
            why = f"unusable ({e})"
        foreign = foreign_checkpoint(out)  # a downloaded model's: not the bench's to replace
        if foreign:
            raise MoepipeError(
                f"out_dir={out.parent}: {out} holds a checkpoint the bench did not write "
                f"({foreign} has no mark of make_checkpoint's), which writing its own would "
                "delete; pass out_dir= another folder"
            )
        _progress(f"{out} {why}; writing it again")
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_disk_room(spec, out)
    tmp = staging_file(out)  # a dead writer's removed first
    try:
        _write(spec, tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written left behind
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise MoepipeError(
                f"out_dir={out.parent}: the disk filled up while the "
                f"{spec.total_bytes / 1e9:.3g} GB "
                "checkpoint was written (something else wrote to it meanwhile); the partial "
                "checkpoint is removed; free disk space or pass out_dir= on a larger disk"
            ) from None
        if isinstance(e, OSError):  # named by out_dir, not by the hidden folder it wrote into
            raise MoepipeError(
                f"out_dir={out.parent}: cannot write the checkpoint ({e.strerror or e}); the "
                f"partial checkpoint is removed; {os_error_fix(e)}"
            ) from None
        raise
    return out


def _check_disk_room(spec: Any, out: Path) -> None:
    """A MoepipeError, naming each part of the room needed, where the disk of `out` lacks it:
    the checkpoint's tensors, its headers and config.json (under HEADERS_SHARE of them), and
    DISK_HEADROOM_BYTES left free past them. A checkpoint at `out` now does not count as free:
    it stays until the new one, written beside it, is whole."""
    tensors = spec.total_bytes
    headers = int(tensors * HEADERS_SHARE)
    need = tensors + headers + DISK_HEADROOM_BYTES
    free = shutil.disk_usage(out.parent).free
    if free >= need:
        return
    old = _size_of(out)
    fix = (
        f"remove {out} ({old / 1e9:.3g} GB, kept until the new checkpoint is whole), "
        if old and free + old >= need
        else ""
    )
    raise MoepipeError(
        f"out_dir={out.parent}: {free / 1e9:.3g} GB free, writing the checkpoint needs "
        f"{need / 1e9:.3g} GB: {tensors / 1e9:.3g} GB of tensors + {headers / 1e9:.3g} GB for "
        f"its headers and config.json + {DISK_HEADROOM_BYTES / 1e9:.3g} GB "
        f"({DISK_HEADROOM_BYTES >> 20} MiB) left free past it; {fix}free disk space or pass "
        "out_dir= on a larger disk"
    )


def _size_of(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.is_dir() else 0


def _write(spec: Any, out: Path) -> None:
    """config.json and seeded random weights (`write_checkpoint`'s, seed 0), one shard of
    SHARD_BYTES in memory at a time, with progress."""
    from real.checkpoint_write import write_checkpoint

    def progress(_: Any, written: int) -> None:
        _progress(f"checkpoint {written / 1e9:.1f} / {spec.total_bytes / 1e9:.1f} GB written")

    write_checkpoint(spec, out, shard_bytes=SHARD_BYTES, progress=progress)


# ---- the bound and the prediction ------------------------------------------------------------


def physical_bound(schedule: Any, hw: Any) -> dict[str, tuple[float, str]]:
    """Per resource of the schedule: (seconds, how) = bytes over the link's calibrated bandwidth,
    or flops over the compute device's calibrated peak (no latencies, no per-op overheads); and
    per compute device its ops' kernels at their calibrated times (time tables, else roofline),
    still without per-op overheads: where weights stream through RAM (attention, the head) a
    kernel runs far below the matmul peak, which flops over peak alone would not show."""
    from core.cost import CostModel
    from core.types import COMPUTE_KINDS, OpKind, Resource

    cost = CostModel(hw)
    moved: dict[Resource, float] = {}
    flops: dict[Resource, float] = {}
    kernels: dict[Resource, float] = {}
    for op in schedule.ops:
        res = schedule.streams[op.stream].resource
        if op.kind == OpKind.FREE or res == Resource.NONE:
            continue
        if op.kind in COMPUTE_KINDS:
            flops[res] = flops.get(res, 0.0) + float(op.flops)
            spec = hw.gpu if res == Resource.GPU else hw.cpu
            overhead = spec.kind_overhead_s.get(str(op.kind), spec.kernel_overhead_s)
            took = cost.compute_s(res, op.kind, op.flops, op.touch_bytes) - overhead
            kernels[res] = kernels.get(res, 0.0) + took
        else:
            moved[res] = moved.get(res, 0.0) + float(op.nbytes)
    out: dict[str, tuple[float, str]] = {}
    for res, b in moved.items():
        bw = hw.link(res).bandwidth_bytes_per_s
        out[str(res)] = (b / bw, f"{b / 1e9:.2f} GB / {bw / 1e9:.2f} GB/s")
    for res, f in flops.items():
        peak = (hw.gpu if res == Resource.GPU else hw.cpu).peak_flops_per_s
        out[f"{res} compute"] = (f / peak, f"{f / 1e12:.3f} TFLOP / {peak / 1e12:.3f} TFLOP/s")
    for res, k in kernels.items():
        out[f"{res} kernels"] = (k, "calibrated kernel times, no per-op overhead")
    return out


# ---- the command -----------------------------------------------------------------------------


def run(opts: BenchRealOptions) -> list[str]:
    """The benchmark's lines (module doc); progress on stderr; warnings about the bench held
    until its plan is accepted, as a run's (`held_warnings`)."""
    return _run(opts)


def _run(opts: BenchRealOptions) -> list[str]:
    from experiments.common.pipeline import simulate_run
    from experiments.common.real_run import checkpoint_files, unchanged_since

    spec, budget, peers, cold = _checked(opts)
    over = opts.n_layers is not None
    name = f"{spec.name}{f'-L{spec.n_layers}' if over else ''}"
    ckpt = ensure_checkpoint(spec, Path(opts.out_dir) / name)
    files = checkpoint_files(ckpt)  # every system's child runs this one checkpoint
    _calibrate_if_missing(opts, spec, ckpt)
    bench = BenchAccelerateOptions(
        checkpoint=str(ckpt),
        hardware=opts.hardware,
        gpu_frac=budget * DEVICE_SHARE / spec.total_bytes,
        cpu_frac=budget * (1 - DEVICE_SHARE) / spec.total_bytes,
        batch_size=opts.batch_size,
        n_batches=1,
        prompt_len=opts.prompt_len,
        gen_len=opts.gen_len,
        cold=cold,
        slack_mb=opts.slack_mb,
        peer_limit=opts.peer_limit,
        room=opts.room.lower(),
        klotski_n=opts.n,
        routing=opts.routing.lower(),
        trace_dir=opts.trace_dir,
        repeats=1,  # at this scale a run lasts minutes: its spread is small beside it
    )
    bopts = kv(bench)
    _, budget_hw = pe.run_spec(bopts)
    room = pe.measure_room(bopts, budget_hw, peers != "none")
    bopts = room.options(bopts)
    run_spec, hw = pe.run_spec(bopts)  # moepipe's side: the simulator plans its child's tiers
    _progress("simulating the same run")
    sim = simulate_run(run_spec)
    plan_accepted()  # the warnings held (held_warnings), then the rest at once
    if peers == "none":
        rows, header = _moepipe_only(bopts, run_spec)
    else:
        rows, header = pe.compare(bopts, run_spec, hw, room, batch_by_batch=peers == "all")
    unchanged_since(ckpt, files)  # a rewrite between two systems' runs: not one checkpoint
    cut = f", n_layers cut to {spec.n_layers}" if over else ""
    lines = [
        f"{name}: {spec.total_bytes / 1e9:.2f} GB checkpoint{cut} at {ckpt} "
        f"(disk footprint {_size_of(ckpt) / spec.total_bytes:.3f}x the model)",
        *_budget_lines(spec, budget, budget_hw),
        f"routing: {sim.summary['routing']}",
        _n_line(room.n_plan or sim.schedule.meta.get("n_plan", {})),
        *header[1:],
        *_table(rows),
    ]
    return lines + _verdict(rows, sim, physical_bound(sim.schedule, hw), opts.batch_size, peers)


BUDGET_WHY = "a budget is in (0, 1024] GB, 1 TiB: past any one machine"


def _checked(opts: BenchRealOptions) -> tuple[Any, float, str, str]:
    """(the model's spec, the budget in bytes, peers, cold), the options' ranges checked and the
    budget against one layer's working set and the planner's own fit check (where the hardware
    is calibrated already), before anything is written."""
    budget = (
        as_float(
            "budget_gb", opts.budget_gb, positive=True, at_most=MAX_SIZE_MB / 1024, why=BUDGET_WHY
        )
        * 1e9
    )
    for key in ("gen_len", "batch_size", "prompt_len"):
        as_int(key, getattr(opts, key), at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
    as_size_mb("slack_mb", opts.slack_mb)
    as_float("peer_limit", opts.peer_limit, at_least=0.0, at_most=PEER_LIMIT, why=PEER_LIMIT_WHY)
    as_int("n", opts.n, at_least=0)
    as_int("calib_layers", opts.calib_layers, at_least=1)
    pe.checked_routing(opts.routing)
    peers, cold = opts.peers.lower(), opts.cold.lower()
    if peers not in PEERS:
        raise MoepipeError(
            f"peers={opts.peers!r} unknown; {did_you_mean(opts.peers, PEERS)}"
            f"valid: {', '.join(PEERS)}"
        )
    if cold not in ("once", "pass"):
        raise MoepipeError(
            f"cold={opts.cold!r} unknown; {did_you_mean(opts.cold, ('once', 'pass'))}"
            "valid: once, pass"
        )
    checked_room(opts.room, opts.cold)
    over: dict[str, Any] = {}
    if opts.n_layers is not None:
        over["n_layers"] = as_int("n_layers", opts.n_layers, at_least=1)
        layers = reduced_spec(opts.model).n_layers
        if over["n_layers"] > layers:
            raise MoepipeError(
                f"n_layers={opts.n_layers}: {opts.model} has {layers} layers; n_layers cuts it "
                f"to its first n: pass n_layers=1 to {layers}"
            )
    spec = reduced_spec(opts.model, **over)
    if budget >= spec.total_bytes:
        raise MoepipeError(
            f"budget_gb={budget / 1e9:g}: {spec.name} ({spec.total_bytes / 1e9:.3g} GB) fits in "
            "it whole, so nothing is offloaded; this bench compares offloading: choose a budget "
            "below the model's size"
        )
    check_trace_routing(opts.routing, spec)  # before the calibration and the checkpoint
    working = _layer_working_set(spec)
    if budget * DEVICE_SHARE < working:
        raise MoepipeError(
            f"budget_gb={budget / 1e9:g}: its device pool ({DEVICE_SHARE:.0%}, "
            f"{budget * DEVICE_SHARE / 1e9:.3g} GB) is below one layer's working set of "
            f"{working / 1e9:.3g} GB (embedding, head, a layer's attention, gate and top-k "
            f"experts); raise budget_gb to at least {working / DEVICE_SHARE / 1e9:.3g}"
        )
    _fits(opts, spec, budget)
    return spec, budget, peers, cold


def _fits(opts: BenchRealOptions, spec: Any, budget: float) -> None:
    """The planner's own fit check, where conf/hardware/<hardware>.yaml exists already."""
    from core.errors import CapacityError
    from core.spec import RoutingConfig, Workload
    from experiments.common.hardware import load_hardware
    from experiments.common.pipeline import RunSpec, resolve_n_batches

    if not _profile_exists(opts.hardware):
        return
    early = load_hardware(
        opts.hardware,
        spec.total_bytes,
        budget * DEVICE_SHARE / spec.total_bytes,
        budget * (1 - DEVICE_SHARE) / spec.total_bytes,
    )
    wl = Workload(
        batch_size=opts.batch_size,
        n_batches=1,
        prompt_len=opts.prompt_len,
        gen_len=opts.gen_len,
        routing=RoutingConfig(source=opts.routing.lower(), trace_dir=opts.trace_dir),
    )
    try:
        resolve_n_batches(
            RunSpec(spec, early, wl, "klotski", {"n": opts.n, "real_activations": True})
        )
    except CapacityError as e:
        # e names its fixes, as this bench's options (OWN_NAMES): each named once; a refusal
        # still, said alone (held_warnings)
        raise CapacityError(
            f"budget_gb={budget / 1e9:g}: Klotski's plan does not fit it: {e}"
        ) from None


def _calibrate_if_missing(opts: BenchRealOptions, spec: Any, ckpt: Path) -> None:
    """conf/hardware/<hardware>.yaml measured (experiments.calibrate) when missing, on a cut of
    the model to its first `calib_layers` layers that links `ckpt`'s shards (no second copy):
    the same tensors' shapes for the compute tables, while calibrate's small runs, which hold
    60% of their checkpoint in the device pool, stay a few GB whatever the model's size."""
    hardware = opts.hardware
    if _profile_exists(hardware):
        return
    layers = min(opts.calib_layers, spec.n_layers)
    cut = ckpt.parent / ".calib-cut"
    try:  # the profile, once written, needs no checkpoint: the cut goes on every way out
        linked_cut(ckpt, reduced_spec(opts.model, n_layers=layers), cut)
        os.sync()  # the checkpoint's dirty pages written back: the disk is measured quiet
        _progress(f"no hardware profile {hardware}: calibrating on {cut} (first {layers} layers)")
        cmd = [sys.executable, "-m", "experiments.calibrate", f"hardware.name={hardware}"]
        why = _run_child([*cmd, f"checkpoint={cut}"])
        if why:
            raise MoepipeError(
                f"hardware={hardware}: calibrating it failed ({why}); run this bench again, or "
                f"python -m experiments.calibrate hardware.name={hardware} checkpoint={ckpt}"
            )
    finally:
        shutil.rmtree(cut, ignore_errors=True)


def _run_child(cmd: list[str]) -> str:
    """`cmd` run to its end, its stderr relayed but for its `error: ` line (`pe.relay`), which
    is returned (its exit status where it said none; empty where it succeeded): the bench's
    own line says it, not a second error line before it."""
    errors: list[str] = []
    with subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, preexec_fn=pe.ignore_ctrl_c
    ) as proc:
        try:
            pe.relay(proc.stderr, errors)
            proc.wait()
        except BaseException:  # Ctrl-C is the bench's: the child (which ignores it) goes too
            proc.kill()
            raise
    if not proc.returncode:
        return ""
    return errors[-1] if errors else f"exit status {proc.returncode}"


def _profile_exists(hardware: str) -> bool:
    """Whether conf/hardware/<hardware>.yaml (or the YAML `hardware` names) is there."""
    from experiments.common.hardware import hardware_path

    try:
        return hardware_path(hardware).is_file()
    except MoepipeError:  # hardware_path refuses a missing profile
        return False


def linked_cut(ckpt: Path, cut: Any, out: Path) -> Path:
    """`out` (replaced): the checkpoint of `cut` (a model whose first layers are `ckpt`'s),
    its config.json and index written, its shards symbolic links to `ckpt`'s that hold them."""
    from core.hf_config import spec_to_hf_config
    from real.checkpoint import INDEX_FILE, load_checkpoint, unit_layout

    _, index = load_checkpoint(ckpt)
    names = [ts.hf_name for tensors in unit_layout(cut).values() for ts in tensors.values()]
    weight_map = {n: Path(index[n].file).name for n in names}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for f in sorted(set(weight_map.values())):
        (out / f).symlink_to((ckpt / f).resolve())
    total = sum(index[n].nbytes for n in names)
    meta = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(meta, indent=2))
    (out / "config.json").write_text(json.dumps(spec_to_hf_config(cut), indent=2))
    load_checkpoint(out)  # the cut checked as any checkpoint is
    return out


def _n_line(plan: dict[str, Any]) -> str:
    """How Klotski's n was set: by its n-planner (and what bound it) or by hand."""
    if not plan:
        return "klotski n: not recorded"
    how = "its n-planner's choice" if plan.get("n_auto") else "set by hand (n=)"
    holds = "hold" if plan.get("inequalities_hold") else "do not all hold"
    return f"klotski n={plan.get('n')}: {how}; binding: {plan.get('binding')}; (4)-(7) {holds}"


def _budget_lines(spec: Any, budget: float, hw: Any) -> list[str]:
    from core.types import Tier

    return [
        f"budget {budget / 1e9:g} GB: device pool {hw.memory_bytes[Tier.GPU] / 1e9:.3f} GB + host "
        f"{hw.memory_bytes[Tier.CPU] / 1e9:.3f} GB; the rest ({1 - budget / spec.total_bytes:.0%}"
        ") on disk"
    ]


def _verdict(
    rows: list[Any], sim: Any, bound: dict[str, tuple[float, str]], batch: int, peers: str
) -> list[str]:
    """The simulator's row, the physical bound per resource, and the last lines: moepipe over
    the best peer, over the bound, and the simulator's error."""
    ours = rows[0]
    sim_s = sim.summary["makespan_s"]
    lines = [
        f"{'simulator (same schedule)':40s} {batch:5d} {sim.summary['throughput_tok_s']:8.2f} "
        f"{sim_s:7.2f}",
        "physical bound of Klotski's schedule, per resource:",
        *(f"  {r:14s} {s:8.2f} s  ({how})" for r, (s, how) in bound.items()),
    ]
    bound_s = max(s for s, _ in bound.values())
    binding = max(bound, key=lambda r: bound[r][0])
    lines.append(f"  {'max':14s} {bound_s:8.2f} s  ({binding})")
    lines += _peer_over_bound(rows, bound_s)
    if ours.dag_efficiency is not None:
        lines.append(f"moepipe dag_efficiency: {ours.dag_efficiency:.3f}")
    lines += pe.format_rows(rows)[len(_table(rows)) :]  # `moepipe / best peer`, if a peer ran
    if ours.seconds:
        lines.append(
            f"moepipe / physical bound: {ours.seconds / bound_s:.2f}x "
            f"(makespan {ours.seconds:.2f} s, bound {bound_s:.2f} s)"
        )
        lines.append(
            f"simulator error: {(sim_s - ours.seconds) / ours.seconds:+.1%} "
            f"(predicted {sim_s:.2f} s, measured {ours.seconds:.2f} s)"
        )
    return lines


def _peer_over_bound(rows: list[Any], bound_s: float) -> list[str]:
    """The best peer's time over the same bound: where moepipe is far from the bound, whether
    the peer is as far (the resource binds both) or not (moepipe leaves time unused)."""
    peers = [r for r in rows if not r.system.startswith("moepipe") and r.tok_s_at_most]
    if not peers or bound_s <= 0:
        return []
    best = max(peers, key=lambda r: r.tok_s_at_most or 0.0)
    if best.seconds:
        return [
            f"best peer / physical bound: {best.seconds / bound_s:.2f}x ({best.system}, "
            f"{best.seconds:.2f} s)"
        ]
    return [  # stopped at its time limit: it would have taken longer
        f"best peer / physical bound: >= {best.stopped_s / bound_s:.2f}x ({best.system}, "
        f"stopped at {best.stopped_s:.0f} s)"
    ]


def _table(rows: list[Any]) -> list[str]:
    """The rows' table without the `moepipe / best peer` line format_rows ends with when a
    peer ran."""
    out = pe.format_rows(rows)
    return out[:-1] if out[-1].startswith("moepipe / best peer") else out


def _moepipe_only(bopts: dict[str, Any], run_spec: Any) -> tuple[list[Any], list[str]]:
    got, peak, why = pe.run_side("moepipe", bopts, None)
    if got is None:
        raise pe.side_failed("moepipe klotski", why)
    row = pe.Row(
        f"moepipe klotski (n={got['n_batches']})",
        run_spec.workload.batch_size,
        got["tok_s"],
        got["seconds"],
        got["peak_rss_bytes"],
        peak,
        dag_efficiency=got.get("dag_efficiency"),
    )
    return [row], ["", "no memory cgroup (peers=none)"]


def _layer_working_set(spec: Any) -> int:
    """Bytes the device pool must hold at once for one layer: the embedding and head, and the
    largest layer's attention, gate, shared FFN and top-k experts."""
    from core.types import Tensor
    from real.checkpoint import unit_layout
    from real.store import round_up

    per: dict[tuple[Any, int], int] = {}
    for unit, tensors in unit_layout(spec).items():
        b = sum(spec.dtype_bytes * _numel(ts.shape) for ts in tensors.values())
        key = (unit.kind, unit.layer)
        per[key] = max(per.get(key, 0), round_up(b, 4096))
    fixed = per.get((Tensor.EMBED, -1), 0) + per.get((Tensor.HEAD, -1), 0)
    layers = {layer for _, layer in per if layer >= 0}
    most = max(
        (
            per.get((Tensor.ATTENTION, i), 0)
            + per.get((Tensor.GATE, i), 0)
            + per.get((Tensor.FFN, i), 0)
            + spec.top_k * per.get((Tensor.EXPERT, i), 0)
            for i in layers
        ),
        default=0,
    )
    return fixed + most


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# what the shared bench code (a run's keys, experiments.bench.accelerate's options, which its
# child processes take) calls this bench's options
OWN_NAMES = {
    "hardware.memory_gb.gpu or hardware.memory_gb.cpu": "budget_gb",  # before each alone
    "gpu_frac or cpu_frac": "budget_gb",  # the same, from a child's line
    **BENCH_OPTIONS,
    "planner.params.n": "n",
    "workload.n_batches": "n",
    "klotski_n": "n",
    "n_batches": "n",  # the children's, which the bench sets to n
    "hardware.memory_gb.gpu": "budget_gb",  # its device pool is a share of the budget
    "gpu_frac": "budget_gb",
    "hardware.memory_gb.cpu": "budget_gb",  # and its host tier the rest of it
    "cpu_frac": "budget_gb",
}


def _main(opts: BenchRealOptions) -> int:
    with named_as(OWN_NAMES):
        print("\n".join(run(opts)))
    return 0


main = command("bench_real", BenchRealOptions, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
