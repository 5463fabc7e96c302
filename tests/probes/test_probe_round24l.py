"""Round 24l of issue 48: the memory a plan reserves in each tier against what its ops need
there (tests/probes/reservations.py). Class found: `fiddler` placed (and reserved) a host
copy on CPU or disk of every expert it keeps on the GPU for the whole run, which no op reads:
its CPU and disk peaks were overstated, and a run whose CPU had no room for those copies (and
no disk) was refused ("layer 0's experts fit nowhere") although it needs none of them.

A few tiny runs here; every planner on the tiny model and on Mixtral at small n, at five
memory budgets each, in the slow suite.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import MoepipeError
from core.hardware import HardwareSpec
from core.types import Tier
from experiments.common.pipeline import RunResult, RunSpec, simulate_run
from planners import planner_names
from planners.registry import expert_parallel_names
from tests.conftest import conf, model_from_conf
from tests.probes.reservations import reservation_problems
from tests.probes.test_probe_round24g import (
    MIX_GB,
    MIX_WL,
    TINY_GB,
    TINY_WL,
    hardware,
    tiny_spec,
)

FAST = [("fiddler", "gpu_tight"), ("fiddler", "cpu_edge"), ("moe_infinity", "cpu_edge")]


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str], tuple[RunSpec, RunResult]]:
    return {c: (s, simulate_run(s)) for c in FAST for s in [tiny_spec(*c)]}


@pytest.mark.parametrize("case", FAST)
def test_each_tier_reserves_what_its_ops_need(case: tuple[str, str], runs: Any) -> None:
    assert not reservation_problems(*runs[case])


def test_fiddler_holds_no_host_copy_of_its_resident_experts(runs: Any) -> None:
    """At the tight GPU 5 of 8 experts stay on it: the CPU holds the other 3 (3 x 49152 B),
    not all 8."""
    spec, result = runs[("fiddler", "gpu_tight")]
    assert result.summary["plan"]["resident_experts"] == 5
    assert result.schedule.resident_bytes[Tier.CPU] == 3 * spec.model.expert_bytes


def test_fiddler_fits_a_cpu_without_room_for_copies_it_never_reads() -> None:
    """Every expert stays on a 1 GB GPU; a CPU of 20 kB and no disk was refused before."""
    d: dict[str, Any] = dict(conf("hardware", "tiny"))
    d.update(name="tiny-no-disk", memory_gb=dict(gpu=1.0, cpu=0.00002, disk=None))
    spec = RunSpec(model_from_conf("tiny"), HardwareSpec.from_dict(d), TINY_WL, "fiddler")
    result = simulate_run(spec)
    assert result.summary["peak_bytes"]["cpu"] == 0
    assert result.summary["plan"]["placement"]["expert_layers"] == {"gpu": 2}
    assert not reservation_problems(spec, result)


def _matrix() -> list[tuple[str, str, str]]:
    return [
        (model, planner, budget)
        for model, budgets in (("tiny", TINY_GB), ("mixtral", MIX_GB))
        for budget in budgets
        for planner in planner_names()
        if planner not in expert_parallel_names()
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "planner", "budget"), _matrix())
def test_every_planner_at_every_budget(model: str, planner: str, budget: str) -> None:
    if model == "tiny":
        spec = tiny_spec(planner, budget)
    else:
        hw = hardware("rtx3090-env1", *MIX_GB[budget])
        spec = RunSpec(model_from_conf("mixtral-8x7b"), hw, MIX_WL, planner)
    try:
        result = simulate_run(spec)
    except MoepipeError:  # refused in one line (probes elsewhere check the line)
        return
    assert not reservation_problems(spec, result)
