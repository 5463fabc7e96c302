"""Cost model: how long an op takes on a given hardware.

Transfers take `bytes / bandwidth + latency`; compute takes the roofline
`max(flops / peak, touch_bytes / memory_bandwidth)`, or a calibrated (flops -> seconds) table
when the hardware profile has one for that op kind, divided by the stream's `share` of the
device (1, or 1/G for a lane holding 1/G of a GPU's SMs), plus the per-op overhead (a
calibrated table times the kernels alone; the overhead is what running one op costs on top). It
lives in core (not sim/) because planners need it too: Klotski's n-planner solves its inequalities
with it.

An expert-parallel schedule whose G devices run as processes of one machine (not lanes) also
pays the hardware's `processes` terms: each compute op its kind's `compute_scale`, each op starts
its kind's `start_delay` after it is ready (`start_delays`), each dispatch pays the gate
exchange (`as_processes`).

Streams in a shared pool (CUDA streams on one GPU's SMs) split an op into its overhead (launch,
on its stream, no SMs) and its work (the seconds it takes at the whole GPU), run by the
simulator at a varying share of the GPU of at most `cap`: what an op of `width` thread blocks
can fill (`pool_parts`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

import numpy as np

from core.hardware import ComputeSpec, HardwareSpec
from core.schedule import Op, Schedule
from core.types import COMPUTE_KINDS, TRANSFER_KINDS, OpKind, Resource

# A GEMM's output tile per thread block: CUTLASS's and DeepGEMM's common 128 x 128 (DeepGEMM also
# runs 64-row tiles for few tokens; 128 is the conservative count for them).
TILE = 128


def gemm_blocks(rows: Iterable[int], cols: int) -> int:
    """Thread blocks of a grouped GEMM with `cols` output columns: each group's (an expert's)
    ceil(rows / TILE) x ceil(cols / TILE) output tiles; groups with no rows launch none."""
    return sum(-(-int(r) // TILE) for r in rows if r > 0) * -(-cols // TILE)


def as_processes(schedule: Schedule) -> bool:
    """Do the schedule's devices run as G > 1 processes (devices of their own, not lanes of one
    GPU), whose ops pay the hardware's `processes` terms?"""
    ep = schedule.ep
    return ep is not None and not ep.lanes and ep.n_devices > 1


class CostModel:
    def __init__(self, hardware: HardwareSpec) -> None:
        self.hw = hardware

    def start_delays(self, schedule: Schedule) -> np.ndarray:
        """Per op, how long after it is ready it starts: its kind's `processes.start_delay` on
        G processes (the host's work between ops, a transfer thread's turn), else 0."""
        out = np.zeros(len(schedule.ops))
        delays = self.hw.processes.start_delay_s
        if not delays or not as_processes(schedule):
            return out
        kinds = schedule.columns()["kind"]
        for ki, kind in enumerate(OpKind):
            if kind != OpKind.FREE and delays.get(str(kind)):
                out[kinds == ki] = delays[str(kind)]
        return out

    def gate_exchange_s(self, schedule: Schedule) -> float:
        """What a dispatch waits beyond its transfer: the batch's routing reaching every rank."""
        return self.hw.processes.gate_exchange_s if as_processes(schedule) else 0.0

    def overhead_s(self, device: Resource, kind: OpKind) -> float:
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        return spec.kind_overhead_s.get(str(kind), spec.kernel_overhead_s)

    def cap(self, device: Resource, flops: float, touch_bytes: float, width: int) -> float:
        """The largest share of the device an op of `width` thread blocks can use: its roofline
        at the whole device over its roofline alone, where each block holds one SM (compute:
        width / sms of the peak) and draws at most one SM's bandwidth (memory). 1 where width is
        0 (fills the device) or the device's SM count is unknown."""
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        f, m = flops / spec.peak_flops_per_s, touch_bytes / spec.mem_bw_bytes_per_s
        if width <= 0 or spec.sms <= 0 or max(f, m) <= 0:
            return 1.0
        sm_bw = spec.sm_mem_bw_bytes_per_s or spec.mem_bw_bytes_per_s / spec.sms
        c_f = min(1.0, width / spec.sms)
        c_m = min(1.0, width * sm_bw / spec.mem_bw_bytes_per_s)
        return max(f, m) / max(f / c_f, m / c_m)

    def cap_vec(
        self, device: Resource, flops: np.ndarray, touch: np.ndarray, width: np.ndarray
    ) -> np.ndarray:
        """`cap` of many ops on one device at once."""
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        f, m = flops / spec.peak_flops_per_s, touch / spec.mem_bw_bytes_per_s
        whole = (width <= 0) | (spec.sms <= 0) | (np.maximum(f, m) <= 0)
        sm_bw = (
            spec.sm_mem_bw_bytes_per_s or spec.mem_bw_bytes_per_s / spec.sms if spec.sms else 0.0
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            c_f = np.minimum(1.0, width / spec.sms)
            c_m = np.minimum(1.0, width * sm_bw / spec.mem_bw_bytes_per_s)
            part = np.maximum(f, m) / np.maximum(f / c_f, m / c_m)
        return np.where(whole, 1.0, part)

    def pool_parts(
        self, schedule: Schedule, durations: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per op (NaN off pool streams and for ops that are neither compute nor transfer):
        overhead seconds, work seconds at the whole device (its duration, `durations` if given,
        less the overhead) and `cap`. A transfer in a pool (the streams of one link) has its
        link's latency as overhead and its bytes at the whole bandwidth as work, cap 1: the
        pool's transfers share the bandwidth evenly."""
        n = len(schedule.ops)
        over, work, caps = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
        pools = {name for name, s in schedule.streams.items() if s.pool}
        if not pools:
            return over, work, caps
        durations = self.durations(schedule) if durations is None else durations
        routing_s = self.gate_exchange_s(schedule)
        for op in schedule.ops:
            if op.stream not in pools:
                continue
            res = schedule.streams[op.stream].resource
            if op.kind in TRANSFER_KINDS:  # the routing's wait is latency, not bandwidth
                over[op.id] = self.hw.link(res).latency_s + (
                    routing_s if op.kind == OpKind.DISPATCH else 0.0
                )
                caps[op.id] = 1.0
            elif op.kind in COMPUTE_KINDS:
                over[op.id] = self.overhead_s(res, op.kind)
                caps[op.id] = self.cap(res, op.flops, op.touch_bytes, op.width)
            else:
                continue
            work[op.id] = max(durations[op.id] - over[op.id], 0.0)
        return over, work, caps

    def transfer_s(self, resource: Resource, nbytes: float) -> float:
        return self.hw.link(resource).time_s(nbytes)

    def compute_s(
        self, device: Resource, kind: OpKind, flops: float, touch_bytes: float, share: float = 1.0
    ) -> float:
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        overhead = spec.kind_overhead_s.get(str(kind), spec.kernel_overhead_s)
        table = spec.time_tables.get(str(kind))
        if table:
            return _interpolate(table, flops) / share + overhead
        roofline = max(flops / spec.peak_flops_per_s, touch_bytes / spec.mem_bw_bytes_per_s)
        return roofline / share + overhead

    def duration_s(self, op: Op, resource: Resource, share: float = 1.0) -> float:
        if op.kind == OpKind.FREE:
            return 0.0
        if op.kind in COMPUTE_KINDS:
            return self.compute_s(resource, op.kind, op.flops, op.touch_bytes, share)
        return self.transfer_s(resource, op.nbytes)

    def durations(self, schedule: Schedule) -> np.ndarray:
        """Duration of every op of a schedule, in op order (vectorised `duration_s`)."""
        cols = schedule.columns()
        kinds = list(OpKind)
        # each op's resource as an index into `names` (compared as integers, not enum objects)
        names = list(dict.fromkeys(s.resource for s in schedule.streams.values()))
        stream_res = np.array(
            [names.index(s.resource) for s in schedule.streams.values()], dtype=np.int64
        )
        res = stream_res[cols["stream"]] if len(stream_res) else np.zeros(0, np.int64)
        stream_share = np.array([s.share for s in schedule.streams.values()], dtype=np.float64)
        share = stream_share[cols["stream"]] if len(stream_share) else np.ones(0)
        out = np.zeros(len(schedule.ops))
        procs = as_processes(schedule)
        # the codes present, sorted (np.unique's hash path imports numpy.ma, 0.012 s)
        for ki in np.flatnonzero(np.bincount(cols["kind"])):
            kind = kinds[ki]
            if kind == OpKind.FREE:
                continue
            of_kind = cols["kind"] == ki
            for ri in np.flatnonzero(np.bincount(res[of_kind])).tolist():
                sel = of_kind & (res == ri)
                r = names[ri]
                if kind in COMPUTE_KINDS:
                    out[sel] = self.compute_vec(
                        Resource(r), kind, cols["flops"][sel], cols["touch_bytes"][sel], share[sel]
                    ) * (self.hw.processes.scale(kind) if procs else 1.0)
                else:
                    link = self.hw.link(Resource(r))
                    out[sel] = cols["nbytes"][sel] / link.bandwidth_bytes_per_s + link.latency_s
                    if kind == OpKind.DISPATCH:
                        out[sel] += self.gate_exchange_s(schedule)
        return out

    def compute_vec(
        self,
        device: Resource,
        kind: OpKind,
        flops: np.ndarray,
        touch: np.ndarray,
        share: np.ndarray | float,
    ) -> np.ndarray:
        """`compute_s` of many ops of one kind on one device at once."""
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        if spec.time_tables.get(str(kind)):
            shares = np.broadcast_to(share, np.shape(flops))
            return np.array(
                [
                    self.compute_s(device, kind, f, t, s)
                    for f, t, s in zip(flops, touch, shares, strict=True)
                ]
            )
        roofline = np.maximum(flops / spec.peak_flops_per_s, touch / spec.mem_bw_bytes_per_s)
        return roofline / share + spec.kind_overhead_s.get(str(kind), spec.kernel_overhead_s)


def _interpolate(table: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear in flops; extrapolates with the last segment's slope (or x-proportional)."""
    xs = [p[0] for p in table]
    if len(table) == 1:
        x0, y0 = table[0]
        return y0 * (x / x0) if x0 > 0 and x > x0 else y0
    i = min(max(bisect.bisect_left(xs, x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return max(y, min(y0, y1) if x >= x0 else 0.0, 0.0)


def water_fill(caps: list[float], total: float = 1.0) -> list[float]:
    """Rates of ops sharing one device, in the order of `caps`: each min(cap, level), the level
    chosen so the rates sum to `total` (all at their caps if those sum to less)."""
    rates = [0.0] * len(caps)
    left, n = total, len(caps)
    for i in sorted(range(len(caps)), key=caps.__getitem__):
        rates[i] = min(caps[i], left / n)
        left, n = left - rates[i], n - 1
    return rates


def pool_makespan_s(lanes: list[list[tuple[float, float, float]]]) -> float:
    """When the last of these lanes' ops ends, each lane a list of (overhead, work, cap) run in
    order from time 0, with the simulator's pool semantics (sim/executor.py `_Fluid`): an op's
    overhead runs on its lane, then its work (seconds at the whole device) at a rate of at most
    its cap, the running ops' rates water-filled to sum to at most 1. For planners that weigh a
    placement on lanes that share a GPU without building a schedule."""
    pos = [0] * len(lanes)
    # per lane: ("over", ends at) or ("work", work left, cap) or None when done
    state: list[tuple[str, float, float] | None] = [None] * len(lanes)
    now = 0.0

    def start_next(i: int) -> None:
        if pos[i] < len(lanes[i]):
            over, _, _ = lanes[i][pos[i]]
            state[i] = ("over", now + over, 0.0)
        else:
            state[i] = None

    for i in range(len(lanes)):
        start_next(i)
    while any(st is not None for st in state):
        running = [(i, st[2]) for i, st in enumerate(state) if st is not None and st[0] == "work"]
        rate = dict(zip([i for i, _ in running], water_fill([c for _, c in running]), strict=True))
        step = np.inf
        for i, st in enumerate(state):
            if st is None:
                continue
            step = min(step, st[1] - now if st[0] == "over" else st[1] / rate[i])
        now += max(step, 0.0)
        for i, st in enumerate(state):
            if st is None:
                continue
            if st[0] == "over":
                if st[1] <= now + 1e-15:
                    _, work, cap = lanes[i][pos[i]]
                    state[i] = ("work", work, cap) if work > 0 else None
                    if state[i] is None:
                        pos[i] += 1
                        start_next(i)
            else:
                left_w = st[1] - rate[i] * step
                if left_w <= 1e-12 * max(1.0, st[1]):
                    pos[i] += 1
                    start_next(i)
                else:
                    state[i] = ("work", left_w, st[2])
    return now
