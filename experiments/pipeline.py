"""Wiring without hydra: plan a run with a registered planner, execute it, summarise, write it.

`experiments.run` (hydra) and the benchmarks call these; tests call them directly.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from core.balance import phases
from core.cost import CostModel
from core.planner import PlanContext
from core.routing import CausalRouting, Routing, load_routing, peek_label
from core.schedule import Schedule, ScheduleBuilder, validate
from core.spec import HardwareSpec, ModelSpec, Workload
from core.trace import make_trace, summarize, write_chrome
from planners.registry import make_planner


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
    causal = (
        routing
        if isinstance(routing, CausalRouting)
        else CausalRouting.replay(routing, spec.workload)
    )
    cost = CostModel(spec.hardware)
    ctx = PlanContext(spec.model, spec.hardware, spec.workload, causal, cost)
    builder = ScheduleBuilder(spec.hardware.memory_bytes)
    make_planner(spec.planner, spec.params).plan(ctx, builder)
    builder.meta.update(planner=spec.planner, params=dict(spec.params), oracle=causal.peeked)
    schedule = builder.build()
    validate(schedule, check_finishes=spec.executor != "sim")
    return schedule


def resolve_n_batches(spec: RunSpec) -> RunSpec:
    """Planners that size their batch group (Klotski's `n: 0` = auto) set workload.n_batches
    here, before routing for that many sequences is loaded. Others keep the workload's n."""
    choose = make_planner(spec.planner, spec.params).choose_n_batches
    n = choose(spec.model, spec.hardware, spec.workload, CostModel(spec.hardware))
    return (
        spec
        if n == spec.workload.n_batches
        else replace(spec, workload=spec.workload.with_(n_batches=n))
    )


def simulate_run(spec: RunSpec, routing: Routing | None = None) -> RunResult:
    from sim.executor import simulate_times

    if routing is None:
        spec = resolve_n_batches(spec)
    routing = routing if routing is not None else load_routing(spec.model, spec.workload)
    schedule = build_schedule(spec, routing)
    cost = CostModel(spec.hardware)
    parts = cost.pool_parts(schedule)  # NaN for every op of a schedule without a pool
    start, end, granted = simulate_times(schedule, cost, parts)
    trace = make_trace(schedule, start, end, source="sim", sm_s=parts[1], launch_s=parts[0],
                       alloc_s=granted)  # fmt: skip
    return RunResult(schedule, trace, summary_of(spec, schedule, trace, routing.description))


def summary_of(
    spec: RunSpec, schedule: Schedule, trace: pd.DataFrame, routing_desc: str
) -> dict[str, Any]:
    # ep_slots (every iteration's expert placement) is run data, too large for a summary
    meta = {k: v for k, v in schedule.meta.items() if k not in ("planner", "params", "ep_slots")}
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


def write_run(out_dir: str | Path, result: RunResult) -> None:
    """trace.parquet, trace.json (Chrome), balance.csv for an expert-parallel run,
    tokens.safetensors for a real run (its prompts and generated tokens), then
    summary.json last and atomically: a run directory counts as finished only once summary.json
    exists."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.trace.to_parquet(out / "trace.parquet", index=False)
    write_chrome(out / "trace.json", [result.trace])
    write_balance(out, result)
    if result.outputs:
        from safetensors.numpy import save_file

        save_file(result.outputs, str(out / TOKENS_FILE))
    atomic_write_json(out / "summary.json", result.summary)


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
    the profile a run used itself: experiments.run its resolved config.yaml, replication its
    spec, replication_cv and reproduce_klotski the profile's text."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for folder in ("core", "planners", "sim", "real", "experiments", "conf"):
        for f in sorted((root / folder).rglob("*")):
            if f.suffix in (".py", ".yaml") and f.parent != root / "conf" / "hardware":
                h.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return h.hexdigest()[:16]


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
