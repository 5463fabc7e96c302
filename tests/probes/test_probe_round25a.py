"""Round 25a of issue 48: one rule for warnings, in one place. A run's warnings print once its
plan is accepted; a refused run prints only its refusal; any other failure prints them before
its line. Rounds 24b and 24f applied it command by command, with a hold on the root logger's
handlers: the commands without a logging setup of their own (Python's last-resort handler)
held nothing at all, a forked pool worker inherited a hold it never released, and eleven
commands held nothing. Now every command holds through its shared entry (`cli.run_command`,
each hydra job), and the error path settles what is held.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from core.errors import CapacityError, MoepipeError
from experiments.common import held_warnings as hw
from experiments.common.held_warnings import plan_accepted, warnings_held
from tests.probes.conftest import TINY

_NOTE = "probe: a note about the run"
_log = logging.getLogger("experiments.probe")


@pytest.fixture
def said(capsys: pytest.CaptureFixture[str]) -> Callable[[], list[str]]:
    """The lines on stderr since last asked (`bare`: the warnings logged, as a terminal
    shows them)."""
    return lambda: [line for line in capsys.readouterr().err.splitlines() if line]


@contextmanager
def bare() -> Iterator[None]:
    """The root logger without pytest's handlers, as a command's: a record reaches Python's
    last-resort handler, on stderr."""
    root = logging.getLogger()
    handlers, root.handlers = root.handlers, []
    try:
        yield
    finally:
        root.handlers = handlers


def test_a_command_without_handlers_holds_its_warnings(said: Callable[[], list[str]]) -> None:
    """The hold filtered the root's handlers: with none (bench_host, collect), Python's
    last-resort handler printed every warning at once, before a refusal too."""
    with bare(), warnings_held():
        _log.warning(_NOTE)
        assert said() == []
        plan_accepted()
        _log.warning("later")
    assert said() == [_NOTE, "later"]


def test_an_inner_release_waits_for_the_outer_hold(said: Callable[[], list[str]]) -> None:
    """A hold closing inside one that still holds gives it its warnings: said with the
    outer's, in order, once; a refusal inside drops the inner's alone."""
    with bare(), warnings_held():
        _log.warning("outer 1")
        with warnings_held():
            _log.warning("inner")
        with pytest.raises(CapacityError), warnings_held():
            _log.warning("refused")
            raise CapacityError("GPU memory too small")
        _log.warning("outer 2")
        assert said() == []
    assert said() == ["outer 1", "inner", "outer 2"]


def test_an_inner_plan_releases_every_hold_once(said: Callable[[], list[str]]) -> None:
    """The plan accepted inside (a sweep point's run) releases the outer hold first; the next
    point holds again."""
    with bare(), warnings_held():
        _log.warning("before")
        with warnings_held():
            _log.warning("point 1")
            plan_accepted()
            assert said() == ["before", "point 1"]
        with pytest.raises(CapacityError), warnings_held():
            _log.warning("point 2")
            raise CapacityError("GPU memory too small")
    assert said() == []


@pytest.mark.parametrize(
    ("error", "kept"),
    [(CapacityError("too small"), []), (MoepipeError("bad"), [_NOTE, "error: bad"])],
)
def test_the_error_path_settles_what_is_held(
    said: Callable[[], list[str]], error: Exception, kept: list[str]
) -> None:
    from experiments.common.held_warnings import say_line

    with bare(), warnings_held():
        _log.warning(_NOTE)
        say_line(error)
    assert said() == (kept or [f"error: {error}"])


def test_a_forked_worker_holds_nothing_of_its_parents() -> None:
    """A pool's forked worker inherited the hold, which only the parent releases: its
    warnings were lost."""
    read, write = os.pipe()
    handler = logging.StreamHandler(os.fdopen(write, "w"))
    logging.getLogger().addHandler(handler)
    try:
        with warnings_held():
            pid = os.fork()
            if pid == 0:  # the worker: its warning goes to the pipe at once
                _log.warning("from the worker")
                handler.flush()
                os._exit(0)
            os.waitpid(pid, 0)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.stream.close()  # the pipe's end: its reader sees the end of what was said
    with os.fdopen(read) as f:
        assert f.read().count("from the worker") == 1
    assert hw._OPEN == []


# each command's own path for a bad input, a warning logged as its work starts
_BAD = {
    "experiments.collect": ["dir=/nonexistent/sweep"],
    "experiments.trace_json": ["runs=[/nonexistent/run]"],
    "experiments.replication_cv": ["dir=/nonexistent/sweep"],
    "experiments.convert_traces": ["src=/nonexistent/trace", "out=/nonexistent/t.npz"],
    "experiments.bench.host": ["device=cpu", "repeats=0"],
    "experiments.bench.lanes": ["lanes=1", "device=cpu"],
    "experiments.validate": ["checkpoint=/nonexistent/ck", "hardware=tiny"],
}


@pytest.fixture
def noted(monkeypatch: pytest.MonkeyPatch) -> Callable[[Exception | None], None]:
    """Every command's options check logs the note first, then raises `error` (None: none)."""
    from experiments.common import app

    def note_then(error: Exception | None) -> None:
        check = app.check_not_empty

        def checked(opts: Any, prefix: str = "") -> None:
            if not prefix:
                _log.warning(_NOTE)
                if error is not None:
                    raise error
            check(opts, prefix)

        monkeypatch.setattr(app, "check_not_empty", checked)

    return note_then


@pytest.mark.parametrize("module", list(_BAD))
def test_every_command_says_its_warnings_before_its_own_error(
    module: str, noted: Any, cli_here: Any
) -> None:
    noted(None)
    with bare():
        r = cli_here(module, *_BAD[module])
    lines = [line for line in r.stderr.splitlines() if line]
    assert r.returncode == 2 and lines[-1].startswith("error: "), r.stderr
    notes = [i for i, line in enumerate(lines) if line.endswith(_NOTE)]
    assert len(notes) == 1 and notes[0] < len(lines) - 1, r.stderr


@pytest.mark.parametrize("module", ["experiments.collect", "experiments.bench.host"])
def test_a_refused_command_says_only_its_refusal(module: str, noted: Any, cli_here: Any) -> None:
    noted(CapacityError("GPU memory too small; raise hardware.memory_gb.gpu"))
    with bare():
        r = cli_here(module, *_BAD[module])
    assert [line for line in r.stderr.splitlines() if line] == [
        "error: GPU memory too small; raise hardware.memory_gb.gpu"
    ], r.stderr


def test_a_long_simulations_warning_comes_before_it_simulates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_here: Any
) -> None:
    """'... minutes to simulate; Ctrl-C stops it', said up front, was held until the run had
    simulated (a sim run's plan was accepted only as it ended)."""
    from experiments.common import pipeline

    monkeypatch.setattr(pipeline, "OPS_CHECKED", 1)  # the tiny run as if of millions of ops
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    monkeypatch.setattr(logging.getLogger(pipeline.__name__), "handlers", [handler])
    simulate = pipeline.simulate_table
    by_then: list[str] = []

    def simulated(*args: Any) -> Any:
        by_then.extend(said)
        return simulate(*args)

    monkeypatch.setattr(pipeline, "simulate_table", simulated)
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert len(by_then) == 1 and "Ctrl-C stops it" in by_then[0], (by_then, said)
