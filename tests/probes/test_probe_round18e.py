"""Probe round 18e (issue 48): three small leftovers.

A value the user typed that the run silently ignored: `planner=klotski
workload.n_batches=1000000` ran klotski's own n (`planner.params.n: 0`) and never said the
user's n_batches went unused. One warning line names both fields and the fix; an experiment
file's or the workload conf's own n_batches is not the user's and is not warned of.

A misleading YaRN line: a config.json's `rope_scaling` yarn with `beta_fast: 0` and `beta_slow:
40` said "beta_fast=32 is below ..." where the file says 0: it says `beta_fast=0 (transformers'
default 32)`, and likewise for null and an absent beta.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.hf_config import spec_to_hf_config
from core.spec import ModelSpec
from real.checkpoint import reduced_spec
from tests.probes.conftest import TINY, raises_one_line

KLOTSKI = [*TINY[:3], "planner=klotski"]
UNUSED = "was not used"


def test_a_typed_n_batches_klotski_sizes_away_is_warned_of_once(
    cli_here: Any, tmp_path: Path
) -> None:
    """klotski (n: 0) picks its own n on the tiny model (1): the typed 1000 went unused."""
    r = cli_here(
        "experiments.run", *KLOTSKI, "workload.n_batches=1000", f"hydra.run.dir={tmp_path}"
    )
    assert r.returncode == 0, r.stderr
    said = [x for x in (r.stdout + r.stderr).splitlines() if UNUSED in x]
    assert len(said) == 1, said
    for name in ("workload.n_batches=1000", "planner.params.n=0", "planner.params.n=-1"):
        assert name in said[0]
    assert "drop workload.n_batches" in said[0]


@pytest.mark.parametrize(
    "args",
    [
        [*KLOTSKI],  # the workload conf's own n_batches: not the user's
        [*KLOTSKI, "workload.n_batches=1000", "planner.params.n=-1"],  # it runs the typed n
        [*TINY, "workload.n_batches=2"],  # flexgen keeps the workload's n
    ],
)
def test_no_warning_where_nothing_typed_went_unused(
    cli_here: Any, tmp_path: Path, args: list[str]
) -> None:
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert UNUSED not in r.stdout + r.stderr


@pytest.mark.parametrize("family", ["deepseek-v2-lite", "qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize(
    ("betas", "said"),
    [
        ({"beta_fast": 0, "beta_slow": 40}, "beta_fast=0 (transformers' default 32) is below"),
        ({"beta_fast": None, "beta_slow": 40}, "beta_fast=null (transformers' default 32)"),
        ({"beta_slow": 40}, "beta_fast (absent: transformers' default 32) is below"),
        ({"beta_fast": 0.5, "beta_slow": 0}, "below beta_slow=0 (transformers' default 1)"),
    ],
)
def test_a_yarn_beta_of_0_is_said_as_written(
    tmp_path: Path, family: str, betas: dict[str, Any], said: str
) -> None:
    """Before: "rope_scaling.beta_fast=32 is below beta_slow=40", a 32 the file does not hold."""
    rope = {"rope_type": "yarn", "factor": 4.0, **betas}
    cfg = spec_to_hf_config(reduced_spec(family)) | {"rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "rope_scaling.", said)
    assert "swap them" in line
