"""Faults of a distributed real run's rank processes (experiments/common/dist_run.py): each
ends the run with one line naming the rank, or is the command's to handle (Ctrl-C, a killed
launcher), never a rank's own traceback or a rank running on without its command."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from experiments.common import dist_run
from experiments.common.dist_run import _as_rank, _spawn
from tests.conftest import alive, catches_sigterm, torchrun_ranks, user_env
from tests.probes.conftest import deadline, one_line, raises_one_line, real_run


def _signal_state(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says how it handles Ctrl-C and SIGHUP, and what kills it with its parent."""

    def state() -> dict[str, Any]:
        death = ctypes.c_int(0)
        ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG
        return dict(
            ignored=[signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGHUP)],
            blocked=sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
            death=death.value,
        )

    _as_rank(rank, tmp, state)


def test_a_rank_leaves_ctrl_c_to_the_command_and_dies_with_it() -> None:
    """Ctrl-C at the terminal while a rank still imported torch printed the rank's
    KeyboardInterrupt traceback (and a second one from its handler's import) before the
    command's line; a launcher killed with SIGKILL left its ranks running the run to its end.
    A rank now ignores Ctrl-C and SIGHUP from its first instruction (they are blocked from
    before exec until then) and is killed with its parent."""
    got = _spawn(1, _signal_state, ())
    assert got == dict(ignored=[True, True], blocked=[], death=signal.SIGKILL)


def _where(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says which process started it, and the environment and folder it runs in."""
    _as_rank(
        rank,
        tmp,
        lambda: dict(
            parent=os.getppid(),
            torch_loaded="torch.distributed" in sys.modules,
            probe=os.environ.get("MOEPIPE_PROBE"),
            cwd=os.getcwd(),
        ),
    )


def test_ranks_fork_from_one_server_with_each_runs_environment(monkeypatch, tmp_path) -> None:
    """Each spawned rank imported torch and the executor itself: 2.5 s of CPU per rank before it
    ran anything. Ranks now fork from a server that imported them once, for every run of the
    command; each still runs in the environment and folder of its own run."""
    first = _spawn(1, _where, ())
    monkeypatch.setenv("MOEPIPE_PROBE", "second run")
    monkeypatch.chdir(tmp_path)
    second = _spawn(1, _where, ())
    server = first["parent"]
    assert server != os.getpid() and second["parent"] == server
    assert "forkserver" in Path(f"/proc/{server}/cmdline").read_text(errors="replace")
    assert first["torch_loaded"] and first["probe"] is None
    assert second["probe"] == "second run" and second["cwd"] == str(tmp_path)


def _stops_itself(rank: int, world: int, init: str, tmp: Path) -> None:
    """Rank 1 stops (SIGSTOP) at once; rank 0 waits, as a peer of a stopped rank does."""

    def run() -> None:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)

    _as_rank(rank, tmp, run)


@pytest.mark.slow  # two rank processes, each importing the run's modules
def test_a_stopped_rank_stops_the_run_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stopped with SIGSTOP held up its peers, named (by their stall check) only after
    120 s, or never where they waited to join: the command names it once it stays stopped for
    `STOPPED_S` (shortened here), and ends every rank, the stopped one too."""
    monkeypatch.setattr(dist_run, "STOPPED_S", 0.5)
    pids: list[int] = []
    start = dist_run._watch

    def watch(procs: list[Any], tmp: Path, *rest: Any) -> None:
        pids.extend(p.pid for p in procs)
        start(procs, tmp, *rest)

    monkeypatch.setattr(dist_run, "_watch", watch)
    with deadline(60):
        line = raises_one_line(lambda: dist_run._spawn(2, _stops_itself, ()), "rank 1 was stopped")
    assert "rank 0" not in line
    assert not [p for p in pids if alive(p)]


@pytest.mark.parametrize(
    "rank, world, names",
    [
        ("5", "2", ["RANK=5", "WORLD_SIZE=2"]),
        ("-1", "2", ["RANK=-1"]),
        ("x", "2", ["RANK='x'", "must be integers"]),
        ("0", "two", ["WORLD_SIZE='two'", "must be integers"]),
    ],
)
def test_launch_variables_out_of_range_are_one_line(
    rank: str, world: str, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """RANK and WORLD_SIZE as a launcher sets them: a word was int()'s traceback (twice over,
    as the error path read them again), and RANK=5 of 2 waited out the rendezvous timeout."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    raises_one_line(dist_run.launched, *names)


@pytest.mark.slow  # a command starting: torch and hydra imported
def test_a_rendezvous_that_fails_is_one_line_without_torchs_log(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """Rank 1 whose MASTER_ADDR:MASTER_PORT nobody serves: c10d's retries printed 40-80 lines
    of warnings and stack dumps on stderr before the one line (torch's C++ log, now at FATAL
    unless the user sets TORCH_CPP_LOG_LEVEL)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(user_env(), RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.pop("TORCH_CPP_LOG_LEVEL", None)
    args = ["executor.distributed=true", "planner=eplb", "+planner.params.n_devices=2"]
    args += ["hardware=h200-hgx8", "executor.rendezvous_timeout_s=1"]
    r = real_run(tiny_ckpt, tmp_path / "run", *args, env=env)
    one_line(r, "rank 1", "did not form within executor.rendezvous_timeout_s=1")


def _torchrun_long_run(ckpt: Path, run: Path) -> list[str]:
    """torchrun of a 2-rank eplb run of 2000 tokens into `run`: far longer than any probe."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["executor=real", f"checkpoint={ckpt}", "hardware=h200-hgx8", "workload=tiny"]
    args += ["executor.distributed=true", "planner=eplb", "+planner.params.n_devices=2"]
    args += ["workload.gen_len=2000", f"hydra.run.dir={run}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    return cmd + [f"--master_port={port}", "-m", "experiments.run", *args]


@pytest.mark.slow  # torchrun and two ranks starting
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_torchruns_ranks_die_with_it(tiny_ckpt: Path, tmp_path: Path) -> None:
    """torchrun killed with SIGKILL (the OOM killer, a scheduler's kill) left its two ranks
    running the run on as orphans, holding the terminal's output for minutes. A rank now dies
    with its agent, from its first import on."""
    cmd = _torchrun_long_run(tiny_ckpt, tmp_path / "run")
    agent = subprocess.Popen(
        cmd, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ranks: dict[int, int] = {}
    try:
        with deadline(120):
            while len(ranks) < 2:
                time.sleep(0.1)
                ranks = torchrun_ranks(agent.pid)
        agent.kill()
        agent.wait()
        with deadline(60):
            while [p for p in ranks.values() if alive(p)]:
                time.sleep(0.1)
    finally:
        for pid in ranks.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # torchrun and two ranks starting
@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_torchrun_rank_stopped_alone_is_the_one_line(tiny_ckpt: Path, tmp_path: Path) -> None:
    """SIGTERM to one rank of a torchrun launch (a user's kill, a scheduler's): the rank said
    torchrun stopped it as rank 0 had failed first, then rank 0, which torchrun stopped next,
    that rank 1 had: two lines, the first blaming the rank that ran on. The rank stopped says
    so, and the rank torchrun stops after it says nothing."""
    cmd = _torchrun_long_run(tiny_ckpt, tmp_path / "run")
    agent = subprocess.Popen(
        cmd, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    ranks: dict[int, int] = {}
    try:
        with deadline(120):
            while not (len(ranks) == 2 and all(map(catches_sigterm, ranks.values()))):
                time.sleep(0.1)
                ranks = torchrun_ranks(agent.pid)
        os.kill(ranks[1], signal.SIGTERM)
        _, stderr = agent.communicate(timeout=120)
    finally:
        agent.kill()
        for pid in ranks.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for claim in Path(tempfile.gettempdir()).glob(f"moepipe-launch-{agent.pid}-*"):
            claim.unlink()
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: rank 1 was stopped (SIGTERM); the run did not finish and wrote nothing"
    ] or lines == ["error: rank 1 was stopped (SIGTERM) while it started; nothing was written"], (
        stderr[-2000:]
    )
    assert not (tmp_path / "run" / "summary.json").exists()


_WATCHER = """
import time
from experiments.common import dist_run
dist_run.STOPPED_S = 0.3
time.sleep(1.0)  # rank 1 started, and stopped by the test
dist_run.watch_local_peers(0)
time.sleep(60)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_torchrun_rank_names_a_stopped_rank_beside_it() -> None:
    """Under torchrun a rank stopped with SIGSTOP held its peers until their stall check (120
    s) and the agent's stop waited on it: the launch hung for minutes without a line. A rank
    watches the ranks its agent started beside it and ends with one line naming the stopped
    one (this test is the agent: both ranks are its children, with RANK set)."""
    env = user_env()
    asleep = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], env=dict(env, RANK="1")
    )
    try:
        os.kill(asleep.pid, signal.SIGSTOP)
        watcher = subprocess.run(
            [sys.executable, "-c", _WATCHER],
            env=dict(env, RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2"),  # as torchrun's
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        asleep.kill()
        asleep.wait()
    assert watcher.returncode == dist_run.FAILED
    (line,) = watcher.stderr.splitlines()
    assert line.startswith("error: rank 1 was stopped (SIGSTOP"), line


@pytest.mark.parametrize(
    "rank, error, printed",
    [
        ("1", "torchrun started 2 processes, the schedule has 1 devices", False),
        ("0", "torchrun started 2 processes, the schedule has 1 devices", True),
        ("1", "rank 1: /ck/model.safetensors: truncated safetensors file", True),
        ("1", "rank 0 died or left during the run; rank 1 stopped (gloo: ...)", True),
    ],
)
def test_under_torchrun_a_line_every_rank_meets_is_printed_once(
    rank: str, error: str, printed: bool, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """A config error every rank of a torchrun launch meets (here torchrun's process count)
    was printed by each rank, the same line G times: a rank other than 0 prints only a line
    that names it (its own fault, or the peer it lost)."""
    from core.errors import ConfigError
    from experiments.common.cli import exit_with

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the SIGTERM it ignores: not pytest's
    with pytest.raises(SystemExit) as stop:
        exit_with(ConfigError(error))
    assert stop.value.code == 2
    assert capsys.readouterr().err == (f"error: {error}\n" if printed else "")


def test_under_torchrun_ctrl_c_is_one_line_from_rank_0(
    monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """Ctrl-C reaches every rank of a torchrun launch: each printed `interrupted: ...`."""
    from experiments.common.cli import until_interrupted

    def interrupted() -> None:
        raise KeyboardInterrupt

    said = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as stop:
            until_interrupted(interrupted)
        assert stop.value.code == 130
        said.append(capsys.readouterr().err)
    assert said[0].startswith("interrupted: ") and said[1] == ""


def _cannot_report(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that fails where it cannot write its error file (a full TMPDIR)."""

    def run() -> None:
        (tmp / f"rank{rank}.err").mkdir()  # its write fails, as ENOSPC does
        raise OSError(28, "No space left on device", str(tmp / "rank0.tmp"))

    _as_rank(rank, tmp, run)


def test_a_rank_that_cannot_write_its_error_is_one_line() -> None:
    """TMPDIR full: rank 0's result could not be written, nor its error file, and the rank's
    own traceback (three exceptions chained) came before "rank 0 died (exit code 1)". The rank
    exits with a code that says so, and the command names the folder."""
    raises_one_line(
        lambda: _spawn(1, _cannot_report, ()),
        "rank 0 failed and could not write its result or error to",
        "set TMPDIR",
    )


def test_a_bad_routing_mode_is_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """executor.routing_mode=bogus with executor.distributed=true started every rank, each of
    which refused it, the line then naming a rank ("rank 1: ...") as if it were at fault."""

    def no_spawn(*args: Any) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(dist_run, "_spawn", no_spawn)
    line = raises_one_line(
        lambda: dist_run.run_distributed("unused", None, "bogus", None, 5),  # type: ignore[arg-type]
        "executor.routing_mode='bogus'",
        "replay, live",
    )
    assert "rank" not in line


def test_a_planner_that_peeks_is_refused_live_before_any_rank_starts(
    tiny_ckpt: Path, tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oracle_replication (it plans from the coming iteration's routing) with
    executor.routing_mode=live and executor.distributed=true started every rank, and the line
    came from one of them ("rank 0: this planner looks at routing ...") once each had run into
    the peek. The command's own plan shows the peek: it is refused there, naming the planner."""

    def no_spawn(*args: Any) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(dist_run, "_spawn", no_spawn)
    r = cli_here(
        "experiments.run",
        "executor=real",
        "executor.distributed=true",
        "executor.routing_mode=live",
        "hardware=h200-hgx8",
        "workload=tiny",
        "planner=oracle_replication",
        "+planner.params.n_devices=2",
        f"checkpoint={tiny_ckpt}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = one_line(r, "planner oracle_replication: looks at routing before its gate")
    assert "rank" not in line and "pass executor.routing_mode=replay" in line
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_killed_commands_rank_folder_goes_with_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command killed with SIGKILL cannot remove its ranks' folder in the temporary folder,
    and each such kill left one there. The next distributed run removes the folders of
    commands that are gone, and keeps those of commands still running."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has now
    stale = tmp_path / f"{dist_run.RANK_DIR}{gone.pid}-abc"
    running = tmp_path / f"{dist_run.RANK_DIR}{os.getppid()}-def"
    other = tmp_path / f"{dist_run.RANK_DIR}notapid-ghi"
    for d in (stale, running, other):
        d.mkdir()
        (d / "rank1.err").write_text("left behind\n")
    assert _spawn(1, _where, ())["cwd"]
    assert not stale.exists() and running.exists() and other.exists()
    # this run's own folder went too (multiprocessing may keep a folder of its own here)
    left = sorted(p.name for p in tmp_path.glob(f"{dist_run.RANK_DIR}*"))
    assert left == sorted([running.name, other.name])


def _aborts_in_native_code(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that dies as gloo's listener did out of descriptors: C++'s terminate lines written
    to descriptor 2 past Python, then SIGABRT."""
    os.write(2, b"terminate called after throwing an instance of 'gloo::EnforceNotMet'\n")
    os.write(
        2,
        b"  what():  [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:446]"
        b" rv != -1. -1 vs -1. accept: Too many open files\n",
    )
    os.abort()


def test_a_rank_aborted_in_native_code_is_one_line_with_what_it_said() -> None:
    """Under `ulimit -n 20` gloo sometimes aborted a rank inside its listener: the rank's C++
    terminate lines reached the terminal above "rank 0 died (signal 6); the run stopped", which
    named neither the cause nor the fix. A rank's standard error goes to its file, and the one
    line carries its last line, the signal's name and, for descriptors, the limit to raise."""
    line = raises_one_line(
        lambda: _spawn(1, _aborts_in_native_code, ()),
        "rank 0 died (signal 6, SIGABRT: rv != -1. -1 vs -1. accept: Too many open files)",
        "ulimit -n 4096",
    )
    assert "pair.cc" not in line and "terminate called" not in line


def _stderr_and_warns(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says where its descriptor 2 points, after printing a warning there."""

    def run() -> str:
        print("moepipe: a warning every rank prints", file=sys.stderr, flush=True)
        return os.readlink("/proc/self/fd/2")

    _as_rank(rank, tmp, run)


def test_what_ranks_print_reaches_the_command_once_after_the_run(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Ranks write their standard error to their run's folder (native code's too), and a run
    that succeeds relays it: each distinct line once, not once per rank."""
    where = _spawn(2, _stderr_and_warns, ())
    assert where.endswith("rank0.stderr")
    err = capfd.readouterr().err
    assert err.splitlines() == ["moepipe: a warning every rank prints"], err
