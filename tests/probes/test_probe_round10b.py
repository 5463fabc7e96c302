"""Probe round 10b (issue 48): an empty value for an option with a default (read as the
current folder, or as a name), and a benchmark's options for its own children given by a user
(ignored without a word)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import cli, one_line, raises_one_line


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.replication", ["dir="], "dir=''"),
        ("experiments.replication_cv", ["dir="], "dir=''"),
        ("experiments.routing_stats", ["trace_dir=", "out={tmp}/s.json"], "trace_dir=''"),
        ("experiments.prefetch_eval", ["trace_dir="], "trace_dir=''"),
        ("experiments.validate", ["checkpoint={tmp}", "hardware="], "hardware=''"),
        ("experiments.bench.lanes", ["model=", "device=cpu"], "model=''"),
        ("experiments.trace_json", ["runs=['']"], "an empty item"),
        ("experiments.convert_traces", ["src=", "out={tmp}/t.npz"], "src=''"),
    ],
)
def test_an_empty_value_for_an_option_with_a_default_is_refused(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], key: str
) -> None:
    """'' was the current folder: replication read the repository as its sweep ("skipped
    conf: no summary.json"), trace_json looked for the repository's trace.parquet; or a name:
    hardware='' was conf/hardware/.yaml, with "run calibrate hardware.name=" as the fix."""
    r = cli_here(module, *(a.format(tmp=tmp_path) for a in args))
    line = one_line(r, key)
    assert "an empty" in line
    assert list(tmp_path.iterdir()) == []


def test_bench_real_refuses_an_empty_hardware_before_writing(tmp_path: Path) -> None:
    """bench.real hardware= wrote the checkpoint, then calibrated a profile named '' and
    failed with two error lines."""
    r = cli(
        "experiments.bench.real",
        "model=tiny",
        "budget_gb=0.0003",
        f"out_dir={tmp_path}/b",
        "hardware=",
        timeout=120,
    )
    one_line(r, "hardware=''", "an empty value", "this-machine")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("arg", ["acc_batch=8", "acc_limit_s=3", "host_room_mb=100"])
def test_a_bench_childs_option_from_a_user_is_refused(
    tmp_path: Path, cli_here: Any, arg: str
) -> None:
    """bench.accelerate sets these for its own children, over the user's: `acc_batch=8` ran
    every accelerate row at the batch the bench picked, without a word (as role= is refused)."""
    r = cli_here("experiments.bench.accelerate", f"checkpoint={tmp_path}/none", arg)
    one_line(r, arg.split("=")[0], "leave it out")


def test_an_accelerate_childs_limit_is_checked() -> None:
    """acc_limit_s=nan went unchecked into the child's generate loop."""
    from experiments.bench.accelerate import checked
    from experiments.common.schema import BenchAccelerateOptions

    opts = BenchAccelerateOptions(
        checkpoint="ck", role="accelerate", acc_batch=1, acc_limit_s=float("nan")
    )
    raises_one_line(lambda: checked(opts), "acc_limit_s=nan")
