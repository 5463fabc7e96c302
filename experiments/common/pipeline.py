"""Wiring without hydra: plan a run with a registered planner, execute it, summarise, write it.

`experiments.run` (hydra) and the benchmarks call these; tests call them directly.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from core.balance import phases
from core.chrome_trace import chrome_parts, write_chrome
from core.cost import CostModel
from core.errors import CapacityError, ConfigError, MoepipeError, capacity_error
from core.files import plain_permissions
from core.hardware import HardwareSpec
from core.lazy import lazy_module
from core.planner import PlanContext, Planner
from core.routing import CausalRouting, Routing, load_routing, peek_label
from core.schedule import Schedule, ScheduleBuilder, validate
from core.schedule_batches import check_work
from core.schedule_units import check_units, within_units
from core.shown import gb
from core.spec import ModelSpec, Workload
from core.trace import summarize, trace_table
from core.trace_table import TraceTable
from core.types import Tier
from experiments.common.run_dir import RUN_FILES, TOKENS_FILE, replace_run  # noqa: F401
from planners.placement import KV_LOWER, KV_MORE
from planners.registry import expert_parallel_names, make_planner, own_bugs, own_errors

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

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
    # the trace as the run made it: a simulated run's columns (a frame needs pandas' import)
    table: pd.DataFrame | TraceTable
    summary: dict[str, Any]
    # A real run's `prompts` [S, P] and generated `tokens` [S, gen_len] (int64), by sequence:
    # written to tokens.safetensors, so its outputs can be checked without the Python API
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def trace(self) -> pd.DataFrame:
        """The trace as a frame, made from the columns when first read."""
        if isinstance(self.table, TraceTable):
            self.table = self.table.frame()
        return self.table


def build_schedule(
    spec: RunSpec, routing: Routing | CausalRouting, planner: Planner | None = None
) -> Schedule:
    """Plan with replayed routing and validate: the IR's rules, and the whole run's work."""
    schedule = plan_schedule(spec, routing, planner)
    with own_bugs(spec.planner):
        check_units(schedule, spec.model, spec.workload)
        validate(schedule, check_finishes=spec.executor != "sim")
        check_work(schedule, spec.model, spec.workload)
    return schedule


def plan_schedule(
    spec: RunSpec, routing: Routing | CausalRouting, planner: Planner | None = None
) -> Schedule:
    """Plan with replayed routing (not validated: `build_schedule` does both). `planner`: the
    run's own (`run_planner`), which may have sized the workload already; else a new one."""
    causal = (
        routing
        if isinstance(routing, CausalRouting)
        else CausalRouting.replay(routing, spec.workload)
    )
    cost = CostModel(spec.hardware)
    ctx = PlanContext(spec.model, spec.hardware, spec.workload, causal, cost)
    builder = ScheduleBuilder(spec.hardware.memory_bytes)
    builder.meta["planner"] = spec.planner  # named by a refusal as it plans
    units = within_units(builder, spec.model, spec.workload)
    with gc_paused(), own_errors(spec.planner), own_bugs(spec.planner), units:
        (planner or run_planner(spec)).plan(ctx, builder)
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


def run_planner(spec: RunSpec) -> Planner:
    """The run's planner. One for the whole run: what it decides in sizing the workload
    (Klotski's n-planner) it keeps for the fit probe and the plan, which would decide it again."""
    return make_planner(spec.planner, spec.params)


def sizes_its_group(spec: RunSpec) -> bool:
    """Does the run's planner choose its own n (Klotski's `n: 0`), rather than keep the
    workload's n_batches (`Planner.choose_n_batches`, the default)?"""
    return type(run_planner(spec)).choose_n_batches is not Planner.choose_n_batches


def resolve_n_batches(spec: RunSpec, planner: Planner | None = None) -> RunSpec:
    """Planners that size their batch group (Klotski's `n: 0` = auto) set workload.n_batches
    here, before routing for that many sequences is loaded. Others keep the workload's n.
    `planner`: the run's (`run_planner`), to plan with after; else a new one."""
    return sized_run(spec, planner)[0]


def sized_run(spec: RunSpec, planner: Planner | None = None) -> tuple[RunSpec, Planner]:
    """`resolve_n_batches`, and the run's planner that sized it: made after one batch's sizes
    are checked, where none is given."""
    # one batch's sizes first: a planner's choice builds routing of every step and position
    # (Klotski's warm-up ran for half a minute, in 4 GB, at a gen_len or prompt_len of a
    # million before the check below refused it); any n it chooses holds at least that one
    check_kv_fits(replace(spec, workload=spec.workload.with_(n_batches=1)), warn=False)
    planner = planner or run_planner(spec)
    with own_bugs(spec.planner):  # a researcher's choice of n indexing past its run's: theirs
        n = planner.choose_n_batches(
            spec.model, spec.hardware, spec.workload, CostModel(spec.hardware)
        )
    if n != spec.workload.n_batches:
        spec = replace(spec, workload=spec.workload.with_(n_batches=n))
    check_kv_fits(spec, warn=False)
    check_plan_fits(spec, planner)
    check_ops_fit(
        spec
    )  # a long run said once it passed every refusal: a refused one says only that
    return spec, planner


# routing this large takes about a second to build (Mixtral-8x7B, 240 sequences of 520 tokens:
# 96 MB in 0.3 s); below it, a planner's pass up to its first gate (klotski: choosing n, 0.2 s)
# would cost more than it saves
PROBE_ROUTING_BYTES = 1 << 28


class _RoutingNeeded(BaseException):
    """Where a planner first reads `check_plan_fits`'s stand-in routing: its own checks of the
    model, hardware and workload (its placement) have passed. A BaseException, so that no
    planner's `except Exception` takes it for its own."""


def check_plan_fits(spec: RunSpec, planner: Planner | None = None) -> None:
    """The planner's refusals that need no routing (its placement: a working set larger than
    the GPU), made before a routing that takes seconds to build is built: a prompt_len of three
    million built routing for a minute before flexgen refused its activations. The planner plans
    with a stand-in routing up to its first read of it: `planner`, the run's, or a new one."""
    m = spec.model
    if routing_bytes(spec) < PROBE_ROUTING_BYTES and op_count(spec) < OPS_CHECKED:
        return  # built at once, and planned before long: the plan itself refuses it as soon

    def not_yet(*_: int) -> Any:
        raise _RoutingNeeded

    stand_in = CausalRouting(not_yet, m.n_experts, m.top_k, labels=not_yet)
    ctx = PlanContext(m, spec.hardware, spec.workload, stand_in, CostModel(spec.hardware))
    try:
        with gc_paused(), own_errors(spec.planner):
            (planner or run_planner(spec)).plan(ctx, ScheduleBuilder(ctx.hardware.memory_bytes))
    except _RoutingNeeded:
        return
    except CapacityError:
        raise
    except Exception:  # noqa: BLE001 (the stand-in's doing, or the real plan's to say)
        return


def routing_bytes(spec: RunSpec) -> int:
    """The bytes of the run's routing (top-k ids and gate weights of every token and layer)."""
    m, wl = spec.model, spec.workload
    return wl.n_sequences * wl.seq_positions * m.n_layers * m.top_k * 12


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


def check_kv_fits(spec: RunSpec, warn: bool = True) -> None:
    """A CapacityError when the group's KV cache cannot fit in GPU + CPU memory, whatever the
    planner (no planner keeps KV on disk): checked before routing for that many tokens is built,
    which for a prompt of millions of tokens would itself take more memory than the machine has.
    `warn`: say a run that fits but has millions of ops (not where a sweep checks its points)."""
    m, wl, hw = spec.model, spec.workload, spec.hardware
    # the schedule's ops whatever the routing's size: a gen_len of a million on a small model
    # has little routing but tens of millions of ops
    check_ops_fit(spec, warn)
    # Below this, routing is cheap to build and the planner's own capacity check says more (a
    # model whose weights do not fit is named as such, not as a KV cache to shrink).
    if routing_bytes(spec) < ROUTING_CHECK_BYTES:
        return
    # the configuration's own limit first, then this machine's free RAM, which varies from run
    # to run: a KV cache that no machine of this hardware profile holds is named as such
    kv = wl.n_sequences * wl.seq_positions * m.kv_bytes_per_token * m.n_layers
    room = hw.memory_bytes.get(Tier.GPU, 0) * max(1, hw.n_gpus) + hw.memory_bytes.get(Tier.CPU, 0)
    if kv > room:
        raise capacity_error(
            f"KV cache of {wl.n_sequences} sequences x {wl.seq_positions} tokens "
            f"({kv / 1e9:.3g} GB) cannot fit in GPU + CPU memory ({room / 1e9:.3g} GB)",
            KV_LOWER,
            KV_MORE,
        )
    check_ram(
        routing_bytes(spec) * ROUTING_PEAK_FACTOR,
        f"routing for {wl.n_sequences} sequences x {wl.seq_positions} tokens x {m.n_layers} layers",
        "lower workload.prompt_len, gen_len, batch_size or n_batches",
    )


OPS_CHECKED = 1_000_000  # a schedule estimated this large is checked against memory
BYTES_PER_OP = 1500  # a run's peak RAM per op (docs/results/sim-speed.md: 1.9 GB at 1.23M ops)


def op_count(spec: RunSpec) -> int:
    """About how many ops the run's schedule has: per step, layer and batch, each expert a
    batch's tokens can reach and a few dense and transfer ops."""
    m, wl = spec.model, spec.workload
    return (
        (wl.gen_len + 1)
        * m.n_layers
        * wl.n_batches
        * (min(m.n_experts, wl.batch_size * m.top_k) + 6)
    )


def check_ops_fit(spec: RunSpec, warn: bool = True) -> None:
    """A MoepipeError when the schedule's ops (about: per step, layer and batch, each expert a
    batch's tokens can reach and a few dense and transfer ops) would take more RAM than the
    machine has: a gen_len of millions planned for minutes before running out of memory."""
    m, wl = spec.model, spec.workload
    ops = op_count(spec)
    if ops < OPS_CHECKED:
        return
    # sized_run checks one batch first: then n_batches, whatever was given, is no way out
    batches = "one batch" if wl.n_batches == 1 else f"n_batches={wl.n_batches}"
    what = f"workload.gen_len={wl.gen_len} x {batches} on {m.n_layers} layers (about {ops:.3g} ops)"
    fix = "lower gen_len" + (" or n_batches" if wl.n_batches > 1 else "")
    check_ram(ops * BYTES_PER_OP, what, fix)
    if not warn:
        return
    # it fits, but plans and simulates for minutes with nothing said: said once, up front
    log.warning(
        "%s needs about %.3g GB of RAM and minutes to simulate; Ctrl-C stops it (%s to shorten)",
        what,
        ops * BYTES_PER_OP / 1e9,
        fix,
    )


def check_ram(need: int, what: str, fix: str) -> None:
    """A MoepipeError where `what` needs more than this machine's available RAM (the check of
    every command that sizes its memory before it allocates, make_checkpoint's too)."""
    avail = _available_ram_bytes()
    if avail is not None and need > avail:
        raise MoepipeError(
            f"{what} would need about {need / 1e9:.3g} GB of RAM, and this machine has "
            f"{avail / 1e9:.3g} GB of RAM available; {fix}"
        )


def simulate_run(
    spec: RunSpec,
    routing: Routing | None = None,
    planner: Planner | None = None,
    on_planned: Callable[[], None] | None = None,
    keep: list[object] | None = None,
) -> RunResult:
    """Plan, validate, simulate and summarise `spec`: sized here where no `routing` is given,
    else `spec` is the sized run the routing is of. `planner`: the run's (`sized_run`'s), which
    keeps its choices; else a new one. `on_planned`: called once its schedule is built, before
    the simulation (a run's warnings, held till then, say what it will take up front).
    `keep`: `simulate_table`'s."""
    if routing is None:
        spec, planner = sized_run(spec, planner)
        routing = last_routing(spec.model, spec.workload)
    else:
        planner = planner or run_planner(spec)
    # the collector paused from the plan to the summary, not only while planning and simulating:
    # on again in between, it scanned the schedule's ops in the validator (a young and an old
    # collection, a twentieth of a 178k-op run's time)
    with gc_paused(), own_bugs(spec.planner):
        schedule = build_schedule(spec, routing, planner)
        if on_planned is not None:
            on_planned()
        trace = simulate_table(schedule, spec.hardware, keep)
        return RunResult(schedule, trace, summary_of(spec, schedule, trace, routing))


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
        weights = routing.weights
        if callable(weights):  # weights made when first read: read-only too
            routing = replace(routing, weights=lambda: _read_only(weights()))
        for a in (routing.expert_ids, routing.weights, routing.labels):
            if isinstance(a, np.ndarray):
                _read_only(a)
        _LAST_ROUTING[key] = routing
    return _LAST_ROUTING[key]


def _read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def simulate_trace(schedule: Schedule, hardware: HardwareSpec) -> pd.DataFrame:
    """The simulator's trace of a validated schedule."""
    return simulate_table(schedule, hardware).frame()


def simulate_table(
    schedule: Schedule, hardware: HardwareSpec, keep: list[object] | None = None
) -> TraceTable:
    """`simulate_trace`'s columns, without pandas. `keep`: `simulate_times`'."""
    from sim.executor import simulate_times

    cost = CostModel(hardware)
    parts = cost.pool_parts(schedule)  # NaN for every op of a schedule without a pool
    with gc_paused():
        start, end, granted = simulate_times(schedule, cost, parts, keep)
    return trace_table(
        schedule, start, end, source="sim", sm_s=parts[1], launch_s=parts[0], alloc_s=granted
    )


def summary_of(
    spec: RunSpec,
    schedule: Schedule,
    trace: pd.DataFrame | TraceTable,
    routing: Routing,
    mode: str = "",
) -> dict[str, Any]:
    """summary.json's labels and metrics; its routing twice, from one object: `routing` the
    description tables print (behind a real run's `mode: `), `routing_fields` the same as
    data, which collect and report compare with config.yaml (run_config.routing_disagrees)."""
    meta = {k: v for k, v in schedule.meta.items() if k not in ("planner", "params")}
    if "placement" in meta:  # what the run holds, with what a planner reserves beside it
        held = {str(t): gb(n) for t, n in schedule.resident_bytes.items()}
        meta["placement"] = {**meta["placement"], "resident_gb": held}
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
        routing=f"{mode}: {routing.description}" if mode else routing.description,
        routing_fields=dict(routing.fields),
        plan=meta,
    )


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
    from experiments.common.tables import check_result  # (tables reads runs: it imports us)

    check_result(result.summary)

    def files(tmp: Path) -> None:
        write_trace_parquet(result.table, tmp / "trace.parquet")
        if chrome:
            write_chrome(
                tmp / "trace.json",
                chrome_parts(result.trace, int(result.summary.get("processes", 0))),
            )
        write_balance(tmp, result)
        if result.outputs:
            from safetensors.numpy import save_file

            save_file(result.outputs, str(tmp / TOKENS_FILE))
            plain_permissions(tmp / TOKENS_FILE)
        for name, text in (texts or {}).items():
            (tmp / name).write_text(text)

    replace_run(Path(out_dir), result.summary, files)


def write_trace_parquet(trace: pd.DataFrame | TraceTable, path: Path) -> None:
    """trace.parquet: dictionary-encoded where the frame's column is categorical (stream, kind
    ...) and plain elsewhere. pyarrow's default tries a dictionary on every column, which for
    ids and times of distinct values only costs: half the write's time, and a larger file. The
    frame read back is the same. The bytes are `trace.to_parquet(path, index=False,
    use_dictionary=cats)`'s, written by pyarrow itself: pandas' writer converts the columns on
    a pool of threads and writes through a Python file object, a fifth more CPU for this. A
    simulated run's columns (`TraceTable.arrow`) make the same table without pandas."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(trace, TraceTable):
        cats, table = list(trace.names), trace.arrow()
    else:
        cats = [c for c in trace.columns if isinstance(trace[c].dtype, pd.CategoricalDtype)]
        table = pa.Table.from_pandas(trace, preserve_index=False, nthreads=1)
    pq.write_table(table, str(path), compression="snappy", use_dictionary=cats)


def write_balance(out: Path, result: RunResult) -> None:
    """balance.csv (`core.balance.phases`: tokens per device, balancedness and utilisation per
    step, layer and batch) when the run is expert-parallel."""
    if "n_devices" in result.summary:
        phases(result.trace, int(result.summary["n_devices"])).to_csv(
            out / "balance.csv", index=False
        )


def one_device(planners: list[str]) -> ConfigError:
    """The error of executor.distributed=true given `planners` that plan one device."""
    ep = expert_parallel_names()
    which = (
        f"planner {planners[0]} plans"
        if len(planners) == 1
        else f"planners {', '.join(planners)} plan"
    )
    return ConfigError(
        "executor.distributed=true runs an expert-parallel planner's devices as processes; "
        f"{which} one device (use {', '.join(ep[:-1])} or {ep[-1]}, or executor.distributed=false)"
    )


def expert_parallel_only(names: list[str], given: list[str]) -> list[str]:
    """The planners a distributed validation runs: the expert-parallel ones of `names` where
    none was `given`; else `names`, refused where one plans one device (its row skipped after
    the others' runs, it said so only then)."""
    one = [n for n in names if n not in expert_parallel_names()]
    if one and given:
        raise ConfigError(f"planners={','.join(given)}: {one_device(one)}")
    return [n for n in names if n not in one]
