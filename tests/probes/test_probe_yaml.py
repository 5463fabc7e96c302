"""Probe class: a YAML file given by path (`hardware=FILE.yaml`, `model=FILE.yaml`) or read back
from a run dir (config.yaml) whose aliases expand past any config (a "billion laughs"), refer
to themselves, or nest thousands deep: one line naming the file, never a hang or an internal
RecursionError. Aliases of an ordinary size still load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from core.yaml_size import MAX_NODES, check_yaml_size
from experiments.common.tables import collect
from tests.conftest import ROOT
from tests.probes.conftest import TINY, deadline, one_line

# nine levels of nine aliases each: 9^9 (387 million) values once expanded
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)
BOMBS = [
    ("billion laughs", LAUGHS, "aliases"),
    ("alias inside itself", "r: &r [*r]\n", "aliases"),
    ("nested 5000 deep", "a: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
]


@pytest.mark.parametrize("group", ["hardware", "model"])
@pytest.mark.parametrize("case, tail, words", BOMBS, ids=[c[0] for c in BOMBS])
def test_a_config_file_that_expands_without_end_is_one_line(
    tmp_path: Path, cli_here: Any, group: str, case: str, tail: str, words: str
) -> None:
    """The billion laughs ran for minutes (hydra building its nodes); 5000 brackets were a
    RecursionError."""
    path = tmp_path / f"{group}.yaml"
    path.write_text((ROOT / "conf" / group / "tiny.yaml").read_text() + tail)
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    with deadline(60):
        r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path}/r")
    one_line(r, str(path), words)
    assert not (tmp_path / "r" / "summary.json").exists()


def test_a_run_dirs_config_yaml_of_laughs_is_skipped_by_collect(tmp_path: Path) -> None:
    run = tmp_path / "sweep" / "a"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(
        '{"planner": "p", "model": "m", "makespan_s": 1.0, "throughput_tok_s": 1.0}'
    )
    (run / "config.yaml").write_text(LAUGHS)
    with deadline(60):
        df, problems = collect(tmp_path / "sweep")
    assert df.empty and len(problems) == 1 and "aliases" in problems[0]


def test_aliases_of_an_ordinary_size_pass() -> None:
    text = "cpu: &c {tflops: 0.1}\ngpu: *c\nlist: &l [1, 2, 3]\nmore: [*l, *l, *l]\n"
    check_yaml_size(text, "f.yaml", "fix it")
    check_yaml_size("x: [" + ", ".join(["1"] * (MAX_NODES // 20)) + "]\n", "f.yaml", "fix it")
    check_yaml_size("a: " + "[" * 100 + "]" * 100 + "\n", "f.yaml", "fix it")


@pytest.mark.parametrize("kind", ["FIFO", "directory", "symbolic link to nothing"])
def test_a_config_path_that_is_no_regular_file_says_what_it_is(
    tmp_path: Path, cli_here: Any, kind: str
) -> None:
    """A FIFO, a folder or a link looping to itself given as hardware=X.yaml was "no such
    file", which it is not."""
    path = tmp_path / "hw.yaml"
    if kind == "FIFO":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(path.name)
    with deadline(60):
        r = cli_here("experiments.run", *TINY[:1], f"hardware={path}", *TINY[2:])
    one_line(r, str(path), "a folder, where a file belongs" if kind == "directory" else kind)


def test_an_integer_of_5000_digits_is_named_not_an_internal_error(
    tmp_path: Path, cli_here: Any
) -> None:
    """PyYAML's int() of 4300+ digits is Python's ValueError: an internal error in a run given
    the file, and in collect reading a run dir's config.yaml."""
    huge = "9" * 5000
    path = tmp_path / "hw.yaml"
    text = (ROOT / "conf" / "hardware" / "tiny.yaml").read_text()
    path.write_text(text.replace("overhead_us: 0}", f"overhead_us: {huge}}}", 1))
    r = cli_here("experiments.run", *TINY[:1], f"hardware={path}", *TINY[2:])
    one_line(r, str(path), "5000 digits")
    run = tmp_path / "sweep" / "a"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(
        '{"planner": "p", "model": "m", "makespan_s": 1.0, "throughput_tok_s": 1.0}'
    )
    (run / "config.yaml").write_text(f"workload:\n  batch_size: {huge}\n")
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and "5000 digits" in problems[0]
