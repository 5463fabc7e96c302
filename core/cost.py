"""Cost model: how long an op takes on a given hardware.

Transfers take `bytes / bandwidth + latency`; compute takes the roofline
`max(flops / peak, touch_bytes / memory_bandwidth)`, or a calibrated (flops -> seconds) table
when the hardware profile has one for that op kind, divided by the stream's `share` of the
device (1, or 1/G for a lane holding 1/G of a GPU's SMs), plus the per-op overhead (a
calibrated table times the kernels alone; the overhead is what running one op costs on top). It lives in core
(not sim/) because planners need it too: Klotski's n-planner solves its inequalities with it.
"""

from __future__ import annotations

import bisect

import numpy as np

from core.schedule import Op, Schedule
from core.spec import ComputeSpec, HardwareSpec
from core.types import COMPUTE_KINDS, OpKind, Resource


class CostModel:
    def __init__(self, hardware: HardwareSpec) -> None:
        self.hw = hardware

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
        stream_res = np.array([s.resource for s in schedule.streams.values()], dtype=object)
        res = stream_res[cols["stream"]] if len(stream_res) else np.array([], dtype=object)
        stream_share = np.array([s.share for s in schedule.streams.values()], dtype=np.float64)
        share = stream_share[cols["stream"]] if len(stream_share) else np.ones(0)
        out = np.zeros(len(schedule.ops))
        for ki in np.unique(cols["kind"]):
            kind = kinds[ki]
            if kind == OpKind.FREE:
                continue
            for r in set(res[cols["kind"] == ki]):
                sel = (cols["kind"] == ki) & (res == r)
                if kind in COMPUTE_KINDS:
                    out[sel] = self._compute_vec(
                        Resource(r), kind, cols["flops"][sel], cols["touch_bytes"][sel], share[sel]
                    )
                else:
                    link = self.hw.link(Resource(r))
                    out[sel] = cols["nbytes"][sel] / link.bandwidth_bytes_per_s + link.latency_s
        return out

    def _compute_vec(
        self, device: Resource, kind: OpKind, flops: np.ndarray, touch: np.ndarray,
        share: np.ndarray,
    ) -> np.ndarray:  # fmt: skip
        spec: ComputeSpec = self.hw.gpu if device == Resource.GPU else self.hw.cpu
        if spec.time_tables.get(str(kind)):
            return np.array([self.compute_s(device, kind, f, t, s)
                             for f, t, s in zip(flops, touch, share, strict=True)])  # fmt: skip
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
