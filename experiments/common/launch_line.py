"""Whether this process is a rank of a torchrun launch, and under torchrun which rank says why
the launch stopped: its agent stops every rank (SIGTERM) once one ends, and each rank's line
followed the first one's, blaming another rank. The first rank to say claims it (a file named
after the agent) and the others end without a line. Light on imports: a rank's SIGTERM handler
uses it while the command still starts, and every run asks it first.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

from core.errors import ConfigError, MoepipeError


def launched() -> bool:
    """Is this process one rank of a torchrun (or similar) launch of G > 1 processes?"""
    return launch_ranks() is not None


def launch_ranks() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) of this process where it is one rank of a torchrun (or similar) launch
    of G > 1 processes (both set), else None; one line where they are not whole numbers or the
    rank is not below the world size (an int() of them was a traceback, and RANK=5 of 2 waited
    out the rendezvous timeout)."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is None or world is None:
        return None
    try:
        r, w = int(rank), int(world)
    except ValueError:
        raise ConfigError(
            f"environment RANK={rank!r}, WORLD_SIZE={world!r}: must be integers (torchrun sets "
            "them for each rank it starts; unset them to run one process)"
        ) from None
    if w < 1:  # a launch of no process: the variables are not a launcher's
        raise ConfigError(
            f"environment WORLD_SIZE={w}: a launch has at least one process (torchrun sets it "
            "to the ranks it starts); unset RANK and WORLD_SIZE to run one process"
        )
    if w == 1:
        return None
    if not 0 <= r < w:
        raise ConfigError(
            f"environment RANK={r} is not in [0, WORLD_SIZE={w}): each of the WORLD_SIZE "
            "processes needs its own rank 0 .. WORLD_SIZE - 1 (as torchrun sets them)"
        )
    return r, w


def other_rank() -> int | None:
    """This process's rank where it is a rank other than 0 of a torchrun launch (RANK and
    WORLD_SIZE > 1 whole numbers), else None."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if rank.isdigit() and world.isdigit() and int(world) > 1 and 0 < int(rank) < int(world):
        return int(rank)
    return None


# held while this process claims the line and prints it: another thread of it that would say
# the launch's line (`say_first`) waits until the line is out, then finds the claim taken
_SAYING = threading.Lock()


def say_first(line: str) -> bool:
    """Print `line` on stderr where this rank is the first to say why the launch stopped
    (`first_to_say`), and whether it was. Another thread of this process saying at once waits
    for this one's line to be out (a thread that found the claim taken and ended the process
    at once cut the claiming thread's line off)."""
    with _SAYING:
        if not first_to_say():
            return False
        # one write: under torchrun (`python -u`, stderr written through) print's two, the line
        # and its newline, let the agent's log line in between, on the same line as ours
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
        return True


def record_error(line: str) -> None:
    """`line` in torchrun's error file for this rank (TORCHELASTIC_ERROR_FILE, in torchelastic's
    JSON: `errors.ErrorHandler`'s): torchrun's report of a failed rank then shows it (its
    "traceback" field) in place of a link to torch's docs, the one place it is seen where the
    ranks' stderr goes to torchrun's --log-dir. Nothing outside a torchelastic launch, and
    nothing where the file cannot be written (the line is on stderr anyway)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    info = {"py_callstack": line, "timestamp": str(int(time.time()))}
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": info}}, f)
    except OSError:
        pass


def claims_lines() -> bool:
    """Whether this rank's lines are claimed (`first_to_say`): under torchrun's agent, where
    one line of the launch is printed whichever rank says it."""
    return _claim() is not None


def first_to_say() -> bool:
    """Whether this rank is the first of those its agent started to print why the launch
    stopped; it claims that now. True outside a torchrun launch of G > 1 ranks, and where no
    claim can be made (no /proc, a temporary folder that is not writable)."""
    path = _claim()
    if path is None:
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    except OSError:
        return True
    _remove_stale(path.parent)
    return True


def gone_peers() -> list[int]:
    """The ranks the agent started beside this one (LOCAL_WORLD_SIZE of them) that have ended."""
    running = launched_ranks(os.getppid())
    return [r for r in local_peers() if r not in running]


def local_peers() -> list[int]:
    """The ranks the agent started beside this one (LOCAL_WORLD_SIZE of them); none outside a
    torchrun launch."""
    try:
        rank = int(os.environ["RANK"])
        first = rank - int(os.environ["LOCAL_RANK"])
        local = range(first, first + int(os.environ["LOCAL_WORLD_SIZE"]))
    except (KeyError, ValueError):  # not torchrun's: nothing known of the peers
        return []
    return [r for r in local if r != rank]


def all_local() -> bool:
    """Do all ranks of the launch run on this machine (under one agent)?"""
    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def check_split_over_ranks(executor: str, distributed: bool) -> None:
    """Under a launch of G > 1 processes only a distributed real run splits its work over the
    ranks: any other ran whole on every rank, into one run dir, the last to end replacing the
    others' result, without a word."""
    ranks = launch_ranks()
    if ranks is None:
        return
    if executor == "real" and distributed:
        check_rendezvous_env(ranks[0])
        return
    raise ConfigError(
        f"torchrun started {ranks[1]} processes (WORLD_SIZE), but a run of executor={executor} "
        "without executor.distributed=true runs whole in each of them, into one run dir: pass "
        "executor=real executor.distributed=true with an expert-parallel planner, or "
        "--nproc_per_node=1"
    )


def check_rendezvous_env(rank: int) -> None:
    """A rank meets its group at MASTER_ADDR:MASTER_PORT: a port outside 1..65535 (0 too: each
    rank 0 would take a free one no other rank knows) or a host this machine cannot resolve
    was said only once the rendezvous timed out (120 s by default), as a group that did not
    form within it."""
    port = os.environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            f"rank {rank}: environment MASTER_PORT={port!r} is not a port (1 to 65535) every rank "
            "can meet at; set it to a free port on rank 0's host, e.g. MASTER_PORT=29500"
        )
    host = os.environ.get("MASTER_ADDR")
    if host and not resolves(host):
        raise ConfigError(
            f"rank {rank}: environment MASTER_ADDR={host!r}: no such host here; set it to rank "
            "0's host name or address"
        )


def resolves(host: str) -> bool:
    """Does this machine resolve `host` (a name or an address)? A launch's rendezvous at one it
    cannot retried for ever, or waited out its timeout."""
    import socket

    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return True


def launched_ranks(launcher: int) -> dict[int, int]:
    """rank -> pid of the processes `launcher` started with RANK set (torchrun's ranks); an
    ended one, not yet reaped, shows no environment and is left out."""
    ranks = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[-1].split()[1]) != launcher:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):  # gone, or not ours to read
            continue
        for kv in env:
            if kv.startswith(b"RANK=") and kv[5:].isdigit():
                ranks[int(kv[5:])] = int(d.name)
    return ranks


_PREFIX = "moepipe-launch-"
_RESTART = b"TORCHELASTIC_RESTART_COUNT="  # in a rank's environment


def _claim() -> Path | None:
    """The claim's file: one per agent process (its pid and start time) and restart. None but
    under torchrun's agent (TORCHELASTIC_RUN_ID: RANK and WORLD_SIZE alone may be a user's)."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if not (rank.isdigit() and world.isdigit() and int(world) > 1):
        return None
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return _claim_of(os.getppid(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _claim_of(agent: int, restart: str) -> Path | None:
    started = _start_time(agent)
    if started is None:
        return None
    return Path(tempfile_dir()) / f"{_PREFIX}{agent}-{started}-{restart}.said"


def say_as_agent(line: str) -> bool:
    """Print `line` where no rank this process started (as torchrun's agent:
    `experiments.torchrun`) said the launch's line first, and claim it for them: a signal to
    the launcher, which it passes on to its ranks as SIGTERM, is said by the launcher, not by a
    rank as its own. The claim is that of the ranks running now (their restart's)."""
    restart = "0"
    for pid in launched_ranks(os.getpid()).values():
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        found = [kv.partition(b"=")[2].decode() for kv in env if kv.startswith(_RESTART)]
        restart = found[0] if found and found[0].isdigit() else restart
        break
    path = _claim_of(os.getpid(), restart)
    with _SAYING:
        if path is not None:
            try:
                os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                return False
            except OSError:
                pass
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
        return True


def _start_time(pid: int) -> str | None:
    try:  # field 22 of /proc/PID/stat, the 20th after the command's name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[19]
    except (OSError, IndexError):
        return None


def _remove_stale(folder: Path) -> None:
    """Claims of agents that have ended: one small file per failed launch would pile up."""
    for p in folder.glob(f"{_PREFIX}*.said"):
        agent, _, rest = p.name[len(_PREFIX) :].partition("-")
        if agent.isdigit() and _start_time(int(agent)) != rest.partition("-")[0]:
            p.unlink(missing_ok=True)


def said_under(agent: int) -> bool:
    """Whether a rank that `agent` (this process, where it runs torchrun's agent:
    `experiments.torchrun`) started said the launch's line (`first_to_say`); its claims are
    removed, the launch being over."""
    started = _start_time(agent)
    said = False
    for p in Path(tempfile_dir()).glob(f"{_PREFIX}{agent}-{started}-*.said"):
        said = True
        p.unlink(missing_ok=True)
    return said


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


def say_error(line: str) -> None:
    """`line` (`error: ...`) on stderr as a rank of a launch says it: in torchrun's error file
    (`record_error`), and printed once a launch, under torchrun's agent by the first rank to say
    (`say_first`), elsewhere by rank 0, a rank other than 0 printing only a line that names it.
    Outside a launch, printed. A number an override gave is shown as typed (`with_typed`)."""
    from experiments.common.typed_values import with_typed

    line = with_typed(line)
    record_error(line)  # every rank's, for torchrun's report of the failed ranks
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    other = rank.isdigit() and world.isdigit() and 0 < int(rank) < int(world)
    if not other or f"rank {rank}" in line or claims_lines():
        say_first(line)


# hydra's flags that print instead of running (the help, a config, hydra's info)
PRINTING_FLAGS = frozenset({"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info"})


@contextmanager
def printed_once(flags: Sequence[str]) -> Iterator[None]:
    """A command's --help (--cfg, --info: what prints in place of a run) printed once a launch:
    by rank 0, a rank other than 0 printing nothing (under torchrun each rank printed it)."""
    rank, world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    other = rank.isdigit() and world.isdigit() and 0 < int(rank) < int(world)
    if not (other and PRINTING_FLAGS & set(flags)):
        yield
        return
    with open(os.devnull, "w") as nowhere, redirect_stdout(nowhere):
        yield


def refused_at_once(rank: int, first: str) -> MoepipeError | None:
    """What failed the process group at once, not by a timeout (`first`: torch's first line),
    as one line naming the variable and its fix: gloo's interface, the store's port in use,
    a rank started by hand without MASTER_ADDR or MASTER_PORT. None for anything else."""
    if "Unable to find address for" in first:
        import socket

        names = ", ".join(n for _, n in socket.if_nameindex())
        return MoepipeError(
            f"rank {rank}: environment GLOO_SOCKET_IFNAME="
            f"{os.environ.get('GLOO_SOCKET_IFNAME')!r} names no network interface of this "
            f"machine (it has {names}); set it to one of them, or unset it"
        )
    if "EADDRINUSE" in first:  # rank 0 listens on MASTER_PORT for the group's store
        port = re.search(r"port: (\d+)", first)
        return MoepipeError(
            f"rank {rank}: MASTER_PORT={port.group(1) if port else os.environ.get('MASTER_PORT')}"
            " is in use by another process, so the process group's store cannot listen there; "
            "set MASTER_PORT to a free port (torchrun: --master_port=PORT, or --standalone, "
            "which picks a free one)"
        )
    unset = re.search(r"environment variable (MASTER_\w+) expected, but not set", first)
    if unset:
        return MoepipeError(
            f"rank {rank}: RANK and WORLD_SIZE are set, {unset.group(1)} is not: a rank started "
            "by hand joins its group at MASTER_ADDR:MASTER_PORT (torchrun sets both); set them, "
            "start the ranks with torchrun, or unset RANK and WORLD_SIZE to let the command "
            "start them"
        )
    return None
