"""What a G-process run of this machine costs beyond its ops alone, measured for `calibrate`: the
link its transfers take (a gloo ping-pong), a replica copy's share of a process's compute, and
the compute scale, start delays and gate exchange seen in real distributed runs
(`measure_processes_in_run`). Each measurement runs its own processes (`dist_run._spawn`).

Usage:
    link = measure_d2d()                       # {"gbps", "latency_us"}
    seen = measure_processes_in_run(ckpt, hw)  # ProcessesSeen
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np

from core.types import COMPUTE_KINDS, OpKind, Resource
from experiments.common.dist_run import _as_rank, _spawn, run_distributed
from experiments.common.pipeline import RunSpec


def measure_d2d(
    sizes: tuple[int, ...] = (1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 23, 1 << 25),
    reps: int = 9,
    timeout_s: float = 60.0,
) -> dict[str, float]:
    """The link the G-process run's transfers take (gloo between 2 processes of this machine):
    the median one-way time of a ping-pong per size, 4 KiB (a dispatch of a few tokens) to
    32 MiB (a replica copy), fitted to latency + bytes / bandwidth -> {"gbps", "latency_us"}."""
    points = _spawn(2, _pingpong, (sizes, reps, timeout_s))
    bw, lat = fit_relative(points)
    return {"gbps": bw / 1e9, "latency_us": lat * 1e6}


def fit_relative(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(bytes, seconds) points fitted to seconds = latency + bytes / bandwidth by least squares
    of the relative error -> (bandwidth bytes/s, latency s). An unweighted fit is the large
    sizes' line, whose intercept is their noise (a few ms here), while most transfers of a run
    are small: each point counts by its own scale."""
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]  # rows scaled by 1 / y
    (lat, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
    if per_byte <= 0:  # latency-bound throughout: the bandwidth of the largest size alone
        per_byte = max(y[-1] - max(lat, 0.0), 1e-12) / x[-1]
    return float(1.0 / per_byte), max(float(lat), 0.0)


@dataclass
class ProcessesSeen:
    """What the ops of G-process runs took beyond the cost model's time for them alone."""

    link: Any  # core.hardware.LinkSpec: the p2p link (`p2p_seen`)
    gate_exchange_s: float  # a dispatch's wait for its batch's routing (`p2p_seen`)
    compute_scale: dict[
        str, float
    ]  # per compute kind: the runs' time over the model's (`scale_seen`)
    start_delay_s: dict[str, float]  # per op kind: ready to started (`delay_seen`)


IN_RUN_PLANNER = "eplb"  # a planner that copies replicas too, so that every kind of op shows
POOL_OF_MODEL = 1.3  # its device pool: every expert resident, and room for replicas
IN_RUNS = 3  # runs of it, their ops pooled


def measure_processes_in_run(
    ckpt: str,
    hw: dict[str, Any],
    runs: int = IN_RUNS,
    timeout_s: float = 120.0,
    dtype: str | None = None,
) -> ProcessesSeen | None:
    """What `runs` G=2 process runs of `IN_RUN_PLANNER` on the checkpoint's model see: 2
    batches of 4 sequences, 16-token prompts, 4 tokens, synthetic routing (seed 1), every
    expert resident in a device pool of `POOL_OF_MODEL` x the model, as validation runs the
    replication planners (not `hw`'s pool: with 25% of RAM, two runs minutes apart saw 11 ms
    a transfer and 0.10 GB/s copies, against 3.2 ms and 0.25 GB/s at 1.3 x). The p2p link
    and the gate exchange (`p2p_seen`), each compute kind's scale over `hw`'s cost model
    (`scale_seen`) and its ops' start after they were ready (`delay_seen`). None if they
    moved nothing. `dtype`: the runs' compute dtype (executor.dtype)."""
    from core.cost import CostModel
    from core.hardware import HardwareSpec
    from core.spec import RoutingConfig, Workload
    from core.types import RoutingSource
    from real.checkpoint import load_checkpoint

    model, _ = load_checkpoint(ckpt, dtype)
    d = dict(hw, n_gpus=2)
    d["memory_gb"] = dict(hw["memory_gb"], gpu=POOL_OF_MODEL * model.total_bytes / 1e9)
    hardware = HardwareSpec.from_dict(d)
    wl = Workload(
        batch_size=4,
        n_batches=2,
        prompt_len=16,
        gen_len=4,
        seed=1,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    spec = RunSpec(model, hardware, wl, IN_RUN_PLANNER, {"n_devices": 2})
    results = []
    for _ in range(runs):
        out = run_distributed(ckpt, spec, "replay", None, timeout_s, dtype=dtype)
        assert out is not None, "a spawned run returns rank 0's result"
        results.append(out.result)
    seen = p2p_seen([r.trace for r in results], hardware.link(Resource.P2P))
    if seen is None:
        return None
    cost = CostModel(hardware)
    pairs = [(r.trace, cost.durations(r.schedule)) for r in results]
    delays = delay_seen([(r.trace, r.schedule) for r in results])
    return ProcessesSeen(seen.link, seen.gate_exchange_s, scale_seen(pairs), delays)


def delay_seen(runs: list[tuple[Any, Any]]) -> dict[str, float]:
    """Per op kind (compute and transfer), the mean time its ops in runs' (trace, schedule)
    started after they were ready: after the last of their deps and of the op before them on
    their stream ended (what `core.bubbles` counts as `late`: the host's work between ops, a
    transfer thread's turn). Ops that started at once count, as 0."""
    late: dict[str, list[float]] = {}
    for tr, schedule in runs:
        n = len(schedule.ops)
        start, end = np.full(n, np.nan), np.full(n, np.nan)
        ids = tr["op_id"].to_numpy()
        start[ids], end[ids] = tr["start_s"].to_numpy(), tr["end_s"].to_numpy()
        prev: dict[str, int] = {}
        for op in schedule.ops:
            before = [*op.deps, *([prev[op.stream]] if op.stream in prev else [])]
            prev[op.stream] = op.id
            if op.kind == OpKind.FREE or np.isnan(start[op.id]):
                continue
            ready = max((end[d] for d in before if not np.isnan(end[d])), default=start[op.id])
            late.setdefault(str(op.kind), []).append(max(start[op.id] - ready, 0.0))
    return {k: float(np.mean(v)) for k, v in sorted(late.items())}


def scale_seen(runs: list[tuple[Any, np.ndarray]]) -> dict[str, float]:
    """Per compute kind, the time its ops took in runs' traces over the time the cost model
    gives them (each run's `CostModel.durations`, by op id): sums, not a median of ratios,
    for a run's makespan adds the slow ops up too (a rank descheduled while the other
    computes)."""
    took: dict[str, float] = {}
    model: dict[str, float] = {}
    for tr, predicted in runs:
        for kind, g in tr.groupby(tr["kind"].astype(str)):
            if OpKind(kind) not in COMPUTE_KINDS:
                continue
            took[kind] = took.get(kind, 0.0) + float((g["end_s"] - g["start_s"]).sum())
            model[kind] = model.get(kind, 0.0) + float(predicted[g["op_id"].to_numpy()].sum())
    return {k: took[k] / model[k] for k in sorted(took) if model[k] > 0}


@dataclass
class P2PSeen:
    link: Any  # core.hardware.LinkSpec
    gate_exchange_s: float


def p2p_seen(traces: list[Any], link: Any, large_bytes: int = 1 << 20) -> P2PSeen | None:
    """The p2p link (`core.hardware.LinkSpec`) and the gate exchange the transfers of G-process
    runs' traces saw, or None when they have none. Latency: the mean time of the small
    combines (results going back: nothing but the transfer) beyond their bytes at `link`'s
    bandwidth. Gate exchange: the mean time of the dispatches beyond that, for a dispatch
    moves its batch's tokens only once the batch's routing has reached every rank.
    Bandwidth: that of the large transfers (replica copies) net of the latency, else
    `link`'s. Means, not medians: a run's makespan adds the slow transfers up too. A
    transfer's time here holds what the executor does around gloo's (host copies, the pairs'
    rows), which a ping-pong does not."""
    from core.hardware import LinkSpec

    extra: dict[str, list[float]] = {str(OpKind.COMBINE): [], str(OpKind.DISPATCH): []}
    big_bytes = big_s = 0.0
    n_big = 0
    for tr in traces:
        t = tr[tr["resource"].astype(str).str.startswith("p2p") & (tr["bytes"] > 0)]
        dur = (t["end_s"] - t["start_s"]).to_numpy()
        nbytes = t["bytes"].to_numpy().astype(float)
        kind = t["kind"].astype(str).to_numpy()
        is_small = nbytes < large_bytes
        for k, xs in extra.items():
            sel = is_small & (kind == k)
            xs += list(dur[sel] - nbytes[sel] / link.bandwidth_bytes_per_s)
        # the rate from replica copies alone: a large dispatch, combine or all-reduce holds the
        # executor's work around gloo's (pairs' rows, a collective's rounds) in its time
        big = ~is_small & (kind == str(OpKind.LOAD))
        big_bytes += float(nbytes[big].sum())
        big_s += float(dur[big].sum())
        n_big += int(big.sum())
    combine, dispatch = extra[str(OpKind.COMBINE)], extra[str(OpKind.DISPATCH)]
    if not combine and not dispatch and not big_bytes:
        return None
    small = combine or dispatch  # no combine: the dispatches stand for the latency
    lat = max(float(np.mean(small)), 0.0) if small else link.latency_s
    gate = max(float(np.mean(dispatch)) - lat, 0.0) if combine and dispatch else 0.0
    net = big_s - n_big * lat
    bw = big_bytes / net if big_bytes and net > 0 else link.bandwidth_bytes_per_s
    return P2PSeen(LinkSpec(bw, lat), gate)


def _pingpong(
    rank: int, world: int, init: str, tmp: Path, sizes: tuple[int, ...], reps: int, timeout_s: float
) -> None:
    def run() -> list[tuple[float, float]]:
        import statistics

        import torch

        with _gloo(rank, world, init, timeout_s) as dist:
            points = []
            for n in sizes:
                buf, times = torch.zeros(n, dtype=torch.uint8), []
                for i in range(reps + 1):  # the first a warm-up
                    dist.barrier()
                    t0 = time.perf_counter()
                    _exchange(dist, buf, rank, None)
                    if i:
                        times.append((time.perf_counter() - t0) / 2)
                points.append((float(n), statistics.median(times)))
            return points

    _as_rank(rank, tmp, run)


def measure_copy_share(
    nbytes: int = 1 << 24, reps: int = 40, rounds: int = 5, timeout_s: float = 60.0
) -> float:
    """The share of a process's compute that a replica copy it sends or receives holds while
    it runs, on this machine's 2 processes (`processes.copy_share`): each rank times a GEMM
    alone and while a thread of its own moves `nbytes` buffers to and from the other rank over
    a gloo group of their own, as the executor's copies do; 1 - alone / beside, the median of
    `rounds` over both ranks. On a CPU-only machine a copy is a memcpy on the cores that
    compute; on a GPU the copy engines move it and the share is about 0."""
    return float(_spawn(2, _copy_contention, (nbytes, reps, rounds, timeout_s)))


def _copy_contention(
    rank: int,
    world: int,
    init: str,
    tmp: Path,
    nbytes: int,
    reps: int,
    rounds: int,
    timeout_s: float,
) -> None:
    def run() -> float:
        import statistics

        import torch

        from real.interpreter import cpu_compute_threads

        torch.set_num_threads(cpu_compute_threads())  # the executor's compute threads
        with _gloo(rank, world, init, timeout_s) as dist:
            group = dist.new_group(backend="gloo")  # the copies' own connection
            a, b = torch.randn(64, 2048), torch.randn(2048, 2048)  # an expert GEMM's shape

            def gemm_s() -> float:
                t0 = time.perf_counter()
                for _ in range(reps):
                    torch.mm(a, b)
                return (time.perf_counter() - t0) / reps

            buf = torch.zeros(nbytes, dtype=torch.uint8)
            shares = []
            for _ in range(rounds):
                dist.barrier()
                alone = gemm_s()
                # enough exchanges on both ranks to outlast the timing beside them: rank 0's
                # count, from an exchange timed first, is every rank's
                t0 = time.perf_counter()
                _exchange(dist, buf, rank, group)
                n = torch.tensor([int(3 * reps * alone / (time.perf_counter() - t0)) + 2])
                dist.broadcast(n, 0)
                failed: list[BaseException] = []

                def move(k: int = int(n), failed: list[BaseException] = failed) -> None:
                    try:
                        for _ in range(k):
                            _exchange(dist, buf, rank, group)
                    except BaseException as e:  # noqa: BLE001 - raised below, in this rank's main
                        failed.append(e)

                mover = threading.Thread(target=move)
                mover.start()
                beside = gemm_s()
                mover.join()
                if failed:  # a peer gone: the rank's one line (`_as_rank`), not a thread's trace
                    raise failed[0]
                shares.append(max(0.0, 1.0 - alone / beside))
            both = [torch.tensor(shares) for _ in range(world)]
            dist.all_gather(both, torch.tensor(shares))
            return statistics.median(float(x) for t in both for x in t)

    _as_rank(rank, tmp, run)


@contextmanager
def _gloo(rank: int, world: int, init: str, timeout_s: float) -> Iterator[Any]:
    """A spawned rank's gloo process group for a measurement: torch.distributed, in it."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _exchange(dist: Any, buf: Any, rank: int, group: Any) -> None:
    """One buffer to the other rank and one back (a copy each way; `group` None: the default)."""
    if rank == 0:
        dist.send(buf, 1, group=group)
        dist.recv(buf, 1, group=group)
    else:
        dist.recv(buf, 0, group=group)
        dist.send(buf, 0, group=group)
