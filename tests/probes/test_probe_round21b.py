"""Valid input at its extremes (issue 48, "honest in what it measures"): a run the simulator
accepts reports numbers that mean what they say (tests/probes/invariants.py), or it is refused
in one line whose numbers say why. Classes found:

- a refusal at the GPU's edge read "GPU memory 7e-05 GB is smaller than the working set 7e-05
  GB": sizes one byte apart printed alike (core.errors.gb_apart);
- an expert cache of a small planner.params.cache_share gave an AssertionError traceback;
- n_devices=0 on more GPUs than experts was told to "lower n_devices";
- a lower bound past the makespan by rounding: an efficiency of 1.0000000000000002.

The whole sweep of every planner at each edge runs in the slow suite.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from core.errors import CapacityError, ConfigError, gb_apart
from core.hardware import HardwareSpec
from core.spec import RoutingConfig, Workload
from core.types import Tier
from experiments.common.pipeline import (
    RunSpec,
    build_schedule,
    last_routing,
    simulate_run,
    sized_run,
)
from planners import planner_names
from tests.conftest import conf, model_from_conf
from tests.probes.conftest import raises_one_line
from tests.probes.invariants import run_problems

TINY_WL = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
LINKS = ("h2d", "d2h", "disk", "disk_write")


def hardware(**changes: Any) -> HardwareSpec:
    """hardware=tiny with `changes` ("links.h2d.gbps": value) made."""
    d = conf("hardware", "tiny")
    for key, value in changes.items():
        *path, last = key.split(".")
        at = d
        for part in path:
            at = at.setdefault(part, {})
        at[last] = value
    return HardwareSpec.from_dict(d)


def gpu_of(hw: HardwareSpec, gpu_bytes: int) -> HardwareSpec:
    return replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: gpu_bytes})


def honest(spec: RunSpec) -> None:
    """`spec` runs, and its summary holds every invariant."""
    result = simulate_run(spec)
    sized = replace(spec, workload=spec.workload.with_(n_batches=result.summary["n_batches"]))
    assert not run_problems(sized, result), run_problems(sized, result)


def least_gpu(planner: str, lo: int = 10_000, hi: int = 1_000_000) -> int:
    """The fewest GPU bytes `planner` runs the tiny model's workload in (refused below)."""
    model, hw = model_from_conf("tiny"), hardware()

    def runs(gpu: int) -> bool:  # planned and validated: the simulation refuses nothing more
        try:
            spec, made = sized_run(RunSpec(model, gpu_of(hw, gpu), TINY_WL, planner))
            build_schedule(spec, last_routing(spec.model, spec.workload), made)
        except (CapacityError, ConfigError):
            return False
        return True

    assert runs(hi) and not runs(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if runs(mid) else (mid, hi)
    return hi


def _has_less(gb: list[float]) -> bool:  # "GPU memory A GB is smaller than ... B GB"
    return gb[0] < gb[1]


def _needs_more(gb: list[float]) -> bool:  # "needs A GB ..., only B GB is spare"
    return gb[0] > gb[1]


def _adds_past(gb: list[float]) -> bool:  # "A GB of replicas on top of B GB exceed its C GB"
    return gb[0] + gb[1] > gb[2]


def _total_past(gb: list[float]) -> bool:  # "experts (E GB) with ... B GB of buffers (T GB) do
    return gb[2] > gb[3]  # not fit 1 GPU(s) of C GB"


# what the sizes of each planner's refusal at the GPU's edge must read as: the first the
# working set's (placement's and klotski's), the expert caches', expert parallelism's
SAYS_WHY = {
    "ep_static": _total_past,
    "eplb": _adds_past,
    "mixtral_offloading": _needs_more,
    "moe_infinity": _has_less,
    "oracle_replication": _adds_past,
    "predictive_replication": _adds_past,
}


def gpu_edge(planner: str) -> None:
    """At exactly the least GPU and a byte more the run is honest; a byte less is refused in
    one line whose sizes read as the refusal says (one byte apart, they printed alike)."""
    model, hw = model_from_conf("tiny"), hardware()
    least = least_gpu(planner)
    for gpu in (least, least + 1):
        honest(RunSpec(model, gpu_of(hw, gpu), TINY_WL, planner))
    spec = RunSpec(model, gpu_of(hw, least - 1), TINY_WL, planner)
    line = raises_one_line(lambda: simulate_run(spec), "GB")
    sizes = [float(x) for x in re.findall(r"([0-9.]+(?:e[+-][0-9]+)?) GB", line)]
    assert SAYS_WHY.get(planner, _has_less)(sizes), line


# a planner for each refusal at the GPU's edge: the placement's working set, klotski's n, an
# expert cache's, expert parallelism's replicas
@pytest.mark.parametrize("planner", ["flexgen", "klotski", "mixtral_offloading", "eplb"])
def test_a_gpu_at_its_working_set_runs_and_a_byte_less_says_so(planner: str) -> None:
    gpu_edge(planner)


@pytest.mark.slow
@pytest.mark.parametrize("planner", planner_names())
def test_every_planner_at_its_gpu_edge(planner: str) -> None:
    gpu_edge(planner)


def test_sizes_one_byte_apart_read_apart() -> None:
    assert gb_apart(70016, 70015) == ("7.002e-05", "7.001e-05")
    assert gb_apart(10**9, 10**9, 2 * 10**9) == ("1", "1", "2")  # equal sizes read alike
    assert gb_apart(123_456_789_012, 123_456_789_011) == ("123.456789012", "123.456789011")


@pytest.mark.parametrize("planner", ["mixtral_offloading", "moe_infinity"])
def test_a_cache_share_at_its_bound_is_refused_or_honest(planner: str) -> None:
    """cache_share=1e-9 left GPU memory the placement gave to an expert layer: an
    AssertionError ("experts must be off the GPU"); the rest of the spare memory stays unused."""
    model, hw = model_from_conf("tiny"), hardware()
    spec = RunSpec(model, hw, TINY_WL, planner, {"cache_share": 1e-9})
    raises_one_line(lambda: simulate_run(spec), "planner.params.cache_share", "raise")
    honest(RunSpec(model, hw, TINY_WL, planner, {"cache_share": 0.5}))


def test_n_devices_0_on_more_gpus_than_experts_names_a_way_out() -> None:
    """n_devices=0 (the hardware's GPUs) was told to "lower n_devices", which is 0 already."""
    model = model_from_conf("tiny")
    spec = RunSpec(model, hardware(n_gpus=model.n_experts + 1), TINY_WL, "ep_static")
    line = raises_one_line(lambda: simulate_run(spec), "n_devices=0", "n_devices=1 to")
    assert "lower n_devices" not in line


@pytest.mark.parametrize("planner", ["klotski", "sequential"])
def test_a_bound_past_the_makespan_by_rounding_is_the_makespan(planner: str) -> None:
    """A resource busy the whole run summed its ops' times past the makespan by rounding:
    efficiency or dag_efficiency 1.0000000000000002 in summary.json."""
    for workload in (TINY_WL, Workload(batch_size=4, n_batches=4, prompt_len=16, gen_len=4)):
        honest(RunSpec(model_from_conf("tiny"), hardware(), workload, planner))


def _synthetic(**kw: Any) -> RoutingConfig:
    return RoutingConfig(source="synthetic", **kw)  # type: ignore[arg-type]


# (label, hardware changes, workload): each valid and at an edge
EDGES: list[tuple[str, dict[str, Any], Workload]] = [
    ("links 1e-4 GB/s", {f"links.{k}.gbps": 1e-4 for k in LINKS}, TINY_WL),
    ("links 1e6 GB/s", {f"links.{k}.gbps": 1e6 for k in LINKS}, TINY_WL),
    ("latency 1 s", {f"links.{k}.latency_us": 1e6 for k in LINKS}, TINY_WL),
    ("tflops 1e-6", {"gpu.tflops": 1e-6, "cpu.tflops": 1e-6}, TINY_WL),
    ("tflops 1e6", {"gpu.tflops": 1e6, "cpu.tflops": 1e6}, TINY_WL),
    ("memory bandwidth 1e-3", {"gpu.mem_bw_gbps": 1e-3}, TINY_WL),
    ("cpu smaller than the model", {"memory_gb.cpu": 1e-4}, TINY_WL),
    ("one token", {}, Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)),
    ("64 batches", {}, replace(TINY_WL, n_batches=64)),
    ("seed 2**63", {}, replace(TINY_WL, seed=2**63)),
    ("one hot expert", {}, replace(TINY_WL, routing=_synthetic(hot_experts=1, hot_share=1.0))),
    ("uniform", {}, replace(TINY_WL, routing=_synthetic(skew=0.0, layer_corr=0.0, reuse=0.0))),
]


@pytest.mark.parametrize(("label", "changes", "workload"), EDGES, ids=[e[0] for e in EDGES])
def test_a_valid_edge_gives_an_honest_run(
    label: str, changes: dict[str, Any], workload: Workload
) -> None:
    honest(RunSpec(model_from_conf("tiny"), hardware(**changes), workload, "klotski"))


@pytest.mark.slow
@pytest.mark.parametrize("planner", planner_names())
@pytest.mark.parametrize(("label", "changes", "workload"), EDGES, ids=[e[0] for e in EDGES])
def test_every_planner_at_every_edge(
    planner: str, label: str, changes: dict[str, Any], workload: Workload
) -> None:
    try:
        honest(RunSpec(model_from_conf("tiny"), hardware(**changes), workload, planner))
    except (CapacityError, ConfigError) as e:  # a refusal: one line, naming its fix
        assert "\n" not in str(e) and ";" in str(e), e
