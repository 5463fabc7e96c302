"""Probe round 13a (issue 48): other members of the option classes. An option or a choice named
in capitals (`BATCH=2`, `links=Probe`) or a choice misspelt (`only=[tabel3]`, `planner=flexgne`,
`planner.params.dense=tensr`) listed the valid names with no did-you-mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import experiments.common.app  # noqa: F401  registers what conf/ composes with (schemas)
from tests.conftest import overridden
from tests.probes.conftest import ROOT, TINY, one_line, raises_one_line


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


@pytest.mark.parametrize("planner", ["sequential", "layer_prefetch", "zero_inference"])
@pytest.mark.parametrize("plus", ["", "+"])
def test_a_param_of_a_planner_that_takes_none_says_so(
    cli_here: Any, tmp_path: Path, planner: str, plus: str
) -> None:
    """`planner.params.x=1` on sequential was "unknown key" and no more; `+planner.params.x=1`
    said "valid: none" and `+` on flexgen listed Python's repr of the names."""
    r = cli_here(
        "experiments.run",
        *TINY[:3],
        f"planner={planner}",
        f"{plus}planner.params.x=1",
        f"hydra.run.dir={tmp_path}",
    )
    one_line(r, "takes none", "leave")


def test_a_misspelt_param_added_with_plus_gets_a_did_you_mean() -> None:
    from planners.registry import make_params

    line = raises_one_line(lambda: make_params("klotski", {"hot_kk": 1}), "did you mean 'hot_k'")
    assert "[" not in line


@pytest.mark.parametrize(
    ("module", "arg", "words"),
    [
        ("experiments.collect", "out=~/x", ["out='~/x'", "~ is not expanded"]),
        ("experiments.make_checkpoint", "out=a;b", ["out='a;b'"]),
        ("experiments.trace_json", "runs=[~/a,/b]", ["runs=['~/a','/b']"]),
        ("experiments.report", "dir=x;y", ["dir='x;y'"]),
        ("experiments.run", "hydra.run.dir=a#b", ["hydra.run.dir='a#b'"]),
        ("experiments.routing_stats", "out=a'b", ['"out=\\"a\'b\\""']),
    ],
)
def test_a_value_hydra_takes_only_quoted_says_how_to_quote_it(
    cli_here: Any, module: str, arg: str, words: list[str]
) -> None:
    """`out=~/x` (a path with `~`, a newline, `;`, `#`, a quote) was hydra's
    "LexerNoViableAltException: out=~/x" and a link to its grammar."""
    one_line(cli_here(module, arg), "must be quoted", *words)


TINY_MODEL = (ROOT / "conf/model/tiny.yaml").read_text()
TINY_WORKLOAD = (ROOT / "conf/workload/tiny.yaml").read_text()


@pytest.mark.parametrize(
    ("group", "text", "words"),
    [
        ("model", f"# @package _global_\n{TINY_MODEL}", ["remove that line"]),
        ("model", f"# @package hardware\n{TINY_MODEL}", ["hardware.family", "remove that line"]),
        ("workload", f"# @package workload.routing\n{TINY_WORKLOAD}", ["# @package workload"]),
        ("experiment", "workload:\n  batch_size: 3\n", ["# @package _global_"]),
        ("experiment", "", ["# @package _global_"]),
    ],
    ids=["model-global", "model-hardware", "workload-routing", "experiment-none", "empty"],
)
def test_a_users_file_with_a_wrong_package_line_names_that_line(
    cli_here: Any, tmp_path: Path, group: str, text: str, words: list[str]
) -> None:
    """Each named the first key it put out of place and listed the run's keys (a model file
    under `# @package _global_`: "name: unknown key; valid: checkpoint, ..."; an experiment file
    without the header: "experiment: unknown key; did you mean 'checkpoint'?")."""
    (tmp_path / group).mkdir()
    (tmp_path / group / "mine.yaml").write_text(text)
    args = [*overridden(TINY, f"{group}=mine"), f"hydra.run.dir={tmp_path / 'run'}"]
    r = cli_here("experiments.run", "--config-dir", str(tmp_path), *args)
    one_line(r, f"{group}/mine.yaml", *words)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("hardware.memory_gb.gpu=1000000000", "memory_gb.gpu=1e+09"),  # 1 GB in bytes
        ("hardware.memory_gb.gpu=81920", "memory_gb.gpu=81920"),  # 80 GB in MB
        ("hardware.memory_gb.cpu=524288", "memory_gb.cpu=524288"),  # 512 GB in MB
    ],
)
def test_a_memory_size_in_another_unit_is_named(override: str, key: str) -> None:
    """A GPU of 1e9 GB (1 GB written in bytes) ran: memory_gb's bound was 1e9 GB for every
    tier, a disk's."""
    from hydra import compose, initialize_config_dir

    from experiments.common.resolve import run_spec

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*TINY, override])
    raises_one_line(lambda: run_spec(cfg), key, "check its unit")


def test_a_socket_where_a_config_json_belongs_is_named_a_socket(tmp_path: Path) -> None:
    """checkpoint=SOCKET said "cannot read it (No such device or address)" (open's ENXIO),
    where a FIFO said what it is."""
    import socket

    from core.files import read_small
    from core.spec import ModelSpec

    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / "s"))
        raises_one_line(lambda: read_small(tmp_path / "s"), "not a regular file (a socket)")
        raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path / "s"), "a socket")
    finally:
        sock.close()
