"""Probe round 15b (issue 48): the simulated and analysis commands (run, its sweeps and hydra's
features, collect, report, trace_json, convert_traces, routing_stats, prefetch_eval,
replication_cv, reproduce_klotski, bench.sim, bench.host). What this round found: a
replication block's param named as the planner reads it, not as the user wrote it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

REPLICATION = ["-m", "experiment=replication_switch_128", "workload.batch_size=2"]


@pytest.mark.parametrize(
    ("row", "given", "named"),
    [
        ("eplb", "replication.planners.eplb.interval=0", "replication.planners.eplb.interval=0"),
        ("eplb_interval8", "replication.params.interval=0", "replication.params.interval=0"),
    ],
)
def test_a_replication_blocks_param_is_named_as_written(
    cli_here: Any, tmp_path: Path, row: str, given: str, named: str
) -> None:
    """`replication.planners.eplb.interval=0` failed naming `planner.params.interval=0`, a key
    the user never wrote (the block's values reach the planner as its params)."""
    args = [*REPLICATION, f"replication_row={row}", given, f"hydra.sweep.dir={tmp_path}"]
    r = cli_here("experiments.run", *args, "hydra.launcher.n_jobs=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "1 run(s) failed" in r.stderr
    (failed,) = tmp_path.rglob("failed.txt")
    assert named in failed.read_text() and "planner.params" not in failed.read_text()
    assert not list(tmp_path.rglob("summary.json"))
