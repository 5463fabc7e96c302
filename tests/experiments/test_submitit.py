"""Sweeps through hydra's submitit launcher: `hydra/launcher=submitit_local` runs each point as a
submitit job on this machine, the same plugin and code path as `hydra/launcher=slurm` on a
cluster."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow  # a sweep of submitit's processes: .ci/run's slow suite
def test_a_sweep_runs_through_submitit(tmp_path):
    """Two planners swept with submitit_local: each point's run directory has its summary, of
    its own planner, and submitit's job folders (one per point) hold what its jobs wrote."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            "-m",
            "model=tiny",
            "hardware=tiny",
            "workload=tiny",
            "planner=sequential,flexgen",
            "hydra/launcher=submitit_local",
            f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    summaries = sorted(tmp_path.rglob("summary.json"))
    assert {json.loads(p.read_text())["planner"] for p in summaries} == {"sequential", "flexgen"}
    assert all(json.loads(p.read_text())["makespan_s"] > 0 for p in summaries)
    jobs = [d for d in (tmp_path / ".submitit").iterdir() if d.name != "%j"]
    assert len(jobs) == 2 and all(list(d.glob("*_result.pkl")) for d in jobs)
