"""The forkserver that spawned ranks fork from (`server_context`): what it does as it starts
(`as_server`, run by `rank_server_init`, its first preload) and a watch of it from the command
(`ServerWatch`). It is a child of the command and the parent of every rank, so a fault of it is
a fault of the run: its death lost the ranks' exit codes (multiprocessing reads 255) and, while
it was stopped (SIGSTOP), the command waited for them for ever."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from core.files import ulimits
from experiments import TERMINAL_SIGNALS

PARENT_VAR = "MOEPIPE_RANK_SERVER_PARENT"  # the command's pid, for the server to check
LOST = 255  # multiprocessing's exit code for a process whose server went away
# how multiprocessing starts its forkserver (`python -c "from multiprocessing.forkserver ..."`)
SERVER_CMDLINE = b"from multiprocessing.forkserver import main"
# what a rank imports, once in the server its processes fork from (`server_context`);
# experiments first: its __init__ sets what torch reads as it loads
PRELOAD = [
    "experiments.common.rank_server_init",
    "experiments.common.real_run",
    "real.distributed",
    "torch.distributed",
]


def server_context() -> Any:
    """Ranks fork from a server process that imported torch and the executor once (forkserver):
    each spawned rank imported them itself, 2.5 s of CPU per rank before it did anything. The
    server is a fresh interpreter that never touches CUDA, so a forked rank may (PyTorch's
    multiprocessing notes: spawn or forkserver for CUDA)."""
    from multiprocessing import resource_tracker

    os.environ[PARENT_VAR] = parent_value()  # the server reads it (`rank_server.as_server`)
    # the server's start starts multiprocessing's resource tracker first, which unblocks Ctrl-C
    # and SIGTERM in this process as it does (CPython 3.11): the server then started with Ctrl-C
    # open, and one at the terminal printed its traceback from the interpreter's start. The
    # tracker ignores Ctrl-C and SIGTERM, not SIGHUP: a closed terminal killed it, and its
    # relaunch warned in two lines above the command's; it keeps SIGHUP (and Ctrl-backslash's
    # SIGQUIT) blocked from here
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP, signal.SIGQUIT])
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    ctx = mp.get_context("forkserver")
    # read when the server starts: the first run's
    ctx.set_forkserver_preload([*PRELOAD, *_start_method_module()])
    return ctx


def _start_method_module() -> list[str]:
    """The module that registers this process's start method, where a library's is set (in a
    joblib sweep's worker, loky's): each rank sets its parent's method as it starts, and the
    server, without loky's module, failed every rank of a sweep's distributed run ("cannot
    find context for 'loky'", said as `rank 0 died (exit code 1)`)."""
    method = mp.get_start_method(allow_none=True)
    module = type(mp.get_context(method)).__module__ if method else "multiprocessing"
    return [] if module.split(".")[0] == "multiprocessing" else [module]


def as_server() -> None:
    """In the server, before it imports torch: Ctrl-C and SIGHUP at the terminal are the
    command's (one at the server printed its KeyboardInterrupt's traceback under the command's
    line), and it dies with the command (a command killed with SIGKILL left it importing torch
    and forking a rank for seconds)."""
    from experiments.common.pool import die_with_parent

    for signum in TERMINAL_SIGNALS:  # and Ctrl-backslash's SIGQUIT
        signal.signal(signum, signal.SIG_IGN)
    sys.excepthook = _quiet_end
    # SIGTERM stays blocked (a rank forks with it so, and unblocks it once set), and a thread
    # takes it: one sent to the server alone (`kill PID`) was held for ever, the run going on
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    threading.Thread(target=_term_to_command, name="sigterm-relay", daemon=True).start()
    parent = os.environ.get(PARENT_VAR, "")
    if not parent.isdigit():  # started off the command's main thread: see `parent_value`
        return
    die_with_parent()
    if os.getppid() != int(parent):
        os._exit(0)  # the command died before the server asked to die with it


def _term_to_command() -> None:
    """In the server: each SIGTERM it gets is sent on to the command, its parent, which stops
    the run in its one line (`kill` of the launcher's); the server then dies with it. A SIGTERM
    to the command's group reaches the command twice: its second stop is the same stop
    (`stop_again`)."""
    while True:
        signal.sigwait({signal.SIGTERM})
        parent = os.getppid()
        if parent > 1:
            with contextlib.suppress(OSError):
                os.kill(parent, signal.SIGTERM)


def _quiet_end(kind: type[BaseException], e: BaseException, tb: Any) -> None:
    """The server's end by a lost connection or a system limit (out of file descriptors: its
    `recvfds` raises EOFError, or an AssertionError where the descriptors came cut short) is
    the command's to say, in its one line naming the limit (`ServerWatch.why`): the server's
    own traceback came first, over 8 lines. Anything else is printed as Python would (a rank
    puts Python's hook back: `dist_run._rank_process`)."""
    last = tb
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    receiving = last is not None and last.tb_frame.f_code.co_name == "recvfds"
    if not (issubclass(kind, EOFError | OSError) or receiving):
        sys.__excepthook__(kind, e, tb)


def few_descriptors() -> bool:
    """This process may open fewer files than the ranks' start needs with room to spare (a
    few per rank, and the server's own): `ulimit -n` below 256."""
    try:
        import resource
    except ImportError:  # not POSIX
        return False
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 256


def parent_value() -> str:
    """PARENT_VAR for a server this thread starts: the command's pid, or (off the main thread)
    a value that keeps the server from dying with its parent, which Linux reads as the thread
    that started it (a joblib thread's end would kill a server other threads still use)."""
    if threading.current_thread() is threading.main_thread():
        return str(os.getpid())
    return f"{os.getpid()}:thread"


def parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (from /proc), or None where it is gone or unknown."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def server_pid() -> int | None:
    """This process's forkserver's pid while it runs, or None: its child whose command line is
    multiprocessing's server's (`ForkServer.ensure_running`), found through /proc, not the
    private attribute multiprocessing keeps it in. One that died shows no command line."""
    me = os.getpid()
    found = None
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if parent_of(int(d.name)) != me:
                continue
            if SERVER_CMDLINE in (d / "cmdline").read_bytes():
                found = max(found or 0, int(d.name))
        except (OSError, ValueError):  # gone meanwhile
            continue
    return found


def kill_server(pid: int, wait_s: float = 1.0) -> None:
    """SIGKILL the server `pid` (this process's child) and wait, up to `wait_s`, until its exit
    can be seen by `os.waitpid`, without reaping it: multiprocessing's next start asks
    waitpid whether the server still runs. The server has a second thread (`_term_to_command`),
    and a killed process's main thread shows as a zombie before its other threads are gone:
    a start in between took the dead server for a live one, and its rank's start failed."""
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return
        except ChildProcessError:  # reaped already, or not this process's child
            return
        time.sleep(0.005)


def is_stopped(pid: int) -> bool:
    """Is the process stopped by a signal (state T; not `t`, a debugger's stop)?"""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone, or no /proc
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["T"]


class ServerWatch:
    """While a run's ranks start and run: a thread that kills the server once it stays stopped
    (SIGSTOP) for `stopped_s`, so the command's wait for it ends (a rank's start, or the exit
    codes it reports); `why()` then says what happened to it, as it does once it died."""

    def __init__(self, stopped_s: float) -> None:
        self.stopped_s = stopped_s
        self.killed: int | None = None  # the server's pid, where this watch killed it
        self.seen: int | None = None  # the server's pid, as last seen running
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rank-server", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the watch, and the server where it is stopped now (its ranks wait for it)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        pid = server_pid()
        if pid is not None and is_stopped(pid):
            kill_server(pid)

    def _run(self) -> None:
        since: float | None = None
        while not self._done.wait(0.2):
            pid = server_pid()
            self.seen = pid or self.seen
            if pid is None or not is_stopped(pid):
                since = None
                continue
            since = since or time.monotonic()
            if time.monotonic() - since > self.stopped_s:
                self.killed = pid
                kill_server(pid)  # its ranks die with it
                return

    def why(self) -> str:
        """One line: the server was stopped too long, or died, so the run stopped."""
        pid = server_pid() or self.seen
        at = f", pid {pid}" if pid is not None else ""
        if self.killed is not None:
            return (
                f"the process that starts the ranks (multiprocessing's forkserver, pid "
                f"{self.killed}) was stopped (SIGSTOP) and did not go on within "
                f"{self.stopped_s:g} s, so the run stopped: run it again"
            )
        fix = "run it again"
        if few_descriptors():  # it dies receiving a rank's descriptors (`_quiet_end`)
            fix = f"{ulimits('n')} may be too few for it: raise it (e.g. ulimit -n 4096) and {fix}"
        return (
            f"the process that starts the ranks (multiprocessing's forkserver{at}) died "
            f"or was killed, and its ranks with it; the run stopped: {fix}"
        )
