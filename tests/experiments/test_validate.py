"""What validate and calibrate read off real runs: the bandwidth a link delivered, and the
hardware with links at given bandwidths."""

import pandas as pd
import pytest
import yaml

from core.spec import HardwareSpec
from core.trace import link_bandwidth
from core.types import Resource
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
