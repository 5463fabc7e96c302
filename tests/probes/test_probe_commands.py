"""Probe class: a command's own failure paths (issue 48 part 1), found by probing every command
with a bad value, a file that is not what it should be, and Ctrl-C sent to its process group as
a terminal sends it. Each is one line, a non-zero exit, no traceback, and nothing left that
looks like a result."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import overridden, started, user_env
from tests.probes.conftest import ROOT, TINY, cli, one_line, raises_one_line, tiny_run

NOT_UTF8 = b"\xff\xfe\x00: [\x80"


def test_missing_interpolation_in_the_sweep_dir_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """`hydra.sweep.dir=...${nosuch.key}`: hydra warned of the progress callback's error over
    five lines before the launcher's own error."""
    r = cli_here("experiments.run", "-m", *TINY, f"hydra.sweep.dir={tmp_path}/s_${{nosuch.key}}")
    one_line(r, "hydra.sweep.dir", "nosuch.key")
    assert not any(tmp_path.iterdir())


def test_missing_interpolation_in_the_subdir_starts_its_own_line(
    tmp_path: Path, cli_here: Any
) -> None:
    """`hydra.sweep.subdir=...${nosuch.key}`: the error line went on after the progress bar's,
    on the same line, and the sweep dir was left with hydra's multirun.yaml in it."""
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "workload.n_batches=1,2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "hydra.sweep.subdir=s_${nosuch.key}",
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    last = r.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert last.startswith("error: ") and "nosuch.key" in last and "hydra.sweep.subdir" in last
    assert not (tmp_path / "sweep").exists()  # hydra's multirun.yaml alone is no sweep


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.run", [*TINY[:1], "workload=tiny", "hardware={file}", "hydra.run.dir={run}"]),
        ("experiments.bench.lanes", ["hardware={file}", "rows=[8]", "repeats=1", "device=cpu"]),
    ],
    ids=["run", "bench.lanes"],
)
def test_a_hardware_file_that_is_not_text_is_one_line(
    tmp_path: Path, module: str, args: list[str], cli_here: Any
) -> None:
    """A hardware=FILE.yaml of bytes that are not UTF-8: UnicodeDecodeError, reported as an
    internal error (run) or a traceback."""
    bad = tmp_path / "mine.yaml"
    bad.write_bytes(NOT_UTF8)
    r = cli_here(module, *[a.format(file=bad, run=tmp_path / "run") for a in args])
    line = one_line(r, "mine.yaml", "UTF-8")
    assert "internal error" not in line
    assert not (tmp_path / "run").exists()


def test_a_trace_that_is_not_parquet_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """trace_json on a run dir whose trace.parquet was overwritten: pyarrow's ArrowInvalid,
    reported as an internal error. (In this process: a subprocess trace_json on a bad trace is
    test_a_parquet_that_is_not_a_runs_trace_is_one_line's.)"""
    run = tmp_path / "run"
    run.mkdir()
    (run / "trace.parquet").write_bytes(b"PAR1 not parquet")
    r = cli_here("experiments.trace_json", f"runs=[{run}]")
    line = one_line(r, "trace.parquet", "run again")
    assert "internal error" not in line
    assert not (run / "trace.json").exists()


def _interrupt_group(module: str, args: list[str], after_s: float) -> subprocess.CompletedProcess:
    """`python -m module args`, in a process group of its own, sent SIGINT after `after_s` as a
    terminal's Ctrl-C is (to every process of the group)."""
    proc = started(module, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_ctrl_c_while_a_command_imports_is_one_line() -> None:
    """Ctrl-C in the first second, while the command still imports torch: a KeyboardInterrupt
    traceback from inside an import, and exit status -2."""
    r = _interrupt_group("experiments.bench.host", ["device=cpu"], 0.3)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted: "), r.stderr


def test_a_sweeps_workers_start_with_ctrl_c_ignored() -> None:
    """A sweep's joblib workers, started as `sys.executable -m ...`, printed a KeyboardInterrupt
    traceback when Ctrl-C came while they imported numpy; now they start with SIGINT ignored
    (the sweep's process stops them and prints the one line), and loky's resource tracker
    does not warn after that line about the folders it removes."""
    from experiments.common.callbacks import workers_ignore_ctrl_c

    real = workers_ignore_ctrl_c()
    assert real is not None
    try:
        code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        # the tracker's warning about the memmap folders of a stopped pool, which it removes
        warn = "import warnings; warnings.warn('resource_tracker: There appear to be 1 leaked')"
        tracker = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True)
    finally:
        wrapper = Path(sys.executable).parent
        sys.executable = real
        for p in wrapper.iterdir():
            p.unlink()
        wrapper.rmdir()
    assert r.stdout.strip() == "True", r.stderr
    assert tracker.returncode == 0 and tracker.stderr == "", tracker.stderr


def test_bench_children_leave_ctrl_c_to_the_bench() -> None:
    """A bench's child process (one system each) printed its own `interrupted:` line beside
    the bench's: it now starts with SIGINT ignored, and the bench kills it."""
    from experiments.common.peers import ignore_ctrl_c

    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)"
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=ignore_ctrl_c
    )
    assert r.stdout.strip() == "True"


_POOL_STOP = """
import time
from concurrent.futures import CancelledError, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import wait

from experiments.common.pool import ignore_ctrl_c, stop_pool

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, initializer=ignore_ctrl_c)
    running = pool.submit(time.sleep, 60.0)
    queued = pool.submit(time.sleep, 60.0)
    while not running.running():
        time.sleep(0.05)
    procs = list(pool._processes.values())
    manager = pool._executor_manager_thread
    stop_pool(pool)
    left_running = manager.is_alive()  # its wake-up pipe, closed as it ends, raced the exit's
    # each worker's end as its sentinel shows it (is_alive() of a worker the pool's own thread
    # reaped meanwhile says True), well inside the runs' 60 s, with room for a loaded machine
    ended = wait([p.sentinel for p in procs], timeout=30)
    alive = [p.pid for p in procs if p.sentinel not in ended]
    try:  # cancelled, or failed with the broken pool (it may be cancelled while we ask)
        ended = isinstance(queued.exception(timeout=10), BrokenProcessPool)
    except CancelledError:
        ended = True
    print(alive, ended, left_running)
"""


def test_reproduce_klotskis_pool_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C in reproduce_klotski waited for every queued run (leaving the pool's `with`
    waits for them all): the command hung for the rest of the grid. `stop_pool` ends the running
    runs, cancels the queued ones and waits for the pool's thread. In a process of its own, as
    the command runs it (forked from the test process, a worker inherits whatever signal state
    earlier tests left)."""
    script = tmp_path / "pool_stop.py"
    script.write_text(_POOL_STOP)
    r = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # the workers' 60 s runs ended within the wait's 30 s, the queued run never ran, and the
    # pool's thread had ended: concurrent.futures' wake-up of it at exit printed an "Exception
    # ignored ... Bad file descriptor" traceback where it had not (seen on SIGTERM in CI)
    assert r.stdout.split() == ["[]", "True", "False"], r.stdout
    assert "Traceback" not in r.stderr, r.stderr


def test_a_reader_that_leaves_the_pipe_is_no_error() -> None:
    """`python -m experiments.X --help | head -2`: the rest of the help met a closed pipe and
    the command printed `error: Broken pipe; check the file and the disk`."""
    code = (
        "from experiments.common.cli import run_command\n"
        "def main():\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "run_command(main)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 141 and r.stderr == "", r.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run's dir (one subprocess for the module); tests edit a copy."""
    return tiny_run(tmp_path_factory.mktemp("finished") / "run")


@pytest.mark.parametrize(
    "fresh, edit, names",
    [
        (True, lambda df: df.drop(columns=["start_s"]), ["no column(s) start_s"]),
        (
            False,
            lambda df: df.assign(start_s=df["start_s"].astype(str)),
            ["column start_s", "not numbers"],
        ),
        (False, lambda df: df.assign(end_s=float("nan")), ["end_s=nan"]),
        (False, lambda df: df.assign(end_s=df["start_s"] - 1), ["end >= start"]),
    ],
    ids=["missing column", "numbers as text", "NaN time", "ends before it starts"],
)
def test_a_parquet_that_is_not_a_runs_trace_is_one_line(
    tmp_path: Path, finished_run: Path, fresh: bool, edit: Any, names: list[str], cli_here: Any
) -> None:
    """report's timeline figure and trace_json read a run's trace.parquet: a file of another
    schema was a KeyError or a TypeError deep inside (an internal error), NaN times were drawn.
    `fresh`: trace_json runs as a user runs it (a subprocess); in the other cases, in this
    process."""
    import pandas as pd

    from core.trace import read_trace

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    path = run / "trace.parquet"
    edit(pd.read_parquet(path)).to_parquet(path)
    raises_one_line(lambda: read_trace(path), str(path), *names)
    r = (cli if fresh else cli_here)(
        "experiments.trace_json", f"runs=[{run}]", f"out={tmp_path / 't.json'}"
    )
    one_line(r, *names)


def test_calibrate_refuses_a_disk_probe_larger_than_the_free_disk(
    tmp_path: Path, cli_here: Any
) -> None:
    """disk_mb=10^8 wrote until the disk was full, and the 60 GB probe file stayed (a size
    past 1 TiB is now refused before: the free-disk check is probed at 1 TiB)."""
    r = cli_here(
        "experiments.calibrate",
        "hardware.name=x",
        "disk_mb=1048576",
        f"out={tmp_path / 'x.yaml'}",
        f"disk_dir={tmp_path / 'd'}",
    )
    one_line(r, "disk_mb=1048576", "free")
    assert not (tmp_path / "d").exists() and not (tmp_path / "x.yaml").exists()


def test_a_second_calibrate_waits_for_the_first(tmp_path: Path) -> None:
    """Two calibrates at once each measured the other's load and wrote one temporary file: the
    second now waits for the machine's lock, saying so, and measures once the first is done.
    The lock is the one in the temporary folder (`TMPDIR`): the test's own, so that a calibrate
    or this test of another checkout on the machine does not hold it meanwhile."""
    import fcntl
    import select

    from experiments.calibrate import MEASURING_LOCK

    code = "from experiments.calibrate import measuring_alone as m\nwith m(): print('measuring')"
    with open(tmp_path / MEASURING_LOCK.name, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a first calibrate, measuring
        p = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**user_env(), "TMPDIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready, _, _ = select.select([p.stderr], [], [], 120)
            said = p.stderr.readline() if ready else ""  # type: ignore[union-attr]
            still = p.poll() is None
        except BaseException:
            p.kill()
            raise
    out, err = p.communicate(timeout=60)  # the lock released: the second goes on
    assert "another calibrate" in said and "waiting" in said and still, (said, out, err)
    assert p.returncode == 0 and out == "measuring\n" and err == ""


@pytest.mark.parametrize(
    "module, args, names",
    [
        ("accelerate", ["gpu_frac=0.6", "cpu_frac=0.5"], ["gpu_frac=0.6", "sum below 1"]),
        ("accelerate", ["role=bogus"], ["role='bogus'", "leave it out"]),
        ("accelerate", ["role=accelerate"], ["role='accelerate'", "not on a command line"]),
        ("real", ["model=mixtral-tiny", "budget_gb=1"], ["budget_gb=1", "fits in it whole"]),
        ("real", ["model=mixtral-tiny", "budget_gb=0.001", "n_layers=99"], ["n_layers=99"]),
        # found only after calibrating and writing the checkpoint (54 s), or in the child
        ("real", ["model=mixtral-tiny", "budget_gb=0.005", "routing=trace"], ["routing=trace"]),
        ("accelerate", ["planner=bogus"], ["unknown planner 'bogus'"]),
    ],
)
def test_a_bench_that_would_offload_nothing_is_one_line(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], names: list[str]
) -> None:
    """A budget that holds the whole model made accelerate load it whole (no device map), and its
    child's traceback printed before exit 0; a cut past the model's layers wrote a checkpoint of
    99 layers; the bench's own child options, set by hand, ended in an internal error."""
    where = [f"checkpoint={tmp_path}"] if module == "accelerate" else [f"out_dir={tmp_path}"]
    r = cli_here(f"experiments.bench.{module}", *where, "hardware=tiny", *args)
    one_line(r, *names)
    assert not any(tmp_path.iterdir())


def test_a_command_started_by_another_keeps_tracebacks_off() -> None:
    """run_command sets HYDRA_FULL_ERROR=1 for hydra's sake; a bench's child inherited it and
    took it for the user's switch, printing its traceback. The user's choice travels instead."""
    from experiments.common.cli import TRACEBACK_ENV

    code = (
        "import os, sys; from experiments.common.cli import run_command; "
        "run_command(lambda: print(os.environ['MOEPIPE_TRACEBACK']))"
    )
    cases = [
        ({}, "0"),
        ({"HYDRA_FULL_ERROR": "1"}, "1"),  # the user's
        ({TRACEBACK_ENV: "1"}, "1"),
        ({"HYDRA_FULL_ERROR": "1", TRACEBACK_ENV: "0"}, "0"),  # a child of a command
    ]
    for env, want in cases:
        got = subprocess.run(
            [sys.executable, "-c", code],
            env={**user_env(), **env},
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        )
        assert got.stdout.strip() == want, (env, got.stdout, got.stderr)


@pytest.mark.parametrize(
    "args, names",
    [
        (["seed=100000000000000000000"], ["seed=", "64-bit"]),
        (["n_experts=1000000"], ["n_experts=1000000", "at most 32767"]),
        (["n_layers=100000"], ["GB", "free"]),
        (["scale=1e308"], ["scale=1e308", "inf", "pass scale in ["]),
        (["model=/nonexistent/m.yaml"], ["model=/nonexistent/m.yaml: no such file"]),
        # set, then dropped unread: a run names the model after its folder, and a Mixtral
        # config.json has no dense FFN size (every layer holds experts)
        (["name=../../x"], ["name=../../x", "cannot keep", "name=ck", "out="]),
        (["dense_ffn_size=64"], ["dense_ffn_size=64", "cannot keep", "dense_ffn_size=0"]),
    ],
)
def test_make_checkpoint_refuses_what_it_could_not_write(
    tmp_path: Path, cli_here: Any, args: list[str], names: list[str]
) -> None:
    """A seed past 64 bits failed in torch ("Overflow when unpacking long long") leaving an
    empty out dir; 393 GB of experts were started on a 60 GB disk; scale=1e308 wrote inf
    weights with exit 0; a field the checkpoint cannot keep was dropped without a word. Each is
    one line before anything is made."""
    out = tmp_path / "new" / "ck"
    r = cli_here(
        "experiments.make_checkpoint", *overridden(["model=mixtral-tiny", f"out={out}"], *args)
    )
    one_line(r, *names)
    assert not (tmp_path / "new").exists()


def test_make_checkpoint_refuses_a_model_the_disk_cannot_hold_before_checking_its_scale(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The free-space check comes before the scale's, which goes over every tensor's shape (a
    minute for 100,000 layers, to refuse a model the disk could never hold)."""
    import experiments.make_checkpoint

    def not_reached(spec: Any) -> tuple[float, float]:
        raise AssertionError("check_scale ran before check_room")

    monkeypatch.setattr(experiments.make_checkpoint, "std_range", not_reached)
    out = tmp_path / "new" / "ck"
    r = cli_here(
        "experiments.make_checkpoint", "model=mixtral-tiny", f"out={out}", "n_layers=100000"
    )
    one_line(r, "GB", "free")
    assert not (tmp_path / "new").exists()


def test_make_checkpoint_reads_a_model_file_and_cleans_up_a_failed_write(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model=FILE.yaml was looked up as conf/model/FILE.yaml.yaml; a write that fails (a full
    disk) leaves no out dir of its own."""
    import errno

    import real.checkpoint_write

    mine = tmp_path / "m.yaml"
    shutil.copyfile(ROOT / "conf" / "model" / "mixtral-tiny.yaml", mine)
    out = tmp_path / "ck"
    r = cli_here("experiments.make_checkpoint", f"model={mine}", f"out={out}", "hidden_size=64")
    assert r.returncode == 0 and (out / "config.json").exists(), r.stderr

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(real.checkpoint_write, "_save_shards", full)
    new = tmp_path / "new" / "ck"
    r = cli_here("experiments.make_checkpoint", f"model={mine}", f"out={new}", "hidden_size=64")
    one_line(r, "out=", "No space left")
    assert not (tmp_path / "new").exists()


def test_a_submitit_job_that_did_not_finish_is_one_line() -> None:
    """A submitit job killed (its timeout, the scheduler) ended the sweep with an internal error
    of submitit's UncompletedJobError, a traceback file and nothing to do."""
    from submitit.core.utils import UncompletedJobError

    from experiments.common.cli import error_line

    e = UncompletedJobError("Job 7 (task: 0) has not produced any output (state: TIMEOUT)\nx")
    line = error_line(e)
    assert line is not None and "\n" not in line
    assert "Job 7" in line and ".submitit" in line and "run the same command" in line


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.routing_stats", ["-m", "seed=1,2", "out={out}"]),
        ("experiments.bench.sim", ["--multirun", "repeat=1,2"]),
    ],
)
def test_a_command_other_than_run_refuses_a_sweep(
    tmp_path: Path, cli_here: Any, module: str, args: list[str]
) -> None:
    """`-m` on a command that runs once ran it once per point, each writing the same output
    (routing_stats' second seed replaced the first's file) without a word."""
    out = tmp_path / "stats.json"
    r = cli_here(module, *[a.format(out=out) for a in args])
    one_line(r, "runs once, not as a sweep")
    assert not out.exists()
