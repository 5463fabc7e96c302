"""Probe round 23a (issue 48): round 22's leftovers.

Classes:
1. `~KEY` where KEY is one of a command's own options with a default (a run's `~trace_json`,
   validate's `~gen_len`, report's `~metric`): hydra deleted it and the command ran on the
   default without a word. Refused in one line naming the default and `KEY=VALUE`.
"""

from __future__ import annotations

import importlib

import pytest

from tests.probes.conftest import raises_one_line


@pytest.mark.parametrize(
    "module, schema, key, default",
    [
        ("experiments.common.schema", "RunSchema", "trace_json", "false"),
        ("experiments.common.schema", "RunSchema", "skip_finished", "true"),
        ("experiments.common.schema", "RunSchema", "reproduce", "{}"),
        ("experiments.validate", "Options", "gen_len", "4"),
        ("experiments.report", "Options", "metric", "throughput_tok_s"),
    ],
)
def test_deleting_an_option_is_refused_naming_its_default(
    module: str, schema: str, key: str, default: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common import hydra_errors
    from experiments.common.overrides import check_hydra_overrides

    root = getattr(importlib.import_module(module), schema)
    monkeypatch.setattr(hydra_errors, "ROOT_SCHEMA", [root])
    for deleted in (f"~{key}", f"~{key}={default}"):
        line = raises_one_line(
            lambda d=deleted: check_hydra_overrides([d], hydra_errors.CONF_DIR)  # type: ignore[misc]
        )
        assert line.startswith(f"{deleted}: an option cannot be deleted"), line
        assert f"its default, {default})" in line and f"pass {key}=VALUE" in line, line


@pytest.mark.parametrize("deleted", ["~model", "~checkpoint", "~workload.seed"])
def test_deleting_a_group_or_a_null_option_is_left_to_hydras_line(
    deleted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common import hydra_errors
    from experiments.common.overrides import check_hydra_overrides
    from experiments.common.schema import RunSchema

    monkeypatch.setattr(hydra_errors, "ROOT_SCHEMA", [RunSchema])
    check_hydra_overrides([deleted], hydra_errors.CONF_DIR)  # hydra's own one line follows
