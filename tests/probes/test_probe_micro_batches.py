"""Expert-parallel planners' micro-batches (two-batch overlap) where nothing overlaps."""

from __future__ import annotations

import pytest

from experiments.common.pipeline import simulate_run
from tests.planners.ep_common import tiny_spec
from tests.probes.conftest import raises_one_line


@pytest.mark.parametrize("dense", ["data", "tensor"])
@pytest.mark.parametrize("planner", ["ep_static", "oracle_replication"])
def test_micro_batches_on_one_device_are_refused(planner: str, dense: str) -> None:
    """micro_batches=2 with n_devices=1 ran, at half the throughput, two micro-batches with no
    all-to-all or all-reduce to overlap (lanes=true, the other case of no collective, was
    refused): one line saying so."""
    spec = tiny_spec(planner, n_devices=1, dense=dense, micro_batches=2)
    raises_one_line(lambda: simulate_run(spec), "micro_batches=2", "n_devices=1", "micro_batches=1")
