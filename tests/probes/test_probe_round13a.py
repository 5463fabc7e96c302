"""Probe round 13a (issue 48): other members of the option classes. An option or a choice named
in capitals (`BATCH=2`, `links=Probe`) or a choice misspelt (`only=[tabel3]`, `planner=flexgne`,
`planner.params.dense=tensr`) listed the valid names with no did-you-mean."""

from __future__ import annotations

from typing import Any

import pytest

from tests.probes.conftest import one_line, raises_one_line


@pytest.mark.parametrize(
    ("module", "args", "meant"),
    [
        ("experiments.bench.host", ["BATCH=2"], "batch"),
        ("experiments.bench.sim", ["Repeat=1"], "repeat"),
        ("experiments.prefetch_eval", ["GROUP_SEQS=4"], "group_seqs"),
        ("experiments.routing_stats", ["OUT=x.json"], "out"),
    ],
)
def test_an_option_in_other_case_gets_a_did_you_mean(
    cli_here: Any, module: str, args: list[str], meant: str
) -> None:
    one_line(cli_here(module, *args), "unknown key", f"did you mean {meant!r}")


def _checked(key: str, given: list[str], valid: list[str]) -> Any:
    from experiments.common.cli import checked_names

    return lambda: checked_names(key, given, valid)


def _planner(name: str) -> Any:
    from planners.registry import make_planner

    return lambda: make_planner(name, {})


def _ep(**params: Any) -> Any:
    from planners.ep.params import EPParams

    return lambda: EPParams(**params)


@pytest.mark.parametrize(
    ("fn", "meant"),
    [
        (_checked("only", ["tabel3"], ["table3", "fig14"]), "table3"),
        (_checked("cases", ["ESFT-G8"], ["esft-g8", "esft-g4"]), "esft-g8"),
        (_planner("flexgne"), "flexgen"),
        (_planner("Klotski"), "klotski"),
        (_ep(dense="tensr"), "tensor"),
        (_ep(dispatch="balance"), "balanced"),
    ],
    ids=["only", "cases", "planner", "planner-case", "dense", "dispatch"],
)
def test_a_misspelt_choice_gets_a_did_you_mean(fn: Any, meant: str) -> None:
    raises_one_line(fn, f"did you mean {meant!r}")


@pytest.mark.parametrize(
    ("module", "args", "meant"),
    [
        ("experiments.validate", ["links=Probe"], "probe"),
        ("experiments.bench.real", ["model=tiny", "budget_gb=1", "peers=bst"], "best"),
        ("experiments.bench.accelerate", ["checkpoint=/nonexistent", "cold=onse"], "once"),
        ("experiments.bench.accelerate", ["checkpoint=/nonexistent", "routing=trase"], "trace"),
    ],
)
def test_a_commands_misspelt_choice_gets_a_did_you_mean(
    cli_here: Any, module: str, args: list[str], meant: str
) -> None:
    one_line(cli_here(module, *args), "unknown", f"did you mean {meant!r}")
