"""A real run of an expert-parallel schedule as G processes, one per device (torch.distributed,
gloo): `experiments.run executor=real executor.distributed=true` starts them itself, or runs as
one of them under torchrun (RANK / WORLD_SIZE set). Each rank runs its device's ops of the one
schedule (`real.distributed`); rank 0's result (every rank's ops) is the run's.

Faults end the run with one line naming the rank and a non-zero exit, never a peer's traceback:
a rank that dies stops the others at once (they are terminated), a rank stopped (SIGSTOP) stops
them after `STOPPED_S`, a rank that never joins stops the others after
`executor.rendezvous_timeout_s`. Ctrl-C is the command's: a spawned rank ignores it. Spawned
ranks fork from one server process that imported torch once per command (forkserver); its
death, or a stop of it past `STOPPED_S`, ends the run with one line naming it (`rank_server`),
and a SIGTERM to it is passed on to the command, which stops the run as for its own.

Usage:
    python -m experiments.run executor=real executor.distributed=true checkpoint=DIR \
        planner=eplb +planner.params.n_devices=2
    torchrun --nproc_per_node=2 -m experiments.run executor=real executor.distributed=true ...
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError, MoepipeError, reworded
from core.files import ulimits
from core.planner import Planner
from core.routing import Routing
from experiments import TERMINAL_SIGNALS
from experiments.common import rank_stderr
from experiments.common.deferred import interrupt_deferred
from experiments.common.launch_line import gone_peers, launched, refused_at_once
from experiments.common.pipeline import RunResult, RunSpec, build_schedule, one_device, sized_run
from experiments.common.rank_server import (
    LOST,
    ServerWatch,
    is_stopped,
    parent_of,
    server_context,
)
from experiments.common.torchrun_rank import stop_on_sigterm, watch_local_peers

if TYPE_CHECKING:
    from experiments.common.real_run import FileState

RANK_DIR = "moepipe-ranks-"  # a run's folder for its ranks' results: RANK_DIR<command's pid>-*
PEER_LOST = 3  # a rank's exit code when it stopped because another one did
FAILED = 2  # a rank's exit code for an error it wrote to its error file
NO_REPORT = 4  # a rank's exit code where it could not write its error file (tmp full)
STOPPED_S = 5.0  # a rank stopped (SIGSTOP) this long stops the run: its peers wait for it
LEFT_TO_PARENT = TERMINAL_SIGNALS  # a spawned rank ignores them (`_rank_process`)
# blocked while the server and the ranks start, as a torchrun rank's start-up has them
# (`torchrun._ranks_start_stops_blocked`); the server keeps them blocked, the command's to act
# on, and a rank unblocks them once it is set (a stop in Python's own start-up was the server's
# death, a line of its own, or "Fatal Python error")
STARTS_BLOCKED = (*LEFT_TO_PARENT, signal.SIGTERM)


@dataclass
class DistOutput:
    """What a G-process run gives back: the run (every rank's ops) and the generated output."""

    result: RunResult
    tokens: Any  # torch.Tensor [n*b, gen_len]
    logits: Any  # torch.Tensor [n*b, V]
    routing: Routing  # the experts the gates used (replayed, or the model's own)


def n_processes(ckpt: str, spec: RunSpec, routing_mode: str = "replay") -> int:
    """The devices of the schedule `spec` plans (one process each); one line where the machine
    cannot run them, the planner has none, or it peeks at routing a live run cannot give it."""
    return sized_processes(ckpt, spec, routing_mode)[0]


def sized_processes(
    ckpt: str,
    spec: RunSpec,
    routing_mode: str = "replay",
    planner: Planner | None = None,
    dtype: str | None = None,
) -> tuple[int, RunSpec, Planner]:
    """`n_processes`, the run sized on the checkpoint's model (`sized_run`, in the compute
    `dtype`) and the planner that sized and planned it (`planner`, else a new one), for the
    ranks to reuse its choices."""
    from experiments.common.real_run import _shape_routing
    from real.checkpoint import load_checkpoint

    model, _ = load_checkpoint(ckpt, dtype)
    spec, planner = sized_run(replace(spec, model=model, executor="real"), planner)
    schedule = build_schedule(spec, _shape_routing(spec), planner)
    ep = schedule.ep
    if routing_mode == "live" and schedule.meta.get("oracle"):
        from real.executor import LIVE_ORACLE

        # here, not as each rank's line ("rank 0: ...") once every rank has started
        raise ConfigError(f"planner {spec.planner}: {LIVE_ORACLE}")
    if ep is None:
        raise one_device([spec.planner])
    g = ep.n_devices
    # n_devices 0 (its default) is hardware.n_gpus: the line names what the user set
    named = (
        f"planner.params.n_devices={g}"
        if spec.params.get("n_devices")
        else f"planner.params.n_devices=0 (hardware.n_gpus: {g} device{'s' * (g != 1)})"
    )
    if g == 1:  # one rank alone, as if distributed: said, as a planner of one device is
        raise ConfigError(
            f"{named} with executor.distributed=true: one device runs in one process; set "
            "planner.params.n_devices=2 or more, or executor.distributed=false"
        )
    if g > model.n_experts:
        raise ConfigError(
            f"{named} is more than model {model.name}'s {model.n_experts} "
            "experts: a process would hold none; lower n_devices"
        )
    cores = os.cpu_count() or 1
    if g > cores:
        raise ConfigError(
            f"{named}: one process per device, but this machine has {cores} CPU cores; set "
            f"n_devices lower (at most {cores})"
        )
    if g > 1 and ep.lanes:
        raise ConfigError(
            "lanes (G streams of one GPU) run in one process; set executor.distributed=false"
        )
    return g, spec, planner


def run_distributed(
    ckpt: str,
    spec: RunSpec,
    routing_mode: str,
    device: str | None,
    timeout_s: float,
    routing: Routing | None = None,
    planner: Planner | None = None,
    dtype: str | None = None,
    files: dict[str, FileState] | None = None,
    on_planned: Callable[[], None] | None = None,
) -> DistOutput | None:
    """Run `spec` on G processes; None on a rank other than 0 of a torchrun launch.
    `routing`: replay this routing (else the workload's, as `real_execute`). `planner`: the
    run's (a simulation's of it), else one made here; the spawned ranks reuse its choices.
    `dtype`: the compute dtype (`real_execute`'s). `files`: the checkpoint's state where the
    command first read it (`real_execute`'s), else taken here. `on_planned`: called once the
    run's plan is accepted (`real_execute`'s; before the ranks start, where spawned here)."""
    from experiments.common.real_run import check_routing_mode, checkpoint_files, unchanged_since

    if launched():
        args = (ckpt, spec, routing_mode, device, timeout_s, None, routing, planner, dtype)
        out = _rank(*args, on_planned=on_planned)
        if files is not None:
            unchanged_since(ckpt, files)
        return out if int(os.environ["RANK"]) == 0 else None
    check_routing_mode(routing_mode)  # here, not as each rank's line ("rank 1: ...") once started
    if files is None:  # the ranks start apart: one may read it before a change
        files = checkpoint_files(ckpt)
    g, _, planner = sized_processes(ckpt, spec, routing_mode, planner, dtype)
    if on_planned is not None:  # planned here: the ranks reuse its choices
        on_planned()
    args = (ckpt, spec, routing_mode, device, timeout_s, routing, planner, dtype)
    out = _spawn(g, _child, args)
    unchanged_since(ckpt, files)
    return out


def _spawn(g: int, target: Any, args: tuple[Any, ...]) -> Any:
    """Start `target(rank, world, init, tmp, *args)` on G processes, watch them (`_watch`) and
    return what rank 0 left in tmp/rank0.pkl."""
    remove_stale_rank_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{RANK_DIR}{os.getpid()}-") as tmp:
        ctx = server_context()
        init = f"file://{Path(tmp) / 'rendezvous'}"
        procs = [
            ctx.Process(
                target=_rank_process,
                args=(os.getpid(), dict(os.environ), target, r, g, init, Path(tmp), *args),
                name=f"rank{r}",
            )
            for r in range(g)
        ]
        # SIGTERM (`kill`, `timeout`, a scheduler) would end this process alone, the ranks
        # running on as orphans: it unwinds through the `finally` that stops them
        term = signal.getsignal(signal.SIGTERM)  # a command's (stops.Stopped) unwinds already
        main = threading.current_thread() is threading.main_thread() and term == signal.SIG_DFL
        if main:
            signal.signal(signal.SIGTERM, _exit_on_term)
        server = ServerWatch(STOPPED_S)
        try:
            server.start()
            # each rank started whole: a signal between a child's start and its being sent what
            # to run left it reading an empty pipe, and its traceback followed the stop line
            with interrupt_deferred():
                # the server and a rank start with Ctrl-C, SIGTERM, SIGHUP and SIGQUIT blocked
                # (the mask outlives exec) until a rank is set (`_rank_process`): one at the
                # terminal, while a rank still imported torch, printed its traceback and more
                blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STARTS_BLOCKED)
                try:
                    _start(procs, server)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            _watch(procs, Path(tmp), server)
            rank_stderr.relay(g, Path(tmp))
        finally:
            server.stop()
            if main:
                signal.signal(signal.SIGTERM, term)
            started = [p for p in procs if p.pid is not None]
            for p in started:
                if p.is_alive():
                    p.terminate()
                    with contextlib.suppress(
                        OSError
                    ):  # a stopped rank: SIGTERM acts once it goes on
                        os.kill(p.pid, signal.SIGCONT)
            for p in started:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        with open(Path(tmp) / "rank0.pkl", "rb") as f:
            return pickle.load(f)


def remove_stale_rank_dirs() -> None:
    """The ranks' folders (`RANK_DIR<pid>-*` in the temporary folder) of commands that are gone:
    one killed with SIGKILL cannot remove its own, and each such kill left one behind."""
    for d in Path(tempfile.gettempdir()).glob(f"{RANK_DIR}*-*"):
        pid = d.name[len(RANK_DIR) :].partition("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its command is gone (another user's: PermissionError)
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _start(procs: list[Any], server: ServerWatch) -> None:
    """Start each rank; one line where the server that forks them died or was stopped first
    (its pipe closed: an EOFError or a refused connection, not the command's fault)."""
    try:
        for p in procs:
            p.start()
    except (EOFError, ConnectionError):
        raise MoepipeError(server.why()) from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):  # the rank's pipes and the server's socket
            raise MoepipeError(
                f"starting {len(procs)} rank processes: {e.strerror} ({ulimits('n')}; each rank "
                "takes a few descriptors); raise the limit (e.g. ulimit -n 4096) and run it again"
            ) from None
        if "AF_UNIX path too long" not in str(e):
            raise
        # the server listens on a socket in the temporary folder; "check the file and the
        # disk" (an OSError's line) named neither the folder nor the fix
        raise MoepipeError(
            f"the temporary folder {tempfile.gettempdir()} is too long a path for the socket "
            "the ranks are started through (at most 107 bytes with its file name); set TMPDIR "
            "to a shorter folder, e.g. TMPDIR=/tmp"
        ) from None


def _rank_process(parent: int, env: dict[str, str], target: Any, *args: Any) -> None:
    """A spawned rank: it leaves Ctrl-C, SIGHUP and SIGQUIT to the command, which stops every rank
    (SIGTERM) and prints the one line, and dies with the command (a launcher killed with
    SIGKILL left its ranks running the run on); then `target(*args)`."""
    from experiments.common.pool import die_with_parent

    sys.excepthook = sys.__excepthook__  # not the server's (`rank_server.as_server`)
    rank_stderr.capture(args[0], args[3])  # `target(rank, world, init, tmp, ...)`
    for signum in LEFT_TO_PARENT:
        signal.signal(signum, signal.SIG_IGN)  # drops one that came while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTS_BLOCKED)  # a SIGTERM held comes now
    die_with_parent()  # its parent is the server, which ends when the command does
    # the server (and with it the command) died before this rank asked to die with it: the
    # rank's parent is then another process (init), and nothing would ever stop the rank
    if parent_of(os.getppid()) not in (parent, None):
        os._exit(PEER_LOST)
    try:
        os.kill(parent, 0)
    except ProcessLookupError:  # the command died before this rank asked to die with it
        os._exit(PEER_LOST)
    # the server's environment is the command's at the first run's start: this run's instead
    os.environ.clear()
    os.environ.update(env)
    target(*args)


def _exit_on_term(signum: int, frame: Any) -> None:
    sys.exit(128 + signum)


def _watch(procs: list[Any], tmp: Path, server: ServerWatch) -> None:
    """Wait for every rank; the first that fails (not one that stopped because another did), or
    that stays stopped (SIGSTOP) for `STOPPED_S`, stops the others and the run, with one line
    naming it (or the server, where it died or `server` killed it: each rank's code is LOST)."""
    left = {p.sentinel: (r, p) for r, p in enumerate(procs)}
    lost_at: float | None = None
    stops = Stops()
    while left:
        for s in wait(list(left), timeout=0.2):
            r, p = left.pop(s)
            p.join()
            code = p.exitcode
            if code == 0:
                continue
            if code == PEER_LOST:  # the culprit's own exit comes within moments
                lost_at = lost_at or time.monotonic()
                continue
            if code == LOST:
                raise MoepipeError(server.why())
            raise MoepipeError(_why(r, code, tmp))
        now = time.monotonic()
        r = stops.long_stopped({r: p.pid for r, p in left.values()}, now)
        if r is not None:
            raise MoepipeError(stopped_line(r))
        if lost_at is not None and now - lost_at > 5:
            raise MoepipeError(
                f"real run: a rank lost its peers and no rank says why{_seen(tmp)}; check the "
                f"limits on open files and processes ({ulimits('n', 'u')}) and run it again"
            )
    if lost_at is not None:  # every rank ended as if another had failed first (each its sockets)
        raise MoepipeError(
            f"real run: every rank lost its peers, none failed first{_seen(tmp)}; check the "
            f"limits on open files and processes ({ulimits('n', 'u')}) and run it again"
        )


def _seen(tmp: Path) -> str:
    """What the first rank that lost its peers saw (`_as_rank`'s `.lost` file), as `(rank R:
    ...)`; empty where none said."""
    for f in sorted(tmp.glob("rank*.lost")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            return f" ({f.stem}: {f.read_text().strip()[:200]})"
    return ""


def stopped_line(rank: int) -> str:
    return (
        f"rank {rank} was stopped (SIGSTOP or SIGTSTP to it alone) and did not go on within "
        f"{STOPPED_S:g} s; the other ranks wait for it, so the run stopped: run it again"
    )


class Stops:
    """Which watched rank stayed stopped (SIGSTOP) for `STOPPED_S`, as a loop polling them
    sees it; a pause of the loop itself (Ctrl-Z stops the whole job) starts the count again."""

    def __init__(self) -> None:
        self.since: dict[int, float] = {}  # rank -> when the loop first saw it stopped
        self.last = time.monotonic()

    def long_stopped(self, pids: dict[int, int], now: float) -> int | None:
        """The first of `pids` (rank -> pid) stopped for `STOPPED_S` by `now`, or None."""
        if now - self.last > 1.0:  # this process was stopped too
            self.since.clear()
        self.last = now
        for r, pid in pids.items():
            if not is_stopped(pid):
                self.since.pop(r, None)
            elif now - self.since.setdefault(r, now) > STOPPED_S:
                return r
        return None


def _why(rank: int, code: int | None, tmp: Path) -> str:
    if code == NO_REPORT:
        return (
            f"rank {rank} failed and could not write its result or error to {tmp}: the "
            "temporary folder is full or not writable; free space there, or set TMPDIR to a "
            "folder with room"
        )
    err = tmp / f"rank{rank}.err"
    if err.exists() and err.read_text().strip():
        return err.read_text().strip().splitlines()[0]
    return rank_stderr.died_line(rank, code, tmp)


def _child(
    rank: int,
    world: int,
    init: str,
    tmp: Path,
    ckpt: str,
    spec: RunSpec,
    routing_mode: str,
    device: str | None,
    timeout_s: float,
    routing: Routing | None,
    planner: Planner | None = None,
    dtype: str | None = None,
) -> None:
    """One spawned rank: its result (rank 0) or its one-line error goes to a file in `tmp`."""
    where = (init, rank, world)
    _as_rank(
        rank,
        tmp,
        lambda: _rank(ckpt, spec, routing_mode, device, timeout_s, where, routing, planner, dtype),
    )


def _as_rank(rank: int, tmp: Path, run: Any) -> None:
    """Run a spawned rank's work: rank 0's result to tmp/rank0.pkl; an error as one line in
    tmp/rank<r>.err and an exit code `_watch` reads (PEER_LOST: another rank stopped first)."""
    try:
        out = run()
        if rank == 0:
            with open(tmp / "rank0.tmp", "wb") as f:
                pickle.dump(out, f)
            os.replace(tmp / "rank0.tmp", tmp / "rank0.pkl")
    except BaseException as e:  # noqa: BLE001 - one line for the parent; the rest in the log
        if _peer_gone(e):  # what it saw, for a launch where no rank failed first
            with contextlib.suppress(OSError):
                (tmp / f"rank{rank}.lost").write_text(str(e).splitlines()[0] if str(e) else "")
            sys.exit(PEER_LOST)
        if isinstance(e, MoepipeError):
            text, code = f"{e}\n", FAILED
        elif isinstance(e, OSError):  # said as the single process says it (a disk, a limit)
            from experiments.common.cli import error_line

            text, code = f"rank {rank}: {error_line(e)}\n" + traceback.format_exc(), 1
        else:
            first = str(e).splitlines()[0] if str(e) else ""
            text = f"rank {rank}: {type(e).__name__}: {first}\n" + traceback.format_exc()
            code = 1
        try:
            (tmp / f"rank{rank}.err").write_text(text)
        except OSError:  # its folder full (its result's write may be what failed) or gone
            sys.exit(NO_REPORT)
        sys.exit(code)


def _peer_gone(e: BaseException) -> bool:
    from real.distributed import PeerLost

    if isinstance(e, PeerLost):
        return True
    text = str(e)
    return any(
        s in text
        for s in (
            "Connection reset by peer",
            "Connection closed by peer",
            "Broken pipe",
            "Socket closed",
        )
    )


def _one_process_per_device(
    ckpt: str, spec: RunSpec, planner: Planner | None, dtype: str | None
) -> Planner | None:
    """The run's planner, sized; one line where the launch's WORLD_SIZE is not the schedule's
    number of devices."""
    g, _, planner = sized_processes(ckpt, spec, planner=planner, dtype=dtype)
    world = int(os.environ["WORLD_SIZE"])
    if world != g:
        raise ConfigError(
            f"torchrun started {world} processes (WORLD_SIZE), the schedule has {g} devices; "
            "set --nproc_per_node (by hand: WORLD_SIZE) to planner.params.n_devices"
        )
    return planner


def _rank(
    ckpt: str,
    spec: RunSpec,
    routing_mode: str,
    device: str | None,
    timeout_s: float,
    init: tuple[str, int, int] | None,
    routing: Routing | None = None,
    planner: Planner | None = None,
    dtype: str | None = None,
    on_planned: Callable[[], None] | None = None,
) -> DistOutput:
    """This process's rank: join the group (`init`: spawned; else torchrun's env), run in
    `dtype`. `planner`: the run's, whose choices (Klotski's n) this rank's plans reuse.
    `on_planned`: `real_execute`'s."""
    import torch.distributed as dist

    from experiments.common.real_run import real_execute

    kw: dict[str, Any] = dict(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if init is not None:
        kw.update(init_method=init[0], rank=init[1], world_size=init[2])
    rank = init[1] if init is not None else int(os.environ["RANK"])
    held: list[Any] = []  # this rank's Peers, once made
    watch = None
    if init is None:  # torchrun stops the survivors of a failed rank at once (SIGTERM)
        stop_on_sigterm(rank, held)
        watch = watch_local_peers(rank, held)  # torchrun started every local rank at once
        # before the group forms: a rank started by hand with WORLD_SIZE other than the
        # schedule's devices waited out the rendezvous for ranks no one would start
        planner = _one_process_per_device(ckpt, spec, planner, dtype)
    try:
        dist.init_process_group(**kw)
    except Exception as e:  # noqa: BLE001 - a rendezvous timeout or a bad address, one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        at_once = refused_at_once(rank, first)
        if at_once is not None:
            raise at_once from None
        lost = gone_peers() if init is None else []
        if lost:  # under torchrun, whose agent had not stopped this rank yet: the rank is known
            raise MoepipeError(
                f"rank {lost[0]} died or left before the process group formed; rank {rank} "
                f"stopped (it waited executor.rendezvous_timeout_s={timeout_s:g} s)"
            ) from None
        raise MoepipeError(
            f"rank {rank}: the process group did not form within executor.rendezvous_timeout_s="
            f"{timeout_s:g} s (a rank never joined, or MASTER_ADDR/MASTER_PORT are wrong): "
            f"{first}; start every rank with the same MASTER_ADDR/MASTER_PORT, or raise the "
            "timeout"
        ) from None
    try:
        if device and device.startswith("cuda"):
            device = f"cuda:{dist.get_rank() % max(1, _cuda_count())}"
        run: dict[str, Any] = dict(routing=routing, device=device, planner=planner, dtype=dtype)
        run["on_planned"] = on_planned
        try:
            result, out = real_execute(
                ckpt, spec, routing_mode, distributed=True, on_peers=held.append, **run
            )
        except MoepipeError as e:
            if _peer_gone(e):
                raise
            # a bug stays one, a researcher's planner's theirs, a refusal one
            raise reworded(e, f"rank {rank}: {e}") from e
        if watch is not None:  # the last collective is done: a peer that ends now has finished
            watch.needed.clear()
        return DistOutput(result, out.tokens, out.logits, out.routing)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()
