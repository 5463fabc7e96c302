"""experiments/common/command_options.py reads each command's options from its source, without
importing it: what it reads must be what the command's schema takes, or a line pointing a
user's key at another command names one that refuses it too."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from experiments.common import command_options
from experiments.common.command_options import ROOT, _options, _schema_name, taken_by


@pytest.mark.parametrize("module", sorted(_options()))
def test_each_commands_options_read_from_its_source_are_its_schemas(module: str) -> None:
    if module == "experiments.run":
        from experiments.common.schema import RunSchema as schema
    else:
        conf = [  # (the last of them, as _options reads them)
            c
            for c in sorted((ROOT / "conf" / "command").glob("*.yaml"))
            if re.match(rf"# python -m {re.escape(module)}:?\s", c.read_text(encoding="utf-8"))
        ][-1]
        path = ROOT / (module.replace(".", "/") + ".py")
        name = _schema_name(path, conf.stem)
        assert name is not None, module
        schema = getattr(importlib.import_module(module), name)
    assert _options()[module] == {f.name for f in dataclasses.fields(schema)}, module


def test_a_key_no_command_takes_names_none() -> None:
    """make_checkpoint lists ModelSpec's fields but the offload tier's (disk_*): a
    `disk_block=` given to any command was said to be make_checkpoint's, which refuses it."""
    command_options._options.cache_clear()
    assert taken_by("disk_block") == ""
    assert "experiments.make_checkpoint" in taken_by("hidden_size")
