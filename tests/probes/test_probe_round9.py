"""Probe round 9 (issue 48): a FIFO in a run file's place, which hashing it against the run's
files.sha256 opened and blocked on, and two make_checkpoint into one folder at once, which
each reported success over a folder of one's config.json and the other's shards."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from experiments.common.dir_lock import LOCK
from experiments.trace_json import read_traces
from tests.probes.conftest import deadline, one_line, raises_one_line


def test_a_fifo_in_a_run_files_place_is_refused_at_once(tmp_path: Path, cli_here: Any) -> None:
    """trace_json hashed summary.json (a FIFO) against files.sha256 and hung until killed."""
    run = tmp_path / "run"
    assert cli_here("experiments.run", *_TINY, f"hydra.run.dir={run}").returncode == 0
    (run / "summary.json").unlink()
    os.mkfifo(run / "summary.json")
    with deadline(5):
        raises_one_line(lambda: read_traces(run), "summary.json", "not a regular file (a FIFO)")


_TINY = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]


def test_a_second_make_checkpoint_into_a_folder_waits_for_the_first(
    tmp_path: Path, cli_here: Any
) -> None:
    """While another holds the folder's lock, no file of the checkpoint appears; once it lets
    go, the checkpoint is written whole (as a second make_checkpoint finds the first's)."""
    out = tmp_path / "ck"
    out.mkdir()
    fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: blocks this process's flock too
    seen: list[bool] = []

    def other_run_ends() -> None:
        # let go once the command waits on the lock (a blocked request in /proc/locks: how long
        # it takes to get there depends on the machine's load), or after a minute
        inode = os.fstat(fd).st_ino
        end = time.monotonic() + 60
        while time.monotonic() < end and not (out / "config.json").exists():
            if _waits_on(inode):
                break
            time.sleep(0.02)
        seen.append((out / "config.json").exists())
        os.close(fd)

    threading.Thread(target=other_run_ends).start()
    r = cli_here("experiments.make_checkpoint", "model=mixtral-tiny", f"out={out}", "n_layers=1")
    assert r.returncode == 0, r.stderr
    assert seen == [False]
    assert f"{out}: another make_checkpoint is writing this folder; waiting" in r.stdout
    assert (out / "config.json").is_file() and not (out / LOCK).exists()
    shutil.rmtree(out)


def _waits_on(inode: int) -> bool:
    """Does a process wait for a lock on the file with this inode (a blocked request's line in
    /proc/locks: `N: -> FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ...`)?"""
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return False
    return any("->" in line and line.split()[-3].endswith(f":{inode}") for line in lines)


def test_a_billion_layers_are_refused_before_they_are_listed() -> None:
    """make_checkpoint n_layers=1e9 listed the MoE layers first and was killed for memory."""
    from real.checkpoint import reduced_spec

    with deadline(5):
        raises_one_line(lambda: reduced_spec("mixtral-tiny", n_layers=10**9), "n_layers=")


def test_a_checkpoint_past_the_ram_is_refused_before_its_weights_are_made(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n_layers=20000 (67 GB) on a 21 GB machine ran until it was killed, its weights all made
    in memory before a file was written. They are made a shard at a time now: a machine with
    RAM for no shard (1000 bytes) is refused, naming what makes a shard smaller."""
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 1000)
    out = tmp_path / "ck"
    r = cli_here("experiments.make_checkpoint", "model=mixtral-tiny", f"out={out}")
    one_line(r, "mixtral-tiny", "RAM available", "shard_mb", "hidden_size")
    assert not out.exists()
