"""Simulator vs real executor: run each planner both ways on the same routing and compare.

Tabulates predicted against measured makespan, GPU bubble, lower bound, per-op-kind duration and
bubble causes, into <out>/<planner>/{sim,real}/ run dirs, validate.csv, validate.md and
timeline_<planner>.png: docs/commands.md#validate; results: docs/results/validation.md.

Usage:
    python -m experiments.validate checkpoint=DIR hardware=this-machine|FILE.yaml [planners=[a,b]]
        [gpu_frac=0.6] [cpu_frac=0.15] [batch_size=4] [n_batches=2] [prompt_len=16] [gen_len=4]
        [repeats=3] [links=probe|calibrated] [out=runs/validate/<time>] [executor.distributed=true]
        [executor.dtype=auto|float32|bfloat16]
        [+planner_params.KEY=VALUE ...]   # e.g. +planner_params.dense=tensor, for every planner
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from core.args import (  # noqa: E402
    MAX_REPEATS,
    MAX_TOKENS,
    REPEATS_WHY,
    TOKENS_WHY,
    as_share,
    not_a_run_folder,
    not_the_checkpoint,
    refuse_their_png,
)
from core.balance import device_of  # noqa: E402
from core.bubbles import by_transfer, causes_tv, top_cause  # noqa: E402
from core.errors import (  # noqa: E402
    CapacityError,
    ConfigError,
    MoepipeError,
    ScheduleBug,
    did_you_mean,
    reworded,
)
from core.hardware import HardwareSpec
from core.planner import Planner
from core.routing import Routing, load_routing  # noqa: E402
from core.shown import error, fixed, short_of  # noqa: E402
from core.spec import RoutingConfig, Workload
from core.trace import link_bandwidth  # noqa: E402
from core.types import OpKind, Resource, RoutingSource, Tier  # noqa: E402
from experiments.common.app import command, kv  # noqa: E402
from experiments.common.cli import as_int, checked_names, exit_command, output_dir  # noqa: E402
from experiments.common.dist_measure import p2p_seen  # noqa: E402
from experiments.common.dist_run import run_distributed  # noqa: E402
from experiments.common.figures import fig_sim_vs_real  # noqa: E402
from experiments.common.hardware import load_hardware, measure_in_run, read_hardware, with_links
from experiments.common.held_warnings import plan_accepted, warnings_held
from experiments.common.option_names import VALIDATE_OPTIONS, named_as, own_names
from experiments.common.pipeline import (
    RunResult,
    RunSpec,
    expert_parallel_only,
    simulate_run,
    sized_run,
    write_run,
)
from experiments.common.real_run import FileState, checkpoint_files, real_execute  # noqa: E402
from experiments.common.run_dir import staged_outputs
from experiments.common.schema import DtypeOption
from experiments.common.tables import csv_of_ours, markdown  # noqa: E402
from planners.registry import make_planner, planner_names  # noqa: E402
from real.checkpoint import load_checkpoint, run_dtype  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger(__name__)


@dataclass
class ExecutorOptions(DtypeOption):
    distributed: bool = False  # an expert-parallel planner's devices as processes (gloo)


@dataclass
class Options:
    checkpoint: str | None = None  # the checkpoint folder the real runs read
    hardware: str = "this-machine"  # conf/hardware/<name>.yaml or a FILE.yaml (calibrate's)
    planners: list[str] = field(default_factory=list)  # empty: every registered planner
    gpu_frac: float = 0.6  # the device pool, as a share of the model's bytes
    cpu_frac: float = 0.15  # host RAM, as a share of the model's bytes
    batch_size: int = 4
    n_batches: int = 2
    prompt_len: int = 16
    gen_len: int = 4
    out: str | None = None  # default runs/validate/<time>
    repeats: int = 3  # real runs per planner
    links: str = "probe"  # probe | calibrated
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)
    # params given to every planner, e.g. planner_params.dense=tensor (each planner must take them)
    planner_params: dict[str, Any] = field(default_factory=dict)


_DEFAULTS: dict[str, Any] = kv(Options())


def probe_predict(
    ckpt: str,
    hw_dict: dict[str, Any],
    spec: RunSpec,
    routing: Routing,
    fracs: tuple[float, float],
    dtype: str | None = None,
) -> tuple[RunResult, dict[Resource, float]]:
    """The simulator's prediction for a real run about to start, at the link bandwidths a probe
    run saw just now: one small flexgen run on the checkpoint (calibrate's in-run measurement),
    not the run being predicted. This VM's disk drifts by +-30% over minutes; a calibration
    minutes old has drifted with it. Returns (the simulated run, the probe's link bandwidths)."""
    _, seen = measure_in_run(
        ckpt,
        hw_dict,
        torch.device("cuda" if torch.cuda.is_available() else "cpu"),
        budget_s=0.0,
        runs=1,
        gpu_frac=fracs[0],
        cpu_frac=fracs[1],
        dtype=dtype,
    )
    bandwidths = {Resource(k): v for k, v in seen.items()}
    return simulate_run(replace(spec, hardware=with_links(spec.hardware, bandwidths)), routing), (
        bandwidths
    )


def errors_against(row: dict[str, Any], label: str, sim: dict[str, Any]) -> None:
    """`row` gains sim_<label>_makespan_s and its makespan and GPU-bubble errors against the
    real median already in `row`."""
    row[f"sim_{label}_makespan_s"] = sim["makespan_s"]
    row[f"err_{label}_makespan_s"] = rel(sim["makespan_s"], row["real_makespan_s"])
    row[f"err_{label}_gpu_bubble_s"] = rel(sim["gpu_bubble_s"], row["real_gpu_bubble_s"])


def rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("nan")


def compare(
    planner: str, sim: pd.DataFrame, real: pd.DataFrame, s_sum: dict, r_sum: dict
) -> dict[str, Any]:
    row: dict[str, Any] = dict(planner=planner, ops=len(real), n_batches=r_sum["n_batches"])
    for key in ("makespan_s", "gpu_bubble_s", "lower_bound_s"):
        row[f"sim_{key}"] = s_sum[key]
        row[f"real_{key}"] = r_sum[key]
        row[f"err_{key}"] = rel(s_sum[key], r_sum[key])
    row["real_makespan_over_lb"] = (
        r_sum["makespan_s"] / r_sum["lower_bound_s"] if r_sum["lower_bound_s"] else float("nan")
    )
    # the schedule's own bound with the measured durations: what the executor adds to the DAG
    row["real_makespan_over_dag_lb"] = (
        r_sum["makespan_s"] / r_sum["dag_lower_bound_s"]
        if r_sum.get("dag_lower_bound_s")
        else float("nan")
    )
    # why the GPU idled, predicted and measured (core.bubbles): the main cause of each, and how
    # far apart the two splits of the bubble over its causes are (0: the same mix)
    s_why = by_transfer(s_sum.get("gpu_idle_causes_s", {}))
    r_why = by_transfer(r_sum.get("gpu_idle_causes_s", {}))
    row["sim_bubble_waits_on"], row["real_bubble_waits_on"] = top_cause(s_why), top_cause(r_why)
    row["bubble_causes_tv"] = causes_tv(s_why, r_why)
    joined = sim.merge(real, on="op_id", suffixes=("_sim", "_real"))
    assert len(joined) == len(real) == len(sim)
    for kind, g in joined.groupby("kind_real", observed=True):
        ds = (g["end_s_sim"] - g["start_s_sim"]).mean()
        dr = (g["end_s_real"] - g["start_s_real"]).mean()
        if kind != "free":
            row[f"{kind}_sim_ms"] = 1e3 * ds
            row[f"{kind}_real_ms"] = 1e3 * dr
    return row


def any_device(trace: pd.DataFrame) -> pd.DataFrame:
    """The trace with every device's resource under its kind's name ('p2p:1' -> 'p2p'), for the
    bandwidth a kind of link delivered over all devices."""
    return trace.assign(resource=trace["resource"].astype(str).str.partition(":")[0])


def per_device(sim: RunResult, real: RunResult) -> dict[str, Any]:
    """A G-process run against its simulation: the share of the schedule's ops its trace holds
    exactly once (coverage), each device's expert tokens in both, and their utilisation."""
    ids = real.trace["op_id"].to_numpy()
    once = np.bincount(ids, minlength=len(real.schedule)) == 1
    row: dict[str, Any] = {"coverage": float(once.mean()) if len(once) else 0.0}
    for label, r in (("sim", sim), ("real", real)):
        t = r.trace[r.trace["kind"].astype(str) == str(OpKind.EXPERT)]
        tokens = t.groupby(device_of(t["resource"]))["tokens"].sum()
        row[f"{label}_device_tokens"] = [
            int(tokens.get(d, 0)) for d in range(real.summary["n_devices"])
        ]
        row[f"{label}_utilisation"] = float(r.summary.get("utilisation", float("nan")))
    row["device_tokens_equal"] = row["sim_device_tokens"] == row["real_device_tokens"]
    return row


@dataclass
class Setup:
    """What every step of a validation reads: the options checked, the model and hardware."""

    ckpt: str
    names: list[str]  # the planners
    model: Any  # core.spec.ModelSpec
    hw: Any  # core.hardware.HardwareSpec
    wl: Workload
    out: Path
    fracs: tuple[float, float]  # gpu_frac, cpu_frac
    repeats: int
    distributed: bool
    probe: bool  # links=probe, and not distributed (a probe measures disk and h2d only)
    hw_dict: dict[str, Any]  # the hardware YAML as read, for calibrate's probe
    params: dict[str, Any]  # planner_params, every planner's
    fresh_out: bool = False  # `out` was made by this validation (a failed one removes it)
    dtype: str = "auto"  # executor.dtype: the real runs' compute dtype
    # the checkpoint's files before its first read here: every planner's real run fails on a
    # change since, not only on one during it (the table would compare two checkpoints' runs)
    files: dict[str, FileState] | None = None


def validate(opts: dict[str, Any]) -> pd.DataFrame:
    """The validation (module doc): its table, also written to <out>/validate.csv and .md; they
    and the run dirs and timelines replace an earlier validation's in `out` once all are
    written (a failure or an interrupt leaves that one as it was)."""
    # its warnings print once a real run's plan is accepted (held_warnings): a validation
    # whose real runs are all refused says only that
    setup = _setup(opts)
    stage = staged_outputs(setup.out, _earlier_outputs, "validate.csv", setup.fresh_out)
    with stage as tmp:
        table = _validate(replace(setup, out=tmp))
    print(f"wrote {setup.out}/validate.csv, validate.md, timeline_*.png")
    return table


def _earlier_outputs(out: Path) -> set[str]:
    """The files an earlier validation wrote into `out`, named by its validate.csv."""
    try:
        planners = [str(p) for p in pd.read_csv(out / "validate.csv")["planner"]]
    except (OSError, ValueError, KeyError):
        return set()
    names = {p for p in planners if p and "/" not in p and not p.startswith(".")}
    return {"validate.csv", "validate.md", *names, *(f"timeline_{p}.png" for p in names)}


def _validate(setup: Setup) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    sims = _simulate_all(setup, rows)
    if sims:
        reals, probed = _real_runs(setup, sims, rows)
    if not sims:  # a table of skipped rows alone is no validation
        raise CapacityError(  # each planner refused: a refusal, said alone (held_warnings)
            "every planner was skipped, nothing to compare: "
            + "; ".join(f"{r['planner']}: {r['skipped']}" for r in rows)
            + "; fix one planner's refusal as it says, or pass planners=[...] that fit"
        )
    for r in rows:  # the others' rows follow
        log.warning("%s skipped: %s", r["planner"], r["skipped"])
    # all the validation's probes pooled (the median of each link over every probe): a
    # calibration taken during the validation, from runs other than the ones predicted
    pooled = {
        res: float(np.median(bws))
        for res in (Resource.DISK, Resource.H2D)
        if (bws := [s[res] for ps in probed.values() for _, s in ps if res in s])
    }
    for name, (spec, routing, sim, _) in sims.items():
        runs = sorted(reals[name], key=lambda r: r.summary["makespan_s"])
        # the median run (a trace is one run's); of an even count the lower, not the slower
        real = runs[(len(runs) - 1) // 2]
        if [(o.kind, o.stream, o.deps) for o in sim.schedule.ops] != [
            (o.kind, o.stream, o.deps) for o in real.schedule.ops
        ]:
            raise ScheduleBug(
                f"planner {name} planned different schedules for sim and real on the same routing"
            )
        write_run(setup.out / name / "sim", sim)
        write_run(setup.out / name / "real", real)
        row = compare(name, sim.trace, real.trace, sim.summary, real.summary)
        seen, hw_seen = _spans_and_links(row, setup, runs, sim, real)
        if hw_seen is not None:
            again = simulate_run(replace(spec, hardware=hw_seen), routing)
            errors_against(row, "run_links", again.summary)
        if probed[name]:
            _probe_errors(row, probed[name], reals[name])
            pooled_run = simulate_run(replace(spec, hardware=with_links(setup.hw, pooled)), routing)
            errors_against(row, "window", pooled_run.summary)
        rows.append(row)
        fig_sim_vs_real(name, sim.trace, real.trace, setup.out / f"timeline_{name}.png")
        _print_row(name, row, seen, bool(probed[name]), setup.distributed, len(real.schedule))
    return _write_tables(setup, rows)


def _setup(opts: dict[str, Any]) -> Setup:
    """The options checked, the checkpoint read, the hardware sized and the out folder made (a
    mistake is one line before any run, whose results would be lost after)."""
    links = str(opts["links"])
    if links not in ("calibrated", "probe"):
        raise MoepipeError(
            f"links={links!r} unknown; {did_you_mean(links, ('calibrated', 'probe'))}"
            "valid: calibrated, probe"
        )
    ckpt = opts["checkpoint"]
    if not ckpt:
        raise MoepipeError(
            "missing checkpoint=DIR (make one with python -m experiments.make_checkpoint)"
        )
    given = str(opts["planners"]).split(",") if opts["planners"] else []
    names = checked_names("planners", given, planner_names()) if given else planner_names()
    unknown = [p for p in names if p not in planner_names()]
    if unknown:
        raise MoepipeError(
            f"planners={opts['planners']}: unknown planner(s) {', '.join(unknown)}; valid: "
            f"{', '.join(planner_names())}"
        )
    params = dict(opts.get("planner_params") or {})
    for name in names:  # a param a planner lacks: one line now, not a skipped row per planner
        try:
            make_planner(name, params)
        except MoepipeError as e:
            raise reworded(e, f"planner_params: {e}") from e
    distributed = bool(opts["executor.distributed"])
    names = expert_parallel_only(names, given) if distributed else names
    dtype = run_dtype(opts["executor.dtype"])
    gpu_frac, cpu_frac = (
        # a share of the model's bytes: above 1 where every device must hold the whole model
        # and more (an expert-parallel run's resident experts), up to a rack's worth
        as_share(k, opts[k], 64.0, "a share of the model's bytes")
        for k in ("gpu_frac", "cpu_frac")
    )
    sizes = {
        k: as_int(k, opts[k], at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
        for k in ("batch_size", "n_batches", "prompt_len", "gen_len")
    }
    sizes["repeats"] = as_int(
        "repeats", opts["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY
    )
    hw_dict = read_hardware(str(opts["hardware"]))  # its problems before the checkpoint's
    files = checkpoint_files(ckpt)
    model, _ = load_checkpoint(ckpt, dtype)
    hw = load_hardware(str(opts["hardware"]), model.total_bytes, gpu_frac, cpu_frac)
    repeats = sizes.pop("repeats")
    wl = Workload(**sizes, routing=RoutingConfig(source=RoutingSource.SYNTHETIC))
    where = opts["out"] or ROOT / "runs" / "validate" / datetime.datetime.now().strftime(
        "%Y-%m-%d_%H-%M-%S"
    )
    not_the_checkpoint(where, "out", ckpt)
    not_a_run_folder(where, "out", own=("validate.csv",))
    fresh = not Path(where).exists()
    out = output_dir(where, "out")
    csv_of_ours(out / "validate.csv", "planner", "validate")  # not lost after the runs
    for name in names:  # a plot of the user's where a timeline goes, alike
        refuse_their_png(out / f"timeline_{name}.png", "out")
    probe = links == "probe" and not distributed
    fracs = (gpu_frac, cpu_frac)
    sized = (out, fracs, repeats, distributed, probe, hw_dict, params, fresh, dtype)
    return Setup(ckpt, names, model, hw, wl, *sized, files=files)


# a planner's sized run, its routing, simulation and planner (its real runs reuse its choices)
Sim = tuple[RunSpec, Routing, RunResult, Planner]


def _simulate_all(setup: Setup, rows: list[dict[str, Any]]) -> dict[str, Sim]:
    """Each planner planned and simulated; one it refuses is a `skipped` row of `rows`."""
    sims: dict[str, Sim] = {}
    for name in setup.names:
        run = RunSpec(setup.model, setup.hw, setup.wl, name, dict(setup.params))
        try:
            with warnings_held((MoepipeError,)):  # a planner refused: its warnings dropped
                spec, planner = sized_run(run)
                routing = load_routing(spec.model, spec.workload)
                sims[name] = spec, routing, simulate_run(spec, routing, planner), planner
        except MoepipeError as e:
            if isinstance(e, ScheduleBug):
                raise  # the planner's bug: said as one, not skipped
            rows.append(dict(planner=name, skipped=own_names(str(e), VALIDATE_OPTIONS)))
    return sims


Probed = list[tuple[RunResult, dict[Resource, float]]]  # (prediction, the probe's bandwidths)


def _real_runs(
    setup: Setup, sims: dict[str, Sim], rows: list[dict[str, Any]]
) -> tuple[dict[str, list[RunResult]], dict[str, Probed]]:
    """Each planner's real runs, and with links=probe each one's prediction. Real runs vary
    (this VM's disk by +-30% over minutes): the repeats go round the planners (every planner's
    span the same window), each compared at its median. One the executor refuses leaves `sims`."""
    reals: dict[str, list[RunResult]] = {name: [] for name in sims}
    probed: dict[str, Probed] = {name: [] for name in sims}
    for _ in range(setup.repeats):
        for name, (spec, routing, _, planner) in list(sims.items()):
            # the probe's own failure (its run refused) is the whole command's, not this planner's
            probe_now = (
                probe_predict(setup.ckpt, setup.hw_dict, spec, routing, setup.fracs, setup.dtype)
                if setup.probe
                else None
            )
            try:
                with warnings_held((CapacityError, ConfigError)):  # dropped if refused
                    real_spec = replace(spec, executor="real")
                    if setup.distributed:
                        dist = run_distributed(
                            setup.ckpt,
                            real_spec,
                            "replay",
                            None,
                            120,
                            routing,
                            planner,
                            setup.dtype,
                            files=setup.files,
                        )
                        result = dist.result
                        plan_accepted()
                    else:
                        run = dict(routing=routing, planner=planner, dtype=setup.dtype)
                        run |= dict(files=setup.files, on_planned=plan_accepted)
                        result, _ = real_execute(setup.ckpt, real_spec, "replay", **run)
            except (CapacityError, ConfigError) as e:  # e.g. a working set the pool cannot hold
                # a refusal, not a fault: a rank that died, a checkpoint that changed, NaN
                # weights fail the command (as a skipped row, the table left the planner out)
                rows.append(dict(planner=name, skipped=own_names(str(e), VALIDATE_OPTIONS)))
                del sims[name]
                continue
            reals[name].append(result)
            if probe_now:
                probed[name].append(probe_now)
    return reals, probed


RUN_LINKS = (Resource.DISK, Resource.H2D, Resource.P2P)


def _spans_and_links(
    row: dict[str, Any], setup: Setup, runs: list[RunResult], sim: RunResult, real: RunResult
) -> tuple[dict[Resource, float], HardwareSpec | None]:
    """`row` gains the memory sizes, the real runs' spread, the per-device columns of a
    distributed run, and each link's bandwidth as the runs' transfers saw it and as
    calibrated. Returns the bandwidths seen (bytes/s) and the hardware at those links (None if
    none was seen), for the simulator to run again at them: the error left once the links'
    drift since calibration is taken out (a diagnosis)."""
    hw = setup.hw
    spans = [r.summary["makespan_s"] for r in runs]
    row["gpu_gb"], row["cpu_gb"] = hw.memory_bytes[Tier.GPU] / 1e9, hw.memory_bytes[Tier.CPU] / 1e9
    row["disk_bytes"] = real.summary["bytes_moved"].get("disk", 0)
    row["real_runs"] = len(spans)
    row["real_makespan_min_s"], row["real_makespan_max_s"] = min(spans), max(spans)
    traces = [any_device(r.trace) for r in runs]
    seen = {
        res: bw
        for res in RUN_LINKS
        if (bw := link_bandwidth(traces, str(res), hw.link(res).latency_s))
    }
    # G processes: the p2p link's latency too, from the runs' transfers (small ones are
    # nearly all latency, which a bandwidth alone cannot stand for)
    p2p = p2p_seen([r.trace for r in runs], hw.link(Resource.P2P)) if setup.distributed else None
    if p2p is not None:
        seen[Resource.P2P] = p2p.link.bandwidth_bytes_per_s
        row["run_p2p_latency_us"] = p2p.link.latency_s * 1e6
        row["calibrated_p2p_latency_us"] = hw.link(Resource.P2P).latency_s * 1e6
        row["run_gate_exchange_us"] = p2p.gate_exchange_s * 1e6
        row["calibrated_gate_exchange_us"] = hw.processes.gate_exchange_s * 1e6
    if setup.distributed:
        row.update(per_device(sim, real))
    for res in RUN_LINKS:
        row[f"run_{res}_gbps"] = seen[res] / 1e9 if res in seen else float("nan")
        row[f"calibrated_{res}_gbps"] = hw.link(res).bandwidth_bytes_per_s / 1e9
    for k in ("sim_run_links_makespan_s", "err_run_links_makespan_s", "err_run_links_gpu_bubble_s"):
        row[k] = float("nan")
    if not seen:
        return seen, None
    hw_seen = with_links(hw, seen)
    if p2p is not None:  # the gate exchange too: the runs' dispatches' wait beyond a transfer
        hw_seen = replace(
            hw_seen,
            links={**hw_seen.links, Resource.P2P: p2p.link},
            processes=replace(hw.processes, gate_exchange_s=p2p.gate_exchange_s),
        )
    return seen, hw_seen


def _probe_errors(row: dict[str, Any], probed: Probed, reals: list[RunResult]) -> None:
    """`row` gains the error of each real run's own prediction, at the links a probe saw just
    before it: the median prediction's, and the median of each against the run it was for."""
    preds = sorted(probed, key=lambda p: p[0].summary["makespan_s"])
    errors_against(row, "probe", preds[(len(preds) - 1) // 2][0].summary)
    row["err_probe_paired_makespan_s"] = float(
        np.median(
            [
                rel(pred.summary["makespan_s"], run.summary["makespan_s"])
                for (pred, _), run in zip(probed, reals, strict=True)
            ]
        )
    )
    row["probe_disk_gbps"] = float(
        np.median([bws.get(Resource.DISK, np.nan) for _, bws in preds]) / 1e9
    )


def _print_row(
    name: str,
    row: dict[str, Any],
    seen: dict[Resource, float],
    probed: bool,
    distributed: bool,
    n_ops: int,
) -> None:
    """A planner's line (and, distributed, its per-device line) as its results come in."""
    at_run_links = (
        "; at the runs' links ("
        + ", ".join(
            f"{res} {row[f'run_{res}_gbps']:.2f} GB/s, calibrated "
            f"{row[f'calibrated_{res}_gbps']:.2f}"
            + (
                f"; + {row['run_p2p_latency_us']:.0f} us a transfer, calibrated "
                f"{row['calibrated_p2p_latency_us']:.0f}; gate exchange "
                f"{row['run_gate_exchange_us']:.0f} us, calibrated "
                f"{row['calibrated_gate_exchange_us']:.0f}"
                if res == Resource.P2P and "run_p2p_latency_us" in row
                else ""
            )
            for res in seen
        )
        + f"): {error(row['err_run_links_makespan_s'])}, "
        f"bubble {error(row['err_run_links_gpu_bubble_s'])}"
        if seen
        else ""
    )
    at_probe = (
        f"; probed links: {error(row['err_probe_makespan_s'])}, "
        f"bubble {error(row['err_probe_gpu_bubble_s'])}; all probes pooled: "
        f"{error(row['err_window_makespan_s'])}, "
        f"bubble {error(row['err_window_gpu_bubble_s'])}"
        if probed
        else ""
    )
    if distributed:
        print(
            f"{name:24s} coverage {short_of(row['coverage'], '.0%', 0, 1)} of {n_ops} ops, "
            f"expert tokens per device sim {row['sim_device_tokens']} real "
            f"{row['real_device_tokens']} ({'equal' if row['device_tokens_equal'] else 'DIFFER'}), "
            f"utilisation sim {row['sim_utilisation']:.2f} real {row['real_utilisation']:.2f}",
            flush=True,
        )
    print(
        f"{name:24s} makespan sim {fixed(row['sim_makespan_s'], 3)} s "
        f"real {fixed(row['real_makespan_s'], 3)} s "
        f"({error(row['err_makespan_s'])}), bubble {error(row['err_gpu_bubble_s'])}, "
        f"real/LB {row['real_makespan_over_lb']:.2f}, "
        f"real/DAG-LB {row['real_makespan_over_dag_lb']:.2f}, "
        f"bubble waits on {row['sim_bubble_waits_on']} (sim) / "
        f"{row['real_bubble_waits_on']} (real), "
        f"causes apart {row['bubble_causes_tv']:.2f} "
        f"(median of {row['real_runs']} real runs, "
        f"{fixed(row['real_makespan_min_s'], 3)}-{fixed(row['real_makespan_max_s'], 3)} s)"
        f"{at_run_links}{at_probe}",
        flush=True,
    )


def _write_tables(setup: Setup, rows: list[dict[str, Any]]) -> pd.DataFrame:
    """validate.csv and validate.md (the main columns, then per-op-kind mean durations of the
    planners that ran: a skipped one is named under it, its reason in the main table)."""
    model, hw, out = setup.model, setup.hw, setup.out
    table = pd.DataFrame(rows)
    table.to_csv(out / "validate.csv", index=False)
    main_cols = [c for c in table.columns if not c.endswith("_ms")]
    skipped = table["skipped"].notna() if "skipped" in table else pd.Series(False, table.index)
    left_out = ", ".join(table.loc[skipped, "planner"])
    why = f"\n\n{left_out}: skipped, so not timed (why: the table above)" if left_out else ""
    (out / "validate.md").write_text(
        f"# sim vs real: {model.name} ({fixed(model.total_bytes / 1e6, 0)} MB), "
        f"hardware {hw.name}, GPU {fixed(hw.memory_bytes[Tier.GPU] / 1e6, 0)} MB, "
        f"CPU {fixed(hw.memory_bytes[Tier.CPU] / 1e6, 0)} MB\n\n"
        + markdown(table[main_cols])
        + "\n\n## per-op-kind mean duration (ms)\n\n"
        + markdown(table.loc[~skipped, ["planner", *[c for c in table if c.endswith("_ms")]]])
        + f"{why}\n"
    )
    return table


def _main(args: Options) -> int:
    with named_as(VALIDATE_OPTIONS):
        validate(kv(args))
    return 0


main = command("validate", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
