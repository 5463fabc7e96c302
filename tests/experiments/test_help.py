"""Every command's `--help`: exit 0, the module's docstring first (what the command does and
writes), then its options, in a screenful or two; experiments.run lists its groups' choices
and its own keys rather than every group's composed keys."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from tests.conftest import ROOT, command_here


def _commands() -> list[str]:
    """The command modules: every module directly in experiments/ and experiments/bench/."""
    return sorted(
        f"experiments.{sub}{p.stem}"
        for sub, folder in (("", ROOT / "experiments"), ("bench.", ROOT / "experiments" / "bench"))
        for p in Path(folder).glob("*.py")
        if p.stem != "__init__"
    )


@pytest.mark.parametrize("name", _commands())
def test_help_starts_with_what_the_command_does(name, capsys, monkeypatch):
    module = importlib.import_module(name)
    r = command_here(module.main, ["--help"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == module.__doc__.strip().splitlines()[0], lines[:2]
    assert "== Options" in r.stdout or "== Its own keys" in r.stdout
    assert len(lines) <= 60, f"{name} --help is {len(lines)} lines"


def test_run_help_lists_the_groups_a_user_picks(capsys, monkeypatch):
    from experiments import run

    out = command_here(run.main, ["--help"], capsys, monkeypatch).stdout
    assert "planner: " in out and "flexgen" in out and "skip_finished: true" in out
    assert "hidden_size" not in out  # a group's keys: --cfg job prints them
    assert "planner_params:" not in out and "command:" not in out  # internal groups
