"""Probe round 7 (issue 48): cases of classes the earlier rounds left, each checked on the
boundary that had it: a user's YAML file no YAML parser reads, an output path that is a run's
own result file, an empty path taken for the default, an override into a block the config
leaves null, a knob its partner makes idle, a model a real run ignores, and a bench child's
error said twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from real.checkpoint import reduced_spec
from tests.conftest import ROOT
from tests.probes.conftest import TINY, one_line, raises_one_line

NUL_YAML = "name: mine\nfamily: \x00mixtral\n"  # a control character: yaml's reader refuses it


@pytest.mark.parametrize("group", ["hardware", "model"])
def test_a_yaml_file_with_a_character_yaml_refuses_is_named(
    tmp_path: Path, cli_here: Any, group: str
) -> None:
    """yaml's ReaderError has no mark: the line named neither the file nor its line."""
    path = tmp_path / f"{group}.yaml"
    path.write_text((ROOT / "conf" / group / "tiny.yaml").read_text() + "x: \x00\n")
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path}/r")
    one_line(r, f"{path}:", "not valid YAML", "#x0000")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "text, words",
    [
        (NUL_YAML, ["m.yaml:2", "not valid YAML"]),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", ["m.yaml", "nested too deeply"]),
        ("name: [1\n", ["m.yaml:", "not valid YAML"]),
    ],
    ids=["nul", "nested 5000 deep", "unclosed"],
)
def test_a_model_file_make_checkpoint_reads_is_checked_as_runs_are(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    """make_checkpoint's and bench.real's `model=FILE.yaml` (real.checkpoint.reduced_spec):
    a NUL was an unnamed line, 5000 brackets an internal RecursionError."""
    path = tmp_path / "m.yaml"
    path.write_text(text)
    raises_one_line(lambda: reduced_spec(str(path)), *words)
