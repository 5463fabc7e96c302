"""validate's rules about batches: which ops may cover several batches (`Op.batches`), that
every expert compute depends on the gate op(s) of the batches it serves (planners are causal),
and that the schedule computes every batch's tokens (`check_work`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from core.errors import ScheduleBug
from core.schedule import _ANY, Op, Schedule
from core.spec import ModelSpec, Workload
from core.types import OpKind


def check_spans(ops: list[Op], cols: dict[str, np.ndarray]) -> None:
    """An op covers at least one batch; only an attention or a gate of one batch (not an expert
    op over all of them, nor a micro-batch's) may cover several consecutive ones."""
    spans = cols["batches"]
    kinds = list(OpKind)
    bad = spans < 1
    bad |= (spans > 1) & (
        (
            (cols["kind"] != kinds.index(OpKind.ATTENTION))
            & (cols["kind"] != kinds.index(OpKind.GATE))
        )
        | (cols["batch"] < 0)
        | (cols["micro"] != _ANY)
    )
    if bad.any():
        op = ops[int(np.argmax(bad))]
        raise ScheduleBug(
            f"{op.label()}: covers {op.batches} batches; an op covers >= 1, and only an "
            "attention or a gate over whole batches (batch >= 0, no micro-batch) covers several"
        )


def check_gates(schedule: Schedule, cols: dict[str, np.ndarray], owner: np.ndarray) -> None:
    """Every expert compute depends on the gate op(s) of the batches it serves (planners are
    causal); raise naming the first that does not.

    Where its batch's layer has one gate, over the whole batch, that is checked for all such
    ops at once; any other op (a micro-batch's, one over every batch, a batch gated in shares)
    goes through `_gate_problem`, as does every op the fast check flags, for its message."""
    ops = schedule.ops
    n = len(ops)
    kinds = list(OpKind)
    gate_ids = np.flatnonzero(cols["kind"] == kinds.index(OpKind.GATE))
    experts = np.flatnonzero(cols["kind"] == kinds.index(OpKind.EXPERT))
    if not len(experts):
        return
    step, layer, batch = (cols[c].astype(np.int64) for c in ("step", "layer", "batch"))
    # each gate op once per batch it covers (a gate over k batches stands for each of them)
    span = cols["batches"][gate_ids].astype(np.int64)
    g_rep = np.repeat(gate_ids, span)
    g_batch = batch[g_rep] + np.arange(len(g_rep)) - np.repeat(np.cumsum(span) - span, span)
    width = max(int(batch.max(initial=0)), int(g_batch.max(initial=0))) + 2
    sl = step * (int(layer.max(initial=0)) + 2) + layer + 1  # one number per (step, layer)
    key = sl * width + batch + 1  # one number per (step, layer, batch)
    gk = sl[g_rep] * width + g_batch + 1
    uniq, at, count = np.unique(gk, return_index=True, return_counts=True)
    single = (count == 1) & (cols["micro"][g_rep[at]] == _ANY)
    pos = np.searchsorted(uniq, key[experts]).clip(max=max(len(uniq) - 1, 0))
    fast = (cols["batch"][experts] != _ANY) & (len(uniq) > 0)
    if len(uniq):
        fast &= (uniq[pos] == key[experts]) & single[pos]
    need = np.full(n, -2)
    need[experts[fast]] = g_rep[at[pos[fast]]]
    has = np.zeros(n, bool)
    has[owner[cols["dep_idx"] == need[owner]]] = True
    # an op over every batch (micro -1) needs every gate of its layer: count the distinct ones
    # among its deps
    every = (cols["batch"][experts] == _ANY) & (cols["micro"][experts] == _ANY)
    if every.any():
        wanted = np.zeros(n, bool)
        wanted[experts[every]] = True
        is_gate = np.zeros(n, bool)
        is_gate[gate_ids] = True
        deps = cols["dep_idx"]
        e = np.flatnonzero(wanted[owner] & is_gate[deps])
        e = e[sl[deps[e]] == sl[owner[e]]]
        pairs = np.sort(owner[e] * n + deps[e])
        pairs = pairs[np.r_[True, pairs[1:] != pairs[:-1]]] if len(pairs) else pairs
        got = np.bincount(pairs // n, minlength=n)
        su, sc = np.unique(sl[gate_ids], return_counts=True)
        mine = sl[experts[every]]
        p = np.searchsorted(su, mine).clip(max=max(len(su) - 1, 0))
        n_gates = np.where(len(su) and (su[p] == mine), sc[p] if len(su) else 0, 0)
        has[experts[every]] = (n_gates > 0) & (got[experts[every]] == n_gates)
        fast |= every
    # np.union1d of the two: `experts` is sorted and unique (np.unique would import numpy.ma)
    check = experts[(fast & ~has[experts]) | ~fast]
    if not len(check):  # every expert op passed the checks above
        return
    gates = _gates_of(ops, gate_ids)
    for i in check.tolist():
        problem = _gate_problem(ops[i], gates)
        if problem:
            raise ScheduleBug(problem)


def _gates_of(
    ops: list[Op], gate_ids: np.ndarray
) -> dict[tuple[int, int], dict[int, list[tuple[int, int]]]]:
    """(step, layer) -> batch -> its gates (one, or one per device gating a share of the
    batch), each as (its micro-batch (-1: the whole batch), its id)."""
    gates: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
    for i in gate_ids.tolist():
        op = ops[i]
        for b in range(op.batch, op.batch + op.batches):  # a gate over a span: each batch's
            gates.setdefault((op.step, op.layer), {}).setdefault(b, []).append((op.micro, op.id))
    return gates


def _gate_problem(
    op: Op, gates: Mapping[tuple[int, int], Mapping[int, list[tuple[int, int]]]]
) -> str:
    """The expert op's missing gate deps (see `check_gates`), or ""."""
    layer_gates = gates.get((op.step, op.layer), {})
    mine = (
        [g for batch in layer_gates.values() for g in batch]
        if op.batch == _ANY
        else layer_gates.get(op.batch, [(_ANY, -1)])
    )
    # a micro-batch's experts need its own gates (and any over the whole batch); an op over
    # the whole batch needs every gate of it
    need = [g for micro, g in mine if op.micro == _ANY or micro in (_ANY, op.micro)]
    missing = [g for g in need if g not in op.deps]
    if not need or missing:
        return (
            f"{op.label()}: an expert compute must depend on the gate op(s) of the batches "
            f"it serves (planners are causal); missing {missing or 'gate'}"
        )
    return ""


def check_work(schedule: Schedule, model: ModelSpec, workload: Workload) -> None:
    """The schedule computes the whole run: every token's attention at every layer, its top-k
    experts at every MoE layer, and each step's head over every sequence. A planner that leaves
    work out (a batch, a layer, every op: an empty plan) would otherwise report a makespan and
    a throughput for tokens it never computed; raise naming the first kind short of its total
    (a kind may count more: G tensor-parallel GPUs each compute every token's attention)."""
    cols = schedule.columns()
    kinds = list(OpKind)
    positions = workload.n_sequences * workload.seq_positions  # tokens through each layer
    need = {
        OpKind.ATTENTION: positions * model.n_layers,
        OpKind.EXPERT: positions * len(model.moe_layers) * model.top_k,
        OpKind.HEAD: workload.n_sequences * workload.n_steps,
    }
    for kind, total in need.items():
        done = int(cols["tokens"][cols["kind"] == kinds.index(kind)].sum())
        if done < total:  # more where G tensor-parallel GPUs each compute every token
            raise ScheduleBug(
                f"planner {schedule.meta.get('planner', '')}: its schedule computes {done} of "
                f"the {total} {kind.removeprefix('compute-')} tokens of the run; plan every "
                "step, batch and layer of ctx.workload and ctx.model"
            )
