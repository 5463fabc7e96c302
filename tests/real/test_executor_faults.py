"""A real run that fails: an I/O error, an op that hangs, memory no load can get, a double
free, a truncated checkpoint, a missing one; each stops every worker and names the op or file."""

import os
import shutil
import threading
import time

import pytest

from core.errors import ScheduleBug, ScheduleError
from core.types import Tier
from experiments.common.real_run import real_execute
from real.executor import Executor
from real.interpreter import Interpreter
from real.store import TieredStore
from tests.real.test_executor import spec_for


def test_io_error_stops_every_worker(mixtral_tiny, monkeypatch):
    """A failing disk read raises out of the run (no hang) and leaves no worker thread behind."""
    calls = {"n": 0}
    real_read = TieredStore.read_disk

    def flaky(self, unit):
        calls["n"] += 1
        if calls["n"] > 12:  # after setup's preloads, during the run
            raise OSError(f"injected I/O error reading {unit}")
        return real_read(self, unit)

    monkeypatch.setattr(TieredStore, "read_disk", flaky)
    before = threading.active_count()
    with pytest.raises(OSError, match="injected"):
        real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "replay")
    assert threading.active_count() <= before


def short_stall_timeout(monkeypatch, seconds: float) -> None:
    real_init = Executor.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.stall_timeout_s = seconds

    monkeypatch.setattr(Executor, "__init__", init)


def test_an_op_that_runs_too_long_is_named(mixtral_tiny, monkeypatch):
    """A hung read stops the run with its op's name (not 'waits for its stream') and no thread
    left behind; reads that each take a while but finish are not a stall."""
    short_stall_timeout(monkeypatch, 0.6)
    calls = {"n": 0}
    real_read, real_stall = TieredStore.read_disk, Interpreter._stall
    stalled = threading.Event()  # the run has found its stall: the hung read may end

    def slow(self, unit):
        if not threading.current_thread().name.startswith("stream-"):
            return real_read(self, unit)  # the preload before the run: not the run's reads
        calls["n"] += 1
        if 2 < calls["n"] < 6:  # three slow reads
            time.sleep(0.3)
        elif calls["n"] >= 6:  # then a hung one, until the run has named it
            stalled.wait(timeout=60)
        return real_read(self, unit)

    def stall(self, *args):
        error = real_stall(self, *args)
        if error is not None:
            stalled.set()
        return error

    monkeypatch.setattr(TieredStore, "read_disk", slow)
    monkeypatch.setattr(Interpreter, "_stall", stall)
    before = threading.active_count()
    with pytest.raises(ScheduleError, match=r"load .* has run for \d+ s \(stall_timeout_s=0.6\)"):
        real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "replay")
    assert calls["n"] >= 6  # the slow reads before it ran to their end
    assert threading.active_count() <= before


def test_a_run_where_nothing_can_start_names_what_each_stream_waits_for(mixtral_tiny, monkeypatch):
    """GPU memory that the schedule's loads can never get: each blocked stream's head op and the
    bytes it waits for, after stall_timeout_s, instead of a hang."""
    short_stall_timeout(monkeypatch, 0.5)
    real_reset = Executor._reset

    def starved(self, capacity, resident, routing):
        real_reset(
            self, {**capacity, Tier.GPU: (resident or {}).get(Tier.GPU, 0)}, resident, routing
        )

    monkeypatch.setattr(Executor, "_reset", starved)
    with pytest.raises(ScheduleError, match=r"made no progress for 0.5 s: .* waits for \d+ B of"):
        try:
            real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "replay")
        except ScheduleError as e:  # memory a tier lacks: the user's, said with its fix
            assert not isinstance(e, ScheduleBug) and "raise hardware.memory_gb.gpu" in str(e)
            raise


def test_a_double_free_is_named_during_a_live_run(mixtral_tiny, monkeypatch):
    """A live run's schedule is validated only after it ran: a free of more than the ops hold
    (which would let later loads take memory the tier lacks) stops the run at that op, as in the
    simulator."""
    real_add = Executor._add_op
    doubled = {}

    def double_free(self, op, spec):
        if op.free_bytes and not doubled:
            doubled["op"] = op.label()
            op = op._replace(free_bytes=2 * op.free_bytes)
        real_add(self, op, spec)

    monkeypatch.setattr(Executor, "_add_op", double_free)
    with pytest.raises(ScheduleError, match=r"frees \d+ B of .*, more than the ops before it hold"):
        real_execute(mixtral_tiny, spec_for(mixtral_tiny, "flexgen"), "live")
    assert doubled


def test_truncated_checkpoint_names_the_file(mixtral_tiny, tmp_path, monkeypatch):
    """The checkpoint is cut short as the run starts (after its header was checked): the read
    that runs past its end names the file."""
    spec = spec_for(mixtral_tiny, "sequential")
    ckpt = tmp_path / "c"
    shutil.copytree(mixtral_tiny, ckpt)
    store = TieredStore(ckpt, 1 << 30)
    real_run = Executor.run_replay

    def cut_then_run(self, *args):
        os.truncate(ckpt / "model.safetensors", 1 << 16)
        return real_run(self, *args)

    monkeypatch.setattr(Executor, "run_replay", cut_then_run)
    with pytest.raises(OSError, match=r"model.safetensors: .*truncated"):
        real_execute(ckpt, spec, "replay", store=store)
    store.close()


def test_cli_missing_checkpoint_is_one_line_exit_2(tmp_path, cli_here):
    p = cli_here(
        "experiments.run",
        "executor=real",
        f"checkpoint={tmp_path / 'nope'}",
        "hardware=tiny",
        "workload=tiny",
        "planner=sequential",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert p.returncode == 2, p.stderr
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error:") and "nope" in err[0]
    assert not (tmp_path / "run" / "summary.json").exists()
