"""How a stop ends a command: Ctrl-C (SIGINT), SIGTERM, SIGHUP or SIGQUIT (Ctrl-\\) becomes one
line on stderr and exit status 128 + the signal, with nothing half-written left behind.

The story, in the order a stop meets it:

1. **Start-up** (`experiments/__init__.py`, while `python -m experiments.X` imports torch,
   hydra): the four signals have the start-up handler, set before any import. A stop there
   says "interrupted: the command had not started; nothing was written" (or "stopped by
   SIGTERM; ...") and exits 128 + N at once (`os._exit`: nothing is open yet).
2. **The command runs** (`cli.run_command` -> `until_interrupted`, in the main thread): each
   signal still at its default (or start-up's) handler gets `_raise_stopped`, which raises
   where the main thread is: Ctrl-C as `Interrupt` (a KeyboardInterrupt), the others as
   `Stopped(signum)`. A handler someone else set (`nohup`'s ignored SIGHUP, torchrun's) is
   left alone. Inside an import, or code run from text (`exec` of a string), raising would
   crash C++ or mark the whole process interrupted, so the signal is sent again 50 ms later
   (`send_later`) until that code is done.
3. **Unwinding**: the exception goes up through the command's `finally`s and `with`s. A run's
   files go in whole or not at all (`deferred.interrupt_deferred`, `run_dir.replace_run`: the
   earlier result is replaced only by a complete new one, a staging `.partial-*` is removed);
   a run dir's lock is released (`dir_lock`); a process pool is stopped (`pool.stop_pool`;
   a sweep's, `pool.sweep_pool_closed`: its workers killed, the jobs not sent taken back).
4. **A stop that a library lost** on the way is not lost: one raised in a `__del__` or weakref
   callback, which Python only prints ("Exception ignored"), is sent again by the
   unraisable-exception hook (`interrupt_again`); one a library caught and dropped is sent
   again when it is freed (`Interrupt.__del__`); one a library kept and never raised is raised
   as the command returns (`_raise_unsent`). `watched` and `lost` keep the books.
5. **The line** (`_say_interrupted`): a progress bar is closed first (`before_line`), the
   warnings held are said (`held_warnings.settle`), a sweep pool's resource tracker is stopped
   and its memmapping folders removed (`pool.stop_pool_tracker`: its words come before the
   line, not after), then one line:
   "interrupted: ..." or "stopped by SIGTERM; ...", its rest set by the command
   (`on_interrupt`: how to resume, or that the result had been written: `result_written`).
   On a distributed launch one rank says it (`launch_line.say_first`). Exit 128 + N (130 for
   Ctrl-C).
6. **Pressed again** while the line is said: the second stop within `GRACE_S` is the same stop,
   taken quietly (`_stopping` -> `again`); a third, or a second after `GRACE_S` (a clean-up
   that hangs), ends the command at once with the first's status and `UNDONE`'s line.
7. **After the work** (`finished`): the command's result is on disk and its status known; a
   stop in Python's teardown from then on exits at once with that status and no line
   (`experiments._quiet_teardown` ignores them once the exit handlers ran).

The other processes: a sweep's pool workers and its resource tracker start with the terminal's
signals ignored (`callbacks.workers_ignore_ctrl_c`, a wrapper python with `trap ''`) and are
killed by the command; a child command one starts ignores them too
(`pool.leave_stops_to_parent`); a forked child gets the default actions back
(`_default_in_child`). Under `experiments.torchrun` the launcher says the line and passes the
stop on to the ranks as SIGINT (`torchrun._say_signals_here`, `begin` and `again` here); a rank
whose error line is said ignores torchrun's SIGTERM (`cli.exit_with`).

What is left on disk: the runs that finished (a sweep's line says where, or that nothing was
kept); never a summary.json without its run's other files, nor a half-written file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import experiments
from core.errors import interrupt_behind
from experiments import STOP_SIGNALS, STOPS, default_handler, stop_words
from experiments.common.held_warnings import settle


def stop_status(signum: int) -> int:
    """The exit status of a command `signum` stopped: 128 + its number (Ctrl-C's 130)."""
    return 128 + signum


# ---- 2. the handler, and the stop it raises ----


class Interrupt(KeyboardInterrupt):
    """Ctrl-C's KeyboardInterrupt (and `Stopped`, a stop's) as the handler raised it (`raised`):
    a library that catches and drops it (see docs/results/random-stops.md) loses it no more.
    Gone while the command that got it runs on with that handler set (its line not said), it is
    sent again, to be raised where the command is then; kept, it is raised as the command
    returns (`lost`)."""

    signum: int = signal.SIGINT
    raised_by: Any = None  # the handler that raised it; None for one the code raised itself
    token = 0  # its entry in _RAISED while the command that got it runs

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # Python's teardown: the modules half gone
            with _LOCK:
                mine = _RAISED.pop(self.token, None) is not None
            if mine:
                send_later(self.signum)


class Stopped(Interrupt):
    """SIGTERM, SIGHUP or SIGQUIT (`kill`, `timeout`, a scheduler, a closed terminal), raised
    where Ctrl-C's KeyboardInterrupt is: every path that Ctrl-C takes (a pool stopped, a lock
    released, no half-written result, a result going in finished first) serves them too."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


_FROM_TEXT = "<string>"  # the file name of code compiled from text (exec, eval, PyRun_String)


def _raise_stopped(signum: int, frame: Any) -> None:
    """Ctrl-C's KeyboardInterrupt or a stop's `Stopped`, but not inside an import: torch's C++
    modules run Python while they load, and an exception raised there ends the process in
    C++'s `terminate` (exit 134, "pybind11::error_already_set"), not with the one line; nor
    inside code the command runs from text (`exec` or `eval` of a string: dataclasses' methods,
    namedtuple's), which marks a KeyboardInterrupt leaving it as the whole process's, however
    it was handled: the command said its line and then ended by SIGINT (exit -2, in a full CI
    run). There it is sent again a moment later (`send_later`), until that code is done."""
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    codes = [f.f_code for f in frames]
    # text run below the command's own call only: `python -c`, or a test worker, runs it all so
    ours = codes[: codes.index(_UNTIL)] if _UNTIL in codes else []
    if any(c.co_filename.startswith("<frozen importlib") for c in codes) or any(
        c.co_filename == _FROM_TEXT for c in ours
    ):
        send_later(signum)
        return
    raise raised(Stopped(signum) if signum in STOP_SIGNALS else Interrupt(), _raise_stopped)


def _default_in_child() -> None:
    """A forked child (a pool's worker) does not inherit `_raise_stopped`: its parent stops it
    with SIGTERM (`terminate()`), which must end it, not raise inside the task it runs."""
    for signum in STOPS:
        if signal.getsignal(signum) is _raise_stopped:
            signal.signal(signum, default_handler(signum))


os.register_at_fork(after_in_child=_default_in_child)


def until_interrupted(main: Callable[[], Any]) -> Any:
    """`main()`; Ctrl-C ends it with one line, not the launcher's traceback, and exit status 130;
    SIGTERM or SIGHUP likewise (`Stopped`), "stopped by SIGTERM; ...", exit 128 + its number.
    What finished is on disk; the line says how to resume (`on_interrupt`). A handler someone
    else set (torchrun's ranks', `nohup`'s ignored SIGHUP) is left as it is."""
    previous = {}
    if threading.current_thread() is threading.main_thread():  # where handlers can be set
        for signum in STOPS:  # start-up's turn ends
            handler = signal.getsignal(signum)
            default = default_handler(signum)
            if handler == default or getattr(handler, "__module__", "") == "experiments":
                signal.signal(signum, _raise_stopped)
                previous[signum] = default  # not start-up's "had not started" after this
    hook = sys.unraisablehook
    sys.unraisablehook = interrupt_again(hook)
    watched(True)  # the interrupts raised from now on are this command's
    python = sys.executable  # a sweep's workers' wrapper replaces it while the sweep runs
    try:
        result = main()
        _raise_unsent()  # an interrupt the hook below caught, which main() outran
        if experiments.AS_COMMAND:
            finished(result if isinstance(result, int) else 0)
        return result
    except Exception as e:  # raised while a stop unwound (a `finally` of hydra's that failed)
        stop = interrupt_behind(e)
        if stop is None:
            raise
        _say_interrupted(stop)
    except KeyboardInterrupt as e:
        _say_interrupted(e)
    except SystemExit as e:  # its own exit: a launcher whose rank said the stop's line, 143
        if experiments.AS_COMMAND and isinstance(e.code, int | None):
            finished(e.code or 0)  # a stop after it: that status, not the default action's
        raise
    finally:  # called in-process (a test, a notebook), it leaves the handlers as it found them
        sys.unraisablehook = hook
        watched(False)  # said, or the command's own end: none is lost
        cancel_unsent()  # an interrupt sent again now would land after the line, at SIG_DFL
        # and the python its subprocesses start: a sweep that failed or was stopped never
        # reached the callback that puts it back (a later `sys.executable` would ignore SIGTERM)
        callbacks = sys.modules.get("experiments.common.callbacks")
        if callbacks is not None and sys.executable != python:
            callbacks.workers_heed_signals(python)
        for signum, handler in previous.items():
            if signal.getsignal(signum) in (_raise_stopped, _stopping):
                signal.signal(signum, handler)


_UNTIL = until_interrupted.__code__


# ---- 4. a stop a library lost: sent again, or raised as the command returns ----


def interrupt_again(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """An unraisable-exception hook: Ctrl-C's KeyboardInterrupt, when it lands in a callback
    Python cannot raise from (a weakref callback of the import machinery, a `__del__`), was
    printed as "Exception ignored" and lost, and the command ran on to exit 0. It is raised
    again, as a signal sent from another thread a moment later: raised from the hook itself,
    its handler ran inside the hook, where the KeyboardInterrupt was lost the same way (seen in
    a full test run); sent later, it reaches the main thread once the hook has returned."""

    def hook(unraisable: Any) -> None:
        e = unraisable.exc_value
        if isinstance(e, KeyboardInterrupt):
            send_later(getattr(e, "signum", signal.SIGINT))  # a `Stopped`'s, or Ctrl-C's
            return
        previous(unraisable)

    return hook


def raised(e: Interrupt, handler: Any) -> Interrupt:
    """`e`, which the signal `handler` raises: where the code it lands in drops it, it is sent
    again (or raised as the command returns: `lost`)."""
    e.raised_by = handler
    with _LOCK:
        if _WATCHED:
            e.token = next(_TOKENS)
            _RAISED[e.token] = e.signum
    return e


def watched(on: bool) -> None:
    """A command starts (`on`) or ends (`until_interrupted`): the interrupts `raised` while one
    runs are its own, until it says its line (`lost`, which forgets them)."""
    with _LOCK:
        if on:
            _WATCHED.append(True)
        elif _WATCHED:
            _WATCHED.pop()
    lost()


def lost() -> list[int]:
    """The signals raised by their handler (`raised`) since the last call, neither gone nor
    sent again: at the command's normal return, the code it ran swallowed and kept each one.
    The command calls it as it starts and ends, so an earlier command's are none of its own."""
    with _LOCK:
        signals = list(_RAISED.values())
        _RAISED.clear()
    return signals


def send_later(signum: int) -> None:
    """Send `signum` to this process a moment later, from another thread (starting a thread
    waits for it, where a signal it sent at once would be handled here, again too early)."""
    later = threading.Timer(0.05, _send_again, (signum,))
    later.daemon = True
    with _LOCK:
        _UNSENT.append((later, signum))
    later.start()


# the interrupts to be sent again, not sent yet: (its timer, the signal)
_UNSENT: list[tuple[threading.Timer, int]] = []
# the signals `raised` since the command last asked (`lost`), by their Interrupt's token
_RAISED: dict[int, int] = {}
_TOKENS = itertools.count(1)
_WATCHED: list[bool] = []  # one per command running (nested: a command run by another)
# reentrant: an `Interrupt` freed by the garbage collector, which may run inside the lock
_LOCK = threading.RLock()


def _send_again(signum: int) -> None:
    with _LOCK:
        _UNSENT[:] = [(t, s) for t, s in _UNSENT if t is not threading.current_thread()]
    os.kill(os.getpid(), signum)


def cancel_unsent() -> list[tuple[threading.Timer, int]]:
    """The interrupts to be sent again and not sent yet, their timers cancelled."""
    with _LOCK:
        unsent, _UNSENT[:] = list(_UNSENT), []
    for timer, _ in unsent:
        timer.cancel()
    return unsent


def _raise_unsent() -> None:
    """Raise, now, an interrupt the unraisable hook is about to send again: a command that
    ended within the hook's moment would otherwise exit 0 as if no signal had come (a SIGHUP
    lost so was seen in a test run); or one its handler raised that the code it ran swallowed
    and kept (`Interrupt`)."""
    signals = [signum for _, signum in cancel_unsent()] + lost()
    if signals:
        raise Stopped(signals[0]) if signals[0] in STOP_SIGNALS else KeyboardInterrupt


# ---- 5. the line ----

# What the line says after "interrupted: ": a command whose output folder is not the same on a
# rerun (a sweep under a timestamped folder, a single run) sets it with `on_interrupt`.
_ON_INTERRUPT = ["finished runs are kept; run the same command again to resume"] * 2
_BEFORE_LINE: list[Callable[[], Any]] = []  # e.g. a progress bar to close first


def on_interrupt(
    text: str, before: Callable[[], Any] | None = None, written: str | None = None
) -> None:
    """What Ctrl-C's line says in this process from now on (how to resume, or that nothing is),
    what to do before printing it (`before`: close a progress bar, whose line it would
    otherwise continue), and what it says once the work's result is written (`written`,
    from `result_written` on)."""
    _ON_INTERRUPT[:] = [text, written or text]
    _BEFORE_LINE[:] = [before] if before else []


def result_written() -> None:
    """The work's result is whole on disk (`run_dir.replace_run`): a stop that comes now says so
    (`on_interrupt`'s `written`). A single run stopped as its files went in said "did not
    finish" beside its new result."""
    _ON_INTERRUPT[0] = _ON_INTERRUPT[1]


def before_line() -> None:
    """Run what must happen before a last line is printed (close a progress bar, whose line
    it would otherwise continue); once."""
    for before in _BEFORE_LINE:
        before()
    _BEFORE_LINE.clear()


def _say_interrupted(e: KeyboardInterrupt) -> None:
    """Ctrl-C's or a stop's one line, and its exit status."""
    lost()  # this one, and any raised before it that a library dropped: said now, none is lost
    code = stop_status(e.signum if isinstance(e, Stopped) else signal.SIGINT)
    begin(code)
    if threading.current_thread() is threading.main_thread():
        for signum in STOPS:  # until `finished` ends it on one at once
            if signal.getsignal(signum) is _raise_stopped:
                signal.signal(signum, _stopping)
    before_line()
    settle(e)  # the warnings held, before the line
    from experiments.common.launch_line import claims_lines, other_rank, say_first
    from experiments.common.pool import stop_pool_tracker

    stop_pool_tracker()
    # Ctrl-C reaches every rank: rank 0 says it, or under torchrun's agent the first rank
    # to say (rank 0, blocked in a transfer, blamed rank 1 for leaving, before its line)
    quiet = other_rank() is not None and not claims_lines()
    if not quiet:
        said = stop_words(e.signum if isinstance(e, Stopped) else signal.SIGINT)
        say_first(f"{said} {_ON_INTERRUPT[0]}")
    if experiments.AS_COMMAND:  # an interrupt sent again (an import's timer) after the line:
        finished(code)  # its status, not the teardown's default action (exit -2 after it)
    sys.exit(code)


# ---- 6. pressed again ----

# The seconds a second stop waits on the first's clean-up: a clean-up that works takes less
# (joining a pool's workers, closing a progress bar); a later press means it hangs.
GRACE_S = 3.0
UNDONE = (
    "stopped again: ended at once, its clean-up left undone (a sweep's workers, its temporary "
    "files in /tmp or /dev/shm may be left)"
)

# the first stop's exit status, when it came (time.monotonic), and the stops since
_FIRST: list[float] = []


def begin(code: int) -> None:
    """The command stops, its exit status `code`: a stop from now on is `again`."""
    _FIRST[:] = [code, time.monotonic(), 0]


def again() -> None:
    """A later stop: the second within `GRACE_S` of the first is taken quietly; a third, or a
    second after it, ends the command now with the first's status and `UNDONE`'s line."""
    if not _FIRST:
        return
    code, since, seen = _FIRST
    _FIRST[2] = seen + 1
    if seen < 1 and time.monotonic() - since <= GRACE_S:
        return
    _end_now(int(code), UNDONE)


def _stopping(signum: int, frame: Any) -> None:
    """A stop that comes while the command says an earlier one's line is that stop (Ctrl-C
    pressed twice): a KeyboardInterrupt raised there (as a progress bar closed, a pool's
    tracker stopped) was a traceback in place of the line. A third ends it (`again`)."""
    again()


# ---- 7. after the work ----


def finished(code: int = 0) -> None:
    """The command's work is done and on disk, its exit status `code`: Ctrl-C, SIGTERM or SIGHUP
    from now on (Python's shutdown: torch's, hydra's, joblib's cleanup) ends it at once with that
    status and no line. SIGTERM ended it by the signal with no line, and Ctrl-C raised a
    traceback in the shutdown."""
    if threading.current_thread() is not threading.main_thread():
        return
    experiments.FINISHED[:] = [code]  # and after the exit handlers (`_quiet_teardown`)
    for signum in STOPS:
        if signal.getsignal(signum) != signal.SIG_IGN:  # `nohup`'s ignored SIGHUP stays so
            signal.signal(signum, lambda signum, frame: _end_now(code))


def _end_now(code: int, line: str | None = None) -> None:
    """End the process now with status `code`: what is buffered flushed, `line` said first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a write this handler interrupted
            stream.flush()
    if line is not None:
        with contextlib.suppress(OSError):  # a terminal gone: the status still says it
            os.write(2, f"{line}\n".encode())
    os._exit(code)
