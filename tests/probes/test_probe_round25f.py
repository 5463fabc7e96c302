"""Round 25f's probe classes: a size option's range (`shard_mb=1e300` was taken), a stop pressed
again while the command stops (a hung shutdown left only `kill -9`), and a comma inside one item
of a list option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import one_line

_HUGE = [
    ("experiments.make_checkpoint", ["model=tiny", "out=OUT", "shard_mb=1e300"], "shard_mb"),
    ("experiments.calibrate", ["disk_mb=99999999"], "disk_mb"),
    ("experiments.bench.real", ["model=tiny", "budget_gb=1e300"], "budget_gb"),
    ("experiments.bench.real", ["model=tiny", "budget_gb=4", "slack_mb=99999999"], "slack_mb"),
]


@pytest.mark.parametrize(("module", "args", "key"), _HUGE, ids=[c[2] for c in _HUGE])
def test_size_option_past_its_range_names_the_range(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], key: str
) -> None:
    """`make_checkpoint shard_mb=1e300` was taken (one shard planned); a size option's line
    now names its whole range, up to 1 TiB."""
    args = [a.replace("OUT", str(tmp_path / "ck")) for a in args]
    line = one_line(cli_here(module, *args), f"{key}=", "must be <=", "1 TiB")
    assert "in [" in line or "in (0," in line
    assert not (tmp_path / "ck").exists()
