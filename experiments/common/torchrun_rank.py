"""One rank of a torchrun launch, and how it stops with one line. Its agent stops every rank
(SIGTERM) once one ends; a rank blocked in torch's C++ (a process group's set-up waiting for a
dead peer) ran no Python signal handler, so the agent killed it 30 s later, with no line. A
thread of the rank's own (`watch_local_peers`) acts on SIGTERM (through the signal wakeup fd)
and on a rank beside it that died or stays stopped, whatever the main thread is blocked in.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

from experiments.common.launch_line import (
    all_local,
    gone_peers,
    local_peers,
    record_error,
    say_first,
)
from experiments.common.launch_line import launched_ranks as _launched_ranks

FAILED = 2  # the rank's exit code (dist_run.FAILED)
GONE_S = 2.0  # a rank beside this one dead this long, unsaid by this rank's transfers: it says


def stop_on_sigterm(rank: int, held: list[Any] | None = None) -> None:
    """On SIGTERM, one line for the launch, then exit 2 at once, nothing written (`stopped`)."""

    def handler(*_: Any) -> None:
        stopped(rank, held)

    signal.signal(signal.SIGTERM, handler)


def stopped(rank: int, held: list[Any] | None) -> NoReturn:
    """The agent stopped this rank (SIGTERM). Where another rank said why first
    (`launch_line.say_first`), this one ends without a line; where a rank beside it ended
    without one (killed), the line names that rank, as this rank's transfers find it within a
    second (`held`: this rank's Peers, once made); where every rank still runs, this one was
    the one stopped (a kill of its own, or of the whole launch), and the line says so."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one while this says the first
    lost = gone_peers()
    gone = held[0].wait_gone(1.0) if held and (lost or not all_local()) else None
    if gone is not None:
        line = str(gone)
    elif lost:
        line = (
            f"rank {lost[0]} failed or died first (killed, or ended without a line); "
            f"torchrun stopped rank {rank} (SIGTERM)"
        )
    else:
        line = f"rank {rank} was stopped (SIGTERM); the run did not finish and wrote nothing"
    record_error(f"error: {line}")
    ended(f"error: {line}")


def ended(line: str) -> NoReturn:
    """Say `line` (where no rank said one first) and end this rank at once (`os._exit`: its main
    thread may be blocked in C++), its run dir taken away first where it holds only what hydra
    put there (`run_dir.remove_unused_now`): exiting so skipped the command's `finally`, and
    a SIGHUP to the launch's group left a run dir of .hydra and run.log."""
    say_first(line)
    run_dir = sys.modules.get("experiments.common.run_dir")  # none listed where not imported
    if run_dir is not None:
        with contextlib.suppress(Exception):  # ends the same, whatever the disk says
            run_dir.remove_unused_now()
    os._exit(FAILED)


def alive(pid: int) -> bool:
    """Is the process running (a zombie, dead and not yet reaped, is not)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


class PeerWatch:
    """What the watch thread of `watch_local_peers` acts on: `needed` is set while this rank
    still needs its peers (cleared once the run's last collective is done: a peer that ends
    then has finished, not died)."""

    def __init__(self, rank: int, held: list[Any] | None) -> None:
        self.rank, self.held = rank, held
        self.needed = threading.Event()
        self.needed.set()


def watch_local_peers(rank: int, held: list[Any] | None = None) -> PeerWatch:
    """A thread that ends this rank with one line once a rank beside it (a sibling process of
    the same agent), while this rank needs it, stays stopped (SIGSTOP) for
    `dist_run.STOPPED_S` or has died for `GONE_S`, or once SIGTERM comes (`stopped`), whatever
    the main thread is blocked in. The peers waited for a stopped rank until their stall
    check (120 s), and one blocked in a process group's set-up for a dead rank until the agent
    killed it."""
    watch = PeerWatch(rank, held)
    running = _launched_ranks(os.getppid())
    # a rank that died before this looked (its start: a failed import) is dead from the first
    peers = {r: running.get(r, 0) for r in local_peers()}
    wake = _sigterm_wakeup()  # (read end, write end): the thread keeps both open
    threading.Thread(target=_watch, args=(watch, peers, wake), name="peers", daemon=True).start()
    return watch


def _sigterm_wakeup() -> tuple[socket.socket, socket.socket] | None:
    """The signal wakeup fd (a byte per signal Python handles) as a socket pair, where this is
    the main thread and no other wakeup fd is set (an event loop's is left to it)."""
    read, write = socket.socketpair()
    write.setblocking(False)
    try:
        before = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    except ValueError:  # off the main thread
        before = None
    if before is None or before != -1:
        if before is not None:
            signal.set_wakeup_fd(before, warn_on_full_buffer=False)
        read.close()
        write.close()
        return None
    return read, write


def _watch(
    watch: PeerWatch, peers: dict[int, int], wake: tuple[socket.socket, socket.socket] | None
) -> None:
    from experiments.common import dist_run

    stops = dist_run.Stops()
    dead_since: float | None = None
    while True:
        if wake is None:
            time.sleep(0.2)
        elif select.select([wake[0]], [], [], 0.2)[0] and signal.SIGTERM in wake[0].recv(64):
            stopped(watch.rank, watch.held)
        now = time.monotonic()
        r = stops.long_stopped(peers, now) if watch.needed.is_set() else None
        if r is not None:
            ended(f"error: {dist_run.stopped_line(r)}")
        dead = [q for q, pid in peers.items() if not (pid and alive(pid))]
        if not (dead and watch.needed.is_set()):
            dead_since = None
            continue
        dead_since = dead_since or now
        if now - dead_since > GONE_S:
            ended(
                f"error: rank {dead[0]} died or left while rank {watch.rank} waited for it; "
                f"rank {watch.rank} stopped (rank {dead[0]} gone {GONE_S:g} s)"
            )
