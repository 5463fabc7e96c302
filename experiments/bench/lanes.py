"""Lanes on one GPU: how far G concurrent expert kernels overlap, measured on CUDA streams, against
what the shared-lanes model predicts (`CostModel.cap` and the simulator's processor sharing), for
one model's expert over several token counts. Prints its table (overlap = G x alone / together:
1 = the streams serialise, G = fully side by side; docs/commands.md#bench_lanes); writes no files.

Usage:
    python -m experiments.bench.lanes [model=switch-base-128] [hardware=h200] [lanes=8]
        [rows=[8,64,512,4096]] [device=cuda|cpu] [repeats=50]
On a device without CUDA only the model's figures are printed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from core.args import MAX_REPEATS, MAX_TOKENS, REPEATS_WHY, TOKENS_WHY
from core.cost import CostModel, pool_makespan_s
from core.errors import MoepipeError
from core.hardware import HardwareSpec
from core.spec import Activation, ModelSpec
from core.types import OpKind, Resource
from experiments.common.app import kv, timed_command
from experiments.common.cli import (
    as_int,
    exit_command,
)
from experiments.common.hardware import hardware_spec, read_hardware
from experiments.common.held_warnings import plan_accepted
from planners.expert_parallel import expert_width
from real.checkpoint import reduced_spec, torch_dtype
from real.store import resolve_device


@dataclass
class Options:
    model: str = "switch-base-128"  # conf/model/<name>.yaml
    hardware: str = "h200"  # conf/hardware/<name>.yaml, or a FILE.yaml
    lanes: int = 8
    rows: list[int] = field(default_factory=lambda: [8, 64, 512, 4096])  # tokens per lane
    device: str = ""  # cuda | cpu; empty: cuda if available
    repeats: int = 50


_DEFAULTS: dict[str, Any] = kv(Options())


def modelled_s(model: ModelSpec, hw: HardwareSpec, rows: int, lanes: int) -> float:
    """The pool's time (`pool_makespan_s`, the simulator's semantics) for `lanes` expert ops of
    `rows` tokens each, side by side, without per-op overhead."""
    cost, f, b = CostModel(hw), model.expert_flops(rows), model.expert_bytes
    work = cost.compute_s(Resource.GPU, OpKind.EXPERT, f, b) - cost.overhead_s(
        Resource.GPU, OpKind.EXPERT
    )
    cap = cost.cap(Resource.GPU, f, b, expert_width(model, [rows]))
    return pool_makespan_s([[(0.0, work, cap)]] * lanes)


def expert_kernels(
    model: ModelSpec, rows: int, lanes: int, device: torch.device
) -> list[Callable[[], Any]]:
    """One expert MLP per lane (its own random weights, in the model's dtype) over its own
    `rows` x H input."""
    h, f, dtype = model.hidden_size, model.expert_ffn_size, torch_dtype(model)
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02

    out = []
    for _ in range(lanes):
        x, up, down = w(rows, h), w(f, h), w(h, f)
        if model.activation == Activation.SWIGLU:
            gate = w(f, h)
            out.append(
                lambda x=x, u=up, d=down, gt=gate: F.linear(
                    F.silu(F.linear(x, gt)) * F.linear(x, u), d
                )
            )
        else:
            out.append(lambda x=x, u=up, d=down: F.linear(F.relu(F.linear(x, u)), d))
    return out


def measured_s(kernels: list[Callable[[], Any]], repeats: int) -> tuple[float, str]:
    """GPU seconds per round of `kernels`, each on its own CUDA stream, and how it was run."""
    streams = [torch.cuda.Stream() for _ in kernels]

    def round_() -> None:
        cur = torch.cuda.current_stream()
        for k, s in zip(kernels, streams, strict=True):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                k()
        for s in streams:
            cur.wait_stream(s)

    for _ in range(3):
        round_()
    torch.cuda.synchronize()
    run, how = round_, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            round_()
        run, how = graph.replay, "graph"
    except RuntimeError:
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats, how


def report(opts: dict[str, Any]) -> list[str]:
    """The table (module doc); warnings about the bench held until its options are accepted,
    as a run's until its plan is (`held_warnings`)."""
    # one lane runs alone: its overlap is 1 by definition (validate_lanes' bound)
    lanes = as_int("lanes", opts["lanes"], at_least=2, why="one lane has nothing to overlap with")
    repeats = as_int("repeats", opts["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
    if not str(opts["rows"]):
        raise MoepipeError("rows=[]: name at least one token count per lane, e.g. rows=[8,64]")
    rows = [
        as_int("rows", r, at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
        for r in str(opts["rows"]).split(",")
    ]
    # a conf/model name or a user's FILE.yaml, read as make_checkpoint and bench.real read it
    model = reduced_spec(str(opts["model"]))
    hw = hardware_spec(str(opts["hardware"]), read_hardware(str(opts["hardware"])))
    if lanes > model.n_experts:  # each lane runs an expert of its own (validate_lanes' bound)
        raise MoepipeError(
            f"lanes={lanes}: more than the model's {model.n_experts} experts (each lane runs "
            f"one of them); pass lanes=2 to {model.n_experts}"
        )
    device = resolve_device(str(opts["device"]), "device", empty_ok=True)
    plan_accepted()  # the bench is accepted: what was held, then what comes, said at once
    cuda = device.type == "cuda"
    gpu = hw.gpu
    sm_bw = gpu.sm_mem_bw_bytes_per_s / 1e9 or gpu.mem_bw_bytes_per_s / 1e9 / max(gpu.sms, 1)
    lines = [
        f"{model.name} expert ({model.hidden_size} x {model.expert_ffn_size}, "
        f"{torch_dtype(model)}), {lanes} lanes, "
        f"model: {hw.name} (sms {hw.gpu.sms}, sm_mem_bw "
        f"{sm_bw:.0f} GB/s)" + ("" if cuda else "; no CUDA here: the model's figures only"),
        f"{'rows':>6} {'width':>6} {'cap':>6} {'model_alone_us':>14} {'model_together_us':>17} "
        f"{'model_overlap':>13}"
        + (f" {'alone_us':>9} {'together_us':>11} {'overlap':>7} run" if cuda else ""),
    ]
    cost = CostModel(hw)
    for r in rows:
        width = expert_width(model, [r])
        cap = cost.cap(Resource.GPU, model.expert_flops(r), model.expert_bytes, width)
        alone, together = modelled_s(model, hw, r, 1), modelled_s(model, hw, r, lanes)
        line = (
            f"{r:>6} {width:>6} {cap:>6.3f} {1e6 * alone:>14.2f} {1e6 * together:>17.2f} "
            f"{lanes * alone / together:>13.2f}"
        )
        if cuda:
            one, _ = measured_s(expert_kernels(model, r, 1, device), repeats)
            many, how = measured_s(expert_kernels(model, r, lanes, device), repeats)
            line += f" {1e6 * one:>9.2f} {1e6 * many:>11.2f} {lanes * one / many:>7.2f} {how}"
        lines.append(line)
    return lines


main = timed_command("bench_lanes", Options, report, __doc__)

if __name__ == "__main__":
    exit_command(main)
