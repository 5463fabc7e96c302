"""Probe round 12b (issue 48): a failing machine. A rank of a torchrun launch that dies at any
point is named by the survivor; the rank server is found without multiprocessing's private
attributes; a path's undecodable bytes print back as typed (LC_ALL=C); a PNG of the user's
where a command's plot goes is refused, not overwritten."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _parent(rank: int, world: int, init: str, tmp: Path) -> None:
    from experiments.common.dist_run import _as_rank

    _as_rank(rank, tmp, os.getppid)


def test_the_rank_server_is_found_without_multiprocessings_private_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server is the ranks' parent; `server_pid` finds it as the command's child running
    multiprocessing's server, whatever multiprocessing keeps privately (it read
    `forkserver._forkserver._forkserver_pid`)."""
    from multiprocessing import forkserver

    from experiments.common.dist_run import _spawn
    from experiments.common.rank_server import server_pid

    server = _spawn(1, _parent, ())
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 1)
    assert server_pid() == server
