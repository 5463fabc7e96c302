"""Probe class: what a writer killed outright (SIGKILL, out of memory) leaves behind. Its hidden
staging folder (`.partial-PID-HEX`) stayed in the run dir or checkpoint folder for good, its
bytes counted against the disk of every later write there; the next writer removes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.files import staging_dir
from tests.probes.conftest import TINY


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)


def _leftover(folder: Path, pid: int, hexpart: str = "0badc0de") -> Path:
    stale = folder / f".partial-{pid}-{hexpart}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    return stale


def test_staging_removes_only_dead_writers_folders(tmp_path: Path) -> None:
    """A dead writer's folder goes, and so does its aside folder of replaced outputs
    (`-earlier`), once they are back in place; a live one's (this process's) and a name of
    another shape stay."""
    dead = _leftover(tmp_path, _dead_pid())
    live = _leftover(tmp_path, os.getpid())
    aside = _leftover(tmp_path, _dead_pid(), "0badc0de-earlier")
    other = _leftover(tmp_path, 12, "not-hex!")
    new = staging_dir(tmp_path)
    assert not dead.exists() and not aside.exists()
    assert (tmp_path / "model.safetensors").is_file()  # the output set aside, back
    assert live.exists() and other.exists()
    assert not new.exists() and new.name.startswith(f".partial-{os.getpid()}-")


def test_a_killed_make_checkpoints_folder_goes_with_the_next_one(
    tmp_path: Path, cli_here: Any
) -> None:
    out = tmp_path / "ck"
    stale = _leftover(out, _dead_pid())
    r = cli_here("experiments.make_checkpoint", f"out={out}", "model=tiny")
    assert r.returncode == 0, r.stderr
    assert not stale.exists()
    assert (out / "config.json").is_file()


def test_a_killed_runs_folder_goes_with_the_next_run(tmp_path: Path, cli_here: Any) -> None:
    run = tmp_path / "run"
    stale = _leftover(run, _dead_pid())
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    assert not stale.exists()
    assert (run / "summary.json").is_file()
