"""Round 24b of issue 48: last session's leftovers, one class a test group. Each refusal must
name only fixes that help:

- a capacity refusal at the GPU's edge named a smaller workload where the weights alone exceed
  the GPU (the placement had its working set as one number, not its parts).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from core.spec import Workload
from core.types import Tier
from experiments.common.pipeline import RunSpec, simulate_run
from tests.conftest import model_from_conf
from tests.probes.conftest import raises_one_line
from tests.probes.test_probe_round21b import TINY_WL, hardware

LEAST_WL = Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)


def _refusal(
    planner: str, memory: dict[Tier, int], workload: Workload = TINY_WL, *names: str, **hw: Any
) -> str:
    """The one line refusing a simulated run of the tiny model with `memory` on hardware=tiny
    (`hw` changed as `hardware` takes them), naming each of `names`."""
    tiny = hardware(**hw)
    tiny = replace(tiny, memory_bytes={**tiny.memory_bytes, **memory})
    spec = RunSpec(model_from_conf("tiny"), tiny, workload, planner)
    return raises_one_line(lambda: simulate_run(spec), *names)


# (planner, GPU bytes, workload): the streamed weights alone, or one expert at the least
# workload, exceed the GPU
@pytest.mark.parametrize(
    ("planner", "gpu", "workload"),
    [
        ("klotski", 10_000, TINY_WL),
        ("flexgen", 10_000, TINY_WL),
        ("moe_infinity", 10_000, TINY_WL),
        ("moe_infinity", 70_000, LEAST_WL),
        ("mixtral_offloading", 70_000, LEAST_WL),
    ],
)
def test_a_gpu_no_workload_fits_names_no_workload(
    planner: str, gpu: int, workload: Workload
) -> None:
    """klotski at 1e-05 GB: "lower workload.prompt_len or workload.batch_size ..., or raise
    hardware.memory_gb.gpu"; the caches at batch 1: "use a smaller batch"."""
    line = _refusal(planner, {Tier.GPU: gpu}, workload, "raise hardware.memory_gb.gpu")
    assert "workload." not in line and "smaller batch" not in line, line


def test_a_gpu_a_smaller_workload_fits_still_names_it() -> None:
    line = _refusal("flexgen", {Tier.GPU: 600_000}, TINY_WL.with_(prompt_len=4000))
    assert "lower workload.prompt_len" in line, line


@pytest.mark.parametrize("has_disk", [True, False])
def test_weights_past_every_tier_name_no_smaller_workload(has_disk: bool) -> None:
    """Weights larger than GPU + CPU + disk were told to "add memory or shrink the workload"."""
    total = model_from_conf("tiny").total_bytes
    tiers = {Tier.GPU: total // 4, Tier.CPU: total // 4, Tier.DISK: total // 4 if has_disk else 0}
    disk = {} if has_disk else {"memory_gb.disk": None}
    line = _refusal("flexgen", tiers, TINY_WL, "add memory", **disk)
    assert "shrink the workload" not in line, line
