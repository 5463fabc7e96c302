"""Shared by the commands: printing a report or a user's mistake as one line, every failure as
one line (`run_command`: `error_line`, `exit_with`; a stop's own path is stops.py's,
`until_interrupted`), and the argument checks the schemas
(experiments/common/schema.py, experiments/common/app.py) do not cover (argv_checks.py).

Usage:
    print_or_exit(lambda: run(cfg))                               # report lines, or exit 2
    n = as_int("disk_mb", opts["disk_mb"], at_least=1)              # one line naming the key
    out = output_file(opts["out"], "out")                          # its folder made, writable
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import yaml

import experiments
from core.args import as_float, as_int, as_size_mb, output_dir, output_file
from core.errors import MoepipeError, ScheduleBug, did_you_mean, raised_at
from core.files import os_error_fix
from experiments import command_started, out_of_memory
from experiments.common.argv_checks import (
    CONF_DIR,
    exit_on_unwritable_dir,
    key_given_twice,
    missing_launcher,
    sweep_experiment_misused,
    user_conf_dirs,
)
from experiments.common.conf_files import chosen_file
from experiments.common.held_warnings import say_line, settle, warnings_held
from experiments.common.path_values import comma_in_name
from experiments.common.reader_left import guard_stdout, raise_stdout_failure
from experiments.common.stops import (
    Stopped,
    before_line,
    finished,
    on_interrupt,
    result_written,
    until_interrupted,
)

__all__ = [
    "CONF_DIR",
    "as_float",
    "as_int",
    "as_size_mb",
    "output_dir",
    "output_file",
    "print_or_exit",
    "checked_names",
    "exit_on_unwritable_dir",
    "key_given_twice",
    "until_interrupted",
    "missing_launcher",
    "sweep_experiment_misused",
    "error_line",
    "any_error_line",
    "exit_with",
    "run_command",
    "Stopped",
    "on_interrupt",
    "result_written",
    "before_line",
    "finished",
    "user_conf_dirs",
]


def print_or_exit(report: Callable[[], list[str]]) -> None:
    """Prints the lines `report` returns; a MoepipeError (a mistake in the user's input) becomes
    one line on stderr and exit status 2."""
    try:
        print("\n".join(report()))
    except MoepipeError as e:
        say_line(e)
        sys.exit(2)


def checked_names(key: str, names: Sequence[Any], valid: Sequence[str]) -> list[str]:
    """A list option's names checked: none at all, one given twice (its work done twice, its
    rows doubled) or one not in `valid` (skipped without a word) is a MoepipeError naming
    `key` and the valid names."""
    given = [str(n) for n in names]
    listed = ", ".join(valid)
    if not given:
        raise MoepipeError(f"{key}=[]: name at least one; valid: {listed}")
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise MoepipeError(
            f"{key}=[{','.join(given)}]: {', '.join(twice)} given twice; name each once"
        )
    unknown = [n for n in given if n not in valid]
    split = comma_in_name(key, given, valid) if unknown else None
    if split is not None:  # `variants=['a[x','y]']`: one name, split at its comma
        raise split
    if unknown:
        raise MoepipeError(
            f"{key}=[{','.join(given)}]: unknown {', '.join(unknown)}; "
            f"{did_you_mean(unknown[0], valid)}valid: {listed}"
        )
    return given


def our_check(e: BaseException) -> MoepipeError | None:
    """The check of ours that `e` (hydra's or omegaconf's error) wraps: one raised by a resolver
    of ours while an interpolation resolved (`${run_model:}`); None if none."""
    import re

    import core.errors
    from experiments.common.overrides import sweep_in_one_run

    if (ours := core.errors.in_chain(e, MoepipeError)) is not None:
        return ours
    if (sweep := sweep_in_one_run(e)) is not None:
        return sweep
    # from a sweep's worker the chain is lost (pickled): omegaconf's text names our class
    pattern = r"(\w+) raised while resolving interpolation: (.*?)(?:; full_key: \S+)?$"
    got = re.match(pattern, (str(e).splitlines() or [""])[0])
    kind = getattr(core.errors, got.group(1), None) if got else None
    if got and isinstance(kind, type) and issubclass(kind, MoepipeError):
        return kind(got.group(2))
    return None


def _timeout_or_loop(e: BaseException) -> str | None:
    """The line for joblib's TimeoutError (a sweep's point past hydra.launcher.timeout) or
    pathlib's RuntimeError for a symbolic link that leads back to itself: neither is an
    OSError. None for anything else."""
    import re

    if type(e).__module__ == "multiprocessing.context" and type(e).__name__ == "TimeoutError":
        return (
            "a run of the sweep ran past hydra.launcher.timeout (the seconds a point may take); "
            "the runs finished are kept: raise it, or leave it out, and run the same command again"
        )
    loop = re.fullmatch(r"Symlink loop from '(.*)'", str(e)) if type(e) is RuntimeError else None
    return _flat(f"{loop[1]}: a symbolic link that loops; pass another path") if loop else None


def error_line(e: BaseException) -> str | None:
    """The one line a user sees for an expected failure `e`: their mistake (MoepipeError), an
    OSError (a full disk, a folder they cannot write, a file cut short), a config that does not
    compose or resolve (hydra's and omegaconf's errors, bad YAML). None for anything else, a
    bug (a shipped planner's ScheduleBug, not a PlannerBug), which keeps its traceback."""
    import re

    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from core.yaml_size import yaml_place, yaml_problem
    from experiments.common.path_values import literal_dollar
    from experiments.common.torch_env import env_line

    if isinstance(e, MoepipeError):  # a shipped planner's schedule that breaks the IR: a bug
        return None if type(e) is ScheduleBug else _flat(str(e))
    if isinstance(e, HydraException | OmegaConfBaseException):
        ours = our_check(e)
        if ours is not None:
            return _flat(str(ours))
    if isinstance(e, MissingConfigException):  # an OSError too, but hydra's: a config not found
        options = f"; available: {', '.join(e.options)}" if e.options else ""
        return _flat(str(e).splitlines()[0] + options)
    if type(e).__name__ == "TerminatedWorkerError":  # joblib's (loky): a sweep worker died
        from experiments import no_cwd  # a worker started in a folder deleted meanwhile

        if (gone := no_cwd()) is not None:
            return f"a worker process of the sweep could not start in {gone}"
        code = re.search(r"exit codes?[^\d-]*(-?\d+)", str(e))
        how = f" (exit code {code.group(1)}: killed, or out of memory)" if code else ""
        return _flat(
            f"a worker process of the sweep died{how}; the runs it finished are kept: run the "
            "same command again to run the rest"
        )
    if (timeout_or_loop := _timeout_or_loop(e)) is not None:
        return timeout_or_loop
    if type(e).__name__ in ("UncompletedJobError", "FailedJobError"):  # submitit's: a job died
        said = _flat(str(e))[:300]
        return (
            f"a job of the sweep did not finish (submitit: {said}); the runs finished are kept: "
            "see the job's log under the sweep's .submitit folder, then run the same command"
        )
    if (torch_env := env_line(e)) is not None:
        return torch_env
    if (memory := out_of_memory(e)) is not None:
        return memory
    if _torch_out_of_memory(e):
        return "out of memory; make the workload or the model smaller (or use a larger machine)"
    if isinstance(e, OSError):
        return _os_error_line(e)
    if isinstance(e, OverrideParseException):
        from experiments.common.hydra_errors import parse_problem

        if e.override and "=" not in e.override and not e.override.startswith("~"):
            return _flat(  # `foo`: hydra says "missing EQUAL at '<EOF>'"
                f"{e.override!r}: an argument without '='; options are given as key=value "
                "(--help lists them)"
            )
        return _flat(f"override {e.override!r}: {parse_problem(str(e.message))}")
    for cause in (e, e.__cause__, e.__context__):
        if isinstance(cause, yaml.YAMLError):
            problem = yaml_problem(cause)[0]
            return _flat(f"{yaml_place(cause)}not valid YAML ({problem}); fix that file")
    if isinstance(e, MissingMandatoryValue):  # a required field a YAML file left out
        key = getattr(e, "full_key", None) or "a field"
        into = chosen_file(key) or "its YAML file"
        return _flat(f"{key}: required and not set; add it to {into} or pass {key}=VALUE")
    if isinstance(e, OmegaConfBaseException):
        key = getattr(e, "full_key", None)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        dollar = literal_dollar(key, msg)
        return _flat(
            f"{key + ': ' if key else ''}{msg}; fix that value in the config or override{dollar}"
        )
    if isinstance(e, HydraException):
        lines = [*str(e).splitlines(), *str(e.__cause__ or "").splitlines()]
        return _flat("; ".join(line.strip() for line in lines[:2] if line.strip()) or repr(e))
    return None


def _os_error_line(e: OSError) -> str:
    """An OSError as one line: the file, what happened and what would fix it."""
    import errno

    if not e.filename and e.errno == errno.ENOENT:
        from experiments import no_cwd  # a relative path, its folder deleted under the command

        if (gone := no_cwd()) is not None:
            return gone
    where = f"{e.filename}: " if e.filename else ""
    what = "a folder, where a file belongs" if e.errno == errno.EISDIR else e.strerror or e
    return _flat(f"{where}{what}; {os_error_fix(e)}")


def _torch_out_of_memory(e: BaseException) -> bool:
    """torch's allocation failure: `torch.OutOfMemoryError` (CUDA), or on a CPU the allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory"), neither a MemoryError."""
    if type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "CUDA out of memory" in text
    )


def _flat(text: str) -> str:
    """One line: a message's own line breaks become '; '."""
    return "; ".join(line.strip() for line in text.splitlines() if line.strip())


TRACEBACK_ENV = "MOEPIPE_TRACEBACK"  # =1: an unexpected error raises with its traceback


def any_error_line(e: BaseException) -> str:
    """`error_line`, or for an unexpected error (a bug, or input nothing checks yet) one line
    with its type and message and the file its traceback was written to. Re-raises `e` when
    MOEPIPE_TRACEBACK=1 (or HYDRA_FULL_ERROR=1 was set by the user)."""
    line = error_line(e)
    if line is not None:
        return line
    if os.environ.get(TRACEBACK_ENV) == "1":
        raise e
    import tempfile
    import traceback

    fd, path = tempfile.mkstemp(prefix="moepipe-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        traceback.print_exception(e, file=f)
    what = _flat(str(e))[:200] + raised_at(e, f"{experiments.__path__[0]}/..") or "no message"
    return (
        f"internal error ({type(e).__name__}: {what}); a bug or an input nothing checks: "
        f"please report it with the command and {path} (its traceback)"
    )


def exit_with(e: BaseException) -> None:
    """Print `e` as one line (`any_error_line`) on stderr and exit 2. On a rank of a torchrun
    launch, a SIGTERM that comes meanwhile is ignored: torchrun stops every rank once one fails,
    and the handler's own line (`dist_run.stop_on_sigterm`) would follow this one. A line every
    rank meets (a config error, a checkpoint's) is printed once (each rank printed it: the same
    line G times): under torchrun's agent by the first rank to say (`launch_line.say_first`),
    elsewhere by rank 0, a rank other than 0 printing only a line that names it. Every rank
    writes its line to torchrun's error file too (`launch_line.record_error`)."""
    # ValueError: malformed launch variables (this error says so) or off the main thread,
    # where no handler can be set
    with contextlib.suppress(ValueError):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    before_line()
    settle(e)  # the warnings held: dropped for a refusal, else said before its line
    from experiments.common.launch_line import say_error

    # under torchrun's agent the first rank to say prints the line, whichever it is: rank 0,
    # left to say a line every rank meets, was stopped by torchrun once a faster rank 1 ended,
    # and blamed rank 1 for ending "without a line", the cause said nowhere
    say_error(f"error: {any_error_line(e)}")
    if experiments.AS_COMMAND:  # a stop after the line: exit 2, not the default action's end
        finished(2)
    sys.exit(2)


def exit_command(main: Callable[[], Any]) -> NoReturn:
    """A command's `__main__`: `sys.exit(run_command(main))`, with what the process still holds
    frozen out of the cycle collector first (`gc.freeze`). The interpreter's teardown collects
    again and again while it clears the modules, each time over every object of its imports
    (pandas, pyarrow, hydra: a hundred thousand): 0.12 s of CPU of every command, for cycles
    that the process's end frees anyway. Then `leave`."""
    code = run_command(main)
    gc.freeze()
    leave(code)


def leave(code: Any) -> NoReturn:
    """`sys.exit(code)` without the interpreter's teardown of its modules, which frees each of
    their objects one by one for the process's end to discard (0.03-0.07 s of CPU of every
    command): what an exit does that can be seen (atexit's functions: logging's files closed,
    temporary folders removed, a pool's workers ended; the standard streams flushed) runs as
    it does, then the process ends with the status. Where another thread still runs (an exit
    waits for it) or the status is not a number, or a stream fails its flush (the exit then
    says so as before), it exits as `sys.exit`."""
    if (code is None or isinstance(code, int)) and threading.active_count() == 1:
        atexit._run_exitfuncs()  # and forgets them: an exit after does not run them again
        try:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        except (OSError, ValueError):
            sys.exit(code)
        os._exit(code or 0)
    sys.exit(code)


class _StderrLine(logging.StreamHandler):
    """A logged warning as `warning: <message>` on the stderr of the moment (a test's capture,
    as Python's last-resort handler writes it), an error's as `error: <message>`."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:  # StreamHandler's __init__ sets it
        pass

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


def warnings_as_lines() -> None:
    """A command that sets up no logging of its own (collect, report, trace_json, validate...)
    says its warnings as `warning: ...` lines: Python's last-resort handler printed the bare
    message (`skipped RUN: ...`), read as part of the error line after it. A hydra app's
    logging (experiments.run) replaces the root's handlers with its own."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_StderrLine())


def run_command(main: Callable[[], Any]) -> Any:
    """Every command's one error path: `main()`, with Ctrl-C as one line and exit 130, SIGTERM
    and SIGHUP as one line and exit 143 and 129 (`until_interrupted`), and any failure as one
    line on stderr and exit 2, without a traceback (`any_error_line`). A hydra app's errors
    reach here because this sets HYDRA_FULL_ERROR (hydra would otherwise print them itself,
    over many lines); a user who set it, or MOEPIPE_TRACEBACK=1, gets tracebacks."""
    if TRACEBACK_ENV not in os.environ:  # set here, so a command this one starts inherits it
        os.environ[TRACEBACK_ENV] = "1" if os.environ.get("HYDRA_FULL_ERROR") == "1" else "0"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    warnings_as_lines()

    def started() -> Any:  # start-up's signal handlers are until_interrupted's by now
        command_started()  # (Ctrl-C between the two was a KeyboardInterrupt's traceback)
        guard_stdout()
        return main()

    with warnings_held():  # until its plan is accepted (held_warnings: the one rule)
        try:
            result = until_interrupted(started)
            raise_stdout_failure()  # the work is done and its files written: its output is not
            return result
        except BrokenPipeError:  # `... --help | head`: the reader left; nothing to say
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # the flush at exit would fail again
            sys.exit(141)  # a shell's status for a process its pipe's reader left (128 + SIGPIPE)
        except Exception as e:
            if os.environ.get(TRACEBACK_ENV) == "1" and error_line(e) is None:
                raise
            exit_with(e)
