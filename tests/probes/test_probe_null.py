"""Probe class: null given where a value belongs. omegaconf's line ("field 'x' is not
Optional") named the key but not what to do; each command's line now says to pass a value."""

from __future__ import annotations

from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize(
    "module, args, key",
    [
        ("experiments.run", [*TINY, "workload.batch_size=null"], "workload.batch_size"),
        ("experiments.run", [*TINY[:-1], "planner=klotski", "planner.params.n=null"], "params.n"),
        ("experiments.run", [*TINY, "hardware.memory_gb.gpu=null"], "hardware.memory_gb.gpu"),
        ("experiments.prefetch_eval", ["group_seqs=null"], "group_seqs"),
        ("experiments.collect", ["dir=null"], "dir"),
    ],
    ids=["workload", "planner param", "hardware", "prefetch_eval", "collect"],
)
def test_null_where_a_value_belongs_says_to_pass_one(
    module: str, args: list[str], key: str, cli_here: Any
) -> None:
    r = cli_here(module, *args)
    one_line(r, f"{key}=null", "not null", f"{key}=VALUE")
