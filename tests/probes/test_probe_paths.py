"""Probe class: a path argument a command would take other than as the user meant, without a
word: a quoted '~/x' (hydra's grammar takes no bare '~', and no shell expands a quoted one)
made a folder named '~' in the current one."""

from __future__ import annotations

from typing import Any

import pytest

from tests.probes.conftest import ROOT, TINY, one_line


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.run", [*TINY, "hydra.run.dir='~/moepipe_probe_run'"]),
        ("experiments.run", [*TINY, "workload.routing.trace_dir='~'"]),
        ("experiments.collect", ["dir='~root/sweep'"]),
        ("experiments.trace_json", ["runs=[/tmp,'~/run']"]),
    ],
    ids=["run dir", "trace dir", "collect ~user", "in a list"],
)
def test_a_path_starting_with_a_tilde_is_refused_naming_the_key(
    module: str, args: list[str], cli_here: Any
) -> None:
    """Hydra takes a quoted '~/x' as it is: a run made a folder named `~` in the current one
    (collect read a sweep there) without a word. Now one line naming the key and the path in
    full, and no folder made."""
    r = cli_here(module, *args)
    key = args[-1].partition("=")[0]
    one_line(r, key, "'~", "$HOME")
    assert not (ROOT / "~").exists()
