"""A stopped sweep's jobs under `hydra/launcher=submitit_local`, stopped with it.

submitit's LocalExecutor starts each job as a controller process (`submitit.local._local`) that
runs the job's task as its child. Both run through the sweep's python wrapper, which ignores
Ctrl-C, SIGTERM, SIGHUP and SIGQUIT (`callbacks.workers_ignore_ctrl_c`), and submitit's task
bypasses SIGTERM itself: a sweep stopped by Ctrl-C or SIGTERM printed its line while its jobs
ran on and wrote their results after it. As joblib's pool is, they are killed (SIGKILL) before
the sweep's line: a run moves its result in whole, so a killed one leaves none, and its next
run (the same command again) clears what it had staged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from experiments.common.rank_server import parent_of
from experiments.common.torchrun_rank import alive

GONE_S = 5.0  # how long to wait for a killed task to be gone
CONTROLLER = b"submitit.local._local"  # in the command line of a job's controller


def stop_local_jobs() -> None:
    """Kill every submitit local job this process started that still runs, its tasks first,
    and wait until they are gone. Nothing where submitit's local executor was not used."""
    if "submitit.local.local" not in sys.modules:
        return
    me = os.getpid()
    controllers = [pid for pid in _pids() if parent_of(pid) == me and _is_controller(pid)]
    tasks = [pid for pid in _pids() if parent_of(pid) in controllers]
    for pid in [*tasks, *controllers]:
        with contextlib.suppress(OSError):  # gone meanwhile
            os.kill(pid, signal.SIGKILL)
    for pid in controllers:  # submitit's Popen of it, reaped here, reads its code as 0
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    deadline = time.monotonic() + GONE_S
    while any(alive(pid) for pid in tasks) and time.monotonic() < deadline:
        time.sleep(0.02)


def _is_controller(pid: int) -> bool:
    try:
        return CONTROLLER in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return False


def _pids() -> list[int]:
    return [int(d.name) for d in Path("/proc").glob("[0-9]*")]
