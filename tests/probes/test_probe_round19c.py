"""Probe round 19c (issue 48): every writing command as a process on a failing machine.

Classes:
1. A torchrun rank that ends at once (`os._exit`: stopped by its agent's SIGTERM, or its watch
   thread's line for a dead or stopped peer, while its main thread is blocked in C++) skipped
   the command's `finally` and left its run dir holding only hydra's .hydra and run.log (a
   SIGHUP to the launch's group, once in 4 tries): the rank now takes the dir away first.
2. Memory that ran out while a command imported torch (`ulimit -v`, RLIMIT_AS) was a
   MemoryError's or an ImportError's traceback (make_checkpoint, calibrate, validate), and
   once running, "make the model smaller" for a limit of the shell's: one line naming it.
3. A stop between the replacements of a result's files (collect's results.parquet and
   results.csv, reproduce_klotski's three) left a new file beside an earlier one: they are
   replaced together, the stop deferred until all are in (`deferred.written_together`).
4. A stop as a command took its output folder's lock (`dir_lock`) left `.run.lock` there:
   the file is unlinked where this process holds its lock.
5. A read-only or full disk (EROFS, ENOSPC, EDQUOT, EFBIG) at a writing command's lock or
   its output's replace, as probed by hand on a remounted tmpfs: one line, nothing left.
6. Under `ulimit -v`, reading a trace (pyarrow's threads, its allocator's reservations) hung
   or was an internal error: commands under the limit take Arrow's system allocator.
"""

from __future__ import annotations

import errno
import os
import resource
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from experiments.common import run_dir, torchrun_rank
from experiments.common.cli import error_line
from tests.conftest import user_env
from tests.probes.conftest import cli, one_line, tiny_run


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    raise _Exited(code)


@pytest.mark.parametrize("how", ["sigterm", "peer-dead"])
def test_a_torchrun_rank_ended_at_once_takes_its_run_dir_away(
    how: str, tmp_path: Path, monkeypatch: Any
) -> None:
    """The window: hydra made the dir and wrote .hydra and run.log; the rank ends by
    `os._exit` there (stopped by SIGTERM; its watch thread's line for a dead peer)."""
    monkeypatch.setattr(torchrun_rank.os, "_exit", _exit)
    monkeypatch.setattr(torchrun_rank.signal, "signal", lambda *a: None)
    monkeypatch.setattr(torchrun_rank, "say_first", lambda line: None)
    monkeypatch.setattr(torchrun_rank, "record_error", lambda line: None)
    monkeypatch.setattr(torchrun_rank, "gone_peers", lambda: [])
    out = tmp_path / "runs" / "a"
    with run_dir.run_dirs_made() as made:
        made.append((out, tmp_path / "runs", frozenset()))  # as hydra's run_job lists it
        (out / ".hydra").mkdir(parents=True)
        (out / ".hydra" / "config.yaml").write_text("a: 1\n")
        (out / "run.log").write_text("")
        with pytest.raises(_Exited):
            if how == "sigterm":
                torchrun_rank.stopped(0, None)
            else:
                torchrun_rank.ended("error: rank 1 died or left while rank 0 waited for it")
        assert not (tmp_path / "runs").exists()
    assert run_dir.OPEN_RUN_DIRS == []


# --- 2. memory that ran out: while a command imports torch, and under `ulimit -v` ---


@pytest.mark.parametrize(
    "e",
    [MemoryError(), ImportError("libtorch_cpu.so: failed to map segment from shared object")],
    ids=["MemoryError", "mmap-failed"],
)
def test_memory_out_names_the_shells_limit(e: BaseException, monkeypatch: Any) -> None:
    """`ulimit -v` too low for torch's import: MemoryError's traceback from the import (or an
    ImportError, "failed to map segment"), and where the line came, "make the model
    smaller" for a limit of the shell's. Now one line naming `ulimit -v` and its fix."""
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (600_000 * 1024, -1))
    line = error_line(e)
    assert line is not None and "ulimit -v 600000" in line and "unlimited" in line, line


def test_memory_out_while_a_command_imports_is_one_line() -> None:
    """A command that runs out of memory importing torch (`ulimit -v 250000`)."""
    limit = (250_000 * 1024,) * 2
    r = cli(
        "experiments.make_checkpoint",
        "model=mixtral-tiny",
        "out=/nonexistent/never",
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, limit),
    )
    assert r.returncode == 2, r.stderr
    one_line(r, "out of memory", "ulimit -v 250000")


def test_a_trace_is_read_under_a_shells_memory_limit(tmp_path: Path) -> None:
    """Under `ulimit -v` pyarrow's default allocator (mimalloc) could not start its reader's
    threads, as it reserves address space for each: on the 2-core VM trace_json hung for good,
    deaf to SIGTERM, at `ulimit -v 1464843`, and at 1600000 said an internal error ("Failed to
    launch worker thread"). Commands under an address-space limit take Arrow's system
    allocator. With the machine's thread count (the tests' one thread would hide it)."""
    run = tiny_run(tmp_path / "run")
    env = {k: v for k, v in user_env().items() if k != "OMP_NUM_THREADS"}
    limit = (1_600_000 * 1024,) * 2
    r = cli(
        "experiments.trace_json",
        f"runs={run}",
        env=env,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, limit),
    )
    assert r.returncode == 0, r.stderr
    assert (run / "trace.json").stat().st_size > 0


# --- 3. a stop between the files of one result ---


def test_a_stop_between_collects_two_files_replaces_both_or_neither(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """collect stopped (SIGTERM) once results.parquet had replaced the earlier one: the new
    results.parquet beside the earlier results.csv. The stop now acts once both are in."""
    import pandas as pd

    import core.args
    from experiments.common.cli import until_interrupted
    from experiments.common.tables import write_results

    out = tmp_path / "c"
    write_results(pd.DataFrame({"run_dir": ["x"], "a": [0]}), out)
    replace = os.replace

    def replace_then_stop(src: Any, dst: Any) -> None:
        replace(src, dst)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs at the next bytecode

    monkeypatch.setattr(core.args.os, "replace", replace_then_stop)
    with pytest.raises(SystemExit):
        until_interrupted(lambda: write_results(pd.DataFrame({"run_dir": ["x"], "a": [1]}), out))
    monkeypatch.undo()
    got = [pd.read_parquet(out / "results.parquet"), pd.read_csv(out / "results.csv")]
    assert [list(df["a"]) for df in got] == [[1], [1]]


# --- 4. a stop as a command takes its output folder's lock ---


def test_a_stop_as_the_lock_is_taken_leaves_no_lock_file(tmp_path: Path, monkeypatch: Any) -> None:
    """collect stopped (SIGTERM) as it took its out folder's lock left `.run.lock` there."""
    import fcntl

    from experiments.common import dir_lock

    flock, calls = fcntl.flock, []

    def flock_then_stop(fd: int, op: int) -> None:
        flock(fd, op)
        calls.append(op)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as Ctrl-C's handler raises it, right after the lock

    monkeypatch.setattr(dir_lock.fcntl, "flock", flock_then_stop)
    with pytest.raises(KeyboardInterrupt), dir_lock.dir_locked(tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []


# --- 5. a read-only or full disk at a writing command's lock or output (no mount needed) ---

_WRITERS = {
    "collect": (["dir=SWEEP", "out=OUT"], "c"),
    "trace_json": (["runs=SWEEP/a", "out=OUT"], "t.json"),
    "make_checkpoint": (["model=mixtral-tiny", "out=OUT"], "ck"),
}


@pytest.mark.parametrize(
    "command, point, code",
    [
        ("collect", "lock", errno.EROFS),
        ("collect", "replace", errno.ENOSPC),
        ("trace_json", "lock", errno.EDQUOT),
        ("trace_json", "replace", errno.EFBIG),
        ("make_checkpoint", "lock", errno.ENOSPC),
        ("make_checkpoint", "replace", errno.EROFS),
    ],
)
def test_a_read_only_or_full_disk_at_a_lock_or_an_output_is_one_line(
    command: str, point: str, code: int, tmp_path: Path, monkeypatch: Any, cli_here: Any
) -> None:
    """As on a read-only mount (EROFS) or a full one (ENOSPC, EDQUOT, EFBIG), probed by hand
    with a remounted tmpfs: the output folder's lock file that cannot be made, or the output
    that cannot replace its staged copy. One line naming the path, exit 2, nothing left."""
    sweep = tmp_path / "sweep"
    if command != "make_checkpoint":
        shutil.copytree(tiny_run(tmp_path / "run"), sweep / "a")
    args, name = _WRITERS[command]
    out = tmp_path / "o" / name
    real_open = os.open

    def refused(path: Any, *args: Any, **kwargs: Any) -> Any:
        if point == "replace" or str(path).endswith(".run.lock"):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "replace" if point == "replace" else "open", refused)
    argv = [a.replace("SWEEP", str(sweep)).replace("OUT", str(out)) for a in args]
    r = cli_here(f"experiments.{command}", *argv)
    monkeypatch.undo()
    one_line(r, str(tmp_path / "o"))
    assert r.returncode == 2 and not (tmp_path / "o").exists(), r.stderr
