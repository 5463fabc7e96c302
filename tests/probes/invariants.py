"""What a simulated run's summary must hold whatever its inputs, checked on one run: the
invariants of issue 48's honesty probe (a run the simulator accepts reports numbers that mean
what they say). `run_problems` lists each one broken; an empty list is an honest run.

Usage: `assert not run_problems(spec, result)` with a `pipeline.RunResult` of `spec`.
"""

from __future__ import annotations

import math
from typing import Any

from core.types import Tier
from experiments.common.pipeline import RunResult, RunSpec
from experiments.common.tables import _identity_problem, metric_problem

TOL = 1e-9  # relative rounding allowed where two sums of the same seconds are compared
TIMES = ("makespan_s", "prefill_s", "decode_s", "gpu_bubble_s", "lower_bound_s")


def _at_most(a: float, b: float) -> bool:
    return a <= b + TOL * max(1.0, abs(b)) + 1e-12


def run_problems(spec: RunSpec, result: RunResult) -> list[str]:
    """Each invariant the run's summary.json breaks (empty: an honest run)."""
    s, wl = result.summary, spec.workload
    problems = [f"{p[0]}: {p[1]}" for p in (metric_problem(s), _identity_problem(s)) if p]
    make = s["makespan_s"]
    problems += [f"{k} {s[k]} < 0" for k in TIMES if s[k] < 0]
    busy = {f"busy_s.{k}": v for k, v in s["busy_s"].items()}  # sums of times: to rounding
    problems += [f"{k} {v} > makespan {make}" for k, v in busy.items() if not _at_most(v, make)]
    bounds = {k: s[k] for k in ("lower_bound_s", "dag_lower_bound_s", "gpu_bubble_s")}
    problems += [f"{k} {v} > makespan {make}" for k, v in bounds.items() if v > make]
    if not 0 <= s["gpu_bubble_frac"] <= 1:
        problems.append(f"gpu_bubble_frac {s['gpu_bubble_frac']} outside [0, 1]")
    if s["ops"] > 0:
        problems += [
            f"{k} {s[k]} outside (0, 1]"
            for k in ("efficiency", "dag_efficiency")
            if not 0 < s[k] <= 1
        ]
        if make <= 0:
            problems.append(f"makespan {make} for {s['ops']} ops")
    tokens = wl.batch_size * wl.n_batches * wl.gen_len
    if s["tokens_generated"] != tokens:
        problems.append(f"tokens_generated {s['tokens_generated']} != {tokens}")
    if make > 0 and not math.isclose(s["throughput_tok_s"], tokens / make, rel_tol=1e-9):
        problems.append(f"throughput {s['throughput_tok_s']} != {tokens} / {make}")
    return problems + _memory_problems(spec, result) + _trace_problems(result)


def _memory_problems(spec: RunSpec, result: RunResult) -> list[str]:
    """Peaks within each tier's capacity; weights that cannot all sit on the GPUs moved there."""
    s, sched = result.summary, result.schedule
    problems = [
        f"peak {tier} {peak} > capacity {sched.capacity_bytes[Tier(tier)]}"
        for tier, peak in s["peak_bytes"].items()
        if peak > sched.capacity_bytes[Tier(tier)]
    ]
    on_cpu = (result.trace["kind"].astype(str).str.startswith("compute")) & (
        result.trace["resource"].astype(str) == "cpu"
    )
    gpus = max(1, spec.hardware.n_gpus)
    room = sched.capacity_bytes[Tier.GPU] * gpus
    # the weights the run reads: its dense ones and the experts its tokens were routed to; what
    # of them the GPUs cannot hold reaches them at least once
    m, trace = spec.model, result.trace
    routed = trace[trace["kind"].astype(str) == "compute-expert"][["layer", "expert"]]
    experts = len(m.moe_layers) * m.n_experts * m.expert_bytes
    read = m.total_bytes - experts + len(routed.drop_duplicates()) * m.expert_bytes
    must = read - room
    moved = sum(v for k, v in s["bytes_moved"].items() if k in ("h2d", "disk", "p2p"))
    if must > 0 and not on_cpu.any() and moved < must:
        problems.append(f"{moved} bytes moved to the GPU < {must} that cannot stay there")
    return problems


def _trace_problems(result: RunResult) -> list[str]:
    s, trace = result.summary, result.trace
    problems = []
    if len(trace) != len(result.schedule.ops) or s["ops"] != len(trace):
        problems.append(f"trace rows {len(trace)} != ops {len(result.schedule.ops)}")
    causes = sum(s["gpu_idle_causes_s"].values())
    if not math.isclose(causes, s["gpu_bubble_s"], rel_tol=1e-6, abs_tol=1e-12):
        problems.append(f"idle causes {causes} != gpu_bubble_s {s['gpu_bubble_s']}")
    return problems


def summary_values(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's scalar metrics (for a probe's table)."""
    return {k: v for k, v in summary.items() if isinstance(v, int | float)}


def fraction_problems(summary: dict[str, Any], path: str = "") -> list[str]:
    """Each fraction of the summary (a key naming a fraction, share, ratio or efficiency,
    nested ones too; a count `n_...` is none) outside [0, 1]."""
    problems = []
    for key, value in summary.items():
        at = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict):
            problems += fraction_problems(value, at)
        elif (
            isinstance(value, int | float)
            and not isinstance(value, bool)
            and not str(key).startswith("n_")
            and any(w in str(key) for w in ("frac", "efficiency", "share", "ratio"))
            and not 0 <= value <= 1
        ):
            problems.append(f"{at} {value} outside [0, 1]")
    return problems
