"""Two-batch overlap (`micro_batches`): each GPU splits its share of a batch into micro-batches,
each gated, dispatched, computed and combined on its own, so one's all-to-all runs beside
another's compute. Checked on the schedule's structure, the simulated overlap, the validator's
causal rule per micro-batch, the metrics and the experiment's utilisation lines."""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from core.balance import balance_metrics, phases
from core.errors import ConfigError, ScheduleError
from core.hardware import ComputeSpec, LinkSpec
from core.routing import load_routing
from core.schedule import Schedule, validate
from core.types import OpKind, Resource
from experiments.common.ep_rows import utilisation_lines
from experiments.common.pipeline import RunSpec, simulate_run
from planners.expert_parallel import ExpertTime
from tests.planners.ep_common import _MaxCost, tiny_spec


def spec(planner: str = "ep_static", batch_size: int = 6, **params) -> RunSpec:
    s = tiny_spec(planner, **params)
    return replace(s, workload=replace(s.workload, batch_size=batch_size))


def gates_of(ops, micro: int, step: int, layer: int, batch: int) -> set[int]:
    return {
        o.id
        for o in ops
        if o.kind == OpKind.GATE
        and (o.step, o.layer, o.batch, o.micro) == (step, layer, batch, micro)
    }


@pytest.mark.parametrize(
    "planner, dense",
    [("ep_static", "data"), ("predictive_replication", "data"), ("eplb", "tensor")],
)
def test_each_micro_batch_waits_for_its_own_gates_only(planner, dense):
    """Batch 6 on 2 GPUs as 2 micro-batches: every expert op and every dispatch of micro-batch
    i depends on each gate op of micro-batch i (one per GPU) and on none of the other's, so its
    tokens move before the other is gated; the two share one placement per layer."""
    s = spec(planner, micro_batches=2, replica_slots=1, dense=dense)
    res = simulate_run(s)
    ops = res.schedule.ops
    moved = [o for o in ops if o.kind in (OpKind.EXPERT, OpKind.DISPATCH)]
    assert {o.micro for o in moved} == {0, 1}
    for o in moved:
        own = gates_of(ops, o.micro, o.step, o.layer, o.batch)
        other = gates_of(ops, 1 - o.micro, o.step, o.layer, o.batch)
        assert len(own) == 2 and own <= set(o.deps), o.label()
        assert not other & set(o.deps), o.label()
    assert res.summary["plan"]["ep"]["micro_batches"] == 2
    wl = s.workload  # one placement per (step, batch, MoE layer)
    assert len(res.schedule.ep.placements) == wl.n_steps * wl.n_batches * len(s.model.moe_layers)


def test_micro_batches_keep_each_sequence_on_its_gpu():
    """Each GPU splits its own share: the all-to-all moves the same pairs, and every device
    computes the same tokens per layer and batch, as the whole batch at once (ep_static: no
    replica, so no split between copies can differ). Batch 5 over 2 GPUs: shares 3 and 2,
    micro-batches of 2 + 1 and 1 + 1 sequences."""
    whole = simulate_run(spec(batch_size=5))
    micro = simulate_run(spec(batch_size=5, micro_batches=2))
    assert micro.summary["plan"]["ep"]["pairs_sent"] == whole.summary["plan"]["ep"]["pairs_sent"]

    def tokens(res) -> pd.Series:
        t = res.trace[res.trace["kind"].astype(str) == str(OpKind.EXPERT)]
        return t.groupby(["step", "layer", "batch", "resource"], observed=True)["tokens"].sum()

    pd.testing.assert_series_equal(tokens(micro), tokens(whole))
    attn = [
        o
        for o in micro.schedule.ops
        if o.kind == OpKind.ATTENTION and o.step == 0 and o.layer == 0 and o.batch == 0
    ]
    per = spec().workload.step_tokens(0)
    assert [(o.micro, o.stream, o.tokens // per) for o in attn] == [
        (0, "compute", 2),
        (0, "compute1", 1),
        (1, "compute", 1),
        (1, "compute1", 1),
    ]
    assert micro.summary["balancedness"] == pytest.approx(whole.summary["balancedness"])


def test_overlap_hides_the_all_to_all_behind_the_other_micro_batch():
    """With a slow device link the all-to-all dominates a layer: as two micro-batches, one's
    dispatch runs while the other computes, and the run is shorter. In the trace some dispatch
    of micro-batch 0 overlaps a compute op of micro-batch 1 on the same GPU."""
    s = spec(batch_size=8, n_devices=4)
    slow = {
        **s.hardware.links,
        Resource.P2P: LinkSpec(0.05, 0.0),
        Resource.P2P_OUT: LinkSpec(0.05, 0.0),
    }
    s = replace(s, hardware=replace(s.hardware, links=slow))
    whole = simulate_run(s)
    micro = simulate_run(replace(s, params={**s.params, "micro_batches": 2}))
    assert micro.summary["makespan_s"] < 0.9 * whole.summary["makespan_s"]
    tr = micro.trace.assign(micro=[o.micro for o in micro.schedule.ops])
    disp = tr[(tr["kind"].astype(str) == str(OpKind.DISPATCH)) & (tr["micro"] == 0)]
    comp = tr[tr["resource"].astype(str).str.startswith("gpu") & (tr["micro"] == 1)]
    overlap = [
        (d.start_s < c.end_s) and (c.start_s < d.end_s)
        for d in disp.itertuples()
        for c in comp.itertuples()
        if (d.step, d.layer, d.batch) == (c.step, c.layer, c.batch)
    ]
    assert any(overlap)


def test_validate_names_a_micro_batch_that_skips_its_own_gate():
    """An expert op of micro-batch 0 that waits for micro-batch 1's gates instead of its own
    would run on routing nobody has seen at its start: the validator names the missing gate."""
    res = simulate_run(spec(micro_batches=2))
    ops = list(res.schedule.ops)
    ex = next(o for o in ops if o.kind == OpKind.EXPERT and o.micro == 0)
    own = gates_of(ops, 0, ex.step, ex.layer, ex.batch)
    other = gates_of(ops, 1, ex.step, ex.layer, ex.batch)
    deps = tuple(d for d in ex.deps if d not in own) + tuple(g for g in other if g < ex.id)
    ops[ex.id] = ex._replace(deps=deps)
    sched = Schedule(
        ops,
        res.schedule.streams,
        res.schedule.capacity_bytes,
        res.schedule.resident_bytes,
        res.schedule.meta,
    )
    with pytest.raises(ScheduleError, match=r"micro=0 .*must depend on the gate op\(s\).*missing"):
        validate(sched)
    validate(res.schedule)


@pytest.mark.parametrize(
    "params, batch_size, match",
    [
        ({"lanes": True}, 6, r"micro_batches=2 .*lanes=true .*use micro_batches=1"),
        (
            {"dense": "tensor"},
            1,
            r"micro_batches=2 splits a batch's sequences \(dense=tensor: every GPU holds all of "
            r"them\), but workload.batch_size=1 has fewer",
        ),
        (
            {},
            2,
            r"micro_batches=2 splits each GPU's share .*batch_size=2 over n_devices=2 "
            r"gives a GPU at most 1",
        ),
    ],
)
def test_micro_batches_where_no_token_moves_or_too_few_sequences(params, batch_size, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(spec(batch_size=batch_size, micro_batches=2, **params))


def test_tensor_parallel_micro_batches_all_reduce_beside_the_other_ones_compute():
    """dense=tensor on 2 GPUs, batch 2 (one sequence per micro-batch), one step, tiny's 2 MoE
    layers, no replica, one grouped expert op per GPU; every compute op takes 1 ms (overhead
    only) and every all-reduce round 1 ms (link latency only). Per GPU, whole batch, a layer is
    attention 1 + its all-reduce 2 + gate 1 + experts 1 + the MoE all-reduce 2 = 7 ms; two
    layers, the head 1 and its gather 1: 16 ms. As 2 micro-batches (compute order A0 A1 | G0
    E0 | G1 E1 per layer, every all-reduce on its GPU's link in program order):
      layer 0: A0 0-1, A1 1-2; AR(A0) 1-3, AR(A1) 3-5; G0 E0 3-5; AR(moe0) 5-7 beside G1 E1 5-7;
               AR(moe1) 7-9
      layer 1: A0 7-8, A1 9-10; AR(A0) 9-11, AR(A1) 11-13; G0 E0 11-13; AR(moe0) 13-15 beside
               G1 E1 13-15; AR(moe1) 15-17
      heads: H0 15-16, H1 17-18; gathers 17-18, 18-19: 19 ms, where the same ops one after
    another take 14 (compute) + 18 (rounds) = 32 ms. Per-op costs do not shrink with the
    tokens here, so the overlap only wins back part of the doubled ops."""
    s = spec("ep_static", batch_size=2, dense="tensor", replica_slots=0, grouped_gemm=True)
    fast = 1e30  # flop/s, B/s: the roofline's terms vanish, the fixed costs remain
    hw = replace(
        s.hardware,
        gpu=ComputeSpec(fast, fast, 1e-3),
        links={**s.hardware.links, Resource.P2P: LinkSpec(fast, 1e-3)},
    )
    s = replace(s, hardware=hw, workload=replace(s.workload, n_batches=1, gen_len=1))
    whole = simulate_run(s)
    assert whole.summary["makespan_s"] == pytest.approx(0.016)
    micro = simulate_run(replace(s, params={**s.params, "micro_batches": 2}))
    validate(micro.schedule)
    assert micro.summary["makespan_s"] == pytest.approx(0.019)
    tr = micro.trace.assign(micro=[o.micro for o in micro.schedule.ops]).sort_values("op_id")

    def ms(res: str) -> list[tuple[float, float]]:  # GPU 0's compute, or its link
        t = tr[tr["resource"].astype(str) == res]
        return [
            (round(a * 1e3, 6), round(b * 1e3, 6)) for a, b in zip(t.start_s, t.end_s, strict=True)
        ]

    layer = [(3, 4), (4, 5), (5, 6), (6, 7)]  # G0 E0 G1 E1 of layer 0; layer 1's 8 ms later
    assert ms("gpu") == [(0, 1), (1, 2), *layer, (7, 8), (9, 10)] + [
        (a + 8, b + 8) for a, b in layer
    ] + [(15, 16), (17, 18)]
    assert ms("p2p") == [(t, t + 1) for t in range(1, 19)]  # the link never waits
    gpu, link = tr[tr["resource"].astype(str) == "gpu"], tr[tr["resource"].astype(str) == "p2p"]
    beside = [  # a round of one micro-batch while the other one computes
        (r.micro, c.micro)
        for r in link.itertuples()
        for c in gpu.itertuples()
        if r.start_s < c.end_s - 1e-9 and c.start_s < r.end_s - 1e-9
    ]
    assert {(0, 1), (1, 0)} <= set(beside)


def test_micro_batches_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match=r"micro_batches=0: must be a positive integer"):
        simulate_run(spec(micro_batches=0))


def test_an_expert_phase_of_micro_batches_spans_each_of_them():
    """One layer on 2 devices as 2 micro-batches: micro-batch 0's experts run in [0, 2] s,
    micro-batch 1's in [5, 6] s (between them, the other micro-batch's dense work). The phase
    spans 2 + 1 s, not 6; tokens add up per device as one batch's."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 4,
            "resource": ["gpu", "gpu:1"] * 2,
            "step": [0] * 4,
            "layer": [1] * 4,
            "batch": [0] * 4,
            "micro": [0, 0, 1, 1],
            "tokens": [10, 6, 4, 4],
            "start_s": [0.0, 0.0, 5.0, 5.0],
            "end_s": [2.0, 1.0, 6.0, 5.5],
        }
    )
    t = phases(trace, 2)
    assert t["span_s"].tolist() == pytest.approx([3.0])
    assert t[["tokens_0", "tokens_1"]].values.tolist() == [[14, 10]]
    m = balance_metrics(trace, 2)
    assert m["expert_phase_util"] == pytest.approx((2 + 1 + 1 + 0.5) / (2 * 3))
    assert m["balancedness"] == pytest.approx(12 / 14)
    # a trace without the column (written before it existed) reads as whole batches
    assert phases(trace.drop(columns="micro"), 2)["span_s"].tolist() == pytest.approx([6.0])


def test_utilisation_lines_compare_micro_batched_runs_with_their_own_baseline():
    """Overlap lifts ep_static's utilisation too: a micro-batched replication run is judged
    against ep_static run so, not against the whole-batch ep_static."""

    def row(planner, util, micro, of=None):
        r = dict(
            case="a",
            batch_size=128,
            planner=planner,
            utilisation=util,
            makespan_s=1.0,
            gpu_idle_causes_s={"combine@p2p_out": 0.16, "dispatch@p2p_out": 0.1},
            plan={"ep": {"n_devices": 8, "lanes": False, "micro_batches": micro}},
        )
        return {**r, "variant_of": of} if of else r

    rows = [
        row("ep_static", 0.55, 1),
        row("predictive_replication", 0.74, 1),
        row("oracle_replication", 0.75, 1),
        row("ep_static[tbo]", 0.58, 2, "ep_static"),
        row("predictive_replication[tbo]", 0.93, 2, "predictive_replication"),
        row("oracle_replication[tbo]", 0.94, 2, "oracle_replication"),
    ]
    assert utilisation_lines(rows, "utilisation", "util") == [
        "[FAIL] a bs=128 (8 GPUs): util ep_static 0.550 < 0.6 -> predictive_replication 0.740 "
        "(target >= 0.9; the oracle upper bound reaches 0.750)",
        "       predictive_replication's GPUs computed nothing 26.0% of the run, waiting on "
        "combine@p2p_out 16.0%, dispatch@p2p_out 10.0%",
        "[PASS] a bs=128 (8 GPUs, 2 micro-batches overlapped): util ep_static[tbo] 0.580 < 0.6 "
        "-> predictive_replication[tbo] 0.930 (target >= 0.9)",
    ]
    rows[3]["utilisation"] = 0.85  # overlap alone lifted the baseline: no premise, no line
    assert len(utilisation_lines(rows, "utilisation", "util")) == 2  # the FAIL and its causes


def test_a_micro_batch_is_each_gpus_part_of_its_share():
    """Batch 5 over 2 GPUs (shares: sequences 0-2 and 3-4): micro-batch 0 holds sequences 0, 1
    and 3, micro-batch 1 sequences 2 and 4. Each micro-batch's expert ops (ep_static: one copy
    of each expert) take exactly its sequences' routing."""
    s = spec(batch_size=5, micro_batches=2)
    res = simulate_run(s)
    wl, model = s.workload, s.model
    routing = load_routing(model, wl)
    tr = res.trace.assign(micro=[o.micro for o in res.schedule.ops])
    ex = tr[tr["kind"].astype(str) == str(OpKind.EXPERT)]
    for (step, layer, batch, micro), got in ex.groupby(["step", "layer", "batch", "micro"]):
        seqs = [0, 1, 3] if micro == 0 else [2, 4]
        ids = routing.expert_ids[
            [batch * wl.batch_size + q for q in seqs],
            routing.step_slice(step, wl),
            model.moe_index(layer),
        ]
        want = np.bincount(ids.ravel().astype(np.int64), minlength=model.n_experts)
        have = np.bincount(got["expert"], weights=got["tokens"], minlength=model.n_experts)
        assert have.tolist() == want.tolist(), (step, layer, batch, micro)


def test_the_replica_gate_times_each_micro_batch_reading_the_weights_again():
    """One token = 1 flop, one expert = 1 byte (max of the two, s). Device tokens [6, 2] over
    experts 0 and 1: one op, max(8, 2) = 8 s; as 2 micro-batches, 2 x max(4, 2) = 8 s; over
    [1, 1]: max(2, 2) = 2 s whole, 2 x max(1, 2) = 4 s in two (both read both experts). So a
    replica that halves a memory-bound device's tokens gains less under overlap."""
    whole = ExpertTime(_MaxCost(), 1.0, 1, True, 0.0)  # type: ignore[arg-type]
    two = replace(whole, micro=2)
    tokens = np.array([[6.0, 2.0], [1.0, 1.0]])
    assert whole._own_times(tokens).tolist() == [8.0, 2.0]
    assert two._own_times(tokens).tolist() == [8.0, 4.0]
    per_expert = replace(two, grouped=False)  # 2 x (max(3, 1) + max(1, 1)), 2 x (1 + 1)
    assert per_expert._own_times(tokens).tolist() == [8.0, 4.0]
