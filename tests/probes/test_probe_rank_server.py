"""Faults of the forkserver that a distributed real run's ranks fork from
(experiments/common/rank_server.py): it is the ranks' parent and the command's child, so its
death or stop is the run's, named in one line; it never outlives the command or prints a
traceback of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from experiments.common import dist_run
from experiments.common.dist_run import _as_rank, _spawn
from tests.conftest import alive, user_env
from tests.probes.conftest import ROOT, deadline, raises_one_line


def _signals_server(rank: int, world: int, init: str, tmp: Path) -> None:
    """Rank 0 sends its parent (the server) `MOEPIPE_PROBE_SIGNAL`; each rank then waits, as
    one whose peer is gone does."""

    def run() -> None:
        if rank == 0:
            os.kill(os.getppid(), int(os.environ["MOEPIPE_PROBE_SIGNAL"]))
        time.sleep(60)

    _as_rank(rank, tmp, run)


def _parent(rank: int, world: int, init: str, tmp: Path) -> None:
    _as_rank(rank, tmp, os.getppid)


@pytest.mark.parametrize(
    "sig, names",
    [  # SIGKILL's case, two ranks and their server killed mid-way: the slow suite
        pytest.param(signal.SIGKILL, ["died or was killed"], marks=pytest.mark.slow),
        (signal.SIGSTOP, ["stopped (SIGSTOP)"]),
    ],
    ids=["SIGKILL", "SIGSTOP"],
)
def test_a_fault_of_the_server_is_one_line_and_ends_its_ranks(
    sig: int, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server killed mid-run was "rank 1 died (exit code 255)" (multiprocessing's code for
    a status it lost) while the rank ran on; the server stopped (SIGSTOP) hung the command for
    ever, its ranks' exit codes never reported. Either is one line naming the server, no rank
    is left, and the next run starts a new server."""
    monkeypatch.setattr(dist_run, "STOPPED_S", 0.5)
    monkeypatch.setenv("MOEPIPE_PROBE_SIGNAL", str(int(sig)))
    server = _spawn(1, _parent, ())
    pids: list[int] = []
    watch = dist_run._watch

    def watched(procs: list[Any], *rest: Any) -> None:
        pids.extend(p.pid for p in procs)
        watch(procs, *rest)

    monkeypatch.setattr(dist_run, "_watch", watched)
    with deadline(60):
        raises_one_line(lambda: _spawn(2, _signals_server, ()), "forkserver", *names)
    gone = time.monotonic() + 10  # the ranks' death signal (PDEATHSIG) on the server's
    while [p for p in pids + [server] if alive(p)] and time.monotonic() < gone:
        time.sleep(0.02)
    assert len(pids) == 2 and not [p for p in pids + [server] if alive(p)]
    assert _spawn(1, _parent, ()) not in (server, os.getpid())


SERVER_MASK = """
import os
from pathlib import Path
from experiments.common.dist_run import _as_rank, _spawn

def blocked(rank, world, init, tmp):
    status = Path(f"/proc/{os.getppid()}/status").read_text()
    _as_rank(rank, tmp, lambda: [l for l in status.splitlines() if l.startswith("SigBlk:")][0])

if __name__ == "__main__":
    from multiprocessing import resource_tracker

    server = _spawn(1, blocked, ())
    status = Path(f"/proc/{resource_tracker._resource_tracker._pid}/status").read_text()
    print(server, [l for l in status.splitlines() if l.startswith("SigBlk:")][0])
"""


def test_the_server_starts_with_ctrl_c_blocked(tmp_path: Path) -> None:
    """Ctrl-C at the terminal while the server started (the command's first distributed run)
    printed the server's KeyboardInterrupt traceback from the interpreter's start: starting
    multiprocessing's resource tracker on the way unblocked Ctrl-C in the command, so the
    server started with it open. It starts with it blocked, as each rank does; the tracker
    keeps SIGHUP blocked (a closed terminal killed it, and its relaunch warned in two lines)."""
    script = tmp_path / "mask.py"
    script.write_text(SERVER_MASK)
    env = dict(user_env(), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    server, tracker = (int(m, 16) for m in r.stdout.split()[1::2])
    assert server & (1 << (signal.SIGINT - 1)), r.stdout
    assert tracker & (1 << (signal.SIGHUP - 1)), r.stdout


LONG_TMP = """
from experiments.common.cli import error_line
from experiments.common.dist_run import _spawn

try:
    _spawn(1, print, ())
except Exception as e:
    print(error_line(e))
"""


def test_a_temporary_folder_too_long_for_the_servers_socket_is_one_line(tmp_path: Path) -> None:
    """TMPDIR of 100 or more characters: the server's socket there could not be bound, and the
    line was "AF_UNIX path too long; check the file and the disk", naming neither the folder
    nor the fix."""
    long = tmp_path / ("x" * 60) / ("y" * 60)
    long.mkdir(parents=True)
    env = dict(user_env(), PYTHONPATH=str(ROOT), TMPDIR=str(long))
    r = subprocess.run(
        [sys.executable, "-c", LONG_TMP], cwd=ROOT, env=env, capture_output=True, text=True
    )
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and str(long) in lines[0] and "set TMPDIR" in lines[0], r.stdout


def test_a_server_started_off_the_main_thread_outlives_that_thread() -> None:
    """The server dies with the command: Linux ties that to the thread that started it, so a
    server a joblib thread started, dying as that thread ended, would have stopped another
    thread's run. Started off the main thread, it stays for the next run."""
    import threading

    from experiments.common.rank_server import kill_server, server_pid

    pid = server_pid()
    if pid is not None:  # a server this process started before: the thread must start its own
        kill_server(pid, wait_s=10)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(_spawn(1, _parent, ())))
    t.start()
    t.join()
    time.sleep(0.5)  # a death signal on the thread's end would have come by now
    assert got and _spawn(1, _parent, ()) == got[0]
