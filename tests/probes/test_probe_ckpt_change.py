"""A checkpoint rewritten or replaced while a real run reads it (an offloaded unit is read each
time it is loaded, over the whole run): the run fails with one line naming the file, and keeps
no result, rather than giving one of two checkpoints' weights mixed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.spec import RoutingConfig, Workload
from core.types import RoutingSource
from experiments.common import dist_run
from experiments.common.pipeline import RunSpec
from experiments.common.real_run import real_execute
from real.checkpoint import load_checkpoint
from real.executor import Executor
from tests.conftest import hardware_from_conf
from tests.probes.conftest import raises_one_line

WEIGHTS = "model.safetensors"


def spec_of(ckpt: Path, planner: str, **params: Any) -> RunSpec:
    wl = Workload(
        batch_size=2,
        n_batches=1,
        prompt_len=4,
        gen_len=2,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    hw = hardware_from_conf("h200-hgx8")
    return RunSpec(load_checkpoint(ckpt)[0], hw, wl, planner, params)


def replace_weights(ckpt: Path) -> None:
    """The weights' file replaced by a copy (another inode): what `cp new model.safetensors`
    through a temporary name, or a re-download, does."""
    tmp = ckpt / "new.tmp"
    shutil.copyfile(ckpt / WEIGHTS, tmp)
    os.replace(tmp, ckpt / WEIGHTS)


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))


@pytest.mark.parametrize("edit", ["replaced", "rewritten", "config edited"])
def test_a_checkpoint_changed_while_a_run_reads_it_is_one_line(
    ckpt: Path, edit: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its weights' file replaced by other valid weights, rewritten in place, or its
    config.json edited, while a one-process run ran: the run gave a result without a word."""
    run = Executor.run_replay

    def edited(self: Executor, *a: Any, **kw: Any) -> Any:
        if edit == "replaced":
            replace_weights(ckpt)
        elif edit == "rewritten":
            data = (ckpt / WEIGHTS).read_bytes()
            (ckpt / WEIGHTS).write_bytes(data)
            os.utime(ckpt / WEIGHTS, ns=(1, 1))  # as a copy that keeps another file's times
        else:
            config = ckpt / "config.json"
            config.write_text(config.read_text().replace("}", ', "edited": 1}', 1))
        return run(self, *a, **kw)

    monkeypatch.setattr(Executor, "run_replay", edited)
    spec = spec_of(ckpt, "flexgen")
    name = WEIGHTS if edit != "config edited" else "config.json"
    line = raises_one_line(lambda: real_execute(ckpt, spec), str(ckpt / name), "changed")
    assert "not kept" in line


def test_a_distributed_run_checks_the_checkpoint_over_all_its_ranks(
    ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a distributed run start seconds apart: a change between the first's start
    and the second's was inside neither rank's own check, and the ranks ran on two checkpoints'
    weights. The command checks over the whole of its ranks' time."""

    def ranks(g: int, target: Any, args: tuple[Any, ...]) -> str:
        replace_weights(ckpt)
        return "rank 0's result"

    monkeypatch.setattr(dist_run, "_spawn", ranks)
    spec = spec_of(ckpt, "eplb", n_devices=2)
    raises_one_line(
        lambda: dist_run.run_distributed(str(ckpt), spec, "replay", None, 60),
        str(ckpt / WEIGHTS),
        "changed while the run read",
    )
