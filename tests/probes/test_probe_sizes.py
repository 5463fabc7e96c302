"""Probe class: a size that would eat the machine's memory or run for hours instead of being
refused. A run's size is checked before the work it sizes (its ops before planning, the
synthetic generator's tables before routing), a count no routing can hold is refused where the
model is built, and the expert-parallel all-to-all is counted in G x E, not G x G x E, so a
run of thousands of devices runs instead of asking for the memory of a cluster."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.spec import ModelSpec
from tests.probes.conftest import TINY, one_line, raises_one_line


def _planner_never_made(*args: Any, **kw: Any) -> Any:
    raise AssertionError("the planner was made: the size was not checked first")


@pytest.mark.parametrize("planner", ["flexgen", "klotski"])
def test_a_million_generated_tokens_is_refused_before_planning(
    tmp_path: Path, planner: str, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gen_len=10**6 on the tiny model: little routing (a 200 MB check skipped it, and with it
    the check of the ops), about 4e7 ops (60 GB at 1.5 KB each). It planned until the machine's
    memory ran out; Klotski's choice of n read every step first. Now one line naming gen_len,
    before any planner is made (this machine's RAM set to 8 GB, below the need)."""
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 8 * 10**9)
    monkeypatch.setattr("experiments.common.pipeline.make_planner", _planner_never_made)
    args = [*TINY[:-1], f"planner={planner}", "workload.gen_len=1000000"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "gen_len=1000000", "ops", "RAM", "lower gen_len")


def test_more_experts_than_an_int16_id_holds_is_refused(tiny_model: ModelSpec) -> None:
    """Routing holds expert ids as int16: expert 39999 was stored as -25537 and the run went on
    with it. The model is refused where it is built (its YAML or a config.json alike)."""
    raises_one_line(lambda: replace(tiny_model, n_experts=40000), "n_experts=40000", "32767")
    replace(tiny_model, n_experts=32767)  # the largest an id holds


def test_synthetic_tables_beyond_any_machines_ram_are_one_line(
    tmp_path: Path, cli_here: Any
) -> None:
    """2000 MoE layers of 32767 experts: the generator's [L, E, E] tables are about 100 TB.
    It said "out of memory" (numpy's refusal) naming nothing; now the line names the layers
    and n_experts, and what to do."""
    args = [*TINY, "model.n_layers=2000", "model.moe_layers=null", "model.n_experts=32767"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "2000 MoE layers", "n_experts=32767", "workload.routing.source=trace")
