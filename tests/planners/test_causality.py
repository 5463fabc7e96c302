"""Planners are causal (DESIGN.md): routing of (step s, MoE layer l) may change only ops that run
after layer l's gate at step s. A metamorphic test: change the experts of one batch's tokens at
one (step, layer) and rebuild; every op of the new schedule that the old one does not have must
happen after that batch's gate (reachable from it through deps or stream order, the two ways an
op waits). On GPU memory that makes experts stream (the contract's tight machine), so prefetch
decisions exist; the expert-parallel planners, which keep experts resident, on `tiny`."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import numpy as np
import pytest

from core.errors import CapacityError
from core.hardware import HardwareSpec
from core.routing import Routing
from core.spec import Workload
from core.types import OpKind
from experiments.common.pipeline import RunSpec, build_schedule
from planners import planner_names
from tests.conftest import RESIDENT, TIGHT_CPU_GB, TIGHT_GPU_GB, conf, random_routing

# Upper bounds that peek ahead on purpose, labelled as such in every output.
ORACLES = {"oracle_replication"}
# expert-parallel planners over 2 compute lanes of one GPU, 1 replica slot each
EP_PARAMS = {"n_devices": 2, "lanes": True, "replica_slots": 1}
MOE, BATCH = 1, 1  # what changes: MoE layer 1, batch 1, at the prefill (most tokens) or step 1
STEPS = (0, 1)


def changed(routing: Routing, wl: Workload, step: int) -> Routing:
    """`routing` with batch BATCH's tokens at (step, MOE) all sent to the experts the others did
    not choose: a new hot set, so a planner that peeks ahead would act on it."""
    ids = routing.expert_ids.copy()
    pos = routing.step_slice(step, wl)
    seqs = slice(BATCH * wl.batch_size, (BATCH + 1) * wl.batch_size)
    counts = np.bincount(ids[:, pos, MOE].ravel(), minlength=routing.n_experts)
    ids[seqs, pos, MOE] = np.argsort(counts, kind="stable")[: routing.top_k]
    return replace(routing, expert_ids=ids, description="one batch's routing changed")


def after(schedule, start: int) -> set[int]:
    """Ops that wait, directly or through others, for op `start` (deps and stream order)."""
    succ: dict[int, list[int]] = defaultdict(list)
    last: dict[str, int] = {}
    for op in schedule.ops:
        for d in op.deps:
            succ[d].append(op.id)
        if op.stream in last:
            succ[last[op.stream]].append(op.id)
        last[op.stream] = op.id
    seen, todo = {start}, [start]
    while todo:
        for nxt in succ[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("name", [p for p in planner_names() if p not in ORACLES])
def test_routing_changes_only_ops_after_its_gate(name, step, tiny_model, tiny_hw):
    wl = Workload(batch_size=2, n_batches=2, prompt_len=4, gen_len=3)
    base = random_routing(tiny_model, wl)
    params = EP_PARAMS if name in RESIDENT else {}
    one, two = peek_check_pair(name, params, tiny_model, tiny_hw, wl, base, step)
    assert not two.meta.get("oracle")
    early = early_ops(one, two, tiny_model, step)
    assert not early, f"ops decided from routing not yet seen: {early[:5]}"


def test_task_mix_reads_the_batchs_labels_not_its_routing(tiny_model, tiny_hw, tmp_path):
    """`task_mix` plans a batch from its request labels, known before its gates: with labels on
    the routing (the same in both runs), a changed routing still moves only ops after its gate."""
    wl = Workload(batch_size=2, n_batches=2, prompt_len=4, gen_len=3)
    rng = np.random.default_rng(1)
    base = random_routing(tiny_model, wl)
    base = replace(
        base,
        labels=rng.integers(0, 2, base.expert_ids.shape[:2]).astype(np.int16),
        label_names=("a", "b"),
    )
    shape = (2, len(tiny_model.moe_layers), tiny_model.n_experts)
    np.save(tmp_path / "task_load.npy", rng.random(shape) ** 4 * 100)  # skewed per label
    params = {**EP_PARAMS, "predictor": "task_mix", "task_load": str(tmp_path / "task_load.npy")}
    for step in STEPS:
        one, two = peek_check_pair(
            "predictive_replication", params, tiny_model, tiny_hw, wl, base, step
        )
        early = early_ops(one, two, tiny_model, step)
        assert not early, f"ops decided from routing not yet seen: {early[:5]}"


@pytest.mark.parametrize(
    "name, params", [("klotski", {"predictor": "oracle"}), ("oracle_replication", EP_PARAMS)]
)
def test_an_oracle_is_caught_peeking(name, params, tiny_model, tiny_hw):
    """The check above can fail: upper bounds that read the coming routing are caught."""
    wl = Workload(batch_size=2, n_batches=2, prompt_len=4, gen_len=3)
    base = random_routing(tiny_model, wl)
    pairs = [peek_check_pair(name, params, tiny_model, tiny_hw, wl, base, s) for s in STEPS]
    assert any(
        early_ops(one, two, tiny_model, s) for (one, two), s in zip(pairs, STEPS, strict=True)
    )


def peek_check_pair(name, params, model, tiny_hw, wl, base, step):
    """The schedules of `base` and of `changed(base, wl, step)`, on the tight machine where the
    planner runs there, else on `tiny`."""
    d = conf("hardware", "tiny")
    for gpu_gb in (*TIGHT_GPU_GB, None):
        hw = tiny_hw
        if gpu_gb is not None:
            d["memory_gb"] = {"gpu": gpu_gb, "cpu": TIGHT_CPU_GB, "disk": 100.0}
            hw = HardwareSpec.from_dict(d)
        try:
            one = build_schedule(RunSpec(model, hw, wl, name, params), base)
        except CapacityError:
            continue
        return one, build_schedule(RunSpec(model, hw, wl, name, params), changed(base, wl, step))
    raise AssertionError("unreachable: tiny holds every planner")


def early_ops(one, two, model, step) -> list[str]:
    """Labels of the ops of `two` not in `one` that do not wait for the changed batch's gate."""
    layer = model.moe_layers[MOE]
    gates = [
        op.id
        for op in two.ops
        if op.kind == OpKind.GATE
        and (op.step, op.layer) == (step, layer)
        and op.batch in (BATCH, -1)
    ]
    assert gates, "no gate op for the changed token"
    waits = set().union(*(after(two, g) for g in gates))
    kept = Counter(op._replace(id=0, deps=()) for op in one.ops)
    new = []
    for op in two.ops:
        key = op._replace(id=0, deps=())
        if kept[key]:
            kept[key] -= 1
        else:
            new.append(op)
    assert new, "the change moved nothing: the test would check nothing"
    return [op.label() for op in new if op.id not in waits]
