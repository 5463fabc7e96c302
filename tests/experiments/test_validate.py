"""validate's disk diagnosis: the bandwidth the real runs' disk reads saw, and the hardware with
the disk link at that bandwidth."""

from types import SimpleNamespace

import pandas as pd
import pytest

from core.spec import HardwareSpec
from core.types import Resource
from experiments.validate import run_disk_bandwidth, with_disk
from tests.conftest import ROOT


def _run(rows: list[tuple[str, int, float]]) -> SimpleNamespace:
    """A run whose trace has (resource, bytes, seconds) ops, each starting at 0."""
    df = pd.DataFrame(rows, columns=["resource", "bytes", "end_s"]).assign(start_s=0.0)
    return SimpleNamespace(trace=df)


def test_run_disk_bandwidth_is_the_median_over_runs_net_of_latency():
    latency = 0.001
    a = _run([("disk", 10_000_000, 0.011), ("h2d", 10_000_000, 0.001), ("disk", 10, 0.0005)])
    b = _run([("disk", 10_000_000, 0.021), ("disk", 20_000_000, 0.011)])
    # rates: 1e9, 0.5e9, 2e9 (the h2d op and the read shorter than the latency are left out)
    assert run_disk_bandwidth([a, b], latency) == pytest.approx(1e9)
    assert run_disk_bandwidth([_run([("h2d", 1, 0.1)])], latency) is None


def test_with_disk_changes_only_the_disk_read_bandwidth():
    import yaml

    hw = HardwareSpec.from_dict(yaml.safe_load((ROOT / "conf/hardware/tiny.yaml").read_text()))
    faster = with_disk(hw, 5e9)
    assert faster.link(Resource.DISK).bandwidth_bytes_per_s == 5e9
    assert faster.link(Resource.DISK).latency_s == hw.link(Resource.DISK).latency_s
    assert faster.link(Resource.H2D) == hw.link(Resource.H2D)
    assert hw.link(Resource.DISK).bandwidth_bytes_per_s != 5e9  # the original is unchanged
