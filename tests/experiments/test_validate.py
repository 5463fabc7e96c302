"""What validate and calibrate read off real runs: the bandwidth a link delivered, the hardware
with links at given bandwidths, and what the ops of G-process runs took beyond their costs."""

import numpy as np
import pandas as pd
import pytest
import yaml

from core.hardware import HardwareSpec
from core.trace import link_bandwidth
from core.types import OpKind, Resource, Tier
from experiments.validate import with_links
from tests.conftest import ROOT


def _trace(rows: list[tuple[str, int, float]]) -> pd.DataFrame:
    """(resource, bytes, seconds) ops, each starting at 0."""
    return pd.DataFrame(rows, columns=["resource", "bytes", "end_s"]).assign(start_s=0.0)


def test_link_bandwidth_is_bytes_over_time_net_of_latency_over_all_runs():
    latency = 0.001
    a = _trace([("disk", 10_000_000, 0.011), ("h2d", 10_000_000, 0.001), ("disk", 10, 0.0005)])
    b = _trace([("disk", 10_000_000, 0.021), ("disk", 20_000_000, 0.011)])
    # disk: 40 MB over (0.010 + 0.020 + 0.010) s; the h2d op and the read no longer than the
    # latency are left out; a slow transfer weighs by its time (a median of rates would say 1e9)
    assert link_bandwidth([a, b], "disk", latency) == pytest.approx(1e9)
    assert link_bandwidth([b], "disk", latency) == pytest.approx(30e6 / 0.030)
    assert link_bandwidth([_trace([("h2d", 1, 0.1)])], "disk", latency) is None


def test_with_links_changes_only_the_named_bandwidths():
    hw = HardwareSpec.from_dict(yaml.safe_load((ROOT / "conf/hardware/tiny.yaml").read_text()))
    faster = with_links(hw, {Resource.DISK: 5e9, Resource.H2D: 7e9})
    assert faster.link(Resource.DISK).bandwidth_bytes_per_s == 5e9
    assert faster.link(Resource.H2D).bandwidth_bytes_per_s == 7e9
    assert faster.link(Resource.DISK).latency_s == hw.link(Resource.DISK).latency_s
    assert faster.link(Resource.D2H) == hw.link(Resource.D2H)
    assert hw.link(Resource.DISK).bandwidth_bytes_per_s != 5e9  # the original is unchanged


def _p2p(rows: list[tuple[str, str, int, float]]) -> pd.DataFrame:
    """(kind, resource, bytes, seconds) transfers, each starting at 0."""
    return pd.DataFrame(rows, columns=["kind", "resource", "bytes", "end_s"]).assign(start_s=0.0)


def test_p2p_seen_splits_a_dispatchs_wait_for_routing_from_the_link():
    """At 1 GB/s (the calibrated rate for the small ones): combines of 1 MB - 1 B take 2 ms and
    3 ms (1 ms of bytes: latency 1.5 ms, the mean); dispatches 4 ms and 6 ms (gate exchange
    5 - 1 - 1.5 = 2.5 ms); two 10 MB copies take 11.5 ms and 21.5 ms: 20 MB over 33 - 2 x 1.5
    = 30 ms, 0.667 GB/s. A large all-reduce (a collective's rounds, not one transfer) and a
    large dispatch are not the link's rate."""
    from core.hardware import LinkSpec
    from experiments.common.dist_measure import p2p_seen

    small = (1 << 20) - 1
    t = _p2p(
        [
            ("combine", "p2p:0", small, 0.002 + small / 1e9 - 0.001),
            ("combine", "p2p_out:1", small, 0.003 + small / 1e9 - 0.001),
            ("dispatch", "p2p:1", small, 0.004 + small / 1e9 - 0.001),
            ("dispatch", "p2p_out:0", small, 0.006 + small / 1e9 - 0.001),
            ("load", "p2p:1", 10_000_000, 0.0115),
            ("load", "p2p_out:0", 10_000_000, 0.0215),
            ("all-reduce", "p2p:0", 10_000_000, 0.5),
            ("dispatch", "p2p:0", 10_000_000, 0.3),
            ("compute-expert", "gpu:0", 0, 1.0),
        ]
    )
    seen = p2p_seen([t], LinkSpec(1e9, 0.0))
    assert seen is not None
    assert seen.link.latency_s == pytest.approx(0.0015)
    assert seen.gate_exchange_s == pytest.approx(0.0025)
    assert seen.link.bandwidth_bytes_per_s == pytest.approx(20e6 / 0.030)
    assert p2p_seen([t[t["kind"] == "compute-expert"]], LinkSpec(1e9, 0.0)) is None


def test_scale_seen_is_each_kinds_time_over_the_models_in_sums():
    """Experts took 1 + 5 ms where the cost model says 2 + 2 ms: 1.5 (a median of ratios would
    say 1.5 too here, 0.5 and 2.5; sums weigh the slow one by its time); a gate 3 ms against
    1 ms: 3; transfers are no compute kind."""
    from experiments.common.dist_measure import scale_seen

    t = pd.DataFrame(
        {
            "op_id": [0, 1, 2, 3],
            "kind": ["compute-expert", "compute-expert", "compute-gate", "dispatch"],
            "start_s": [0.0, 0.0, 0.0, 0.0],
            "end_s": [0.001, 0.005, 0.003, 0.1],
        }
    )
    predicted = np.array([0.002, 0.002, 0.001, 0.001])
    assert scale_seen([(t, predicted)]) == pytest.approx(
        {"compute-expert": 1.5, "compute-gate": 3.0}
    )


def test_delay_seen_is_the_mean_start_after_ready_per_kind():
    """gate (0-1 ms) -> expert A on the same stream starts at 3 ms (ready at 1: 2 ms late) ->
    expert B, dep on A, starts at 4 ms as A ends (0 late); the dispatch on its own stream,
    dep on the gate, starts at 1.5 ms (0.5 ms late). Experts: (2 + 0) / 2 = 1 ms; the gate,
    ready at once, 0."""
    from core.schedule import ScheduleBuilder
    from experiments.common.dist_measure import delay_seen

    b = ScheduleBuilder({Tier.GPU: 10**9, Tier.CPU: 10**9, Tier.DISK: 10**9})
    b.stream("compute", Resource.GPU, 0)
    b.stream("dispatch", Resource.P2P, 0)
    g = b.add(OpKind.GATE, "compute", layer=0, batch=0)
    d = b.add(OpKind.DISPATCH, "dispatch", (g,), layer=0, batch=0, nbytes=1)
    a = b.add(OpKind.EXPERT, "compute", (g,), layer=0, batch=0, flops=1.0)
    b.add(OpKind.EXPERT, "compute", (a, d), layer=0, batch=0, flops=1.0)
    s = b.build()
    t = pd.DataFrame(
        {
            "op_id": [0, 1, 2, 3],
            "start_s": [0.0, 0.0015, 0.003, 0.004],
            "end_s": [0.001, 0.002, 0.004, 0.005],
        }
    )
    assert delay_seen([(t, s)]) == pytest.approx(
        {"compute-gate": 0.0, "compute-expert": 0.001, "dispatch": 0.0005}
    )
