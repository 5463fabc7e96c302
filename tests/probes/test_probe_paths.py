"""Probe class: a path argument a command would take other than as the user meant, without a
word: a quoted '~/x' (hydra's grammar takes no bare '~', and no shell expands a quoted one)
made a folder named '~' in the current one; a run dir that is the folder of the model a run
reads mixed its files with the weights."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import ROOT, TINY, one_line


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.run", [*TINY, "hydra.run.dir='~/moepipe_probe_run'"]),
        ("experiments.run", [*TINY, "workload.routing.trace_dir='~'"]),
        ("experiments.collect", ["dir='~root/sweep'"]),
        ("experiments.trace_json", ["runs=[/tmp,'~/run']"]),
    ],
    ids=["run dir", "trace dir", "collect ~user", "in a list"],
)
def test_a_path_starting_with_a_tilde_is_refused_naming_the_key(
    module: str, args: list[str], cli_here: Any
) -> None:
    """Hydra takes a quoted '~/x' as it is: a run made a folder named `~` in the current one
    (collect read a sweep there) without a word. Now one line naming the key and the path in
    full, and no folder made."""
    r = cli_here(module, *args)
    key = args[-1].partition("=")[0]
    one_line(r, key, "'~", "$HOME")
    assert not (ROOT / "~").exists()


@pytest.mark.parametrize("real", [True, False], ids=["checkpoint", "hf_config"])
def test_a_run_dir_that_is_the_models_folder_is_refused(
    tmp_path: Path, tiny_ckpt: Path, real: bool, cli_here: Any
) -> None:
    """hydra.run.dir= the checkpoint's own folder: the run's files went beside the weights,
    and its tokens.safetensors changed the model's version, so the finished run ran again at
    every command. Now one line naming the run dir and the key, and the weights are as they
    were."""
    ckpt = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    model = ["executor=real", f"checkpoint={ckpt}"] if real else [f"+model.hf_config={ckpt}"]
    args = ["model=mixtral-tiny", *TINY[1:], *model, f"hydra.run.dir={ckpt}"]
    r = cli_here("experiments.run", *args)
    one_line(r, f"hydra.run.dir={ckpt}", "checkpoint=" if real else "model.hf_config=")
    assert not (ckpt / "summary.json").exists() and not (ckpt / "tokens.safetensors").exists()
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in tiny_ckpt.iterdir())


def test_a_refused_run_into_a_folder_of_the_users_adds_nothing_to_it(
    tmp_path: Path, cli_here: Any
) -> None:
    """A run refused into a folder that was there, holding the user's files: hydra's record
    (.hydra) and run.log, which hydra writes before the run reads its options, go again; the
    user's files stay as they were."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    r = cli_here("experiments.run", *TINY, "workload.batch_size=0", f"hydra.run.dir={mine}")
    one_line(r, "workload.batch_size")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
