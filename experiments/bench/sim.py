"""Simulator speed: the phases of a whole `experiments.run` of Mixtral-8x7B on rtx3090-env1,
Klotski's paper workload (prompt 512, generate 32, batch 16), `flexgen` at n=15 (177,874 ops),
and its ops/s against a bare simpy event loop timed in the same process. It prints its table;
the runs it times write into a temporary folder, removed after.

Usage:
    python -m experiments.bench.sim [repeat=3] [planner=flexgen]
    python -m experiments.bench.sim scaling=true   # CPU time and peak memory over four sizes
Per repeat: the CLI run's wall time, its phases and its ops/s as a ratio to bare simpy's
events/s (docs/commands.md#bench_sim).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import simpy

from core.args import MAX_REPEATS, REPEATS_WHY, as_int
from core.errors import MoepipeError
from experiments.common.app import command
from experiments.common.cli import exit_command  # noqa: E402
from experiments.common.held_warnings import plan_accepted, say_line  # noqa: E402
from planners.registry import make_planner

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
RUN = ["model=mixtral-8x7b", "hardware=rtx3090-env1", "workload=paper", "workload.n_batches=15"]
# (model, n) per size of the scaling table; the paper workload (prompt 512, generate 32) on
# h800-env2, whose GPU holds the activations of n = 61 batches of Mixtral-8x22B (a 3090 does not)
SIZES = [("mixtral-8x7b", 4), ("mixtral-8x7b", 15), ("mixtral-8x22b", 15), ("mixtral-8x22b", 61)]
SCALING_HW = "h800-env2"
PHASES = ("startup", "config", "routing", "plan", "validate", "simulate", "summarize", "write")


def bare_simpy_events_per_s(n: int = 200_000) -> float:
    env = simpy.Environment()

    def proc():  # type: ignore[no-untyped-def]
        for _ in range(n):
            yield env.timeout(1)

    env.process(proc())
    t = time.process_time()
    env.run()
    return n / (time.process_time() - t)


@dataclass
class Options:
    repeat: int = 3  # timed runs; the best is reported
    planner: str = "flexgen"  # a registered planner
    scaling: bool = False  # the table over four sizes instead


def main(argv: list[str] | None = None) -> int:
    return _app(argv)


def _main(args: Options) -> int:
    try:
        make_planner(args.planner, {})  # an unknown planner, before the model is loaded
        as_int("repeat", args.repeat, at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
        plan_accepted()  # inputs accepted: its warnings said now, not as it ends
        if args.scaling:
            scaling(args.planner)
        else:
            bench(args.planner, args.repeat)
    except MoepipeError as e:
        say_line(e)
        return 2
    return 0


def _timed(times: dict[str, float], phase: str, fn: Callable[[], Any]) -> Any:
    """fn's result; its CPU seconds (this process's: other load on the machine not counted)
    into times[phase]."""
    t = time.process_time()
    out = fn()
    times[phase] = time.process_time() - t
    return out


def _child(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of a subprocess run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode:  # the child's own line, once (not as a Python list, with its `error: `)
        said = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise MoepipeError(f"python {' '.join(cmd[1:3])} failed: {said.removeprefix('error: ')}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return wall, cpu


def startup_s() -> float:
    """CPU seconds a fresh interpreter takes to import the run command (hydra and all)."""
    return _child([sys.executable, "-c", "import experiments.run"])[1]


def cached_startup_s() -> float:
    """`startup_s` with Python's bytecode cache on (in a temporary folder, filled by a first
    import that is not timed), as it is by default: where PYTHONDONTWRITEBYTECODE is set,
    every process compiles the project's sources again."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPYCACHEPREFIX": cache}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        cmd = [sys.executable, "-c", "import experiments.run"]
        _child(cmd, env)
        return min(_child(cmd, env)[1] for _ in range(2))


def cli_run_s(planner: str, out: Path) -> tuple[float, float]:
    """Wall and CPU seconds of the whole `python -m experiments.run ...` as a user types it."""
    return _child(
        [
            sys.executable,
            "-m",
            "experiments.run",
            *RUN,
            f"planner={planner}",
            f"hydra.run.dir={out}",
            "skip_finished=false",
        ]
    )


@contextmanager
def _own_hydra() -> Iterator[None]:
    """Compose the run's config as experiments.run does, from inside this command's own hydra
    app: hydra's one global instance is set aside while the run's is made, then put back."""
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    saved = gh.hydra if gh.is_initialized() else None
    gh.clear()
    try:
        yield
    finally:  # hydra's initialize_* may swap the singleton itself: ask for it again
        GlobalHydra.instance().clear()
        if saved is not None:
            GlobalHydra.instance().initialize(saved)


def run_phases(
    planner: str, overrides: list[str], out: Path | None
) -> tuple[int, dict[str, float]]:
    """The ops and the seconds of each phase of one run, as `experiments.run` runs it."""
    from hydra import compose, initialize_config_dir

    from experiments.common.pipeline import gc_paused, sized_run
    from experiments.common.resolve import run_spec

    times: dict[str, float] = {}

    def config():  # type: ignore[no-untyped-def]
        with _own_hydra(), initialize_config_dir(str(CONF), version_base="1.3"):
            cfg = compose("config", [*overrides, f"planner={planner}"])
        return sized_run(run_spec(cfg))  # and the run's one planner, as experiments.run's

    spec, run = _timed(times, "config", config)
    # the collector paused from routing to write, and on again once the run's objects are
    # freed (when `_run_phases` returns), as experiments.run pauses it
    with gc_paused():
        return _run_phases(spec, run, out, times), times


def _run_phases(spec: Any, planner: Any, out: Path | None, times: dict[str, float]) -> int:
    """The run's phases after config, timed into `times`; its ops."""
    from core.routing import load_routing
    from core.schedule import validate
    from experiments.common.pipeline import (
        RunResult,
        plan_schedule,
        simulate_table,
        summary_of,
        write_run,
    )

    routing = _timed(times, "routing", lambda: load_routing(spec.model, spec.workload))
    schedule = _timed(times, "plan", lambda: plan_schedule(spec, routing, planner))
    _timed(times, "validate", lambda: validate(schedule, check_finishes=False))
    kept: list[object] = []  # the simulator's streams, kept unfreed as the command keeps them
    trace = _timed(times, "simulate", lambda: simulate_table(schedule, spec.hardware, kept))
    summary = _timed(times, "summarize", lambda: summary_of(spec, schedule, trace, routing))
    if out is not None:
        _timed(times, "write", lambda: write_run(out, RunResult(schedule, trace, summary)))
    return len(schedule)


def bench(planner: str, repeat: int) -> None:
    cols = ("run", "ops", "cli_wall", "cli_cpu", *PHASES, "sum", "ops/s", "bare ev/s", "ratio")
    print(" ".join(f"{c:>9}" for c in cols))
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeat):
            wall, cpu = cli_run_s(planner, Path(tmp) / f"cli{i}")
            n, times = run_phases(planner, RUN, Path(tmp) / f"run{i}")
            times = {"startup": startup_s(), **times}
            bare = bare_simpy_events_per_s()
            ops_s = n / cpu
            row = [
                i,
                n,
                f"{wall:.2f}",
                f"{cpu:.2f}",
                *(f"{times[p]:.2f}" for p in PHASES),
                f"{sum(times.values()):.2f}",
                f"{ops_s:.0f}",
                f"{bare:.0f}",
                f"{ops_s / bare:.3f}",
            ]
            print(" ".join(f"{c:>9}" for c in row))
    print(
        "seconds of CPU (user + system) unless wall: cli: the whole `python -m experiments.run` "
        "(a subprocess); startup: its imports in a fresh interpreter; the other phases timed "
        "here, in order; ratio: ops / cli_cpu over bare simpy's events per CPU second, timed in "
        "this process. CPU time, so that other load on the machine does not count; on an idle "
        "machine cli_wall is about cli_cpu"
    )
    if sys.flags.dont_write_bytecode:  # every process compiles the project's modules again
        print(
            "PYTHONDONTWRITEBYTECODE is set: startup and cli include compiling the project's "
            "sources each time; with Python's default bytecode cache startup takes "
            f"{cached_startup_s():.2f} s of CPU"
        )


def scaling(planner: str) -> None:
    """Each size in a fresh process (its peak memory is its own)."""
    print(
        f"{'model':>14} {'n':>3} {'ops':>9} {'run_s':>7} {'us/op':>6} {'peak_MB':>8} {'MB/kop':>7}"
    )
    for model, n in SIZES:
        code = (
            "import json, sys; from experiments.bench.sim import one_size; "
            f"print(json.dumps(one_size({planner!r}, {model!r}, {n})))"
        )
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise MoepipeError(f"{model} n={n}: {r.stderr.strip().splitlines()[-1:]}")
        d = json.loads(r.stdout.strip().splitlines()[-1])
        print(
            f"{model:>14} {n:>3} {d['ops']:>9} {d['run_s']:>7.2f} "
            f"{1e6 * d['run_s'] / d['ops']:>6.1f} "
            f"{d['peak_mb']:>8.0f} {1e3 * d['peak_mb'] / d['ops']:>7.2f}"
        )
    print(
        f"{planner} on {SCALING_HW}, paper workload. run_s: CPU seconds of config, routing, "
        "plan, validate, simulate, summarize and write (trace.parquet, summary.json) in a fresh "
        "process; peak_MB: its peak resident memory, imports included"
    )


def one_size(planner: str, model: str, n: int) -> dict[str, float]:
    """Ops, seconds and peak resident MB of one run of `model` at n batches (paper workload)."""
    overrides = [
        f"model={model}",
        f"hardware={SCALING_HW}",
        "workload=paper",
        f"workload.n_batches={n}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ops, times = run_phases(planner, overrides, Path(tmp))
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"ops": ops, "run_s": sum(times.values()), "peak_mb": peak_kb / 1024}


_app = command("bench_sim", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
