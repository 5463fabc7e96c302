"""Expert-parallel generation on G processes: an EP planner places the experts (homes + replicas)
on the same workload and routing the simulator would see; real/distributed.py runs it.

Every rank plans on its own (planning is deterministic), so only activations cross processes.
Rank 0 writes `outputs.pt` (prompts [B, P], tokens [B, gen_len], logits [B, V]) and `summary.json`
(dense mode; per rank: experts held and computed per layer, pairs computed / sent; wall time).
Without torchrun it runs as a single process (G = 1). routing=replay forces the gates to the
workload's synthetic routing; routing=live runs the model's own gates, placed from the routing a
single-process forward records first. dense=data splits the batch's sequences over the ranks
(batch_size < G leaves some ranks none; they still compute their experts' pairs); dense=tensor
splits heads, FFN columns and vocabulary.
dispatch=balanced splits a replicated expert's pairs over its copies as the simulator's
`split_tokens` does with that setting (the busiest rank holding the fewest), not evenly.
micro_batches=2 runs two-batch overlap (dense=data): each rank splits its sequences in two, and
one micro-batch's all-to-all (posted with async_op) travels while the other's attention and
experts run, in the op order the simulator's planner gives the same setting; the summary's
per-rank a2a_wait_s (gloo) is the all-to-all time compute did not hide.

Usage:
    torchrun --nproc_per_node=2 -m experiments.ep_run checkpoint=DIR planner=ep_static \
        batch_size=2 prompt_len=8 gen_len=3 [routing=replay|live] [replica_slots=N] \
        [dense=data|tensor] [dispatch=even|balanced] [micro_batches=1|2] [out=DIR] \
        [rendezvous_s=120]

rendezvous_s: how long each rank waits for the others to join the process group before it stops
with one line (a process that was never started, a wrong MASTER_PORT).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from core.errors import ConfigError, MoepipeError
from core.routing import Routing, load_routing
from core.spec import HardwareSpec, ModelSpec, RoutingConfig, Workload
from core.types import OpKind, RoutingSource
from experiments.app import command, kv
from experiments.pipeline import RunSpec, atomic_write_json, build_schedule
from experiments.real_run import prompts_for
from planners.expert_parallel import DISPATCH, EPParams
from planners.registry import entry
from real.checkpoint import load_checkpoint
from real.distributed import (
    Placement,
    backend_for,
    check_dense,
    check_micro_batches,
    ep_generate,
)
from real.model import live_routing


@dataclass
class Options:
    checkpoint: str | None = None  # the checkpoint folder every rank reads
    planner: str = "ep_static"  # an expert-parallel planner
    batch_size: int = 2
    prompt_len: int = 8
    gen_len: int = 3
    routing: str = "replay"  # replay | live
    replica_slots: int | None = None  # null: the planner's default
    dense: str = "data"  # data | tensor
    dispatch: str = "even"  # even | balanced
    micro_batches: int = 1  # 2: two-batch overlap
    seed: int = 0
    device: str = ""  # cuda | cpu; empty: cuda if available
    out: str = "runs/ep_run"
    rendezvous_s: int = 120  # seconds a rank waits for the others to join


DEFAULTS: dict[str, Any] = kv(Options())
ROUTINGS = ("replay", "live")


def integer(opts: dict[str, Any], key: str, least: int = 1) -> int:
    try:
        v = int(opts[key])
    except ValueError:
        v = least - 1
    if v < least:
        raise ConfigError(f"{key}={opts[key]!r} must be an integer >= {least}")
    return v


def ep_hardware(n_devices: int, model: ModelSpec, replica_slots: int) -> HardwareSpec:
    """G devices with room for the whole model and every device's replicas (the planner weighs all
    of them against one device's memory): this hardware exists only for planning, which needs G
    and resident experts (placement does not depend on speeds unless a replica cost gate is
    chosen)."""
    room = (2 + n_devices * max(replica_slots, 1)) * model.total_bytes / 1e9 + 1.0
    return HardwareSpec.from_dict(dict(
        name=f"ep-run-{n_devices}", memory_gb=dict(gpu=room, cpu=room, disk=room),
        gpu=dict(tflops=100, mem_bw_gbps=1000), cpu=dict(tflops=1, mem_bw_gbps=100),
        links=dict(h2d=dict(gbps=25), d2h=dict(gbps=25), disk=dict(gbps=2)), n_gpus=n_devices,
    ))  # fmt: skip


def ep_workload(opts: dict[str, Any]) -> Workload:
    return Workload(
        batch_size=integer(opts, "batch_size"), n_batches=1, prompt_len=integer(opts, "prompt_len"),
        gen_len=integer(opts, "gen_len"), routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
        seed=integer(opts, "seed", least=0),
    )  # fmt: skip


def plan_placement(spec: RunSpec, routing: Routing) -> tuple[Placement, dict[str, Any]]:
    """placement[step][moe][rank] from the planner's schedule (meta["ep_slots"], empty slots
    dropped), and its meta["ep"] plus the pairs its expert ops give each device."""
    schedule = build_schedule(spec, routing)
    slots = schedule.meta["ep_slots"]
    n_moe = len(spec.model.moe_layers)
    placement = [
        [[[e for e in row if e >= 0] for row in slots[(step, 0, moe)]] for moe in range(n_moe)]
        for step in range(spec.workload.n_steps)
    ]
    planned = [0] * spec.hardware.n_gpus  # pairs the simulator's expert ops give each device
    for op in schedule.ops:
        if op.kind == OpKind.EXPERT:
            planned[schedule.streams[op.stream].device] += op.tokens
    return placement, dict(schedule.meta["ep"], planned_pairs=planned)


def check_device(device: str, world: int) -> str:
    """The device this rank runs on: `device=` (cpu, cuda or cuda:N; empty: cuda if there is
    one), checked before anything is planned. Under torchrun each rank takes GPU LOCAL_RANK, so
    there must be as many GPUs as processes on the node."""
    if not device:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    head, _, index = device.partition(":")
    if head not in ("cpu", "cuda") or (head == "cpu" and index) or (index and not index.isdigit()):
        raise ConfigError(f"device={device!r}; valid: cpu, cuda, cuda:N")
    if head == "cpu":
        return device
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        raise ConfigError(f"device={device}: no CUDA device here; use device=cpu")
    if "RANK" in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if index or local > n:
            raise ConfigError(
                f"device={device} with {local} processes on this node and {n} GPU(s): torchrun "
                f"ranks take GPU LOCAL_RANK each, so give device=cuda and at most {n} processes "
                "(--nproc_per_node), or device=cpu"
            )
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    if index and int(index) >= n:
        raise ConfigError(f"device={device}: this machine has {n} GPU(s) (cuda:0..cuda:{n - 1})")
    return f"cuda:{index or 0}"


def world_size() -> int:
    """The number of processes torchrun started (1 when not launched by it); one line for an
    environment that sets one of RANK and WORLD_SIZE without the other, which would plan for
    one number of ranks and run on another."""
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if (rank is None) != (world is None):
        have, lack = ("RANK", "WORLD_SIZE") if world is None else ("WORLD_SIZE", "RANK")
        raise ConfigError(
            f"{have} is set but {lack} is not: launch with torchrun (it sets both, with "
            f"MASTER_ADDR and MASTER_PORT), or unset {have} for one process"
        )
    try:
        n = int(world) if world is not None else 1
    except ValueError:
        raise ConfigError(f"WORLD_SIZE={world!r} is not a number of processes") from None
    if n < 1:
        raise ConfigError(f"WORLD_SIZE={n} must be >= 1")
    return n


def init_group(device: str, rendezvous_s: int = 120) -> None:
    """The torchrun group, or a one-process group (an in-memory store: no port) when not
    launched by torchrun. A rank whose peers do not all join within `rendezvous_s` stops with
    one line (torch's default wait is 30 minutes)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    if "RANK" not in os.environ:
        dist.init_process_group(backend_for(device), store=dist.HashStore(), rank=0, world_size=1)
        return
    try:  # the rendezvous alone is bounded: the group's collectives keep torch's own timeout
        store, rank, world = next(rendezvous("env://", timeout=timedelta(seconds=rendezvous_s)))
    except dist.DistError as e:
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise MoepipeError(
            f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: the process group at "
            f"{where} did not form ({str(e).splitlines()[0]}); start every process "
            "(torchrun --nproc_per_node=N starts N) and check MASTER_ADDR/MASTER_PORT"
        ) from None
    store.set_timeout(timedelta(minutes=30))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world)


def shared_live_routing(ckpt: str, prompts: torch.Tensor, gen_len: int) -> Routing:
    """The routing the reference forward chooses, computed on rank 0 and broadcast. A failure on
    rank 0 fails every rank with its line (none waits)."""
    box: list[Any] = [None]
    mine = dist.get_rank() == 0
    error: BaseException | None = None
    if mine:
        try:
            box = [live_routing(ckpt, prompts, gen_len)]
        except Exception as e:  # sent as a line; rank 0 raises the original below
            box, error = [f"routing=live: rank 0 could not run the reference forward: {e}"], e
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if isinstance(box[0], str):
        raise MoepipeError(box[0])
    return box[0]


def run(opts: dict[str, Any]) -> dict[str, Any] | None:
    """Plan and run on this rank; rank 0 writes the outputs and returns the summary."""
    if not opts["checkpoint"]:
        raise ConfigError("checkpoint=DIR is required (python -m real.make_checkpoint ...)")
    if opts["routing"] not in ROUTINGS:
        raise ConfigError(f"routing={opts['routing']!r}; valid: {', '.join(ROUTINGS)}")
    if opts["dispatch"] not in DISPATCH:
        raise ConfigError(f"dispatch={opts['dispatch']!r} unknown; valid: {', '.join(DISPATCH)}")
    if not issubclass(entry(opts["planner"]).params, EPParams):
        raise ConfigError(
            f"planner={opts['planner']} is not expert-parallel; use ep_static, eplb, "
            "predictive_replication or oracle_replication"
        )
    model: ModelSpec = load_checkpoint(opts["checkpoint"])[0]
    workload = ep_workload(opts)
    world = world_size()
    rendezvous_s = integer(opts, "rendezvous_s")
    device = check_device(opts["device"], world)
    out_dir = Path(opts["out"])
    try:  # before the run, not after it
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"out={out_dir}: cannot write there ({e.strerror}); give another out=DIR"
        ) from None
    if world > model.n_experts:
        raise ConfigError(
            f"{world} processes for {model.n_experts} experts: each needs at least one expert; "
            f"run at most {model.n_experts} (--nproc_per_node)"
        )
    dense = opts["dense"]
    check_dense(model, dense, world)
    micro = integer(opts, "micro_batches")
    check_micro_batches(micro, dense, workload.batch_size, world)
    params: dict[str, Any] = dict(n_devices=world, dense=dense, dispatch=opts["dispatch"])
    if micro > 1:  # planned the same way, so the placement and the planned pairs match
        params["micro_batches"] = micro
    if opts["replica_slots"] is not None:
        params["replica_slots"] = integer(opts, "replica_slots", least=0)
    slots = int(params.get("replica_slots", EPParams.replica_slots))
    spec = RunSpec(
        model, ep_hardware(world, model, slots), workload, opts["planner"], params, executor="real"
    )
    prompts = prompts_for(model, workload)
    ckpt = opts["checkpoint"]
    if opts["routing"] == "live":
        # the reference forward loads the whole model: rank 0 runs it and sends the routing (on
        # every rank, G processes on one node held G copies of the model)
        init_group(device, rendezvous_s)
        try:
            routing = shared_live_routing(ckpt, prompts, workload.gen_len)
            forced = None
            placement, ep_meta = plan_placement(spec, routing)
        except BaseException:
            dist.destroy_process_group()
            raise
    else:
        routing = forced = load_routing(model, workload)
        placement, ep_meta = plan_placement(spec, routing)  # bad input fails before any wait
        init_group(device, rendezvous_s)
    try:
        dist.barrier()
        t0 = time.perf_counter()
        out = ep_generate(
            ckpt,
            model,
            prompts,
            workload.gen_len,
            placement,
            forced,
            device,
            dense,
            opts["dispatch"],
            micro,
        )
        dist.barrier()
        wall_s = time.perf_counter() - t0
        if dist.get_rank() != 0:
            return None
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    torch.save(dict(prompts=prompts, tokens=out.tokens, logits=out.logits), out_dir / "outputs.pt")
    summary = dict(
        planner=spec.planner, params=params, ep=ep_meta, model=model.name, checkpoint=str(ckpt),
        world_size=world, backend=backend, device=device, dense=dense, dispatch=opts["dispatch"],
        micro_batches=micro,
        dispatcher="all_to_all_single" if dense == "data" else "all_reduce",
        routing=opts["routing"], batch_size=workload.batch_size, prompt_len=workload.prompt_len,
        gen_len=workload.gen_len, seed=workload.seed, wall_s=wall_s, placement=placement,
        ranks=[asdict(s) for s in out.stats],
    )  # fmt: skip
    atomic_write_json(out_dir / "summary.json", summary)
    return summary


def _main(args: Options) -> int:
    opts = kv(args)
    try:
        summary = run(opts)
    except MoepipeError as e:
        print(f"ep_run: error: {e}", file=sys.stderr)
        return 2
    if summary is not None:
        ranks = summary["ranks"]
        pairs = ", ".join(f"rank {r['rank']} {r['pairs_computed']}" for r in ranks)
        copies = ""
        if any(r["copies_in"] for r in ranks):
            copies = "; expert copies in: " + ", ".join(
                f"rank {r['rank']} {r['copies_in']}"
                + ("" if r["copy_wait_s"] is None else f" (layers waited {r['copy_wait_s']:.4f} s)")
                for r in ranks
            )
        waits = ""
        if ranks[0]["a2a_wait_s"] is not None:
            waits = "; all-to-all waited: " + ", ".join(
                f"rank {r['rank']} {r['a2a_wait_s']:.4f} s" for r in ranks
            )
        print(f"ep_run: {summary['world_size']} x {summary['backend']} in {summary['wall_s']:.2f} s, "
              f"pairs computed: {pairs}{copies}{waits} -> {opts['out']}")  # fmt: skip
    return 0


main = command("ep_run", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(main())
