"""validate_lanes: the real lanes run of a replication planner's schedule beside both lanes
models' predictions of it, on the same replayed routing."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from core.errors import MoepipeError
from experiments import validate_lanes as vl

ROOT = Path(__file__).resolve().parents[2]


def test_real_and_both_models_on_the_same_schedule(mixtral_tiny, tmp_path, monkeypatch):
    """The simulator runs the routing the real run replayed; each model's error is its
    prediction over the real median; the files are written."""
    seen = []
    sim = vl.simulate_run

    def spy(spec, routing):
        seen.append((spec.params["lane_sharing"], routing))
        return sim(spec, routing)

    monkeypatch.setattr(vl, "simulate_run", spy)
    opts = dict(
        vl._DEFAULTS,
        checkpoint=str(mixtral_tiny),
        hardware="tiny",
        lanes=2,
        planners="ep_static",
        repeats=2,
        batch_size=2,
        n_batches=2,
        prompt_len=8,
        device="cpu",
        out=str(tmp_path),
    )
    lines = vl.report(opts)
    assert [s for s, _ in seen] == ["partition", "shared"] and seen[0][1] is seen[1][1]
    t = pd.read_csv(tmp_path / "validate_lanes.csv").iloc[0]
    assert t["real_ms"] > 0 and t["real_phase_ms"] > 0
    # the bound with the real durations, the lanes' ops by their share of the GPU, is a bound
    # (summing their durations put the bound above the makespan: the ratio read 0.86)
    assert t["real_over_dag_lb"] >= 1 - 1e-9
    for s in ("partition", "shared"):
        assert t[f"{s}_err"] == pytest.approx(t[f"{s}_ms"] / t["real_ms"] - 1, rel=1e-3)
    assert (tmp_path / "validate_lanes.md").exists()
    assert lines[-2].startswith("ep_static: makespan error partition")


@pytest.mark.parametrize(
    "planners, match",
    [("flexgen", "'flexgen' is not expert-parallel"), ("nosuch", "'nosuch' is unknown")],
)
def test_a_planner_that_is_not_expert_parallel_is_refused(planners, match, mixtral_tiny):
    opts = dict(vl._DEFAULTS, checkpoint=str(mixtral_tiny), planners=planners)
    with pytest.raises(MoepipeError, match=match):
        vl.report(opts)


def test_cli_error_is_one_line(tmp_path, cli_here):
    r = cli_here("experiments.validate_lanes", f"out={tmp_path}")
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "checkpoint=DIR is required" in err[0]
