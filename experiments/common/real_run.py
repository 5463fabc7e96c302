"""Wiring for the real executor: checkpoint -> model spec, routing, store, planner -> a run.

`experiments.run executor=real checkpoint=DIR` calls `real_run`; tests, validate and the
benchmarks call `real_execute`, which also returns the generated tokens and logits. The run dir
gets the prompts and generated tokens too (tokens.safetensors: `prompts`, `tokens`).
Routing: `routing_mode=replay` forces every gate to the workload's routing (synthetic or trace of
the model's shape; `workload.routing.source=live` replays the model's own routing, recorded by an
in-memory forward first); `routing_mode=live` runs the model's own gates and feeds the planner.

Usage:
    python -m experiments.run executor=real checkpoint=ckpt/ planner=flexgen hardware=this-machine
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig

from core.cost import CostModel
from core.errors import ConfigError, MoepipeError, did_you_mean
from core.files import memory_filesystem
from core.hf_config.generation import GENERATION_FILE
from core.planner import PlanContext, Planner
from core.routing import CausalRouting, Routing, load_routing
from core.schedule import Schedule, ScheduleBuilder, validate
from core.spec import ModelSpec, Workload
from core.trace import make_trace
from core.types import OpKind, Resource, RoutingSource, Tensor, Tier
from experiments.common.pipeline import (
    RunResult,
    RunSpec,
    build_schedule,
    one_device,
    run_planner,
    sized_run,
    summary_of,
)
from planners.registry import own_bugs
from real.checkpoint import INDEX_FILE, Unit, hf_config, load_checkpoint, run_dtype
from real.distributed import Peers
from real.executor import Executor
from real.model import Model, live_routing
from real.shards import weight_files
from real.state import RunOutput, resident_units, unit_of
from real.store import TieredStore, resolve_device

log = logging.getLogger(__name__)

ROUTING_MODES = ("replay", "live")


def prompts_for(model: ModelSpec, workload: Workload) -> torch.Tensor:
    """[n*b, P] seeded random prompt tokens (the same for every planner of a comparison)."""
    g = torch.Generator().manual_seed(workload.seed)
    return torch.randint(
        0, model.vocab_size, (workload.n_sequences, workload.prompt_len), generator=g
    )


def replay_routing(
    ckpt: str | Path, spec: RunSpec, prompts: torch.Tensor, dtype: str | None = None
) -> Routing:
    """The routing a replay run forces: the workload's source, or the model's own if `live`
    (the in-memory forward's, in the run's compute dtype)."""
    if spec.workload.routing.source == RoutingSource.LIVE:
        return live_routing(ckpt, prompts, spec.workload.gen_len, dtype)
    return load_routing(spec.model, spec.workload)


def open_store(
    ckpt: str | Path, spec: RunSpec, device: str | None = None, dtype: str | None = None
) -> TieredStore:
    # The executor enforces the schedule's GPU capacity; the store's own accounting (units padded
    # to 4 KiB) only guards against runaway growth, so it gets headroom over the hardware's.
    # The host slabs are cut within the host tier's memory, which the schedule counts.
    cap = 2 * spec.hardware.memory_bytes[Tier.GPU] + (64 << 20)
    return TieredStore(
        ckpt,
        cap,
        device=device,
        host_budget_bytes=spec.hardware.memory_bytes[Tier.CPU],
        dtype=dtype,
    )


def check_routing_mode(routing_mode: str | None) -> None:
    """One line for a routing mode the real executor has not (null, given as a value, was
    said as 'None'; a case slip gets the nearest name)."""
    if routing_mode not in ROUTING_MODES:
        said = "null" if routing_mode is None else repr(routing_mode)
        raise ConfigError(
            f"executor.routing_mode={said}; {did_you_mean(str(routing_mode), ROUTING_MODES)}"
            f"valid: {', '.join(ROUTING_MODES)}"
        )


def real_execute(
    ckpt: str | Path,
    spec: RunSpec,
    routing_mode: str = "replay",
    routing: Routing | None = None,
    device: str | None = None,
    store: TieredStore | None = None,
    distributed: bool = False,
    on_peers: Callable[[Peers], None] | None = None,
    planner: Planner | None = None,
    dtype: str | None = None,
    files: dict[str, FileState] | None = None,
    on_planned: Callable[[], None] | None = None,
) -> tuple[RunResult, RunOutput]:
    """Plan and run `spec` on the checkpoint; the model spec is taken from the checkpoint.
    `distributed`: this process is one rank of an initialised process group, one per device of
    the expert-parallel schedule (`experiments.common.dist_run` starts them); every rank returns the
    whole run. `on_peers`: called with this rank's `Peers` once made (to ask it, on a signal,
    which peer went away). `planner`: the run's (`sized_run`'s, a simulation's of the same run),
    whose choices (Klotski's n) every plan of the run reuses; else one made here. `dtype`: the
    compute dtype (executor.dtype: float32, bfloat16, float16; None or auto: the saved one),
    which the spec's dtype_bytes and so every tier's but the disk's byte sizes follow.
    `files`: the checkpoint's `checkpoint_files` where the command read it first (a run's
    config.json, to record and check its model), so a change since then fails the run too.
    `on_planned`: called once the run's plan is accepted (`held_warnings.plan_accepted`)."""
    check_routing_mode(routing_mode)
    check_real_params(spec)
    if files is None:  # a change while the run reads them fails it at the end
        files = checkpoint_files(ckpt)
    model_spec, _ = load_checkpoint(ckpt, dtype)
    spec = replace(spec, model=model_spec, executor="real")
    if routing is None:
        spec, planner = sized_run(spec, planner)
    planner = planner or run_planner(spec)  # one for every plan below: each would choose again
    # one line per run, not per rank, once its plan is accepted: a refused run says only that
    says = not distributed or torch.distributed.get_rank() == 0

    def planned() -> None:
        if on_planned is not None:
            on_planned()
        if says:
            warn_past_context(ckpt, spec.workload)

    prompts = prompts_for(spec.model, spec.workload)
    model = Model.from_checkpoint(ckpt, spec.model)
    own_store = store is None
    store = store or open_store(ckpt, spec, device, dtype)
    try:
        ex = Executor(store, model, spec.workload, prompts)
        if routing_mode == "replay":
            routing = routing or replay_routing(ckpt, spec, prompts, dtype)
            schedule = build_schedule(spec, routing, planner)
            planned()
            ex.peers = _peers(schedule, spec, on_peers) if distributed else None
            out = ex.run_replay(schedule, routing)
        else:
            out = _run_live(ex, spec, routing, planner, distributed, on_peers, planned)
    finally:
        if own_store:
            store.close()
    trace = make_trace(out.schedule, out.start_s, out.end_s, source="real")
    summary = summary_of(spec, out.schedule, trace, out.routing, routing_mode)
    outputs = {
        "prompts": np.ascontiguousarray(prompts.numpy(), dtype=np.int64),  # [n*b, P]
        "tokens": np.ascontiguousarray(out.tokens.cpu().numpy(), dtype=np.int64),  # [n*b, gen]
    }
    if distributed:
        summary["processes"] = ex.peers.world if ex.peers is not None else 1
    unchanged_since(ckpt, files)
    if says:  # after the checkpoint's last check: a run it fails says only that
        warn_disk_in_memory(ckpt, trace)
    return RunResult(out.schedule, trace, summary, outputs), out


def _run_live(
    ex: Executor,
    spec: RunSpec,
    routing: Routing | None,
    planner: Planner,
    distributed: bool,
    on_peers: Callable[[Peers], None] | None,
    planned: Callable[[], None],
) -> RunOutput:
    """`real_execute`'s live run (its gates choose each layer's experts as it runs), as there;
    `planned` is called once its first plan is accepted."""
    # Dry plans on replayed routing tell where placement-resident units sit.
    dry_routing = routing or _shape_routing(spec)
    resident, kv_batches = resident_before_start(spec, dry_routing, distributed, planner)
    first = build_schedule(spec, dry_routing, planner)  # the first placement: no routing read
    planned()
    ex.peers = _peers(first, spec, on_peers) if distributed else None
    cost = CostModel(spec.hardware)

    def plan(causal: CausalRouting, builder: ScheduleBuilder) -> None:
        planner.plan(PlanContext(spec.model, spec.hardware, spec.workload, causal, cost), builder)
        builder.meta.update(planner=spec.planner, params=dict(spec.params), oracle=causal.peeked)

    out = ex.run_live(plan, spec.hardware.memory_bytes, resident, kv_batches, first.ep)
    validate(out.schedule)
    return out


# device, inode, size, modification and change times (ns): an edit in place that keeps the
# size and puts the mtime back (cp -p, touch -r) still moves the ctime, which no tool sets
FileState = tuple[int, int, int, int, int]


def checkpoint_files(ckpt: str | Path) -> dict[str, FileState]:
    """The checkpoint folder's files a run reads (`read_files`), each as `FileState`; {}
    where the folder cannot be listed (the run's reading it says why)."""
    out = {}
    for name in read_files(Path(ckpt)):
        try:
            st = (Path(ckpt) / name).stat()
        except OSError:  # gone meanwhile: missing from the state, a change
            continue
        out[name] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return out


def read_files(ckpt: Path) -> list[str]:
    """The names of the files checkpoint `ckpt` is read from: config.json, its index and the
    weights' files it names, or its one model.safetensors (`weight_files`), and its
    generation_config.json (the greedy decoding's settings: a rewrite of it ran a finished
    run's result again as this one's, and changed a run's decoding unsaid). A safetensors file
    beside them that none names (an earlier sharding's) is read by no one: rewritten while a
    run reads the checkpoint, it changed nothing the run read. Where the index cannot be read,
    every safetensors file (the run's reading it says why)."""
    try:
        names = sorted(f.name for f in ckpt.iterdir())
    except OSError:
        return []
    try:
        weights = set(weight_files(ckpt))
    except (MoepipeError, OSError, ValueError):
        weights = {n for n in names if n.endswith(".safetensors")}
    return [n for n in names if n in weights or n in ("config.json", INDEX_FILE, GENERATION_FILE)]


def unchanged_since(ckpt: str | Path, before: dict[str, FileState]) -> None:
    """One line where a checkpoint file was rewritten, replaced, added or removed since
    `before` (`checkpoint_files`): the run read its weights over its whole length (an offloaded
    unit each time it is loaded), so its result may mix two checkpoints' weights, which a run
    on other valid weights showed nowhere."""
    after = checkpoint_files(ckpt)
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    if changed:
        raise MoepipeError(
            f"{Path(ckpt) / changed[0]}: changed while the run read the checkpoint (rewritten, "
            "replaced or removed); the result could mix two checkpoints' weights and was not "
            "kept: run again once the checkpoint is whole and no longer changes"
        )


@contextmanager
def unchanged_throughout(ckpt: str | Path) -> Iterator[None]:
    """Fail where the checkpoint changed (`unchanged_since`) between the block's start and its
    end: a bench's systems each load it in a child process of their own, and a rewrite between
    two of them would compare runs of two checkpoints."""
    files = checkpoint_files(ckpt)
    yield
    unchanged_since(ckpt, files)


def _peers(
    schedule: Schedule, spec: RunSpec, on_peers: Callable[[Peers], None] | None = None
) -> Peers:
    """This rank's `Peers` for a schedule (or a live run's dry plan) of an expert-parallel
    planner."""
    if schedule.ep is None:
        raise one_device([spec.planner])
    peers = Peers(schedule.ep, spec.model, spec.workload)
    if on_peers is not None:
        on_peers(peers)
    return peers


def resident_before_start(
    spec: RunSpec, routing: Routing, distributed: bool = False, planner: Planner | None = None
) -> tuple[dict[Unit, Tier], set[int]]:
    """Where each weight unit of a live run must sit before its first op: `resident_units` of dry
    plans, the first on `routing`, each later one on routing that sends every token to experts
    no earlier plan used, until every expert of every MoE layer has been planned for. A live gate
    may choose any expert, and one dry routing can miss some (3 sequences x 7 tokens x top-2 over
    8 experts did), whose weights the live run then read synchronously. A planner's placement at
    t=0 reads no routing (the causal contract), so the plans agree on where a unit starts.
    Also the batches whose KV the plans keep in host memory (KV_LOAD / KV_STORE ops).
    `planner`: the run's, which plans each of them (else a new one each)."""
    moe = {layer: m for m, layer in enumerate(spec.model.moe_layers)}
    n_experts = spec.model.n_experts
    resident: dict[Unit, Tier] = {}  # from the plans that used the unit
    seen: set[Unit] = set()  # every unit some plan loaded, computed with or freed
    used: list[set[int]] = [set() for _ in moe]
    guess: dict[Unit, Tier] | None = None
    kv_batches: set[int] = set()
    while True:
        dry = build_schedule(spec, routing, planner)
        kv_batches |= {op.batch for op in dry.ops if op.kind in (OpKind.KV_LOAD, OpKind.KV_STORE)}
        for unit, tier in resident_units(dry).items():
            resident.setdefault(unit, tier)
        if guess is None:  # whole layers' placement (`resident_units` with n_experts)
            guess = resident_units(dry, n_experts)
        before = sum(map(len, used))
        for op in dry.ops:
            u = unit_of(op)
            if u is None:
                continue
            seen.add(u)
            if u.kind == Tensor.EXPERT and u.layer in moe:
                used[moe[u.layer]].add(u.expert)
        left = [sorted(set(range(n_experts)) - u) for u in used]
        if dry.ep is not None or not any(left) or sum(map(len, used)) == before:
            break  # (expert parallelism holds every expert; or no plan used more)
        routing = replace(routing, expert_ids=_choosing(routing.expert_ids, left, n_experts))
    # units no plan used: where their layer's placement puts them
    resident.update({u: t for u, t in guess.items() if u not in seen})
    return resident, kv_batches


def _choosing(ids: np.ndarray, left: list[list[int]], n_experts: int) -> np.ndarray:
    """`ids` [S, P, L, k] with each MoE layer's tokens sent to the experts in `left[layer]`: the
    tokens, position by position, take them in turn, k distinct a token (padded with other
    experts where fewer than k are left); layers with none left keep their routing."""
    s, p, n_layers, k = ids.shape
    out = ids.copy()
    turn = np.arange(s * p).reshape(p, s).T[..., None] * k + np.arange(k)  # [S, P, k]
    for m in range(n_layers):
        if not left[m]:
            continue
        pool = np.array(
            left[m] + [e for e in range(n_experts) if e not in left[m]][: max(0, k - len(left[m]))]
        )
        out[:, :, m, :] = pool[turn % max(len(left[m]), k)]
    return out


def _shape_routing(spec: RunSpec) -> Routing:
    """Any routing of the model's shape (for the live run's dry plan)."""
    wl = spec.workload
    if wl.routing.source == RoutingSource.LIVE:
        wl = wl.with_(routing=replace(wl.routing, source=RoutingSource.SYNTHETIC))
    return load_routing(spec.model, wl)


def warn_disk_in_memory(ckpt: str | Path, trace: Any) -> None:
    """Log one warning where the run read weights from its disk tier in a checkpoint on a
    filesystem in memory: tmpfs takes O_DIRECT (Linux 6.6 on), so nothing else says that its
    disk reads timed RAM, which the trace and summary then call the disk's."""
    kind = memory_filesystem(ckpt)
    if kind and (trace["resource"].astype(str) == str(Resource.DISK)).any():
        log.warning(
            "checkpoint=%s is on %s, a filesystem in memory: the run's disk reads timed RAM, "
            "not a disk; copy the checkpoint to a disk to measure one",
            ckpt,
            kind,
        )


def warn_past_context(ckpt: str | Path, wl: Workload) -> None:
    """Log one warning where the run feeds the model positions past config.json's
    max_position_embeddings: not an error (transformers runs it too, RoPE extrapolates), but
    the model then runs beyond the context it was trained for."""
    limit = hf_config(ckpt).get("max_position_embeddings", None)  # Switch has none
    if limit is not None and wl.seq_positions > limit:
        log.warning(
            "%s: max_position_embeddings=%d, but workload.prompt_len=%d + gen_len=%d feeds the "
            "model %d positions; past %d it runs beyond the context it was trained for",
            Path(ckpt) / "config.json",
            limit,
            wl.prompt_len,
            wl.gen_len,
            wl.seq_positions,
            limit,
        )


def check_real_params(spec: RunSpec) -> None:
    """Refuse a planner param the real executor cannot run, before the checkpoint is read:
    grouped_gemm's one op per device per layer (the executor runs one op per expert) was met
    as a unit L0.expert-1 "not in this model"."""
    if spec.params.get("grouped_gemm"):
        raise ConfigError(
            "planner.params.grouped_gemm=true: a grouped expert op (all of a device's experts in "
            "one op) runs in the simulator only; set planner.params.grouped_gemm=false for a "
            "real run"
        )


def real_run(
    spec: RunSpec,
    cfg: DictConfig,
    files: dict[str, FileState] | None = None,
    on_planned: Callable[[], None] | None = None,
) -> RunResult | None:
    """`experiments.run executor=real`: needs `checkpoint=DIR`. None on a torchrun rank other
    than 0 (rank 0 writes the run). `files`: the checkpoint's `checkpoint_files` before the
    command first read it, and `on_planned` (`real_execute`)."""
    ckpt = cfg.get("checkpoint")
    if not ckpt:
        raise ConfigError(
            "executor=real needs checkpoint=DIR (a Hugging Face config.json + *.safetensors; "
            "make one with python -m experiments.make_checkpoint model=mixtral-tiny out=ckpt/)"
        )
    ex: Any = cfg.executor
    device = ex.get("device")  # '' is no device: refused, not run as unset
    if device is not None:
        device = str(resolve_device(str(device), "executor.device"))
    mode = ex.get("routing_mode", "replay")
    check_routing_mode(mode)
    dtype = run_dtype(ex.get("dtype"))  # '' is no dtype: refused, not run as auto
    check_real_params(spec)  # here too: a distributed run's ranks would each meet it
    if ex.get("distributed", False):
        from experiments.common.dist_run import run_distributed

        timeout_s = float(ex.get("rendezvous_timeout_s", 120))
        with own_bugs(spec.planner):  # a researcher's planner's broken schedule: theirs to fix
            out = run_distributed(
                str(ckpt),
                spec,
                mode,
                device,
                timeout_s,
                dtype=dtype,
                files=files,
                on_planned=on_planned,
            )
        return None if out is None else out.result  # None: a rank other than 0 of a torchrun
    with own_bugs(spec.planner):
        result, _ = real_execute(
            ckpt, spec, mode, device=device, dtype=dtype, files=files, on_planned=on_planned
        )
    return result
