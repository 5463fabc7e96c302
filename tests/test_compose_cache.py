"""The test session's kept steps of hydra's compose (tests/compose_cache.py, on for every test by
tests/conftest.py) give what composing afresh gives: an edited file's new text, a copy that a
command may change, an override's parse that a caller may change, a failure each time."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from tests.compose_cache import composing_kept


def _composed(conf_dir: Path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        out = OmegaConf.to_container(compose("config", list(overrides)), resolve=True)
    assert isinstance(out, dict)
    return out


def test_an_edited_file_composes_as_its_new_text(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("a: 1\nb: ${a}\n")
    with composing_kept():
        assert _composed(tmp_path) == {"a": 1, "b": 1}
        (tmp_path / "config.yaml").write_text("a: 2\nb: ${a}\n")
        assert _composed(tmp_path) == {"a": 2, "b": 2}
        (tmp_path / "config.yaml").write_text("a: [\n")
        for _ in range(2):  # a file that does not parse fails each time, in hydra's words
            with pytest.raises(Exception, match="config.yaml"):
                _composed(tmp_path)


def test_what_a_compose_returns_is_its_own(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("a: {b: 1}\n")
    with composing_kept(), initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        first = compose("config", ["a.b=2"])
        first.a.b = 3
        assert compose("config", ["a.b=2"]).a.b == 2
        assert compose("config").a.b == 1
        with_hydra = compose("config", return_hydra_config=True)  # hydra's own configs' too
        hydras = OmegaConf.to_yaml(with_hydra.hydra)
        with_hydra.hydra.help.app_name = "changed"
        assert OmegaConf.to_yaml(compose("config", return_hydra_config=True).hydra) == hydras


def test_a_parsed_override_is_the_callers_own() -> None:
    with composing_kept():
        (first,) = OverridesParser.create().parse_overrides(["x=1,2"])
        first.key_or_group = "changed"
        (again,) = OverridesParser.create().parse_overrides(["x=1,2"])
        assert again.key_or_group == "x" and list(again.sweep_string_iterator()) == ["1", "2"]
        for _ in range(2):
            with pytest.raises(Exception, match="no viable alternative"):
                OverridesParser.create().parse_overrides(["x=["])


def test_an_interpolated_default_follows_each_composes_choice(tmp_path: Path) -> None:
    """A default of c/z.yaml interpolates the choice of `a` its parent made: the same defaults
    list each time, another choice."""
    (tmp_path / "config.yaml").write_text("defaults:\n  - c: z\n  - a: x\n  - _self_\n")
    for group in ("a", "b", "c"):
        (tmp_path / group).mkdir()
        for name in ("x", "y", "z"):
            (tmp_path / group / f"{name}.yaml").write_text(f"{group}{name}: 1\n")
    (tmp_path / "c" / "z.yaml").write_text("defaults:\n  - /b: ${a}\n  - _self_\n")
    with composing_kept():
        for choice in ("y", "x", "y"):
            want = {"a": {f"a{choice}": 1}, "c": {"b": {f"b{choice}": 1}}}
            assert _composed(tmp_path, f"a={choice}") == want


def test_a_configs_defaults_are_merged_once_and_each_compose_gets_its_own_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The project's tiny run config composed afresh and kept: the same config (its hydra node
    too), its defaults loaded and merged the first time only, and a copy that a command may
    change."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    import experiments.common.app  # noqa: F401 (the schemas it stores)

    conf = Path(__file__).resolve().parents[1] / "conf"
    tiny = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]

    def yaml_of() -> tuple[str, Any]:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            cfg = compose("config", tiny, return_hydra_config=True)
        return OmegaConf.to_yaml(cfg), cfg

    merged: list[Any] = []
    load = ConfigLoaderImpl._load_single_config
    monkeypatch.setattr(
        ConfigLoaderImpl,
        "_load_single_config",
        lambda self, default, repo: merged.append(default) or load(self, default, repo),
    )
    hydras = inspect.unwrap(ConfigLoaderImpl._compose_config_from_defaults_list)
    monkeypatch.setattr(ConfigLoaderImpl, "_compose_config_from_defaults_list", hydras)
    fresh, _ = yaml_of()  # hydra's own (the test session's kept composes set aside)
    merged.clear()
    with composing_kept():
        first, cfg = yaml_of()
        cfg.workload.batch_size = 99
        n = len(merged)
        again, _ = yaml_of()
    assert first == again == fresh
    assert n > 0 and len(merged) == n  # the second compose merged nothing again
