"""Commands stopped at a random moment (issue 48, round 25e): each started as a terminal starts
it (tests.conftest.started: a session of its own, default signal actions) and sent SIGINT,
SIGTERM, SIGHUP or SIGQUIT to its process group at a moment drawn from [0, its run time],
sometimes twice in quick succession (Ctrl-C pressed twice). Rare races (a KeyboardInterrupt
leaving code run from text, a signal in Python's teardown) are found only so, many times over.

Each stop is recorded: its exit status, its stderr's lines (one? a traceback? "Exception
ignored"? a pool's leaked semaphores?), a process of its session left after it ended, a file
left (`.partial-*`, a summary.json without its trace), and the earlier result, which a stopped
command must leave whole (or replace whole, where it finished first).

`python -m tests.probes.random_stops OUT.jsonl [--per N] [--seed S] [--load]` runs the whole
campaign (`--load`: a second process keeps the other core busy); test_probe_round25e runs a
sample of it with a fixed seed in the slow suite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import started

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]
TRACES = Path("/work/shared/traces/esft-dsv2lite/original/esft_expert_scores_original.tar.gz")
# the run dirs' files of one result, which a stop leaves all old or all new
RESULT = ("summary.json", "config.yaml", "trace.parquet")


@dataclass(frozen=True)
class Case:
    """A command to stop: `args` with {home} (the fixtures' folder) and {here} (this stop's
    folder, its cwd) filled in; `earlier`: the files under `home` copied into `here` first,
    the earlier result the stop must leave whole; `run_s`: about its run time unstopped."""

    module: str
    args: tuple[str, ...]
    run_s: float
    earlier: tuple[str, ...] = ()


def _dist(*more: str) -> tuple[str, ...]:
    return (
        "executor=real",
        "executor.distributed=true",
        "checkpoint={home}/ck",
        "hardware=h200-hgx8",
        "workload=tiny",
        "planner=eplb",
        "+planner.params.n_devices=2",
        *more,
    )


REAL = ("executor=real", "checkpoint={home}/ck", "hardware=tiny", "workload=tiny")
TORCHRUN = ("--standalone", "--nproc_per_node=2", "-m", "experiments.run")
CASES: dict[str, Case] = {
    **{
        f"run.{p}": Case(
            "experiments.run", (*TINY, f"planner={p}", "hydra.run.dir=run"), 1.6, ("run",)
        )
        for p in ("klotski", "sequential", "moe_infinity")
    },
    "run.real": Case(
        "experiments.run", (*REAL, "planner=klotski", "hydra.run.dir=run"), 4.3, ("run",)
    ),
    "run.sweep": Case(
        "experiments.run",
        ("-m", *TINY, "planner=flexgen,klotski,sequential", "hydra.sweep.dir=sweep"),
        8.0,
    ),
    "collect": Case("experiments.collect", ("dir={home}/sweep", "out=coll"), 2.1, ("coll",)),
    "report": Case("experiments.report", ("dir={home}/sweep", "out=rep"), 4.5, ("rep",)),
    "calibrate": Case(
        "experiments.calibrate",
        ("hardware.name=x", "out=x.yaml", "disk_dir=d", "disk_mb=64"),
        9.0,
        ("x.yaml",),
    ),
    "make_checkpoint": Case("experiments.make_checkpoint", ("model=mixtral-tiny", "out=ck2"), 3.6),
    "validate": Case(
        "experiments.validate",
        ("checkpoint={home}/ck", "hardware=tiny", "repeats=1", "out=val", "planners=[flexgen]")
        + ("gpu_frac=2", "cpu_frac=2", "batch_size=2", "n_batches=1"),
        6.0,
    ),
    "convert_traces": Case(
        "experiments.convert_traces", (f"src={TRACES}", "out=x.npz"), 7.0, ("x.npz",)
    ),
    "dist_run": Case("experiments.run", _dist("hydra.run.dir=run"), 15.0, ("run",)),
    "torchrun": Case("experiments.torchrun", (*TORCHRUN, *_dist("hydra.run.dir=run")), 15.0),
    "bench.sim": Case("experiments.bench.sim", ("repeat=1",), 18.0),
    "bench.host": Case("experiments.bench.host", ("device=cpu", "repeats=2"), 5.6),
    "bench.lanes": Case(
        "experiments.bench.lanes",
        ("device=cpu", "model=tiny", "rows=[8]", "repeats=2", "lanes=2"),
        5.2,
    ),
}
# the tiny checkpoint's shape (tests.probes.conftest's tiny_ckpt)
TINY_CKPT = dict(
    hidden_size=64, n_heads=4, n_kv_heads=2, expert_ffn_size=32, vocab_size=128, n_layers=2
)
# the fixtures under home each case reads or copies, made once (`prepare`)
FIXTURES: dict[str, tuple[str, ...]] = {
    "run": ("experiments.run", *TINY, "planner=flexgen", "hydra.run.dir={home}/run"),
    "sweep": (
        "experiments.run",
        "-m",
        *TINY,
        "planner=flexgen,klotski",
        "hydra.sweep.dir={home}/sweep",
    ),
    "coll": ("experiments.collect", "dir={home}/sweep", "out={home}/coll"),
    "rep": ("experiments.report", "dir={home}/sweep", "out={home}/rep"),
    "x.yaml": (
        "experiments.calibrate",
        "hardware.name=x",
        "out={home}/x.yaml",
        "disk_dir={home}/d",
        "disk_mb=16",
    ),
    "x.npz": ("experiments.convert_traces", f"src={TRACES}", "out={home}/x.npz"),
    "run_dist": ("experiments.run", *_dist("hydra.run.dir={home}/run_dist")),
}


def _source(name: str, earlier: str) -> str:
    """The fixture a case's earlier result is copied from."""
    return "run_dist" if name == "dist_run" else earlier


def _needed(args: tuple[str, ...], own: str = "") -> list[str]:
    """The fixtures `args` read (`{home}/NAME`), those they read first."""
    names = [
        n
        for n in ("ck", *FIXTURES)
        if n != own and any(re.search(rf"\{{home\}}/{re.escape(n)}(?![\w.])", a) for a in args)
    ]
    return [m for n in names for m in (*_needed(FIXTURES.get(n, ()), n), n)]


def prepare(home: Path, cases: Iterable[str] = CASES) -> None:
    """The fixtures under `home` that `cases` read: a tiny checkpoint, and each earlier result
    a case copies (made once; a stop works on a copy)."""
    from real.checkpoint import reduced_spec
    from real.checkpoint_write import write_checkpoint
    from tests.conftest import ROOT, user_env

    needed = [
        m
        for name in cases
        for n in (*_needed(CASES[name].args), *(_source(name, e) for e in CASES[name].earlier))
        for m in (*_needed(FIXTURES.get(n, ()), n), n)
    ]
    for name in dict.fromkeys(needed):
        if (home / name).exists():
            continue
        if name == "ck":
            spec = reduced_spec("mixtral-tiny", **TINY_CKPT)
            write_checkpoint(spec, home / "ck", seed=0)
            continue
        module, *args = FIXTURES[name]
        cmd = [sys.executable, "-m", module, *(a.format(home=home) for a in args)]
        subprocess.run(cmd, cwd=ROOT, env=user_env(), check=True, capture_output=True)


@dataclass
class Stop:
    """One stop's record."""

    case: str
    at_s: float
    signals: list[str]
    sent: int = 0  # how many of them reached the group (0: it had ended first)
    handled: bool = True  # the command had set its handlers when the first was sent
    status: int = 0
    stderr: str = ""
    left_processes: list[str] = field(default_factory=list)
    left_files: list[str] = field(default_factory=list)
    lost: str = ""
    faults: list[str] = field(default_factory=list)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".log") and ".hydra" not in p.parts
    }


def _session(sid: int) -> list[str]:
    out = subprocess.run(["pgrep", "-a", "-s", str(sid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _lines(stderr: str) -> list[str]:
    """stderr's lines, a progress bar's redrawn line (\\r) counted once, by its last state."""
    out = []
    for line in stderr.splitlines():
        parts = [p for p in line.split("\r") if p.strip()]
        if parts:
            out.append(parts[-1])
    return out


def _bar(line: str) -> bool:
    return "%|" in line or "it/s]" in line or "s/run]" in line


def _earlier_whole(case: Case, here: Path, before: dict[str, dict[str, bytes]], ok: bool) -> str:
    """What is wrong with the earlier results under `here` ('' if nothing): left as they
    were, or (`ok`: the command finished) replaced whole."""
    for name, files in before.items():
        path = here / name
        now = _files(path) if path.is_dir() else {"": path.read_bytes()} if path.exists() else {}
        if now == files:
            continue
        if not ok:
            return f"{name} changed by a stopped command"
        if set(now) != set(files) and not set(files) <= set(now):
            return f"{name} lost files: {sorted(set(files) - set(now))}"
    return ""


def _left_files(here: Path, shm_before: set[str], ours: set[str]) -> list[str]:
    left = [str(p.relative_to(here)) for p in here.rglob("*") if ".partial-" in p.name]
    for summary in here.rglob("summary.json"):
        if ".partial-" in str(summary):
            continue
        if not (summary.parent / "trace.parquet").exists() and "run" in summary.parts[-2]:
            left.append(f"{summary.relative_to(here)} without its trace.parquet")
    left += [f"/dev/shm/{n}" for n in sorted(_shm() - shm_before) if _orphaned(n, ours)]
    return left


def _orphaned(name: str, ours: set[str]) -> bool:
    """A /dev/shm entry of a pool (loky's semaphores, joblib's memmap folders) made by one of
    `ours` (the pid in its name: the command's, or a process of its session as it was stopped)
    and left: another process's pool (a command run beside) is not this stop's."""
    digits = [part for part in name.replace("_", "-").split("-") if part.isdigit()]
    if not digits or not ("loky" in name or "joblib" in name or name.startswith("sem.")):
        return False
    return digits[0] in ours and not Path(f"/proc/{digits[0]}").exists()


def handles_stops(pid: int) -> bool:
    """`pid` catches SIGTERM (/proc's SigCgt): the command's start-up handler is set. Before
    that Python itself starts (its site .pth files) and no code of the command runs."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    caught = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(caught) and bool(int(caught[0], 16) & (1 << (signal.SIGTERM - 1)))


def _classify(stop: Stop) -> list[str]:
    if not stop.handled and (stop.status < 0 or "init_import_site" in stop.stderr):
        return ["in python's start-up"]  # Python's own, before the command's code runs
    codes = {128 + signal.Signals[s].value for s in stop.signals[: max(stop.sent, 1)]}
    lines = [line for line in _lines(stop.stderr) if not _bar(line)]
    faults = []
    if "Traceback" in stop.stderr:
        faults.append("traceback")
    if "Exception ignored" in stop.stderr or "leaked" in stop.stderr:
        faults.append("warning")
    if stop.status == 0:
        if stop.sent and any(line.startswith(("interrupted:", "stopped by")) for line in lines):
            faults.append("wrong status")
    elif stop.status not in codes:
        faults.append("wrong status")
    else:
        said = [line for line in lines if line.startswith(("interrupted:", "stopped by", "error"))]
        if len(lines) != 1 or len(said) != 1:
            faults.append("more than one line" if len(lines) > 1 else "no line")
    if stop.left_processes:
        faults.append("leftover process")
    if stop.left_files:
        faults.append("leftover file")
    if stop.lost:
        faults.append("result lost")
    return faults


def stop_once(name: str, home: Path, here: Path, rng: random.Random, twice: float = 0.3) -> Stop:
    """`CASES[name]` run in `here` (made afresh, its earlier results copied from `home`) and
    stopped at a random moment by a random signal, sent twice with chance `twice`."""
    case = CASES[name]
    shutil.rmtree(here, ignore_errors=True)
    here.mkdir(parents=True)
    for earlier in case.earlier:
        src = home / _source(name, earlier)
        if src.is_dir():
            shutil.copytree(src, here / earlier, symlinks=True)
        else:
            shutil.copy2(src, here / earlier)
    before = {
        e: _files(here / e) if (here / e).is_dir() else {"": (here / e).read_bytes()}
        for e in case.earlier
    }
    sigs = [rng.choice(SIGNALS)]
    if rng.random() < twice:
        sigs.append(rng.choice((sigs[0], signal.SIGINT)))
    at, gap = rng.uniform(0, case.run_s), rng.uniform(0.0, 0.3)
    stop = Stop(name, round(at, 3), [s.name for s in sigs])
    shm, ours = _shm(), set[str]()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.update(OMP_NUM_THREADS="1")
    for key in ("HYDRA_FULL_ERROR", "MOEPIPE_TRACEBACK"):
        env.pop(key, None)
    args = [a.format(home=home) for a in case.args]
    err = here.parent / f"{here.name}.err"
    with err.open("w") as stream:
        p = started(case.module, *args, cwd=here, env=env, stdout=subprocess.DEVNULL, stderr=stream)
        time.sleep(at)
        for i, sig in enumerate(sigs):
            if i:
                time.sleep(gap)
            try:
                if not i:
                    stop.handled = handles_stops(p.pid)
                    ours = {str(p.pid), *(line.split()[0] for line in _session(p.pid))}
                os.killpg(p.pid, sig)
                stop.sent += 1
            except ProcessLookupError:
                break
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stop.faults.append("hung")
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    stop.status = p.returncode
    stop.stderr = err.read_text(errors="replace")
    for _ in range(30):  # a helper that is on its way out: a moment to go
        stop.left_processes = _session(p.pid)
        if not stop.left_processes:
            break
        time.sleep(0.1)
    if stop.left_processes:
        _kill_session(p.pid)
    stop.left_files = _left_files(here, shm, ours)
    # a stop as its result went in: the new result, whole, and a line that says it finished
    done = stop.status == 0 or " had finished: its result is whole there" in stop.stderr
    stop.lost = _earlier_whole(case, here, before, done)
    stop.faults += _classify(stop)
    return stop


def _kill_session(sid: int) -> None:
    for line in _session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)


def campaign(
    home: Path, per: dict[str, int], seed: int, record: Callable[[Stop], None] | None = None
) -> list[Stop]:
    """`per[name]` stops of each case, in a random order drawn from `seed`."""
    rng = random.Random(seed)
    order = [name for name, n in per.items() for _ in range(n)]
    rng.shuffle(order)
    stops = []
    for i, name in enumerate(order):
        stop = stop_once(name, home, home / "stops" / f"{i}", rng)
        shutil.rmtree(home / "stops" / f"{i}", ignore_errors=True)
        stops.append(stop)
        if record is not None:
            record(stop)
    return stops


def counts(stops: list[Stop]) -> dict[str, int]:
    """stops; conforming; and each kind of fault, over `stops`."""
    ours = [s for s in stops if s.faults != ["in python's start-up"]]
    out = {"stops": len(stops), "conforming": sum(not s.faults for s in ours)}
    for s in stops:
        for f in s.faults:
            out[f] = out.get(f, 0) + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--home", type=Path, default=Path("/tmp/random_stops"))
    parser.add_argument("--per", type=int, default=30)
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument("--only", nargs="*", default=list(CASES))
    parser.add_argument("--counts", type=json.loads, default={}, help='{"case": stops, ...}')
    parser.add_argument("--load", action="store_true")
    a = parser.parse_args()
    a.home.mkdir(parents=True, exist_ok=True)
    prepare(a.home, a.counts or a.only)
    load = None
    if a.load:  # the other core kept busy
        load = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
    try:
        with a.out.open("a") as out:

            def record(stop: Stop) -> None:
                out.write(json.dumps(stop.__dict__) + "\n")
                out.flush()
                print(stop.case, stop.at_s, stop.signals, stop.status, stop.faults, flush=True)

            stops = campaign(a.home, a.counts or {n: a.per for n in a.only}, a.seed, record)
    finally:
        if load is not None:
            load.kill()
    print(json.dumps(counts(stops)))


if __name__ == "__main__":
    main()
