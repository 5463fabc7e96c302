"""torchrun, ending in one line: `python -m experiments.torchrun [torchrun's args] -m
experiments.run ...` takes torchrun's arguments and runs torch's own launcher
(`torch.distributed.run`'s `parse_args` and `run`) inside the commands' error path.

Plain torchrun's own process prints a Python traceback where the launch fails: its
`--master_port` taken (`DistNetworkError`), Ctrl-C or Ctrl-\\ (`SignalException`), a failed rank
(`ChildFailedError` and its table), below the rank's own line. Here a taken port names the port
and the fix, a signal ends with the commands' interrupt line and exit status, and a failed rank's
line (from its error file, `TORCHELASTIC_ERROR_FILE`) is printed once: by the rank itself where its
stderr is this terminal's, else here. The agent's log (its OMP_NUM_THREADS banner, "Sending process
... closing signal") is kept off stderr unless LOGLEVEL is set or tracebacks are asked for.

Usage: python -m experiments.torchrun --standalone --nproc_per_node=2 -m experiments.run \\
           executor=real executor.distributed=true checkpoint=ckpt/ planner=eplb ...
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
from typing import Any

from core.errors import ConfigError, MoepipeError, did_you_mean, integer_below, quoted
from experiments import STOPS, stop_words
from experiments.common import stops
from experiments.common.cli import TRACEBACK_ENV, Stopped, exit_command, on_interrupt
from experiments.common.held_warnings import plan_accepted
from experiments.common.launch_line import resolves, said_under, say_as_agent

FAILED = 2  # the commands' exit status for a failure
# Ctrl-C's line where no rank said one (the launch stopped while its ranks started)
STOPPED = "the launch did not finish and its ranks were stopped; run the same command again"
on_interrupt(STOPPED)  # from here: Ctrl-C while torch imports


def main(argv: list[str] | None = None) -> int:
    """torchrun's launch of `argv` (sys.argv's by default); 0 where every rank succeeded."""
    _checked_loglevel()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    on_interrupt(STOPPED)  # called in-process, after another command set its own
    _SIGNALLED.clear()
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv[: argv.index("-m") if "-m" in argv else len(argv)]):
        print(
            f"{__doc__.strip()}\n\n== Options\ntorchrun's: python -m torch.distributed.run --help"
        )
        return 0
    parser = get_args_parser()
    parser.error = _usage_error  # type: ignore[method-assign]
    args = parser.parse_args(argv)
    _checked(args)
    _quiet_agent()
    _say_signals_here()
    _ranks_start_stops_blocked()
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    try:
        run(args)
    except SignalException as e:
        _interrupted(_SIGNALLED[0] if _SIGNALLED else signal.Signals(e.sigval))
    except ChildFailedError as e:
        line = _failed_line(e)
        if said_under(os.getpid()) and not _stderr_redirected(args):
            sys.exit(FAILED)  # the rank said its line on this terminal
        raise MoepipeError(line) from None
    except RendezvousError as e:
        raise _rendezvous_failed(e, args) from None
    except (ValueError, AssertionError) as e:  # torchrun's checks of its arguments
        raise _argument_error(e) from None
    except RuntimeError as e:
        if str(e).startswith("nnodes="):  # --nnodes=2:1:3, not MIN:MAX
            raise _argument_error(e) from None
        raise _port_taken(e, args) or e from None
    finally:
        said_under(os.getpid())  # the ranks' claim, once the launch is over
    return 0


def _checked(args: Any) -> None:
    """What torchrun meets only with a bare assert (a process count below 1, a monitor interval
    of 0) or in every rank (each printing python's own line: a script or module not found)."""
    import importlib.util

    nproc = str(args.nproc_per_node).strip()
    if nproc.lstrip("-").isdigit() and int(nproc) < 1:
        raise ConfigError(
            f"--nproc_per_node={nproc}: start at least 1 process a node (or pass gpu, cpu or auto)"
        )
    if not (math.isfinite(args.monitor_interval) and args.monitor_interval > 0):
        raise ConfigError(f"--monitor-interval={args.monitor_interval}: pass seconds > 0 (0.1)")
    _checked_nodes(args)
    _checked_rdzv_conf(str(args.rdzv_conf), "c10d" if args.standalone else args.rdzv_backend)
    _checked_signals()
    _checked_streams(args, nproc)
    _resolved("--master_addr", None if args.standalone else args.master_addr)
    _resolved("--local_addr", args.local_addr)
    target = args.training_script
    if args.run_path and (args.module or args.no_python):  # run_path(sys.argv[0]) of a name
        given = "-m" if args.module else "--no-python"
        raise ConfigError(
            f"--run-path runs a script file by its path, not {given} {target}: drop "
            "--run-path, or pass the script's path (experiments/run.py)"
        )
    if args.module and not args.no_python:
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):  # its package is not there, or a name like '.x'
            found = False
        if not found:
            raise ConfigError(f"-m {target}: no such module here; e.g. -m experiments.run")
    elif not args.no_python and not os.path.isfile(target):
        raise ConfigError(
            f"{target}: no such script; pass its path, or a module with -m (-m experiments.run)"
        )


def _checked_loglevel() -> None:
    """LOGLEVEL, which torch's loggers are set to as torchrun's modules are imported (a name
    logging does not know was an internal error)."""
    level = os.environ.get("LOGLEVEL")
    if level is not None and level not in logging.getLevelNamesMapping():
        raise ConfigError(
            f"environment LOGLEVEL={level!r}: not a logging level (torchrun's agent reads it); "
            "set it to DEBUG, INFO, WARNING or ERROR, or unset it"
        )


def _checked_nodes(args: Any) -> None:
    """--nnodes (N or MIN:MAX; int()'s own line named no flag) and --node_rank, which must be
    one of the nodes (a rank past them waited for ever for nodes that never come)."""
    nnodes = str(args.nnodes).strip()
    if not re.fullmatch(r"\d+(:\d+)?", nnodes):
        raise ConfigError(
            f"--nnodes={nnodes} (or PET_NNODES): pass a number of nodes, N or MIN:MAX (1, 2:4)"
        )
    most = int(nnodes.rpartition(":")[2])
    static = args.rdzv_backend == "static" and not args.standalone  # the rest number nodes
    if static and not 0 <= args.node_rank < max(most, 1):
        raise ConfigError(
            f"--node_rank={args.node_rank}: not one of the {most} node(s) of --nnodes={nnodes}; "
            f"pass 0 .. {most - 1}, one per node"
        )


# --rdzv_conf's keys torch's rendezvous backends read as a whole number of seconds (or a count):
# a word there was read by one backend (c10d's read_timeout: a ValueError in the agent) or by
# none (`timeout` is etcd's; c10d's are join_, last_call_ and close_timeout), without a word
RDZV_WHOLE = (
    "timeout",
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "read_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
)
RDZV_BOOL = ("1", "true", "t", "yes", "y", "0", "false", "f", "no", "n")  # as torch reads is_host


# the --rdzv_conf keys each of torch's rendezvous backends reads (--standalone's is c10d):
# another key was ignored without a word (c10d reads join_timeout, not etcd's `timeout`; static
# its rank from --node_rank). A backend of a plugin is not checked.
_DYNAMIC = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
)
RDZV_KEYS = {
    "c10d": (*_DYNAMIC, "is_host", "store_type"),
    "etcd-v2": (*_DYNAMIC, "protocol", "ssl_cert", "ssl_cert_key", "ca_cert"),
    "etcd": ("timeout", "last_call_timeout", "etcd_prefix", "protocol", "cert", "key", "cacert"),
    "static": ("timeout",),
}


def _checked_rdzv_conf(conf: str, backend: str) -> None:
    """--rdzv_conf (KEY=VALUE,...) by torch's own parser; its whole-number and boolean keys
    by their kind, and each key one the chosen backend reads."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    try:
        config = _parse_rendezvous_config(conf)
    except ValueError as e:
        raise ConfigError(f"--rdzv_conf={conf}: {e}; write it as KEY=VALUE,KEY=VALUE") from None
    for key, value in config.items():
        if key in RDZV_WHOLE and not (value.isdigit() and int(value) > 0):
            raise ConfigError(
                f"--rdzv_conf={conf}: {integer_below(key, value, 1)}; pass e.g. {key}=60"
            )
        if key == "is_host" and value.lower() not in RDZV_BOOL:
            raise ConfigError(f"--rdzv_conf={conf}: is_host={value}; pass is_host=true or false")
    known = RDZV_KEYS.get(backend)
    unread = [key for key in config if known is not None and key not in known]
    if unread:
        raise ConfigError(
            f"--rdzv_conf={conf}: {quoted(unread[0])} is no key of the {backend} rendezvous "
            f"(--rdzv_backend), which would ignore it; "
            f"{_nearest(unread[0], known or ())}its keys: {', '.join(known or ())}"
        )


def _nearest(key: str, known: tuple[str, ...]) -> str:
    """`did you mean ...? ` for a key: etcd's and static's `timeout` is c10d's join_timeout."""
    if key == "timeout" and "join_timeout" in known:
        return "did you mean 'join_timeout' (how long to wait for the nodes)? "
    return did_you_mean(key, known)


def _checked_signals() -> None:
    """TORCHELASTIC_SIGNALS_TO_HANDLE (the signals the agent passes on to its ranks): a name
    that is no signal was skipped with a warning in the agent's hidden log."""
    names = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    if names is None:
        return
    for name in names.split(","):
        sig = getattr(signal, name.strip(), None)
        if not isinstance(sig, signal.Signals) or sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ConfigError(
                f"environment TORCHELASTIC_SIGNALS_TO_HANDLE={names}: {quoted(name.strip())} is "
                "no signal a handler can take; list names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT "
                "(its default), or unset it"
            )


def _checked_streams(args: Any, nproc: str) -> None:
    """--redirects and --tee (torch's line named only the value and its pattern), and a
    --local-ranks-filter naming no rank the node starts (every rank's output went unseen)."""
    for flag, value in (("--redirects", args.redirects), ("--tee", args.tee)):
        if not re.fullmatch(r"[0123]|(\d:[0123],)*\d:[0123]", str(value).strip()):
            raise ConfigError(
                f"{flag}={value}: pass 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every "
                "rank or per local rank (0:1,1:2)"
            )
    ranks = str(args.local_ranks_filter or "").strip()
    listed = ranks and nproc.isdigit() and re.fullmatch(r"\d+(,\d+)*", ranks)
    if listed and not {int(r) for r in ranks.split(",")} & set(range(int(nproc))):
        raise ConfigError(
            f"--local-ranks-filter={ranks}: no local rank of --nproc_per_node={nproc} "
            f"(0 .. {int(nproc) - 1}); nothing any rank prints would be shown: pass ranks in "
            "that range"
        )


def _resolved(flag: str, host: str | None) -> None:
    """`host` a name this machine resolves: the agent retried one it cannot for ever."""
    if host and not resolves(host):
        raise ConfigError(f"{flag}={host}: no such host here; pass a name or address of one")


def _argument_error(e: BaseException) -> ConfigError:
    """torchrun's refusal of an argument (--nproc_per_node=abc, --nnodes=2:1): a ValueError, an
    AssertionError or a RuntimeError with its traceback, as one line."""
    said = str(e).strip() or type(e).__name__
    return ConfigError(f"torchrun: {said}; run python -m experiments.torchrun --help for its flags")


def _usage_error(message: str) -> None:
    """argparse's error (usage and a line, exit 2) as the commands' one line."""
    raise ConfigError(
        f"torchrun: {message}; run python -m experiments.torchrun --help for its flags"
    )


def _quiet_agent() -> None:
    """The agent's log off stderr: torch's loggers under torch.distributed, unless the user set
    LOGLEVEL (torchrun's own switch) or asked for tracebacks."""
    if "LOGLEVEL" in os.environ or os.environ.get(TRACEBACK_ENV) == "1":
        return
    quiet = logging.getLogger("torch.distributed")  # torch's logging gives it a handler
    for handler in quiet.handlers:
        handler.addFilter(lambda record: False)
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False


_SIGNALLED: list[signal.Signals] = []  # the signal the launcher got, passed on as SIGINT


def _say_signals_here() -> None:
    """A signal to the launcher (`kill`, a scheduler's SIGTERM) is said here, as a single run
    says it ("stopped by SIGTERM; ..."), before torch's handler (`SignalException`) passes it
    on to the ranks: rank 0 said it as its own ("rank 0 was stopped (SIGTERM)"). A signal to
    the terminal's whole group reaches the ranks too, and the first to say it says it."""
    from torch.distributed.elastic.multiprocessing import api

    torchs = api._terminate_process_handler
    if getattr(torchs, "says_it", False):  # a launch before this one, in-process
        return

    def said_here(signum: int, frame: Any) -> None:
        if _SIGNALLED:  # pressed twice: the same stop, said and passed on (raised again as the
            stops.again()  # launcher exited, after its claim on the line went, it was
            return  # said twice); a third ends the launcher at once
        say_as_agent(f"{stop_words(signum)} {STOPPED}")
        _SIGNALLED[:] = [signal.Signals(signum)]
        stops.begin(stops.stop_status(signum))
        torchs(signal.SIGINT, frame)  # passed on as SIGINT: a rank then takes its run dir away

    said_here.says_it = True  # type: ignore[attr-defined]
    api._terminate_process_handler = said_here


def _ranks_start_stops_blocked() -> None:
    """A rank of the project's commands starts with the stops blocked, until its start-up's
    handler is set (`experiments`' import unblocks them): one still in Python's own start-up
    when the launcher passed a stop on printed "Fatal Python error: init_import_site" and a
    traceback after the launch's line (1 of 76 random stops). Another program is started as
    torch starts it, its stops as they were."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    popen = handler._popen
    if getattr(popen, "blocks_stops", False):  # a launch before this one, in-process
        return

    def stops_blocked(self: Any, args: tuple[Any, ...], env: dict[str, str]) -> Any:
        modules = [str(b) for a, b in zip(args, args[1:], strict=False) if a == "-m"]
        if not any(m.startswith("experiments.") for m in modules):
            return popen(self, args, env)
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
        try:  # the child inherits this thread's mask, across exec
            return popen(self, args, env)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    stops_blocked.blocks_stops = True  # type: ignore[attr-defined]
    handler._popen = stops_blocked  # type: ignore[method-assign]


def _interrupted(signum: signal.Signals) -> None:
    """Ctrl-C, Ctrl-\\ or a stop reached the agent, which stopped its ranks: a rank that said
    the interrupt's line leaves the exit status only; else the commands' line is said here."""
    if said_under(os.getpid()):
        sys.exit(stops.stop_status(signum))
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signum)


def _failed_line(e: Any) -> str:
    """The line of the first rank that failed with one (its error file's), else what ended the
    first to fail (an exit status, a signal)."""
    failures = sorted(e.failures.items(), key=lambda kv: (kv[1].timestamp, kv[0]))
    for _, failure in failures:
        message = failure.message  # the error file's: {"message": LINE, ...} as ours write it
        message = str(message.get("message", "") if isinstance(message, dict) else message)
        if failure.error_file_data and message.startswith("error: "):
            return message.removeprefix("error: ").splitlines()[0]
    rank, failure = failures[0]
    if failure.exitcode < 0:
        how = f"signal {-failure.exitcode}, {failure.signal_name()}"
    else:
        how = f"exit status {failure.exitcode}"
    return (
        f"rank {rank} ended ({how}) without a line; the run did not finish and wrote nothing: "
        "see the rank's output above (or in --log-dir) and run it again"
    )


def _rendezvous_failed(e: Exception, args: Any) -> MoepipeError:
    """The agent's rendezvous failed (torch's RendezvousError and its traceback): most often
    two launches of one --rdzv_id at one --rdzv_endpoint, whose store went with the first."""
    why = {
        "RendezvousConnectionError": "lost its store (the launch hosting it there ended)",
        "RendezvousTimeoutError": "timed out: not every node joined in time",
        "RendezvousClosedError": "is closed: a launch of that id has finished",
        "RendezvousGracefulExitError": "was left by this node",
    }.get(type(e).__name__, f"failed ({type(e).__name__})")
    where = f"--rdzv_id={args.rdzv_id} at --rdzv_endpoint={args.rdzv_endpoint or 'localhost'}"
    return MoepipeError(
        f"{where}: the rendezvous {why}; the run did not start: give each launch its own "
        "--rdzv_id and endpoint port (or --standalone) and run it again"
    )


def _stderr_redirected(args: Any) -> bool:
    """Do the ranks' stderr go to files (--redirects 2 or 3, any rank's), not this terminal?"""
    return bool(re.search(r"(^|[:,])\s*[23]\s*($|,)", str(args.redirects or "0")))


def _port_taken(e: RuntimeError, args: Any) -> ConfigError | None:
    """torch's DistNetworkError where the agent's store could not listen on its port (in use)."""
    if "EADDRINUSE" not in str(e):
        return None
    port = re.search(r"port: (\d+)", str(e))
    given = port.group(1) if port else args.master_port
    return ConfigError(
        f"--master_port={given}: another process is listening on that port; pass another "
        "--master_port, or --standalone to take a free one"
    )


if __name__ == "__main__":
    exit_command(main)
