"""Wiring without hydra: plan a run with a registered planner, execute it, summarise, write it.

`experiments.run` (hydra) and the benchmarks call these; tests call them directly.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pandas as pd

from core.balance import phases
from core.chrome_trace import chrome_parts, write_chrome
from core.cost import CostModel
from core.errors import CapacityError, MoepipeError
from core.hardware import HardwareSpec
from core.planner import PlanContext
from core.routing import CausalRouting, Routing, load_routing, peek_label
from core.schedule import Schedule, ScheduleBuilder, validate
from core.spec import ModelSpec, Workload
from core.trace import make_trace, summarize
from core.types import Tier
from experiments import STOP_SIGNALS
from planners.registry import make_planner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSpec:
    model: ModelSpec
    hardware: HardwareSpec
    workload: Workload
    planner: str  # registry name
    params: dict[str, Any] = field(default_factory=dict)
    executor: str = "sim"


@dataclass
class RunResult:
    schedule: Schedule
    trace: pd.DataFrame
    summary: dict[str, Any]
    # A real run's `prompts` [S, P] and generated `tokens` [S, gen_len] (int64), by sequence:
    # written to tokens.safetensors, so its outputs can be checked without the Python API
    outputs: dict[str, np.ndarray] = field(default_factory=dict)


TOKENS_FILE = "tokens.safetensors"


def build_schedule(spec: RunSpec, routing: Routing | CausalRouting) -> Schedule:
    """Plan with replayed routing and validate."""
    schedule = plan_schedule(spec, routing)
    validate(schedule, check_finishes=spec.executor != "sim")
    return schedule


def plan_schedule(spec: RunSpec, routing: Routing | CausalRouting) -> Schedule:
    """Plan with replayed routing (not validated: `build_schedule` does both)."""
    causal = (
        routing
        if isinstance(routing, CausalRouting)
        else CausalRouting.replay(routing, spec.workload)
    )
    cost = CostModel(spec.hardware)
    ctx = PlanContext(spec.model, spec.hardware, spec.workload, causal, cost)
    builder = ScheduleBuilder(spec.hardware.memory_bytes)
    with gc_paused():
        make_planner(spec.planner, spec.params).plan(ctx, builder)
    builder.meta.update(planner=spec.planner, params=dict(spec.params), oracle=causal.peeked)
    return builder.build()


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off while a planner or the simulator creates its hundreds of
    thousands of ops and events (long-lived, freed by reference counts): each collection of the
    young generations would scan them again, a quarter of planning's time. On again after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def resolve_n_batches(spec: RunSpec) -> RunSpec:
    """Planners that size their batch group (Klotski's `n: 0` = auto) set workload.n_batches
    here, before routing for that many sequences is loaded. Others keep the workload's n."""
    choose = make_planner(spec.planner, spec.params).choose_n_batches
    n = choose(spec.model, spec.hardware, spec.workload, CostModel(spec.hardware))
    if n != spec.workload.n_batches:
        spec = replace(spec, workload=spec.workload.with_(n_batches=n))
    check_kv_fits(spec)
    return spec


ROUTING_CHECK_BYTES = 1 << 28  # routing this large is checked against memory before it is built
ROUTING_PEAK_FACTOR = 20  # the synthetic generator's peak RAM over the routing's own bytes


def _available_ram_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_kv_fits(spec: RunSpec) -> None:
    """A CapacityError when the group's KV cache cannot fit in GPU + CPU memory, whatever the
    planner (no planner keeps KV on disk): checked before routing for that many tokens is built,
    which for a prompt of millions of tokens would itself take more memory than the machine has."""
    m, wl, hw = spec.model, spec.workload, spec.hardware
    # Below this, routing is cheap to build and the planner's own capacity check says more (a
    # model whose weights do not fit is named as such, not as a KV cache to shrink).
    routing_bytes = wl.n_sequences * wl.seq_positions * m.n_layers * m.top_k * 12  # ids + weights
    if routing_bytes < ROUTING_CHECK_BYTES:
        return
    need, avail = routing_bytes * ROUTING_PEAK_FACTOR, _available_ram_bytes()
    if avail is not None and need > avail:
        raise MoepipeError(
            f"routing for {wl.n_sequences} sequences x {wl.seq_positions} tokens x "
            f"{m.n_layers} layers would need about {need / 1e9:.3g} GB of this machine's RAM to "
            f"build ({avail / 1e9:.3g} GB available); reduce prompt_len, batch_size or n_batches"
        )
    kv = wl.n_sequences * wl.seq_positions * m.kv_bytes_per_token * m.n_layers
    room = hw.memory_bytes.get(Tier.GPU, 0) * max(1, hw.n_gpus) + hw.memory_bytes.get(Tier.CPU, 0)
    if kv > room:
        raise CapacityError(
            f"KV cache of {wl.n_sequences} sequences x {wl.seq_positions} tokens "
            f"({kv / 1e9:.3g} GB) cannot fit in GPU + CPU memory ({room / 1e9:.3g} GB); "
            "reduce batch_size, n_batches or the sequence length"
        )


def simulate_run(spec: RunSpec, routing: Routing | None = None) -> RunResult:
    if routing is None:
        spec = resolve_n_batches(spec)
        routing = last_routing(spec.model, spec.workload)
    # the collector paused from the plan to the summary, not only while planning and simulating:
    # on again in between, it scanned the schedule's ops in the validator (a young and an old
    # collection, a twentieth of a 178k-op run's time)
    with gc_paused():
        schedule = build_schedule(spec, routing)
        trace = simulate_trace(schedule, spec.hardware)
        return RunResult(schedule, trace, summary_of(spec, schedule, trace, routing.description))


# The routing `last_routing` built last, by (model, workload): one entry
_LAST_ROUTING: dict[tuple[ModelSpec, Workload], Routing] = {}


def last_routing(model: ModelSpec, workload: Workload) -> Routing:
    """`load_routing(model, workload)`, reused while the next run asks for the same: a sweep's
    runs of one model and workload (every planner of a point) build it once per process. Its
    arrays are read-only, so no run can change the next one's routing. One routing is kept."""
    key = (model, workload)
    if key not in _LAST_ROUTING:
        _LAST_ROUTING.clear()  # before the next is built: at most one in memory
        routing = load_routing(model, workload)
        for a in (routing.expert_ids, routing.gate_weights, routing.labels):
            if a is not None:
                a.flags.writeable = False
        _LAST_ROUTING[key] = routing
    return _LAST_ROUTING[key]


def simulate_trace(schedule: Schedule, hardware: HardwareSpec) -> pd.DataFrame:
    """The simulator's trace of a validated schedule."""
    from sim.executor import simulate_times

    cost = CostModel(hardware)
    parts = cost.pool_parts(schedule)  # NaN for every op of a schedule without a pool
    with gc_paused():
        start, end, granted = simulate_times(schedule, cost, parts)
    return make_trace(
        schedule, start, end, source="sim", sm_s=parts[1], launch_s=parts[0], alloc_s=granted
    )


def summary_of(
    spec: RunSpec, schedule: Schedule, trace: pd.DataFrame, routing_desc: str
) -> dict[str, Any]:
    meta = {k: v for k, v in schedule.meta.items() if k not in ("planner", "params")}
    if schedule.ep is not None:
        meta["ep"] = schedule.ep.summary()
    planner_label = spec.planner + peek_label(schedule.meta)
    return summarize(
        schedule,
        trace,
        spec.workload,
        planner=spec.planner,
        planner_label=planner_label,
        params=dict(spec.params),
        executor=spec.executor,
        model=spec.model.name,
        hardware=spec.hardware.name,
        routing=routing_desc,
        plan=meta,
    )


RUN_FILES = (
    "trace.parquet",
    "trace.json",
    "balance.csv",
    TOKENS_FILE,
)  # write_run's, but the summary


def write_run(
    out_dir: str | Path,
    result: RunResult,
    texts: Mapping[str, str] | None = None,
    chrome: bool = False,
) -> None:
    """trace.parquet (the canonical trace), trace.json (Chrome) where `chrome` (else
    `python -m experiments.trace_json runs=RUN_DIR` writes it), balance.csv for an expert-parallel
    run, tokens.safetensors for a real run (its prompts and generated tokens) and `texts`
    (file name -> text: the config the run is of), then summary.json last and atomically: a
    run directory counts as finished only once summary.json exists. An earlier run's files are
    replaced only once the new ones are whole (`replace_run`)."""

    def files(tmp: Path) -> None:
        write_trace_parquet(result.trace, tmp / "trace.parquet")
        if chrome:
            write_chrome(
                tmp / "trace.json",
                chrome_parts(result.trace, int(result.summary.get("processes", 0))),
            )
        write_balance(tmp, result)
        if result.outputs:
            from safetensors.numpy import save_file

            save_file(result.outputs, str(tmp / TOKENS_FILE))
        for name, text in (texts or {}).items():
            (tmp / name).write_text(text)

    replace_run(Path(out_dir), result.summary, files)


def write_trace_parquet(trace: pd.DataFrame, path: Path) -> None:
    """trace.parquet: dictionary-encoded where the frame's column is categorical (stream, kind
    ...) and plain elsewhere. pyarrow's default tries a dictionary on every column, which for
    ids and times of distinct values only costs: half the write's time, and a larger file. The
    frame read back is the same."""
    cats = [c for c in trace.columns if isinstance(trace[c].dtype, pd.CategoricalDtype)]
    trace.to_parquet(path, index=False, use_dictionary=cats)


PREVIOUS = ".previous"  # in a run dir: the earlier result while a new one moves in


def replace_run(out_dir: Path, summary: Mapping[str, Any], files: Callable[[Path], None]) -> None:
    """Replace a run directory's result with a new one, on success only: `files(tmp)` writes the
    new files into a hidden folder inside `out_dir` (a full disk or a kill leaves the old result
    whole, and the folder is removed); then the old result moves aside into `.previous`, the new
    files move in, the new summary.json is written last and `.previous` goes. A kill -9 in that
    swap leaves `.previous`, which the next run into the dir puts back (`restore_previous`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    restore_previous(out_dir)
    # named before it exists, so that a Ctrl-C at any moment of making it finds it removed
    tmp = out_dir / f".partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        try:
            files(tmp)
        except OSError as e:  # a full disk: the write's error names no file
            raise OSError(
                e.errno,
                f"cannot write the run's files ({e.strerror or e}); the "
                "earlier result there is kept",
                str(out_dir),
            ) from None
        text = json.dumps(summary, indent=2, default=str)  # before the old summary goes
        with interrupt_deferred():  # Ctrl-C now would leave neither result
            new = {p.name for p in tmp.iterdir()}
            _move_aside(out_dir, new | set(RUN_FILES))
            for name in sorted(new):
                os.replace(tmp / name, out_dir / name)
            atomic_write_text(out_dir / "summary.json", text)
            shutil.rmtree(out_dir / PREVIOUS, ignore_errors=True)
        keep_hydra_record(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# hydra's record of a run (.hydra/: config, hydra.yaml, overrides) is rewritten when any run
# starts in the dir, before the run can act; the record of the run whose result the dir holds
# is kept beside it, so that a rerun that fails or is stopped puts it back
HYDRA = ".hydra"
HYDRA_KEPT = ".result"  # inside .hydra/


def keep_hydra_record(out_dir: Path) -> None:
    """Copy hydra's record of the run just finished into `.hydra/.result/` (nothing where the
    run was written without hydra's record)."""
    rec = out_dir / HYDRA
    files = [p for p in rec.glob("*.yaml") if p.is_file()] if rec.is_dir() else []
    if not files:
        return
    kept = rec / HYDRA_KEPT
    tmp = rec / f".kept-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for p in files:
        shutil.copy2(p, tmp / p.name)
    shutil.rmtree(kept, ignore_errors=True)
    os.replace(tmp, kept)


def restore_hydra_record(out_dir: Path) -> None:
    """After a run that did not finish: where the dir holds an earlier result, hydra's record
    of that result comes back over the one the failed run's start wrote."""
    rec = out_dir / HYDRA
    kept = rec / HYDRA_KEPT
    if not (kept.is_dir() and (out_dir / "summary.json").is_file()):
        return
    for p in rec.glob("*.yaml"):
        if not (kept / p.name).exists():
            p.unlink(missing_ok=True)
    for p in kept.iterdir():
        shutil.copy2(p, rec / p.name)


@contextmanager
def staged_outputs(
    out: Path,
    stale: Callable[[Path], set[str]] = lambda _: set(),
    last: str = "",
    made: bool | None = None,
) -> Iterator[Path]:
    """A hidden folder inside `out` to write a command's outputs into. When the block ends they
    replace those of the same names in `out`, with the names `stale(out)` gives (an earlier
    run's outputs the new ones do not overwrite), all under one deferred interrupt, `last`
    moved in last; when it fails (an error, a full disk, Ctrl-C) the folder goes and `out`
    keeps what it had, or goes too where it was made for this (`made`: it was, by the caller;
    default: where it does not exist yet)."""
    made = not out.exists() if made is None else made
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
        yield tmp
        new = sorted((p.name for p in tmp.iterdir()), key=lambda name: name == last)
        with interrupt_deferred():
            for name in (set(new) | stale(out)) - {tmp.name}:
                old = out / name
                if old.is_dir() and not old.is_symlink():
                    shutil.rmtree(old)
                else:
                    old.unlink(missing_ok=True)
            for name in new:
                os.replace(tmp / name, out / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_aside(out_dir: Path, names: set[str]) -> None:
    """The old result's files into `.previous`, summary.json first (a dir without it holds no
    result, so no mix of two runs is ever read as one)."""
    prev = out_dir / PREVIOUS
    prev.mkdir(exist_ok=True)
    for name in ["summary.json", *sorted(names - {"summary.json"})]:
        if (out_dir / name).exists():
            os.replace(out_dir / name, prev / name)


def restore_previous(out_dir: Path) -> None:
    """Undo a swap a kill cut short (`replace_run`): where summary.json is missing and
    `.previous` holds one, the new run's files that had moved in go and the earlier result comes
    back; where the new summary.json was written, `.previous` only had to go."""
    prev = out_dir / PREVIOUS
    if not prev.is_dir():
        return
    if not (out_dir / "summary.json").exists() and (prev / "summary.json").exists():
        for name in RUN_FILES:
            if not (prev / name).exists():
                (out_dir / name).unlink(missing_ok=True)
        for p in sorted(prev.iterdir(), key=lambda p: p.name == "summary.json"):
            os.replace(p, out_dir / p.name)  # summary.json last
    shutil.rmtree(prev, ignore_errors=True)


@contextmanager
def interrupt_deferred() -> Iterator[None]:
    """Run the block whole under Ctrl-C, SIGTERM and SIGHUP: one that comes meanwhile acts once
    it ends, as it would have (KeyboardInterrupt, `Stopped`, or whatever handler was set). Off
    the main thread, which cannot set a handler, the block runs as is; so does a signal whose
    handler was set outside Python."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []
    previous = {}
    for signum in (signal.SIGINT, *STOP_SIGNALS):
        handler = signal.getsignal(signum)
        if handler is not None and handler != signal.SIG_IGN:
            previous[signum] = signal.signal(
                signum, lambda signum, frame: pending.append((signum, frame))
            )
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if pending:
            signum, frame = pending[0]
            handler = previous[signum]
            if callable(handler):
                handler(signum, frame)
            else:  # SIG_DFL: its default action
                os.kill(os.getpid(), signum)


def write_balance(out: Path, result: RunResult) -> None:
    """balance.csv (`core.balance.phases`: tokens per device, balancedness and utilisation per
    step, layer and batch) when the run is expert-parallel."""
    if "n_devices" in result.summary:
        phases(result.trace, int(result.summary["n_devices"])).to_csv(
            out / "balance.csv", index=False
        )


def code_version() -> str:
    """A fingerprint of the code a run depends on (core, planners, sim, real, the experiments
    that build its inputs, the configs): commands that resume reuse a finished run only under
    the same code. Hardware profiles (conf/hardware) are left out: `experiments.calibrate` adds
    one, which must not make every finished run count as another code's. Each command compares
    the profile a run used itself: experiments.run its resolved config.yaml, reproduce_klotski
    the profile's text."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha1()
    for folder in ("core", "planners", "sim", "real", "experiments", "conf"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix in (".py", ".yaml") and f.parent != root / "conf" / "hardware":
                h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


CODE = "code_version.txt"  # in a run dir: the code (code_version) it ran with


def stamp(config_yaml: str) -> dict[str, str]:
    """The files that record what a run dir's summary is of: the config and the code."""
    return {"config.yaml": config_yaml, CODE: code_version()}


def finished(out_dir: Path, config_yaml: str) -> bool:
    """A run directory is finished when its summary.json exists (written last, atomically) and
    its config.yaml and code version are this run's: a changed config or code runs again."""
    summary, config, code = out_dir / "summary.json", out_dir / "config.yaml", out_dir / CODE
    if not summary.exists():
        return False
    if _text(config) != config_yaml:
        log.warning("%s holds a run of another config; running again", out_dir)
        return False
    if _text(code) != code_version():
        log.warning("%s holds a run of other code; running again", out_dir)
        return False
    try:
        got = json.loads(summary.read_text())
    except (OSError, ValueError):  # not UTF-8 or not JSON (UnicodeDecodeError is a ValueError)
        got = None
    if not isinstance(got, dict):
        log.warning("%s: summary.json is not a readable JSON object; running again", out_dir)
        return False
    from experiments.common.tables import check_metrics  # (tables reads runs: it imports us)

    try:  # a metric that no run writes (NaN, a negative rate, a string): not a result to reuse
        check_metrics(got, summary)
    except MoepipeError as e:
        log.warning("%s; running again", e)
        return False
    return True


def _text(path: Path) -> str | None:
    """`path`'s text; None where it is missing, not a file or not UTF-8 (then not this run's)."""
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def write_texts(folder: Path, texts: Mapping[str, str]) -> None:
    for name, text in texts.items():
        (folder / name).write_text(text)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, default=str))


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all (a temporary file in its folder, renamed over it), with
    the permissions a plain write gives (mkstemp's are 0600: others in a shared group could not
    read a run's summary)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o666 & ~_UMASK)
    os.replace(tmp, path)


def _umask() -> int:
    """The process's umask, read once at import: setting it to read it is process-wide, and a
    thread creating a file meanwhile would get mode 0666."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _umask()
