"""Hand-worked cost-model cases on round numbers: 1 TFLOP/s GPU with 1000 GB/s memory, a
0.1 TFLOP/s CPU with 100 GB/s, 1 GB/s links.

Transfers take `bytes / bandwidth + latency`; compute takes the roofline
`max(flops / peak, touch_bytes / mem_bw) + overhead`, or a calibrated (flops -> seconds) table
plus the overhead when the hardware YAML has `time_tables` for that op kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from core.cost import CostModel
from core.errors import ConfigError
from core.hardware import HardwareSpec
from core.schedule import ScheduleBuilder, validate
from core.types import OpKind, Resource, Tier

GB = 10**9

# compute-expert on the GPU: 1 GFLOP in 1 ms, 3 GFLOP in 2 ms, 5 GFLOP in 4 ms.
EXPERT_TABLE = [[1e9, 0.001], [3e9, 0.002], [5e9, 0.004]]


def hw(
    *,
    overhead_us: float = 0.0,
    by_kind: dict[str, float] | None = None,
    tables: dict[str, list[list[float]]] | None = None,
    links: dict[str, dict[str, float]] | None = None,
) -> HardwareSpec:
    """The round-number machine of the module docstring, as a hardware YAML would give it."""
    gpu: dict[str, Any] = {"tflops": 1.0, "mem_bw_gbps": 1000.0, "overhead_us": overhead_us}
    if by_kind is not None:
        gpu["overhead_us_by_kind"] = by_kind
    if tables is not None:
        gpu["time_tables"] = tables
    return HardwareSpec.from_dict(
        {
            "name": "round",
            "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
            "gpu": gpu,
            "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
            "links": links
            or {
                "h2d": {"gbps": 1.0, "latency_us": 100},
                "d2h": {"gbps": 2.0, "latency_us": 0},
                "disk": {"gbps": 0.5, "latency_us": 1000},
            },
        }
    )


# ---- roofline ----------------------------------------------------------------------------------


def test_roofline_compute_bound():
    """1 TFLOP touching 1 GB on the GPU: max(1e12 / 1e12, 1e9 / 1e12) = max(1 s, 1 ms) = 1 s."""
    cost = CostModel(hw())
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 1e12, 1e9) == pytest.approx(1.0)


def test_roofline_memory_bound():
    """1 GFLOP touching 10 GB on the GPU: max(1e9 / 1e12, 1e10 / 1e12) = max(1 ms, 10 ms)
    = 10 ms."""
    cost = CostModel(hw())
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 1e9, 1e10) == pytest.approx(0.010)


def test_roofline_on_the_cpu_uses_the_cpu_numbers():
    """The same two ops on the 0.1 TFLOP/s, 100 GB/s CPU are 10x slower:
    max(1e12 / 1e11, 1e9 / 1e11) = 10 s, and max(1e9 / 1e11, 1e10 / 1e11) = 0.1 s."""
    cost = CostModel(hw())
    assert cost.compute_s(Resource.CPU, OpKind.EXPERT, 1e12, 1e9) == pytest.approx(10.0)
    assert cost.compute_s(Resource.CPU, OpKind.EXPERT, 1e9, 1e10) == pytest.approx(0.1)


def test_overhead_us_is_added_to_every_compute_op():
    """overhead_us 100: the 10 ms memory-bound op takes 10 ms + 0.1 ms = 10.1 ms, and a 0-flop op
    takes the overhead alone, 0.1 ms."""
    cost = CostModel(hw(overhead_us=100))
    assert cost.compute_s(Resource.GPU, OpKind.FFN, 1e9, 1e10) == pytest.approx(0.0101)
    assert cost.compute_s(Resource.GPU, OpKind.GATE, 0.0, 0.0) == pytest.approx(0.0001)


def test_overhead_us_by_kind_replaces_overhead_us_for_that_kind():
    """overhead_us 100, overhead_us_by_kind {compute-attention: 2000}: a 1 GFLOP (1 ms) attention
    takes 1 ms + 2 ms = 3 ms; the same op as an expert keeps the default: 1 ms + 0.1 ms = 1.1 ms.
    The CPU has no overhead at all: 1e9 / 1e11 = 10 ms."""
    cost = CostModel(hw(overhead_us=100, by_kind={"compute-attention": 2000}))
    assert cost.compute_s(Resource.GPU, OpKind.ATTENTION, 1e9, 0) == pytest.approx(0.003)
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 1e9, 0) == pytest.approx(0.0011)
    assert cost.compute_s(Resource.CPU, OpKind.ATTENTION, 1e9, 0) == pytest.approx(0.010)


# ---- transfers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("resource", "nbytes", "expected_s"),
    [
        (Resource.H2D, GB, 1.0001),  # 1 GB / 1 GB/s + 100 us
        (Resource.H2D, 0, 0.0001),  # an empty transfer still pays the latency
        (Resource.D2H, GB, 0.5),  # 1 GB / 2 GB/s + 0
        (Resource.DISK, GB, 2.001),  # 1 GB / 0.5 GB/s + 1 ms
        (Resource.DISK_WRITE, GB, 2.001),  # no disk_write link: the disk read link's numbers
        (Resource.P2P, GB, 1.0001),  # no p2p link: the h2d link's numbers
    ],
)
def test_transfer_is_bytes_over_bandwidth_plus_latency(resource, nbytes, expected_s):
    """h2d 1 GB/s + 100 us, d2h 2 GB/s + 0, disk 0.5 GB/s + 1 ms; disk_write and p2p are absent,
    so `HardwareSpec.link` falls back to disk and h2d respectively (expected values inline)."""
    cost = CostModel(hw())
    assert cost.transfer_s(resource, nbytes) == pytest.approx(expected_s)


def test_disk_write_and_p2p_links_are_used_when_present():
    """With disk_write 0.25 GB/s + 0 and p2p 4 GB/s + 10 us declared: 1 GB writes in 1 / 0.25 = 4 s
    (not the disk read's 1 / 0.5 = 2 s) and crosses p2p in 1 / 4 + 1e-5 = 0.25001 s (not h2d's
    1 s)."""
    links = {
        "h2d": {"gbps": 1.0},
        "d2h": {"gbps": 1.0},
        "disk": {"gbps": 0.5},
        "disk_write": {"gbps": 0.25},
        "p2p": {"gbps": 4.0, "latency_us": 10},
    }
    cost = CostModel(hw(links=links))
    assert cost.transfer_s(Resource.DISK_WRITE, GB) == pytest.approx(4.0)
    assert cost.transfer_s(Resource.P2P, GB) == pytest.approx(0.25001)
    assert cost.transfer_s(Resource.DISK, GB) == pytest.approx(2.0)


# ---- calibrated time tables --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flops", "expected_s"),
    [
        (1e9, 0.001),  # on the first point
        (3e9, 0.002),  # on the middle point
        (5e9, 0.004),  # on the last point
        (2e9, 0.0015),  # between 1 and 3 GFLOP: 1 ms + (2 - 1) / (3 - 1) * 1 ms
        (4e9, 0.003),  # between 3 and 5 GFLOP: 2 ms + (4 - 3) / (5 - 3) * 2 ms
        (7e9, 0.006),  # beyond: the last segment's slope, 4 ms + (7 - 5) * 1 ms/GFLOP
        (0.5e9, 0.00075),  # below: the first segment's slope, 1 ms - 0.5 * 0.5 ms/GFLOP
    ],
)
def test_time_table_interpolates_and_extrapolates(flops, expected_s):
    """gpu.time_tables.compute-expert = [[1e9, 1 ms], [3e9, 2 ms], [5e9, 4 ms]] (flops, seconds):
    piecewise linear in flops (slopes 0.5 ms/GFLOP then 1 ms/GFLOP), the end segments extended.
    The table replaces the roofline: touching 100 GB (100 ms at 1000 GB/s) changes nothing."""
    cost = CostModel(hw(tables={"compute-expert": EXPERT_TABLE}))
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, flops, 1e11) == pytest.approx(expected_s)


def test_time_table_plus_overhead_only_for_its_kind():
    """Expert table + overhead_us 100: 2 GFLOP takes 1.5 ms (table) + 0.1 ms = 1.6 ms. An FFN has no
    table: roofline 2e9 / 1e12 = 2 ms + 0.1 ms = 2.1 ms. The CPU has no table: 2e9 / 1e11 =
    20 ms."""
    cost = CostModel(hw(overhead_us=100, tables={"compute-expert": EXPERT_TABLE}))
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 2e9, 0) == pytest.approx(0.0016)
    assert cost.compute_s(Resource.GPU, OpKind.FFN, 2e9, 0) == pytest.approx(0.0021)
    assert cost.compute_s(Resource.CPU, OpKind.EXPERT, 2e9, 0) == pytest.approx(0.020)


def test_one_point_time_table_scales_with_flops_above_the_point():
    """A one-point table [[2e9, 2 ms]]: 4 GFLOP takes 2 ms * 4 / 2 = 4 ms (proportional); below the
    point, 1 GFLOP, the measured 2 ms is the floor."""
    cost = CostModel(hw(tables={"compute-expert": [[2e9, 0.002]]}))
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 4e9, 0) == pytest.approx(0.004)
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 1e9, 0) == pytest.approx(0.002)


def test_time_table_never_negative():
    """[[1e9, 1 ms], [2e9, 3 ms]] has slope 2 ms/GFLOP: extended down to 0 flops it would give
    1 ms - 2 ms = -1 ms; a duration is clamped at 0 (+ no overhead = 0 s)."""
    cost = CostModel(hw(tables={"compute-expert": [[1e9, 0.001], [2e9, 0.003]]}))
    assert cost.compute_s(Resource.GPU, OpKind.EXPERT, 0.0, 0) == 0.0


# ---- vectorised (simulator) == scalar (planners) -----------------------------------------------


def test_vectorised_durations_equal_scalar_duration_s():
    """`CostModel.durations` (the simulator) must give every op what `CostModel.duration_s` (the
    planners) gives it. One op of each path, on a machine with an expert time table, per-kind
    overheads and the disk_write / p2p fallbacks; the hand-worked values:

    op 0  load 1 GB h2d:                 1 / 1 + 100 us           = 1.0001 s
    op 1  gate 0 flops gpu:              0 + 0.1 ms               = 0.0001 s
    op 2  expert 2 GFLOP gpu (table):    1.5 ms + 0.1 ms          = 0.0016 s
    op 3  expert 4 GFLOP gpu (table):    3 ms + 0.1 ms            = 0.0031 s
    op 4  attention 1 GFLOP, 10 GB gpu:  max(1, 10) ms + 2 ms     = 0.012 s
    op 5  ffn 1 TFLOP gpu:               1 s + 0.1 ms             = 1.0001 s
    op 6  expert 1 GFLOP cpu (no table, no overhead): 1e9 / 1e11 = 0.01 s
    op 7  kv-store 1 GB d2h:             1 / 2                    = 0.5 s
    op 8  kv-store 1 GB cpu->disk (disk_write falls back to disk): 1 / 0.5 + 1 ms = 2.001 s
    op 9  load 1 GB gpu->gpu (p2p falls back to h2d):           1 / 1 + 100 us = 1.0001 s
    op 10 free:                          0 s
    """
    h = hw(
        overhead_us=100,
        by_kind={"compute-attention": 2000},
        tables={"compute-expert": EXPERT_TABLE},
    )
    b = ScheduleBuilder(h.memory_bytes)
    for name, res in [
        ("weights", Resource.H2D),
        ("compute", Resource.GPU),
        ("cpu_compute", Resource.CPU),
        ("kv_store", Resource.D2H),
        ("kv_spill", Resource.DISK_WRITE),
        ("p2p", Resource.P2P),
        ("memory", Resource.NONE),
    ]:
        b.stream(name, res)
    w = b.add(OpKind.LOAD, "weights", src=Tier.CPU, dst=Tier.GPU, nbytes=GB)
    g = b.add(OpKind.GATE, "compute", (w,), layer=0, batch=0)
    b.add(OpKind.EXPERT, "compute", (g,), layer=0, batch=0, flops=2e9)
    b.add(OpKind.EXPERT, "compute", (g,), layer=0, batch=0, flops=4e9)
    b.add(OpKind.ATTENTION, "compute", flops=1e9, touch_bytes=10 * GB)
    b.add(OpKind.FFN, "compute", flops=1e12)
    b.add(OpKind.EXPERT, "cpu_compute", (g,), layer=0, batch=0, flops=1e9)
    b.add(OpKind.KV_STORE, "kv_store", src=Tier.GPU, dst=Tier.CPU, nbytes=GB)
    b.add(OpKind.KV_STORE, "kv_spill", src=Tier.CPU, dst=Tier.DISK, nbytes=GB)
    b.add(OpKind.LOAD, "p2p", src=Tier.GPU, dst=Tier.GPU, nbytes=GB)
    b.add(OpKind.FREE, "memory", free_tier=Tier.GPU, free_bytes=0)
    s = b.build()
    validate(s)
    cost = CostModel(h)
    vec = cost.durations(s)
    scalar = np.array([cost.duration_s(o, s.streams[o.stream].resource) for o in s.ops])
    expected = [1.0001, 0.0001, 0.0016, 0.0031, 0.012, 1.0001, 0.01, 0.5, 2.001, 1.0001, 0.0]
    assert scalar == pytest.approx(expected)
    assert vec == pytest.approx(scalar, rel=1e-12, abs=0)


def test_a_lane_share_divides_the_roofline_not_the_overhead():
    """A stream holding a quarter of the GPU (one of 4 lanes): the 10 ms memory-bound op takes
    4 x 10 ms + 0.1 ms; with the expert time table, 2 GFLOP takes 4 x 1.5 ms + 0.1 ms. The
    simulator's vectorised durations read the share from the op's stream."""
    cost = CostModel(hw(overhead_us=100))
    assert cost.compute_s(Resource.GPU, OpKind.FFN, 1e9, 1e10, 0.25) == pytest.approx(0.0401)
    table = CostModel(hw(overhead_us=100, tables={"compute-expert": EXPERT_TABLE}))
    assert table.compute_s(Resource.GPU, OpKind.EXPERT, 2e9, 0, 0.25) == pytest.approx(0.0061)
    b = ScheduleBuilder(hw().memory_bytes)
    b.stream("whole", Resource.GPU)
    b.stream("lane1", Resource.GPU, 1, 0.25)
    b.add(OpKind.FFN, "whole", flops=1e9, touch_bytes=10 * GB)
    b.add(OpKind.FFN, "lane1", flops=1e9, touch_bytes=10 * GB)
    s = b.build()
    assert cost.durations(s) == pytest.approx([0.0101, 0.0401])
    assert [cost.duration_s(o, Resource.GPU, s.streams[o.stream].share) for o in s.ops] == (
        pytest.approx([0.0101, 0.0401])
    )


def test_a_share_outside_zero_one_is_refused():
    b = ScheduleBuilder(hw().memory_bytes)
    with pytest.raises(AssertionError, match="share 0"):
        b.stream("lane", Resource.GPU, 1, 0.0)


@pytest.mark.parametrize(
    "table", [[[2e9, 1e-3], [1e9, 5e-4]], [[1e9, -1e-3]], []], ids=["unsorted", "negative", "empty"]
)
def test_a_bad_time_table_is_named(table):
    """_interpolate bisects on flops, so a table out of order would give wrong times silently."""
    d = {
        "name": "t",
        "memory_gb": {"gpu": 1, "cpu": 1, "disk": 1},
        "gpu": {"tflops": 1, "mem_bw_gbps": 1, "time_tables": {"compute-expert": table}},
        "cpu": {"tflops": 1, "mem_bw_gbps": 1},
        "links": {k: {"gbps": 1} for k in ("h2d", "d2h", "disk")},
    }
    with pytest.raises(ConfigError, match="time_tables.compute-expert must be"):
        HardwareSpec.from_dict(d)


# ---- the share of the GPU an op of few thread blocks can use (shared pools) --------------------


def test_gemm_blocks_count_each_groups_tiles():
    """128 x 128 output tiles: 1 row and 200 rows over 300 columns are (1 + 2) x 3 tiles; a group
    with no rows launches none."""
    from core.cost import gemm_blocks

    assert gemm_blocks([1, 200, 0], 300) == 9
    assert gemm_blocks([], 300) == 0


@pytest.mark.parametrize(
    "flops, touch, width, sm_bw, cap",
    [
        (1e9, 0, 1, 0, 0.25),  # compute-bound, 1 block of 4 SMs: a quarter of the peak
        (0, 10**9, 1, 0, 0.25),  # memory-bound, one SM's even split of the bandwidth
        (0, 10**9, 1, 500, 0.5),  # one SM can draw 500 of the 1000 GB/s
        (0, 10**9, 3, 500, 1.0),  # three can draw it all
        (1e9, 10**9, 1, 500, 0.25),  # 1 ms of each: the compute part, 4 ms alone, binds
        (1e9, 0, 0, 0, 1.0),  # width 0: fills the GPU
        (1e9, 0, 8, 0, 1.0),  # more blocks than SMs
    ],
)
def test_cap_is_roofline_over_roofline_alone(flops, touch, width, sm_bw, cap):
    """The round GPU with 4 SMs: an op of `width` blocks holds that many SMs (compute) and draws
    at most that many SMs' bandwidth (memory); its cap is its whole-GPU roofline over that."""
    raw = {
        "name": "sms",
        "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
        "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0, "sms": 4, "sm_mem_bw_gbps": sm_bw},
        "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
        "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}, "disk": {"gbps": 0.5}},
    }
    assert CostModel(HardwareSpec.from_dict(raw)).cap(Resource.GPU, flops, touch, width) == (
        pytest.approx(cap)
    )
    assert CostModel(hw()).cap(Resource.GPU, flops, touch, 1) == 1.0  # SM count unknown


def test_negative_sm_count_is_one_config_error():
    raw = {
        "name": "bad",
        "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
        "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0, "sms": -1},
        "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
        "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}, "disk": {"gbps": 0.5}},
    }
    with pytest.raises(
        ConfigError, match="hardware bad: gpu.sms=-1: must be a non-negative integer"
    ):
        HardwareSpec.from_dict(raw)


@pytest.mark.parametrize(
    "gpu,field",
    [
        ({"overhead_us": -50}, "gpu.overhead_us"),
        (
            {"overhead_us_by_kind": {"compute-expert": -100}},
            "gpu.overhead_us_by_kind.compute-expert",
        ),
    ],
)
def test_a_negative_overhead_is_one_config_error(gpu, field):
    """A sign slip in a profile gave ops negative durations (an expert of 1 MFLOP -0.1 ms)."""
    raw = {
        "name": "bad",
        "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
        "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0, **gpu},
        "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
        "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}, "disk": {"gbps": 0.5}},
    }
    with pytest.raises(ConfigError, match=rf"hardware bad: {field} must be >= 0"):
        HardwareSpec.from_dict(raw)


@pytest.mark.parametrize("lanes", [False, True])
def test_processes_terms_only_where_the_devices_are_processes(lanes):
    """A 2-device expert-parallel schedule on a machine whose `processes` block says 1 ms of
    gate exchange and experts 2x slower with both processes computing. Hand-worked, as G
    processes (lanes: none of it, the lanes are one process's):

    expert 2 GFLOP (table 1.5 ms + 0.1 ms overhead) x 2            = 3.2 ms   (lanes 1.6 ms)
    (and starts 0.5 ms after it is ready, a dispatch 0.25 ms: `start_delays`; lanes 0)
    dispatch 1 MB at 1 GB/s on p2p + 100 us latency + 1 ms exchange = 2.1 ms   (lanes 1.1 ms)
    combine 1 MB: no exchange                                       = 1.1 ms
    gate (no scale given for its kind): 0.1 ms

    In a pool (the p2p streams are one), the exchange is the dispatch's overhead, not work that
    shares the link's bandwidth. Without the block every op costs what it costs alone."""
    from core.ep_layout import EPLayout

    def schedule(h: HardwareSpec) -> Any:
        b = ScheduleBuilder(h.memory_bytes)
        b.ep = EPLayout(n_devices=2, lanes=lanes)
        b.stream("compute", Resource.GPU, 0)
        b.stream("dispatch0", Resource.P2P, 0, pool="p2p:0")
        b.stream("combine0", Resource.P2P, 0, pool="p2p:0")
        g = b.add(OpKind.GATE, "compute", layer=0, batch=0)
        d = b.add(OpKind.DISPATCH, "dispatch0", (g,), layer=0, batch=0, nbytes=10**6)
        e = b.add(OpKind.EXPERT, "compute", (d,), layer=0, batch=0, flops=2e9)
        b.add(OpKind.COMBINE, "combine0", (e,), layer=0, batch=0, nbytes=10**6)
        return b.build()

    links = {
        "h2d": {"gbps": 1.0, "latency_us": 100},
        "d2h": {"gbps": 1.0},
        "disk": {"gbps": 1.0},
        "p2p": {"gbps": 1.0, "latency_us": 100},
    }
    plain = hw(overhead_us=100, tables={"compute-expert": EXPERT_TABLE}, links=links)
    procs = HardwareSpec.from_dict(
        {
            "name": "procs",
            "memory_gb": {"gpu": 1, "cpu": 4, "disk": 100},
            "gpu": {
                "tflops": 1.0,
                "mem_bw_gbps": 1000.0,
                "overhead_us": 100,
                "time_tables": {"compute-expert": EXPERT_TABLE},
            },
            "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
            "links": links,
            "processes": {
                "gate_exchange_us": 1000,
                "compute_scale_by_kind": {"compute-expert": 2.0},
                "start_delay_us_by_kind": {"compute-expert": 500, "dispatch": 250},
            },
        }
    )
    alone = [0.0001, 0.0011, 0.0016, 0.0011]
    as_procs = [0.0001, 0.0021, 0.0032, 0.0011]
    assert CostModel(plain).durations(schedule(plain)) == pytest.approx(alone)
    s = schedule(procs)
    cost = CostModel(procs)
    assert cost.durations(s) == pytest.approx(alone if lanes else as_procs)
    over, work, _ = cost.pool_parts(s)
    assert over[1] == pytest.approx(0.0001 if lanes else 0.0011)
    assert work[1] == pytest.approx(0.001) and work[3] == pytest.approx(0.001)
    delays = [0.0, 0.0, 0.0, 0.0] if lanes else [0.0, 0.00025, 0.0005, 0.0]
    assert cost.start_delays(s) == pytest.approx(delays)


def test_a_processes_scale_that_is_not_positive_is_one_config_error():
    d = {
        "name": "x",
        "memory_gb": {"gpu": 1, "cpu": 1, "disk": 1},
        "gpu": {"tflops": 1, "mem_bw_gbps": 1},
        "cpu": {"tflops": 1, "mem_bw_gbps": 1},
        "links": {"h2d": {"gbps": 1}, "d2h": {"gbps": 1}, "disk": {"gbps": 1}},
        "processes": {"compute_scale_by_kind": {"compute-expert": 0}},
    }
    with pytest.raises(ConfigError, match="processes.compute_scale_by_kind.compute-expert"):
        HardwareSpec.from_dict(d)
