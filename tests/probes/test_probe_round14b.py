"""Probe round 14b (issue 48): the simulated and analysis commands (run, its sweeps, collect,
report, trace_json, convert_traces, routing_stats, prefetch_eval, replication_cv,
reproduce_klotski, bench.sim, bench.host). What this round found: a real executor's key
accepted without a word on a simulated run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize("value", ["float16", "bfloat16", "bogus"])
def test_a_real_executors_dtype_on_a_simulated_run_is_refused(
    cli_here: Any, tmp_path: Path, value: str
) -> None:
    """`executor.dtype=float16` on a simulated run went on without a word (exit 0): the
    simulator reads model.dtype_bytes, never the real executor's compute dtype, while its
    siblings (device, routing_mode, rendezvous_timeout_s) were refused."""
    run = tmp_path / "r"
    r = cli_here("experiments.run", *TINY, f"executor.dtype={value}", f"hydra.run.dir={run}")
    one_line(r, "executor.dtype", "model.dtype_bytes", "executor=real")
    assert not (run / "summary.json").exists()
