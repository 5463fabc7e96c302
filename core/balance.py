"""Expert-parallel balance metrics, computed from a trace: per (step, layer, batch) and device,
the tokens and busy seconds of its expert computes, summed into balancedness (tokens, mean/max),
utilisation (busy / makespan), gpu_load (GPUtil's load) and expert_phase_util (how evenly the
expert phases end). Definitions, and how lanes count: docs/replication-model.md#the-metrics-defined.

Usage:
    m = balance_metrics(trace, n_devices=8)   # -> summary.json fields
    phases(trace, n_devices=8)                 # -> balance.csv: one row per (step, layer, batch)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from core.lazy import lazy_module
from core.schedule import Schedule
from core.types import COLLECTIVES, COPY_LINKS, OpKind, Resource, Stream, Tensor

if TYPE_CHECKING:
    import pandas as pd
else:
    pd = lazy_module("pandas")

KEYS = ["step", "layer", "batch"]


def device_of(resource: pd.Series) -> np.ndarray:
    """'gpu' -> 0, 'gpu:3' -> 3."""
    if resource.empty:
        return np.zeros(0, np.int64)
    parts = resource.astype(str).str.partition(":")[2]
    return np.where(parts == "", 0, parts).astype(np.int64)


def covered_s(start: np.ndarray, end: np.ndarray) -> float:
    """Seconds covered by the union of intervals [start, end)."""
    total, reach = 0.0, -np.inf
    for a, b in sorted(zip(start.tolist(), end.tolist(), strict=True)):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def busy_of(trace: pd.DataFrame, n_devices: int) -> np.ndarray:
    """Each op's busy seconds on its device: end - start, or where it shared the GPU's SMs
    (`sm_s`) the whole-GPU seconds its work used times `n_devices` (the lanes it stands for)."""
    wall = (trace["end_s"] - trace["start_s"]).to_numpy()
    if "sm_s" not in trace:
        return wall
    sm = trace["sm_s"].to_numpy()
    return np.where(np.isnan(sm), wall, sm * n_devices)


def device_loads(trace: pd.DataFrame, n_devices: int) -> pd.DataFrame:
    """One row per (step, layer, batch, device): expert `tokens` and `busy_s`, plus the phase's
    `span_s`: first start to last end of its expert ops on any device, summed over the batch's
    micro-batches where it ran as several (two-batch overlap: each is dispatched, computed and
    combined on its own, and the time between them is another micro-batch's, not the phase's)."""
    ex = trace[
        (trace["kind"].astype(str) == str(OpKind.EXPERT))
        & trace["resource"].astype(str).str.startswith(str(Resource.GPU))
    ]
    ex = ex.assign(device=device_of(ex["resource"]), busy_s=busy_of(ex, n_devices))
    per = ex.groupby([*KEYS, "device"], observed=True)[["tokens", "busy_s"]].sum()
    micro = ex["micro"] if "micro" in ex else pd.Series(-1, index=ex.index)
    ends = ex.assign(micro=micro).groupby([*KEYS, "micro"], observed=True)
    phases = (ends["end_s"].max() - ends["start_s"].min()).groupby(KEYS).sum().rename("span_s")
    full = pd.MultiIndex.from_tuples(
        [(*k, d) for k in phases.index for d in range(n_devices)], names=[*KEYS, "device"]
    )  # devices with no expert op in a phase count as idle with zero tokens
    per = per.reindex(full, fill_value=0).reset_index()
    return per.merge(phases.reset_index(), on=KEYS)


def copy_waits(schedule: Schedule, trace: pd.DataFrame, n_devices: int) -> dict[str, Any]:
    """Whether replica copies arrived before the experts needed them (the prefetch the
    replication planners rely on): an expert op depending on an expert-weight LOAD (a replica
    copy) waited for it by the time that copy ended after everything else the op waited for
    (its other deps and the op before it on its stream). `copy_wait_s`: the most any device's
    expert ops waited so, summed over the run; `late_copy_ops`: expert ops that waited at all.
    Ops missing from the trace are skipped."""
    ops = schedule.ops
    end = np.full(len(ops), np.nan)
    ids = trace["op_id"].to_numpy()
    end[ids] = trace["end_s"].to_numpy()
    is_copy = np.array([o.kind == OpKind.LOAD and o.tensor == Tensor.EXPERT for o in ops])
    if not is_copy.any():
        return {}
    waited = np.zeros(n_devices)
    late, prev = 0, dict[str, float]()  # stream -> end of its last op
    for o in ops:
        if o.kind == OpKind.EXPERT and not np.isnan(end[o.id]):
            copies = [d for d in o.deps if is_copy[d]]
            if copies:
                other = [end[d] for d in o.deps if not is_copy[d]]
                ready = np.nanmax([*other, prev.get(o.stream, 0.0)])
                w = float(np.nanmax(end[copies])) - float(ready)
                if w > 1e-12:
                    waited[schedule.streams[o.stream].device % n_devices] += w
                    late += 1
        if not np.isnan(end[o.id]):
            prev[o.stream] = end[o.id]
    return {"copy_wait_s": float(waited.max()), "late_copy_ops": late}


def phases(trace: pd.DataFrame, n_devices: int) -> pd.DataFrame:
    """One row per (step, layer, batch) expert phase: each device's tokens (`tokens_<d>`),
    `max_tokens`, `mean_tokens`, `balancedness` (mean / max), the phase's `span_s` (first expert
    start to last end, any device; of each micro-batch, summed) and `phase_util` (expert busy
    seconds / (G x span)): the per layer and batch view of the summary's metrics (a run directory's
    balance.csv)."""
    loads = device_loads(trace, n_devices)
    if loads.empty:
        return pd.DataFrame()
    tok = loads.pivot_table(index=KEYS, columns="device", values="tokens", aggfunc="sum")
    tok.columns = [f"tokens_{d}" for d in tok.columns]
    g = loads.groupby(KEYS, observed=True)
    out = tok.assign(max_tokens=g["tokens"].max(), mean_tokens=g["tokens"].mean())
    out["balancedness"] = (
        out["mean_tokens"] / out["max_tokens"].where(out["max_tokens"] > 0)
    ).fillna(1.0)
    out["span_s"] = g["span_s"].first()
    busy = g["busy_s"].sum()
    out["phase_util"] = (busy / (n_devices * out["span_s"].where(out["span_s"] > 0))).fillna(0.0)
    return out.reset_index()


def balance_metrics(
    trace: pd.DataFrame, n_devices: int, lanes: bool = False, copy_kernels: bool = False
) -> dict[str, Any]:
    """The run's balance and utilisation metrics (the module's list). `copy_kernels`: replica
    copies between GPUs run as kernels (NCCL's p2p: the hardware's `gpu.copy_sms`), so
    `gpu_load` counts them as it counts the all-to-all's."""
    loads = device_loads(trace, n_devices)
    if loads.empty:
        return {}
    g = loads.groupby(KEYS, observed=True)
    tok_mean, tok_max = g["tokens"].mean(), g["tokens"].max()
    busy = g["busy_s"].sum()
    span = g["span_s"].first()
    by_layer = (
        pd.DataFrame({"mean": tok_mean, "max": tok_max, "busy": busy, "span": span})
        .groupby("layer")
        .sum()
    )
    makespan = float(trace["end_s"].max())
    comp = trace[trace["resource"].astype(str).str.startswith(str(Resource.GPU))]
    start, end = comp["start_s"].to_numpy(), comp["end_s"].to_numpy()
    dur, dev = busy_of(comp, n_devices), device_of(comp["resource"])
    # on lanes a whole-GPU op (stream `compute`) is busy time of every lane
    whole = np.zeros(len(comp), bool)
    if lanes:
        whole = (comp["stream"].astype(str) == str(Stream.COMPUTE)).to_numpy()
        dur = np.where(whole, busy_of(comp, 1), dur)  # counted once per lane below
    dev_busy = np.bincount(dev[~whole], dur[~whole], minlength=n_devices)[:n_devices]
    dev_busy = dev_busy + dur[whole].sum()
    gpu = np.zeros(len(comp), np.int64) if lanes else dev  # lanes: one GPU
    if "launch_s" in comp:  # a pool op's kernel runs after its launch
        start = start + np.nan_to_num(comp["launch_s"].to_numpy(), nan=0.0)
    kernel = trace["kind"].astype(str).isin([str(k) for k in COLLECTIVES])
    if copy_kernels and not lanes:
        kernel |= (
            (trace["kind"].astype(str) == str(OpKind.LOAD))
            & (trace["tensor"].astype(str) == str(Tensor.EXPERT))
            & trace["resource"].astype(str).str.partition(":")[0].isin([str(r) for r in COPY_LINKS])
        )
    coll = trace[kernel]
    start, end = np.r_[start, coll["start_s"].to_numpy()], np.r_[end, coll["end_s"].to_numpy()]
    gpu = np.r_[gpu, device_of(coll["resource"])]
    spans = [covered_s(start[gpu == d], end[gpu == d]) for d in range(1 if lanes else n_devices)]
    return {
        "n_devices": n_devices,
        "balancedness": float(tok_mean.sum() / tok_max.sum()) if tok_max.sum() else 1.0,
        "utilisation": float(dev_busy.sum() / (n_devices * makespan)) if makespan > 0 else 0.0,
        "gpu_load": float(np.mean(spans) / makespan) if makespan > 0 else 0.0,
        "expert_phase_util": float(busy.sum() / (n_devices * span.sum()))
        if span.sum() > 0
        else 0.0,
        "max_over_mean_load": float((tok_max / tok_mean.where(tok_mean > 0)).mean()),
        "expert_phase_s": float(span.sum()),
        "balancedness_per_layer": {
            int(k): round(float(r["mean"] / r["max"]), 4)
            for k, r in by_layer.iterrows()
            if r["max"]
        },
        "expert_phase_util_per_layer": {
            int(k): round(float(r["busy"] / (n_devices * r["span"])), 4)
            for k, r in by_layer.iterrows()
            if r["span"] > 0
        },
        "device_busy_frac": [
            round(float(busy_d) / makespan, 4) if makespan else 0.0 for busy_d in dev_busy
        ],
    }
