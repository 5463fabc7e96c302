"""Probe round 19c (issue 48): every writing command as a process on a failing machine.

Classes:
1. A torchrun rank that ends at once (`os._exit`: stopped by its agent's SIGTERM, or its watch
   thread's line for a dead or stopped peer, while its main thread is blocked in C++) skipped
   the command's `finally` and left its run dir holding only hydra's .hydra and run.log (a
   SIGHUP to the launch's group, once in 4 tries): the rank now takes the dir away first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from experiments.common import run_dir, torchrun_rank


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise _Exited(code)


@pytest.mark.parametrize("how", ["sigterm", "peer-dead"])
def test_a_torchrun_rank_ended_at_once_takes_its_run_dir_away(
    how: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """The window: hydra made the dir and wrote .hydra and run.log; the rank ends by
    `os._exit` there (stopped by SIGTERM; its watch thread's line for a dead peer)."""
    monkeypatch.setattr(torchrun_rank.os, "_exit", _exit)
    monkeypatch.setattr(torchrun_rank.signal, "signal", lambda *a: None)
    monkeypatch.setattr(torchrun_rank, "say_first", lambda line: None)
    monkeypatch.setattr(torchrun_rank, "record_error", lambda line: None)
    monkeypatch.setattr(torchrun_rank, "gone_peers", lambda: [])
    out = tmp_path / "runs" / "a"
    with run_dir.run_dirs_made() as made:
        made.append((out, tmp_path / "runs", frozenset()))  # as hydra's run_job lists it
        (out / ".hydra").mkdir(parents=True)
        (out / ".hydra" / "config.yaml").write_text("a: 1\n")
        (out / "run.log").write_text("")
        with pytest.raises(_Exited):
            if how == "sigterm":
                torchrun_rank.stopped(0, None)
            else:
                torchrun_rank.ended("error: rank 1 died or left while rank 0 waited for it")
        assert not (tmp_path / "runs").exists()
    assert run_dir.OPEN_RUN_DIRS == []
