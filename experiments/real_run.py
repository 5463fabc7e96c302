"""Wiring for the real executor: checkpoint -> model spec, routing, store, planner -> a run.

`experiments.run executor=real checkpoint=DIR` calls `real_run`; tests, validate and the
benchmarks call `real_execute`, which also returns the generated tokens and logits.
Routing: `routing_mode=replay` forces every gate to the workload's routing (synthetic or trace of
the model's shape; `workload.routing.source=live` replays the model's own routing, recorded by an
in-memory forward first); `routing_mode=live` runs the model's own gates and feeds the planner.

Usage:
    python -m experiments.run executor=real checkpoint=ckpt/ planner=flexgen hardware=this-machine
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from core.cost import CostModel
from core.errors import ConfigError
from core.planner import PlanContext
from core.routing import CausalRouting, Routing, load_routing
from core.schedule import Schedule, ScheduleBuilder, validate
from core.spec import ModelSpec, Workload
from core.trace import make_trace
from core.types import RoutingSource, Tier
from experiments.pipeline import RunResult, RunSpec, build_schedule, resolve_n_batches, summary_of
from planners.registry import make_planner
from real.checkpoint import load_checkpoint
from real.executor import Executor, RunOutput, resident_units
from real.model import Model, live_routing
from real.store import TieredStore, resolve_device

ROUTING_MODES = ("replay", "live")


def prompts_for(model: ModelSpec, workload: Workload) -> torch.Tensor:
    """[n*b, P] seeded random prompt tokens (the same for every planner of a comparison)."""
    g = torch.Generator().manual_seed(workload.seed)
    return torch.randint(
        0, model.vocab_size, (workload.n_sequences, workload.prompt_len), generator=g
    )


def replay_routing(ckpt: str | Path, spec: RunSpec, prompts: torch.Tensor) -> Routing:
    """The routing a replay run forces: the workload's source, or the model's own if `live`."""
    if spec.workload.routing.source == RoutingSource.LIVE:
        return live_routing(ckpt, prompts, spec.workload.gen_len)
    return load_routing(spec.model, spec.workload)


def open_store(ckpt: str | Path, spec: RunSpec, device: str | None = None) -> TieredStore:
    # The executor enforces the schedule's GPU capacity; the store's own accounting (units padded
    # to 4 KiB) only guards against runaway growth, so it gets headroom over the hardware's.
    cap = 2 * spec.hardware.memory_bytes[Tier.GPU] + (64 << 20)
    return TieredStore(ckpt, cap, device=device)


def real_execute(
    ckpt: str | Path,
    spec: RunSpec,
    routing_mode: str = "replay",
    routing: Routing | None = None,
    device: str | None = None,
    store: TieredStore | None = None,
) -> tuple[RunResult, RunOutput]:
    """Plan and run `spec` on the checkpoint; the model spec is taken from the checkpoint."""
    if routing_mode not in ROUTING_MODES:
        raise ConfigError(
            f"executor.routing_mode={routing_mode!r}; valid: {', '.join(ROUTING_MODES)}"
        )
    model_spec, _ = load_checkpoint(ckpt)
    spec = replace(spec, model=model_spec, executor="real")
    if routing is None:
        spec = resolve_n_batches(spec)
    prompts = prompts_for(spec.model, spec.workload)
    model = Model.from_checkpoint(ckpt, spec.model)
    own_store = store is None
    store = store or open_store(ckpt, spec, device)
    try:
        ex = Executor(store, model, spec.workload, prompts)
        if routing_mode == "replay":
            routing = routing or replay_routing(ckpt, spec, prompts)
            schedule = _one_process(build_schedule(spec, routing))
            out = ex.run_replay(schedule, routing)
        else:
            # A dry plan with replayed routing tells where placement-resident units sit.
            dry_routing = routing or _shape_routing(spec)
            dry = _one_process(build_schedule(spec, dry_routing))
            resident = resident_units(dry, spec.model.n_experts)
            cost = CostModel(spec.hardware)
            planner = make_planner(spec.planner, spec.params)

            def plan(causal: CausalRouting, builder: ScheduleBuilder) -> None:
                planner.plan(
                    PlanContext(spec.model, spec.hardware, spec.workload, causal, cost), builder
                )
                builder.meta.update(
                    planner=spec.planner, params=dict(spec.params), oracle=causal.peeked
                )

            out = ex.run_live(plan, spec.hardware.memory_bytes, resident)
            validate(out.schedule)
    finally:
        if own_store:
            store.close()
    trace = make_trace(out.schedule, out.start_s, out.end_s, source="real")
    summary = summary_of(spec, out.schedule, trace, f"{routing_mode}: {out.routing.description}")
    return RunResult(out.schedule, trace, summary), out


def _one_process(schedule: Schedule) -> Schedule:
    """The schedule, if this process can run it: tensor-parallel dense work (each GPU every
    sequence on its share of the heads, then an all-reduce) needs one process per GPU."""
    if (schedule.meta.get("ep") or {}).get("dense") == "tensor":
        raise ConfigError(
            "executor=real runs expert-parallel dense work data-parallel only (planner "
            "dense=data); run dense=tensor on one process per GPU: torchrun "
            "--nproc_per_node=G -m experiments.ep_run checkpoint=DIR dense=tensor"
        )
    return schedule


def _shape_routing(spec: RunSpec) -> Routing:
    """Any routing of the model's shape (for the live run's dry plan)."""
    wl = spec.workload
    if wl.routing.source == RoutingSource.LIVE:
        wl = wl.with_(routing=replace(wl.routing, source=RoutingSource.SYNTHETIC))
    return load_routing(spec.model, wl)


def real_run(spec: RunSpec, cfg: DictConfig) -> RunResult:
    """`experiments.run executor=real`: needs `checkpoint=DIR`."""
    ckpt = cfg.get("checkpoint")
    if not ckpt:
        raise ConfigError(
            "executor=real needs checkpoint=DIR (a Hugging Face config.json + *.safetensors; "
            "make one with python -m real.make_checkpoint model=mixtral-tiny out=ckpt/)"
        )
    ex: Any = cfg.executor
    device = ex.get("device") or None
    if device is not None:
        device = str(resolve_device(str(device), "executor.device"))
    result, _ = real_execute(ckpt, spec, str(ex.get("routing_mode", "replay")), device=device)
    return result
