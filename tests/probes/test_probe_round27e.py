"""Round 27e of issue 48: stops and failures around a sweep's worker pool (joblib's, loky's).

Class found: a sweep's pool killed (a point past `hydra.launcher.timeout`, a failed point, Ctrl-C)
just after a job was submitted to it, before loky's manager thread had run again (a loaded
machine: seen once in CI): the thread dropped every job it held but not their ids still queued
for it, looked the new one up, and died of a KeyError that Python printed as "Exception in thread
ExecutorManagerThread" after the command's line. The jobs not sent to a worker are taken back
before a kill now (`pool.take_back_unsent`), by moepipe's own teardown and joblib's.

The thread's interleaving is made here, not waited for: the manager thread, once woken, is held
until its pool is marked shut down, as a machine that does not schedule it would hold it.

Class found (stopping a sweep at each call of its pool's start, in-process): a stop raised as
`submit` released the pool's queue lock (in `Condition.__exit__`, before the release ran) leaves
that lock held for good; the take-back above waited on it and the sweep hung before its line.
A lock still held after a second is not waited for now.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from experiments.common import pool


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """What a thread of this process died of (`threading.excepthook`), for the test to read."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


@pytest.fixture
def manager_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """loky's manager thread, each time it wakes, kept from going on until its pool is marked
    shut down (at most 10 s); the event is set once it is held."""
    from joblib.externals.loky import process_executor as pe

    holding = threading.Event()
    woken = pe._ExecutorManagerThread.wait_result_broken_or_wakeup

    def held(self: Any) -> Any:
        out = woken(self)
        holding.set()
        deadline = time.monotonic() + 10.0
        while not self.executor_flags.shutdown and time.monotonic() < deadline:
            time.sleep(0.001)
        return out

    monkeypatch.setattr(pe._ExecutorManagerThread, "wait_result_broken_or_wakeup", held)
    yield holding
    pool.close_sweep_pool(kill_workers=True)


def _submitted_behind(executor: Any, holding: threading.Event) -> Any:
    """A job submitted while the manager thread is held, after one it took: its id waits."""
    executor.submit(int, 0)
    assert holding.wait(10.0)
    return executor.submit(int, 1)


def test_the_sweeps_own_kill_takes_back_a_job_not_sent(
    manager_held: threading.Event, thread_errors: list[BaseException | None]
) -> None:
    """moepipe's kill of the pool joblib keeps (`close_sweep_pool`, on Ctrl-C or a failure)."""
    from joblib.externals.loky import get_reusable_executor

    executor = get_reusable_executor(max_workers=1)
    behind = _submitted_behind(executor, manager_held)
    manager = executor._executor_manager_thread
    pool.close_sweep_pool(kill_workers=True)
    manager.join(10.0)
    assert thread_errors == [] and behind.cancelled()


def test_joblibs_own_kill_takes_back_a_job_not_sent(
    manager_held: threading.Event, thread_errors: list[BaseException | None]
) -> None:
    """joblib's kill of the pool on a timed-out or failed job, or Ctrl-C (`abort_everything` of
    the backend hydra's launcher names "loky"), in a sweep (`sweep_pool_closed`)."""
    import joblib.parallel as jp

    with pool.sweep_pool_closed():
        backend = jp.BACKENDS["loky"]()
        backend.configure(n_jobs=2, parallel=jp.Parallel(n_jobs=2))
        executor = backend._workers
        behind = _submitted_behind(executor, manager_held)
        manager = executor._executor_manager_thread
        backend.abort_everything(ensure_ready=False)
        manager.join(10.0)
    assert thread_errors == [] and behind.cancelled()
    assert jp.BACKENDS["loky"] is jp.LokyBackend  # joblib's own again after the sweep


def _stopped_as_submit_releases(executor: Any) -> None:
    """`executor.submit`, Ctrl-C landing as the queue of job ids releases its lock (the first
    `Condition.__exit__` that `submit` runs, before the release): its KeyboardInterrupt."""
    sent: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is threading.Condition.__exit__.__code__ and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # its handler runs as the frame starts

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.setprofile(profile)
        executor.submit(int, 0)
    finally:
        sys.setprofile(None)
        signal.signal(signal.SIGINT, previous)


def test_a_lock_a_stop_left_held_is_not_waited_for(
    thread_errors: list[BaseException | None],
) -> None:
    """The sweep's kill of its pool after a stop cut `submit` short as it released the queue's
    lock: waiting on that lock, held for good now, hung the command before its line."""
    from joblib.externals.loky import get_reusable_executor

    pool.close_sweep_pool(kill_workers=True)  # a fresh pool: no manager thread yet
    executor = get_reusable_executor(max_workers=1)
    with pytest.raises(KeyboardInterrupt):
        _stopped_as_submit_releases(executor)
    ids_lock = executor._work_ids.mutex
    assert ids_lock.locked()  # as the stop left it
    ender = threading.Thread(target=pool.close_sweep_pool, args=(True,), daemon=True)
    ender.start()
    ender.join(30.0)
    hung = ender.is_alive()
    ids_lock.release()  # (what a hung kill waits for: it ends now)
    assert not hung and thread_errors == []
