"""Probe round 17 (issue 48): sweeps run twice at once, non-finite numbers, and the torchrun
launcher's loose ends.

A non-finite value of a numeric option (inf, -inf, nan, 1e999, YAML's .inf and .nan, a quoted
'inf') said "must be a finite number" when Python reads it and "not a number" (or "not a whole
number") when YAML spells it: each says the key and "must be a finite number", as the specs'
own check does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize(
    "override",
    [
        "hardware.links.h2d.gbps=.inf",
        "hardware.links.h2d.gbps=-.Inf",
        "hardware.memory_gb.gpu=.nan",
        "hardware.links.h2d.gbps=1e999",
        "hardware.links.h2d.gbps='inf'",
        "workload.gen_len=1e999",
        "workload.batch_size=.inf",
        "workload.seed=nan",
    ],
)
def test_a_non_finite_number_is_said_in_one_wording(
    cli_here: Any, tmp_path: Path, override: str
) -> None:
    r = cli_here("experiments.run", *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    key = override.split("=")[0].removeprefix("hardware.")
    one_line(r, key, "must be a finite number, got")
    assert not (tmp_path / "run").exists()
