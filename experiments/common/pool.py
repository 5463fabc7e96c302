"""A process pool a command can stop at once: its workers leave Ctrl-C to the command, and on
Ctrl-C or a failed task the command cancels what is queued and ends what runs (leaving a
`ProcessPoolExecutor`'s `with` block alone waits for every queued task).

Usage:
    pool = ProcessPoolExecutor(workers, initializer=ignore_ctrl_c)
    with pool, stopped_on_error(pool):
        ...
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from core.errors import MoepipeError, integer_below
from experiments import TERMINAL_SIGNALS


def ignore_ctrl_c() -> None:
    """A worker leaves Ctrl-C (and a closed terminal's SIGHUP, Ctrl-backslash's SIGQUIT) to the
    parent, which stops the pool and prints the one line (a worker's own KeyboardInterrupt would
    print its traceback first). SIGTERM keeps its default action: `stop_pool` ends a worker with
    it. It dies with its parent (`die_with_parent`)."""
    for signum in TERMINAL_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent()


def leave_stops_to_parent() -> None:
    """A child command's start (`preexec_fn`): the stops its whole group gets (Ctrl-C, a closed
    terminal's SIGHUP, Ctrl-\\, a scheduler's SIGTERM to the group) ignored, which stays so
    across exec; the parent (`subprocess.run`, `run_side`) kills the child on them and prints
    the one line, which the child's own would repeat (bench.real's calibrate said "stopped by
    SIGTERM" beside the bench's). It dies with the parent (`die_with_parent`)."""
    for signum in (*TERMINAL_SIGNALS, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    die_with_parent()


def die_with_parent() -> None:
    """On Linux, this process is killed when the one that started it dies: a sweep killed
    with SIGKILL left its pool's workers running their runs, ignoring Ctrl-C, for minutes.
    Elsewhere nothing changes."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def stopped_on_error(pool: ProcessPoolExecutor) -> Iterator[None]:
    """On Ctrl-C or a failed run, `stop_pool` the pool: leaving its `with` block alone waits for
    every queued run to finish (`shutdown(wait=True)`), so the command hung."""
    try:
        yield
    except BaseException:
        stop_pool(pool)
        raise


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Cancel the queued runs and end the running ones: SIGTERM, and SIGKILL for a worker still
    there 2 s later. A worker's end is seen on its sentinel, not with join() or is_alive(): the
    pool's own thread reaps the workers meanwhile (waitpid), and is_alive() of a worker reaped
    by another thread is True (its waitpid fails with ECHILD), which read as a worker that
    outlived SIGKILL."""
    # the pool's worker processes: private to concurrent.futures (Python 3.11); where missing,
    # the running runs finish before the command ends
    procs = list((getattr(pool, "_processes", None) or {}).values())
    manager = getattr(pool, "_executor_manager_thread", None)  # private too, as above
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in procs:
        proc.terminate()
    left = {proc.sentinel: proc for proc in procs}
    deadline = time.monotonic() + 2.0
    while left and time.monotonic() < deadline:
        for ended in wait(list(left), timeout=max(0.0, deadline - time.monotonic())):
            left.pop(ended)
    for proc in left.values():  # a worker that ignores or handles SIGTERM
        proc.kill()
    # The pool's thread closes its wake-up pipe as it ends. Left running, it raced the wake-up
    # concurrent.futures sends it at interpreter exit, which then printed an "Exception
    # ignored ... Bad file descriptor" traceback after the command's one line.
    if manager is not None and manager.is_alive():
        manager.join(timeout=5.0)


def checked_workers(n: int, key: str) -> None:
    """A MoepipeError where `key`=`n` worker processes is below 1, or over 4 per core of this
    machine (each worker is a python process of its own, ~200 MB)."""
    if n < 1:
        raise MoepipeError(f"{integer_below(key, n, 1, 'worker processes')}; pass {key}=1 or more")
    cores = os.cpu_count() or 1
    if n > 4 * cores:
        raise MoepipeError(
            f"{key}={n}: over 4 worker processes per core of this machine's {cores}; "
            f"pass {key}={cores}"
        )


def close_sweep_pool(kill_workers: bool = False) -> None:
    """Close the worker pool joblib keeps for reuse after a sweep (loky's reusable executor,
    in this process) with its memmapping folders, while the resource tracker that registered
    them still runs. Left open, its folders were unregistered only at exit, and where that
    tracker had been stopped meanwhile (an interrupt, `stop_pool_tracker`) the one loky
    started in its place printed a KeyError traceback per folder after the command's last
    line, in any process that ran a sweep in-process (a test, a notebook)."""
    module = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(module, "_executor", None)
    if executor is None:
        return
    if kill_workers:
        take_back_unsent(executor)
    terminate = getattr(executor, "terminate", None)  # joblib's MemmappingExecutor's
    if terminate is not None:
        terminate(kill_workers=kill_workers)
    else:
        executor.shutdown(wait=True, kill_workers=kill_workers)


def take_back_unsent(executor: Any) -> None:
    """Before a loky pool is killed (`shutdown(kill_workers=True)`): mark it shut down and take
    back the jobs its manager thread has not sent to a worker yet, their futures cancelled.

    loky's manager thread, on a kill, drops every job it holds (`pending_work_items`) but not
    their ids still queued for it (`_work_ids`), then fills the workers' queue once more
    (`add_call_item_to_queue`): a job submitted just before the kill, whose id the thread had
    not taken yet (it had not run since: a loaded machine), was looked up and gone, a KeyError
    that ended the thread, printed by Python as "Exception in thread ExecutorManagerThread"
    after the command's line (seen under a loaded CI run, as a sweep's point timed out). Here
    the ids are taken with the lock that `submit` holds, and the pool is marked shut down under
    it, so no job comes in after: the thread finds none.

    A lock that stays held is not waited for (`_held_for`): a stop raised as `submit` released
    one (in `Condition.__exit__`, before its release ran) leaves it held for good, and waiting
    on it hung the command before its line. The kill is then as before. Private to loky
    (joblib 1.6): where its parts are missing, nothing is done either."""
    lock = getattr(executor, "_shutdown_lock", None)
    ids = getattr(executor, "_work_ids", None)
    jobs = getattr(executor, "_pending_work_items", None)
    flags = getattr(executor, "_flags", None)
    if lock is None or not isinstance(ids, queue.Queue) or jobs is None or flags is None:
        return
    taken = []
    with _held_for(lock) as held, _held_for(ids.mutex) as ids_held:
        if held and ids_held:
            flags.shutdown = True  # what `shutdown` marks, under this lock: `submit` refuses now
            flags.kill_workers = True
            taken = [jobs.pop(work_id, None) for work_id in ids.queue]
            ids.queue.clear()
    for job in taken:  # (its callbacks, joblib's, run here: outside the lock that submit takes)
        if job is not None:
            job.future.cancel()


@contextlib.contextmanager
def _held_for(lock: Any) -> Iterator[bool]:
    """`lock` held inside, if it comes free within a second (another thread holds such a lock
    for microseconds); False where it did not, which only a stop that cut its holder short
    explains."""
    held = lock.acquire(timeout=1.0)
    try:
        yield held
    finally:
        if held:
            lock.release()


@contextlib.contextmanager
def sweep_pool_closed() -> Iterator[None]:
    """A sweep in this block leaves no worker pool behind (`close_sweep_pool`): its workers
    finish their jobs, or on an error or interrupt are killed, the jobs not sent to one taken
    back first (`take_back_unsent`, also where joblib kills the pool itself: `_loky_backend`)."""
    import joblib.parallel as jp

    loky, ours = jp.BACKENDS.get("loky"), _loky_backend()
    if loky is jp.LokyBackend:  # (not a backend someone else registered as "loky")
        jp.BACKENDS["loky"] = ours  # hydra's joblib launcher names "loky" itself
    try:
        yield
    except BaseException:
        close_sweep_pool(kill_workers=True)
        raise
    finally:
        if loky is not None:
            jp.BACKENDS["loky"] = loky
    close_sweep_pool()


def _loky_backend() -> type:
    """joblib's loky backend, taking back the jobs not sent (`take_back_unsent`); made once."""
    if _BACKEND:
        return _BACKEND[0]
    from joblib.parallel import LokyBackend

    class LokyBackendTakingBack(LokyBackend):  # type: ignore[misc]
        """joblib's loky backend, its pool killed on a failed or timed-out job, or Ctrl-C, as
        joblib kills it (`abort_everything`), the jobs not sent to a worker taken back first
        (`take_back_unsent`)."""

        def abort_everything(self, ensure_ready: bool = True) -> None:
            if self._workers is not None:
                take_back_unsent(self._workers)
            super().abort_everything(ensure_ready=ensure_ready)

    _BACKEND.append(LokyBackendTakingBack)
    return LokyBackendTakingBack


_BACKEND: list[type] = []


def stop_pool_tracker() -> None:
    """Let joblib's worker-pool resource tracker (loky's: a process of its own, which a `-m`
    sweep starts) finish now, so that what it says comes before Ctrl-C's line, not after it.

    Ctrl-C reaches the pool's workers too, and now and then one of the pool's semaphores is
    left registered; the tracker, which ends when this process does, then warns of "1 leaked
    semlock objects" after the line that says how to resume (and after the shell's prompt). The
    pool is gone by now (joblib kills its workers on the interrupt), so this runs what exit
    would (the multiprocessing finalizers that unlink and unregister the live semaphores) and
    then stops the tracker, which cleans up whatever is left before it ends."""
    from multiprocessing import util

    # Private to loky and multiprocessing (as of joblib 1.6, Python 3.11): where either is missing,
    # as in a later version, the line is printed as before, the tracker's words after it.
    module = sys.modules.get("joblib.externals.loky.backend.resource_tracker")
    stop = getattr(getattr(module, "_resource_tracker", None), "_stop", None)
    finalizers = getattr(util, "_run_finalizers", None)
    if stop is None or finalizers is None:
        remove_memmap_folders()
        return
    # the tracker ends only once every process holding its pipe is gone: a pool joblib keeps
    # for reuse (an in-process sweep's, in a test or a notebook) would keep it, and stop() wait
    # for that pool's idle timeout (300 s), so the pool goes first
    close_sweep_pool(kill_workers=True)
    _kill_workers_left()
    finalizers(0)  # exit's first step, run early
    stop()
    remove_memmap_folders()


def remove_memmap_folders() -> None:
    """Remove the memmapping folders this process's sweep made (joblib's, named by its pid, in
    /dev/shm or the temporary folder): a sweep stopped in its first seconds, before joblib
    registered its folder with the tracker, left it in /dev/shm (3 stops in 5 at that moment).
    Its pool is gone by now; nothing of another process's is touched."""
    import shutil
    import tempfile

    for root in dict.fromkeys(("/dev/shm", tempfile.gettempdir())):
        for folder in Path(root).glob(f"joblib_memmapping_folder_{os.getpid()}_*"):
            shutil.rmtree(folder, ignore_errors=True)


def _kill_workers_left() -> None:
    """SIGKILL this process's loky workers that the pool's kill missed (one it was starting as
    the sweep was stopped): each holds the tracker's pipe, and the tracker's stop waited for it
    for good (a sweep stopped by SIGQUIT 5 s in hung, its line never said)."""
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = stat.read_text().rsplit(")", 1)[1].split()[1]
            ours = ppid == me and b"popen_loky_posix" in (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):  # gone meanwhile
            continue
        if ours:
            with contextlib.suppress(OSError):
                os.kill(int(stat.parent.name), signal.SIGKILL)
