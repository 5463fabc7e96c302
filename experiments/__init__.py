"""The commands (`python -m experiments.<name>`) and their shared wiring (common/, bench/).

Started as a command, Ctrl-C while Python still imports it (torch, hydra: seconds) is one line
and exit 130, not an import's traceback, and SIGTERM, SIGHUP or SIGQUIT (Ctrl-backslash) one
line and exit 128 + its number, not a silent end; `common.cli.run_command` hands them to the
command's own handler (`command_started`, `common.stops.until_interrupted`) once the command
runs: common/stops.py tells the whole story.
"""

import atexit
import codecs
import contextlib
import gc
import os
import signal
import sys
from types import FrameType
from typing import Any

try:  # here, not when memory ran out: an import then fails too
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

# what stops a command as Ctrl-C does: `kill`, `timeout`, a scheduler; a closed terminal;
# Ctrl-backslash (SIGQUIT, whose default action dumped core with no line)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# what a terminal sends its whole foreground group: a command's helper process (a pool worker,
# a spawned rank, the server they fork from) leaves them to the command, which says the line
TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# every signal that stops a command: Ctrl-C's and the others (common/stops.py tells the flow)
STOPS = (signal.SIGINT, *STOP_SIGNALS)


def default_handler(signum: int) -> Any:
    """Python's own handler of `signum`: Ctrl-C's KeyboardInterrupt, the others' default action."""
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL


def stop_words(signum: int) -> str:
    """How a stop's one line begins (common/stops.py): "interrupted:" for Ctrl-C, else
    "stopped by SIGTERM;" (its name)."""
    return (
        "interrupted:" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name};"
    )


def _interrupted_at_startup(signum: int, frame: FrameType | None) -> None:
    line = f"{stop_words(signum)} the command had not started; nothing was written"
    rank, size = os.environ.get("RANK"), os.environ.get("WORLD_SIZE", "1")
    world = int(size) if size.isdigit() else 1  # malformed: the command says so once it runs
    if rank is not None and rank.isdigit() and world > 1:
        # one rank of a launch: one line for the launch, said by the first to say (the launcher
        # `experiments.torchrun`, which passes its stop on as SIGINT, or a rank): each rank
        # stopped while it started said its own beside the launcher's
        from experiments.common.launch_line import first_to_say, gone_peers

        if not first_to_say():
            os._exit(128 + signum)
        if signum == signal.SIGTERM:  # torchrun's agent stops them all once one ends (as
            # common.dist_run.stop_on_sigterm says once the command runs)
            lost = gone_peers()
            line = f"error: rank {rank} was stopped (SIGTERM) while it started; nothing was "
            line += "written"
            if lost:
                line = (
                    f"error: rank {lost[0]} failed or died first (killed, or ended without a "
                    f"line); torchrun stopped rank {rank} (SIGTERM) while it started"
                )
    with contextlib.suppress(Exception):  # stderr closed (`2>&-`): not reopened this early
        sys.stderr.write(f"{line}\n")  # one write (launch_line.say_first)
        sys.stderr.flush()
    # Not SystemExit: raised inside an import, a library's bare `except:` can swallow it (the
    # command then ran on and exited 0). Nothing is open or written yet, so nothing is lost.
    os._exit(128 + signum)


# sys.argv[0] is "-m" only while `python -m experiments.<name>` locates the module (Python's
# docs): a command starting, not code (a test, a notebook) importing this package.
AS_COMMAND = sys.argv[:1] == ["-m"]
if AS_COMMAND:  # first of all: in the start-up below (load_env's imports: 0.05 s, more under
    # load) Ctrl-C would be an import's traceback, and SIGTERM an end without a line
    signal.signal(signal.SIGINT, _interrupted_at_startup)
    for _signum in STOP_SIGNALS:
        if signal.getsignal(_signum) == signal.SIG_DFL:  # `nohup`'s ignored SIGHUP stays so
            signal.signal(_signum, _interrupted_at_startup)
    # a launcher's rank (`experiments.torchrun`) starts with them blocked, through Python's own
    # start-up: a stop held there comes now, to the handler above (one line, or none)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOPS)


def command_started() -> None:
    """The command's imports are done: garbage collection on again, and a start-up handler
    still set (where `common.stops.until_interrupted`, which `run_command` enters first, could
    not take the signals: off the main thread) gives way to Python's default action."""
    for signum in STOPS:
        if signal.getsignal(signum) is _interrupted_at_startup:
            signal.signal(signum, default_handler(signum))
    if AS_COMMAND and not gc.isenabled():  # off while the command imported (below)
        gc.freeze()  # the imports' objects live to the end: no collection walks them again
        gc.enable()


# The exit status of a command whose work is done (`common.stops.finished`); empty until then.
FINISHED: list[int] = []


def _quiet_teardown() -> None:
    """Registered first, so run last of the exit handlers: a finished command ignores Ctrl-C,
    SIGTERM and SIGHUP while Python tears its modules down. Python puts their default action
    back before that (a tenth of a short run's time), so a stop then ended the command by the
    signal, with no line, its results whole; it now exits with its status."""
    if FINISHED:
        for signum in STOPS:
            signal.signal(signum, signal.SIG_IGN)


def no_cwd() -> str | None:
    """What is wrong with the current folder, which every relative path is read from: deleted
    (a shell in a folder removed since), or not to be read. None where it is there."""
    try:
        os.getcwd()
    except OSError as e:
        return (
            f"the current folder: {e.strerror} (deleted since the shell entered it?); cd to a "
            "folder that exists, then run the command again"
        )
    return None


def address_space_limit() -> int | None:
    """The shell's limit on this process's address space (`ulimit -v`), in bytes; None where
    there is none."""
    if resource is None:
        return None
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return None if soft in (-1, resource.RLIM_INFINITY) else soft


def out_of_memory(e: BaseException) -> str | None:
    """The line for a failure to get memory (a MemoryError, or a library that could not map
    itself, as torch's libtorch_cpu.so under `ulimit -v`), naming the shell's limit on the
    process's address space where one is set: "make the model smaller" was said to a command
    whose import alone outgrew `ulimit -v`. None for any other error."""
    text = str(e)
    if not (
        isinstance(e, MemoryError)
        or (isinstance(e, OSError | ImportError) and "failed to map segment" in text)
        or "cannot allocate memory" in text.lower()
    ):
        return None
    soft = address_space_limit()
    if soft is not None:
        return (
            f"out of memory under the shell's limit on this process's memory (ulimit -v "
            f"{soft // 1024}, in kB); raise it (ulimit -v unlimited) and run the command again"
        )
    return "out of memory; make the workload or the model smaller (or use a larger machine)"


def _said_at_startup(kind: type[BaseException], e: BaseException, tb: object) -> None:
    """sys.excepthook while a command imports (torch, hydra): memory that ran out there
    (`ulimit -v`) is the one line and exit 2, not the import's traceback."""
    line = out_of_memory(e) if os.environ.get("MOEPIPE_TRACEBACK") != "1" else None
    if line is None:
        sys.__excepthook__(kind, e, tb)  # type: ignore[arg-type]
        return
    with contextlib.suppress(Exception):  # a stream that fails: the status still says it
        sys.stdout.flush()
        sys.stderr.write(f"error: {line}\n")
        sys.stderr.flush()
    os._exit(2)


def _as_typed(e: UnicodeError) -> tuple[str | bytes, int]:
    """Output's error handler: a character the terminal's encoding lacks is written as the
    bytes the user typed, where it stands for one (Python's surrogate escape of an undecodable
    byte of argv, a path or the environment, under LC_ALL=C or a latin-1 file name), so a path
    in a line pastes back; any other as a backslash escape."""
    assert isinstance(e, UnicodeEncodeError)
    c = e.object[e.start]
    if 0xDC80 <= ord(c) <= 0xDCFF:
        return bytes([ord(c) - 0xDC00]), e.start + 1
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}", e.start + 1


codecs.register_error("moepipe.as_typed", _as_typed)


def _open_closed_streams() -> None:
    """A standard stream the shell closed (`>&-`, `2>&-`) gets /dev/null in its place. Python
    leaves sys.stdout None for one (joblib flushed it as a sweep started its workers: an
    internal error), and the next file the command opened took the free descriptor, so that
    what a child process (a sweep worker, a rank) printed went into that file."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: `fd`, in order
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, closefd=False))  # noqa: SIM115 (for good)


def _write_as_typed() -> None:
    """stdout and stderr write a path's undecodable bytes back as they were (`_as_typed`):
    under LC_ALL=C a path's `\\udcc3` could not be pasted back."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="moepipe.as_typed")


if AS_COMMAND:
    from experiments.common.load_env import bad_variable, openmp_complaint

    _open_closed_streams()
    _write_as_typed()
    _env = dict(os.environ)
    if (_bad := bad_variable(_env) or openmp_complaint(_env) or no_cwd()) is not None:
        print(f"error: {_bad}", file=sys.stderr)  # before torch
        sys.exit(2)
    atexit.register(_quiet_teardown)
    sys.excepthook = _said_at_startup
    # no collections while the command imports (numpy, pandas, hydra): their objects live on,
    # and each pass walked all made so far (0.05 s of CPU); on again once it runs
    gc.disable()
    # torch's C++ log goes to stderr beside the one line: c10d's rendezvous retries, each with
    # its stack dump (MASTER_ADDR unreachable: 76 lines), a gloo pair's closed connection. Read
    # once, as torch loads; kept where the user set it or asked for tracebacks.
    if "1" not in (os.environ.get("MOEPIPE_TRACEBACK"), os.environ.get("HYDRA_FULL_ERROR")):
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    if address_space_limit() is not None:
        # pyarrow's default allocator (mimalloc) reserves address space for each of its
        # threads: under `ulimit -v` (1.4 GB) a thread could not start, and reading a trace
        # hung for good (it aborted in a bare `python`); the system allocator reserves none.
        # Read once, as pyarrow loads; kept where the user set it.
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "system")
    # One rank of a torchrun launch (RANK, WORLD_SIZE set): killed with its agent, from its first
    # import on (a torchrun killed with SIGKILL left its ranks running the run on, holding the
    # terminal's output for minutes); where the agent died before this, ppid is init's already.
    if os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE", "1") not in ("0", "1"):
        import ctypes

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # not Linux
            pass
        else:
            if os.getppid() == 1:
                os._exit(1)
