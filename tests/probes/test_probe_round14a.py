"""Round 14a of issue 48's probe: classes the earlier rounds found and left, each fixed as a
class. Ctrl-backslash (SIGQUIT) stops every command as SIGTERM does; ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from experiments import TERMINAL_SIGNALS
from experiments.common.dist_run import _as_rank, _spawn
from tests.conftest import spawned_ranks, started
from tests.probes.conftest import TINY
from tests.probes.test_probe_signals import (
    LONG,
    _finished,
    _start,
    _stop_when,
    _whole_and_the_next_run_proceeds,
    stop_line,
    summaries,
)

# --- SIGQUIT (Ctrl-backslash): its default action dumped core, exit 131 and no line ---


def test_sigquit_stops_a_run_as_sigterm_does(tmp_path: Path, cli_here: Any) -> None:
    """Ctrl-backslash (SIGQUIT to the terminal's group) while a run computes: it ended by the
    signal's default action (status -3, a shell's 131) with no line. Now one line naming the
    signal, exit 131, the earlier result whole and the next run into the dir proceeds."""
    run = tmp_path / "run"
    before = _finished(run, cli_here)
    p = _start(run, *LONG)
    code, err = _stop_when(p, run, "computing", signal.SIGQUIT)
    assert code == 131, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert "did not finish" in stop_line(err, signal.SIGQUIT)
    _whole_and_the_next_run_proceeds(run, before, cli_here)


def test_sigquit_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """SIGQUIT while Python still imports torch and hydra: one line, exit 131, nothing
    written."""
    run = tmp_path / "run"
    p = _start(run, *LONG)
    time.sleep(0.3)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGQUIT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 131, err
    assert stop_line(err, signal.SIGQUIT).endswith(
        "the command had not started; nothing was written"
    )
    assert not run.exists()


def test_sigquit_stops_a_sweep_and_its_workers(tmp_path: Path) -> None:
    """Ctrl-backslash at a `-m` sweep (its group: the sweep and its pool's workers): one line,
    exit 131, no worker's traceback, nothing kept where no point had finished."""
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY[:-1], "planner=sequential", "workload.n_batches=400,401"]
    args += ["workload.gen_len=128", f"hydra.sweep.dir={sweep}"]
    p = started("experiments.run", *args, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while not (sweep / "multirun.yaml").exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    assert not summaries(sweep), "a run finished before the sweep could be stopped"
    os.killpg(p.pid, signal.SIGQUIT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 131, err[-2000:]
    assert stop_line(err, signal.SIGQUIT) == (
        "stopped by SIGQUIT; no run of the sweep had finished; nothing was kept"
    )
    assert not sweep.exists()


def _ignored(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says which of the terminal's signals it ignores."""
    _as_rank(rank, tmp, lambda: [signal.getsignal(s) == signal.SIG_IGN for s in TERMINAL_SIGNALS])


def test_a_rank_leaves_sigquit_to_the_command() -> None:
    """A spawned rank (and the server it forks from) left SIGQUIT at its default: Ctrl-backslash
    dumped each rank's core beside the command's line. It ignores it as it does Ctrl-C."""
    assert _spawn(1, _ignored, ()) == [True, True, True]


def test_sigquit_stops_a_distributed_run_and_its_ranks(tmp_path: Path, tiny_ckpt: Path) -> None:
    """Ctrl-backslash at a distributed real run (the command and its G ranks): one line, exit
    131, no rank left running and no result."""
    run = tmp_path / "run"
    args = ["executor=real", "executor.distributed=true", "hardware=h200-hgx8", "workload=tiny"]
    args += ["planner=eplb", "+planner.params.n_devices=2", f"checkpoint={tiny_ckpt}"]
    p = _start(run, *args, "workload.n_batches=40", "workload.gen_len=40")
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = spawned_ranks(p.pid)
    assert len(ranks) == 2, p.communicate()
    os.killpg(p.pid, signal.SIGQUIT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 131, err
    assert len(err.splitlines()) == 1 and "did not finish" in stop_line(err, signal.SIGQUIT)
    deadline = time.monotonic() + 10
    while [k for k in ranks if Path(f"/proc/{k}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [k for k in ranks if Path(f"/proc/{k}").exists()], "ranks left running"
    assert not run.exists()
