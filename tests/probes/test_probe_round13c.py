"""Probe round 13c (issue 48): the leftovers of round 13. Another command's option named no
command that takes it; a group's YAML holding a scalar read as an unknown key; a field the
routing source ignores in a user's workload file; a size option with no lower bound; a planner
param past what the workload or model holds; a param named other than as a user types it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line


@pytest.mark.parametrize(
    ("module", "arg", "takers"),
    [
        ("experiments.bench.host", "gpu_frac=0.5", ["experiments.bench.accelerate"]),
        ("experiments.run", "+shard_mb=1", ["experiments.make_checkpoint"]),
        ("experiments.collect", "n_layers=1", ["experiments.bench.real", "make_checkpoint"]),
        ("experiments.report", "skip_finished=true", ["experiments.run"]),
    ],
)
def test_another_commands_option_names_the_commands_that_take_it(
    cli_here: Any, module: str, arg: str, takers: list[str]
) -> None:
    """`gpu_frac=0.5` given to bench.host was "unknown key; valid: ..." and no more."""
    one_line(cli_here(module, arg), "unknown key", *takers, "take")


@pytest.mark.parametrize("group", ["model", "hardware", "workload", "planner", "executor"])
@pytest.mark.parametrize(("text", "holds"), [("tiny", "a str 'tiny'"), ("3", "an int 3")])
def test_a_group_yaml_holding_a_scalar_says_what_it_holds(
    cli_here: Any, tmp_path: Path, group: str, text: str, holds: str
) -> None:
    """A `tiny` in a --config-dir's model/mine.yaml was `model.tiny: unknown key`, a `3`
    "Invalid loaded object type: int"; given as model=FILE.yaml, the same."""
    (tmp_path / "c" / group).mkdir(parents=True)
    (tmp_path / "c" / group / "mine.yaml").write_text(text + "\n")
    args = [a for a in [*TINY, "executor=sim"] if not a.startswith(f"{group}=")]
    run = f"hydra.run.dir={tmp_path / 'r'}"
    r = cli_here(
        "experiments.run", "--config-dir", str(tmp_path / "c"), *args, f"{group}=mine", run
    )
    one_line(r, "mine.yaml", holds, f"mapping of {group} fields", f"conf/{group}/")
    if group in ("model", "hardware", "workload"):
        r = cli_here(
            "experiments.run", *args, f"{group}={tmp_path / 'c' / group / 'mine.yaml'}", run
        )
        one_line(r, "mine.yaml", holds, f"mapping of {group} fields")


@pytest.mark.parametrize(
    ("module", "args", "words"),
    [
        (
            "experiments.make_checkpoint",
            ["model=tiny", "out=OUT", "shard_mb=1e-30"],
            ["shard_mb", "must be >="],
        ),
        (
            "experiments.bench.host",
            ["unit_mb=1e-6", "device=cpu"],
            ["unit_mb", "4096 bytes", "must be >="],
        ),
        ("experiments.calibrate", ["disk_mb=0"], ["disk_mb", "an integer in [1, 1048576]"]),
    ],
)
def test_a_size_option_below_its_bound_names_the_bound(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], words: list[str]
) -> None:
    """`make_checkpoint shard_mb=1e-30` was accepted and wrote one file per tensor; a
    `unit_mb` of a byte timed the page it was rounded up to."""
    args = [a.replace("OUT", str(tmp_path / "ck")) for a in args]
    one_line(cli_here(module, *args), *words)
    assert not (tmp_path / "ck").exists()


def _bad_params() -> list[tuple[str, str, Any]]:
    """(planner, param, a value out of any range) for each number or string param of every
    registered planner."""
    import dataclasses
    import typing

    from planners.registry import entry, planner_names

    out = []
    for name in planner_names():
        cls = entry(name).params
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = typing.get_args(hints[f.name]) or (hints[f.name],)
            bad = [-7, 10**9] if int in kinds else [-7.5, 1e9] if float in kinds else []
            out += [(name, f.name, v) for v in bad + (["zzz"] if str in kinds else [])]
    return out


def test_every_planner_param_line_names_the_param_as_typed_and_the_planner_once() -> None:
    """fiddler's `resident_share=2` said `resident_share=2.0 must be in [0, 1]` (a user types
    planner.params.resident_share); eplb's said `planner eplb: eplb: window=0 ...`."""
    from core.errors import ConfigError
    from planners.registry import make_params

    wrong = []
    for name, param, value in _bad_params():
        try:
            make_params(name, {param: value})
        except ConfigError as e:
            line = str(e)
            once = line.startswith(f"planner {name}: ") and line.count(f"{name}:") == 1
            if not once or f"planner.params.{param}" not in line:
                wrong.append(line)
    assert not wrong, wrong


def test_a_planners_own_line_as_it_plans_names_it_once(cli_here: Any, tmp_path: Path) -> None:
    r = cli_here(
        "experiments.run",
        *TINY[:3],
        "planner=klotski",
        "planner.params.hot_k=99",
        f"hydra.run.dir={tmp_path}",
    )
    line = one_line(r, "planner klotski: planner.params.hot_k=99", "planner.params.hot_k <=")
    assert line.count("klotski:") == 1


@pytest.mark.parametrize("n", ["-1", "2"])
def test_klotski_attn_batches_past_a_group_the_user_set_is_refused(
    cli_here: Any, tmp_path: Path, n: str
) -> None:
    """`attn_batches=99` on a group of 2 was accepted (only 256 was a bound): spans cut to the
    group without a word."""
    r = cli_here(
        "experiments.run",
        *TINY[:3],
        "planner=klotski",
        f"planner.params.n={n}",
        "planner.params.attn_batches=99",
        f"hydra.run.dir={tmp_path}",
    )
    one_line(r, "planner.params.attn_batches=99", "group's 2 batches", "at most 2")


def test_klotski_attn_batches_past_a_group_it_chose_is_cut_and_said(
    cli_here: Any, tmp_path: Path
) -> None:
    args = ["planner=klotski", "planner.params.n=0", "planner.params.attn_batches=99"]
    r = cli_here("experiments.run", *TINY[:3], *args, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "attn_batches=99 spans the whole group" in r.stdout + r.stderr


WORKLOAD = """batch_size: 2
n_batches: 2
prompt_len: 8
gen_len: 3
routing:
  source: synthetic
  KNOB: [math]
"""


@pytest.mark.parametrize("way", ["file", "config-dir", "searchpath"])
@pytest.mark.parametrize("knob", ["tasks", "exclude_tasks"])
def test_a_knob_the_routing_ignores_in_a_users_workload_file_is_refused(
    cli_here: Any, tmp_path: Path, way: str, knob: str
) -> None:
    """`tasks:` in the user's workload file on a synthetic run was ignored without a word (on
    the command line it was refused)."""
    mine = tmp_path / "c" / "workload" / "mine.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text(WORKLOAD.replace("KNOB", knob))
    given = {
        "file": ["workload=" + str(mine)],
        "config-dir": ["--config-dir", str(tmp_path / "c"), "workload=mine"],
        "searchpath": [f"hydra.searchpath=[file://{tmp_path / 'c'}]", "workload=mine"],
    }[way]
    run = f"hydra.run.dir={tmp_path / 'r'}"
    r = cli_here("experiments.run", *given, "model=tiny", "hardware=tiny", "planner=flexgen", run)
    one_line(r, f"workload.routing.{knob} (in {mine})", "synthetic", "drop it from that file")
    assert not (tmp_path / "r" / "summary.json").exists()


def test_the_pool_tracker_runs_through_the_wrapper_that_ignores_hup_and_quit() -> None:
    """loky's resource tracker ran the real python (its executable read when loky was
    imported), so a SIGHUP or SIGQUIT killed it and the one loky started again printed a
    KeyError traceback per name after the sweep's lines."""
    import sys

    import joblib.externals.loky.backend.spawn as spawn

    from experiments.common.callbacks import workers_heed_signals, workers_ignore_ctrl_c

    real = workers_ignore_ctrl_c()
    assert real is not None
    try:
        assert spawn.get_executable() == sys.executable != real
        assert "trap '' INT TERM HUP QUIT" in Path(sys.executable).read_text()
    finally:
        workers_heed_signals(real)
    assert spawn.get_executable() == sys.executable == real
