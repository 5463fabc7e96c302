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


def test_composing_a_run_does_not_make_its_schema_a_config(monkeypatch):
    """hydra evaluates --help's template (its own keys, `app._run_keys`) as it composes every
    run's config; the keys come from the schema's fields, not from the schema made a config
    (0.013 s of CPU each run). The keys it lists: the schema's own, with their defaults."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from experiments.common import app
    from experiments.common.schema import RunSchema

    made: list[object] = []
    real = OmegaConf.structured
    monkeypatch.setattr(
        OmegaConf, "structured", lambda obj, *a, **k: made.append(obj) or real(obj, *a, **k)
    )
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", ["planner=flexgen"], return_hydra_config=True)
    assert "skip_finished: true" in cfg.hydra.help.template
    assert RunSchema not in made
    assert app._run_keys().splitlines() == [
        "skip_finished: true",
        "checkpoint: null",
        "reproduce: {}",
        "trace_json: false",
        "replication: null",
    ]
