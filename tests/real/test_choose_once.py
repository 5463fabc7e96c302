"""Every command that runs Klotski with n=0 (auto) chooses its n once per run: a real run (replay
or live: its dry plans and the live plan reuse the choice), validate (the simulation and each real
run of a planner, one choice) and a distributed run's sizing. Each choice builds a warm-up
routing and solves the n-planner (0.14 s on the paper workload). Counted at `solve_n`, as
tests/planners/test_klotski.py counts the simulated run's."""

from __future__ import annotations

from dataclasses import replace

import pytest

import planners.klotski as k
from core.cost import CostModel
from core.errors import ConfigError
from experiments import validate as v
from experiments.common.dist_run import n_processes
from experiments.common.real_run import real_execute
from planners.klotski import Klotski, KlotskiParams
from tests.real.test_executor import OFFLOAD, assert_matches_reference, spec_for


@pytest.fixture
def choices(monkeypatch) -> list:
    """The hardware of each choice Klotski's n-planner makes."""
    calls: list = []
    solve = k.solve_n
    monkeypatch.setattr(k, "solve_n", lambda *a, **kw: calls.append(a[1]) or solve(*a, **kw))
    return calls


@pytest.mark.parametrize("mode", ["replay", "live"])
def test_a_real_run_chooses_its_n_once(mixtral_tiny, choices, mode):
    """The run sizes its workload, makes its dry plans (live: one per routing that reaches new
    experts) and plans, on one planner: one choice, the one a new planner makes at the run's n;
    the tokens are still the in-memory forward's."""
    spec = replace(spec_for(mixtral_tiny, "klotski"), params={"n": 0})
    result, out = real_execute(mixtral_tiny, spec, mode)
    assert len(choices) == 1
    wl = spec.workload.with_(n_batches=result.summary["n_batches"])
    fresh = Klotski(KlotskiParams(n=0)).choose(spec.model, OFFLOAD, wl, CostModel(OFFLOAD))
    assert result.summary["plan"]["n_plan"] == fresh.meta()
    assert_matches_reference(mixtral_tiny, spec, result, out)


@pytest.mark.slow  # validate's real runs of each planner: .ci/run's slow suite
def test_validate_chooses_each_planners_n_once(mixtral_tiny, tmp_path, choices):
    """validate's simulation of klotski and its two real runs: one choice at validate's
    hardware (the simulator's runs again at the links the runs saw are other hardware's)."""
    opts = dict(
        v._DEFAULTS,
        checkpoint=str(mixtral_tiny),
        hardware="tiny",
        repeats=2,
        planners="klotski",
        out=str(tmp_path),
        gpu_frac=0.9,
        cpu_frac=0.5,
        planner_params={"n": 0},
    )
    row = v.validate(opts).set_index("planner").loc["klotski"]
    assert row["real_runs"] == 2
    assert choices and sum(h == choices[0] for h in choices) == 1


def test_a_distributed_runs_sizing_chooses_its_n_once(mixtral_tiny, choices):
    """A distributed run sizes its workload and plans its devices with one planner (Klotski
    plans one device: refused after one choice)."""
    spec = replace(spec_for(mixtral_tiny, "klotski"), params={"n": 0})
    with pytest.raises(ConfigError, match="plans one device"):
        n_processes(str(mixtral_tiny), spec)
    assert len(choices) == 1
