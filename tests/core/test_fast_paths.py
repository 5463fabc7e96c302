"""The vectorised paths (Schedule.columns, validate, the bubble walk, the DAG bound, peak
memory, the Chrome writer) give what the per-op Python they replaced gave, to the bit: the
references are kept here, and compared on every planner's run and on random traces (hypothesis:
jittered times, ops that never ran, schedules with a gate dep taken out)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.bubbles import idle_causes
from core.chrome_trace import to_chrome, write_chrome
from core.errors import CapacityError, ScheduleError
from core.schedule import (
    Op,
    Schedule,
    validate,
)
from core.spec import Workload
from core.trace import _heads_tails, _plus_zero, make_trace, peak_bytes, prefill_s, work_s
from core.types import OpKind, Resource, Tensor, Tier
from experiments.common.pipeline import RunSpec, build_schedule, simulate_trace
from planners import planner_names
from tests.conftest import RESIDENT, hardware_from_conf, model_from_conf, random_routing
from tests.core.fast_path_refs import (
    ref_columns,
    ref_heads_tails,
    ref_idle_causes,
    ref_make_trace,
    ref_peak_bytes,
    ref_prefill_s,
    ref_validate,
)
from tests.planners.test_replication import tiny_spec

# every planner on the tiny model; the expert-parallel ones on 2 devices, as G GPUs and as lanes
# of one GPU (pools, SM holds)
RUNS = (
    [(p, {}) for p in planner_names() if p not in RESIDENT]
    + [(p, {"n_devices": 2}) for p in sorted(RESIDENT)]
    + [
        ("ep_static", {"n_devices": 2, "lanes": True}),
        ("predictive_replication", {"n_devices": 2, "lanes": True, "replica_slots": 1}),
    ]
)


@pytest.fixture(scope="module")
def runs() -> list[tuple[Schedule, pd.DataFrame]]:
    """Each of RUNS planned, validated and simulated: (schedule, sim trace)."""
    out = []
    for name, params in RUNS:
        spec = run_spec(name, params)
        schedule = build_schedule(spec, random_routing(spec.model, spec.workload))
        out.append((schedule, simulate_trace(schedule, spec.hardware)))
    return out


def run_spec(name: str, params: dict) -> RunSpec:
    """RUNS' entry as a run: tiny, on 4 GPUs where the planner is expert-parallel."""
    if params:
        return tiny_spec(name, **params)
    return RunSpec(
        model_from_conf("tiny"),
        hardware_from_conf("tiny"),
        Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3),
        name,
    )


def fresh(schedule: Schedule) -> Schedule:
    """The schedule with no cached columns (so each path builds its own)."""
    return Schedule(
        schedule.ops,
        schedule.streams,
        schedule.capacity_bytes,
        schedule.resident_bytes,
        schedule.meta,
    )


def jittered(schedule: Schedule, trace: pd.DataFrame, seed: int, drop: float) -> pd.DataFrame:
    """The trace's times through a random increasing map (each gap and duration stretched or
    shrunk at random, the order of every start and end kept, so the trace stays one a run
    could give), random launch and allocation times, and the last `drop` share of its ops (by
    start) never run (left out, as a real run that stopped leaves them)."""
    rng = np.random.default_rng(seed)
    n = len(trace)
    t = np.unique(np.r_[trace["start_s"].to_numpy(), trace["end_s"].to_numpy()])
    f = np.r_[0.0, np.cumsum(np.diff(t) * rng.choice([0.0, 0.5, 1.0, 3.0], len(t) - 1))]
    tr = trace.copy()
    tr["start_s"] = f[np.searchsorted(t, trace["start_s"].to_numpy())]
    tr["end_s"] = f[np.searchsorted(t, trace["end_s"].to_numpy())]
    dur = (tr["end_s"] - tr["start_s"]).to_numpy()
    tr["launch_s"] = np.where(rng.random(n) > 0.5, dur * rng.random(n), np.nan)
    tr["alloc_s"] = np.where(rng.random(n) > 0.5, tr["start_s"], np.nan)
    keep = tr["start_s"].rank(method="first").to_numpy() <= n * (1 - drop)
    return tr[keep].reset_index(drop=True)


def test_columns_are_the_rows_they_were(runs):
    for schedule, _ in runs:
        new, ref = fresh(schedule).columns(), ref_columns(schedule)
        for k, v in ref.items():
            assert new[k].dtype == v.dtype and np.array_equal(new[k], v), k
        deps = [
            new["dep_idx"][a:b].tolist()
            for a, b in zip(new["dep_ptr"][:-1], new["dep_ptr"][1:], strict=True)
        ]
        assert deps == [list(o.deps) for o in schedule.ops]


def test_columns_truncate_a_float_count_as_the_reference():
    """A planner may give a byte or token count as a float, or a numpy scalar: each column holds
    what the reference's float64 rows, cast, hold (a float truncated toward zero)."""
    from core.schedule import StreamSpec

    fields = dict(nbytes=2.9, tokens=np.int64(7), alloc_bytes=3.0, free_bytes=np.float64(1.5))
    ops = [
        Op(0, OpKind.LOAD, "w", layer=np.int64(1), alloc_tier=Tier.GPU, **fields),
        Op(1, OpKind.FREE, "w", step=2.0, free_tier=Tier.GPU, free_bytes=5.99, deps=(0,)),
    ]
    s = Schedule(ops, {"w": StreamSpec("w", Resource.H2D)}, {}, {})
    new, ref = s.columns(), ref_columns(s)
    for k, v in ref.items():
        assert new[k].dtype == v.dtype and np.array_equal(new[k], v), k
    assert new["nbytes"].tolist() == [2, 0] and new["free_bytes"].tolist() == [1, 5]


@pytest.mark.parametrize("cats", [None, ["h2d", "gpu", "d2h"], ["d2h", "gpu", "h2d", "none"]])
def test_sums_by_name_are_the_str_groupbys(cats):
    """`sum_by_name` (a categorical column grouped by its codes) gives what grouping its names
    cast to str gives: the same compensated sums of the same rows, names in sorted order, with
    categories unsorted, unused, or a row with none (NaN, which str names "nan")."""
    from core.trace import sum_by_name

    rng = np.random.default_rng(0)
    names = rng.choice(["gpu", "h2d", "d2h"], 1000).astype(object)
    values = pd.Series(rng.random(1000) * 10.0 ** rng.integers(-9, 9, 1000))
    col = pd.Series(names if cats is None else pd.Categorical(names, categories=cats))
    for c in (col, col.where(np.arange(1000) != 7)):
        new, ref = sum_by_name(values, c), values.groupby(c.astype(str), observed=True).sum()
        assert list(new.index) == list(ref.index) and new.to_numpy().tolist() == ref.tolist()


def test_prefill_time_is_the_span_by_span_unions(runs, monkeypatch):
    """`prefill_s` (the step-0 spans' union in numpy, no pass over rows) equals summing the
    sorted spans one by one, to the bit: each run's trace and the trace jittered (equal starts,
    zero lengths, spans inside others, ops that never ran), its prefill spans shuffled in time,
    and none at all."""
    traces = []
    for seed, (schedule, trace) in enumerate(runs):
        rng = np.random.default_rng(seed)
        shuffled = trace.copy()
        shift = rng.random(len(trace)) * shuffled["end_s"].max()
        shuffled["start_s"] += shift
        shuffled["end_s"] += shift * rng.choice([1.0, 0.5], len(trace))
        traces += [trace, jittered(schedule, trace, seed, 0.0), shuffled, trace[:0]]
    with monkeypatch.context() as m:
        m.setattr(pd.DataFrame, "itertuples", None)  # the reference's loop over rows
        got = [prefill_s(tr) for tr in traces]
    assert got == [ref_prefill_s(tr) for tr in traces]


def test_head_and_tail_passes_take_max_over_any_number_of_predecessors():
    """`_heads` and `_tails` unroll max() for ops of one to three neighbours: with 0-5 of them
    per op, ties, NaN durations first, last and alone, each op's head and tail are what max()
    over the list gives (a tail at least 0.0), to the bit."""
    from core.trace import _heads, _tails

    rng = np.random.default_rng(0)
    n = 400
    d = np.round(rng.random(n), 1)
    d[rng.random(n) < 0.05] = np.nan
    counts = rng.integers(0, 6, n)
    counts[0] = 0
    pred = np.concatenate([rng.integers(0, max(i, 1), c) for i, c in enumerate(counts)])
    fin, head = [x + 0.0 for x in d.tolist()], [0.0] * n
    a = 0
    for i, c in enumerate(counts.tolist()):
        if c:
            head[i] = max([fin[p] for p in pred[a : a + c].tolist()])
            fin[i] = head[i] + d[i]
        a += c
    got = _heads(d.tolist(), _plus_zero(d), counts, pred)
    assert np.array_equal(got, np.asarray(head), equal_nan=True)
    # the same lists read backwards: op i's successors are op n-1-i's predecessors above
    succ = (n - 1 - pred)[::-1]
    after, tail = [x + 0.0 for x in d[::-1].tolist()], [0.0] * n
    b = len(succ)
    for i, c in reversed(list(enumerate(counts[::-1].tolist()))):
        if c:
            tail[i] = max([0.0, *[after[s] for s in succ[b - c : b].tolist()]])
            after[i] = d[::-1][i] + tail[i]
        b -= c
    got = _tails(d[::-1].tolist(), _plus_zero(d[::-1]), counts[::-1], succ)
    assert np.array_equal(got, np.asarray(tail), equal_nan=True)


@pytest.mark.parametrize("values", [[], [0], [5, 5, 5], [3, 0, 7, 3, 12, 0, 1], [-2, 4, -2]])
def test_the_walks_label_codes_are_np_uniques(values):
    """`small_unique` (the bubble walk's kind, tensor and stream combinations counted by
    bincount) gives `np.unique`'s sorted values and per-code indices: gaps, repeats, a single
    value, none, and negative codes (which take np.unique itself)."""
    from core.bubbles import small_unique

    codes = np.array(values, np.int64)
    rng = np.random.default_rng(len(values))
    for c in (codes, rng.permutation(np.repeat(codes, 3))):
        (u, inv), (ref_u, ref_inv) = small_unique(c), np.unique(c, return_inverse=True)
        assert u.dtype == ref_u.dtype and u.tolist() == ref_u.tolist()
        assert inv.ravel().tolist() == ref_inv.ravel().tolist() and len(inv) == len(c)


def test_every_run_summarises_as_the_references_do(runs):
    """Bubble causes, heads/tails and peak memory of each planner's simulated run."""
    for schedule, trace in runs:
        s = fresh(schedule)
        assert idle_causes(s, trace) == ref_idle_causes(s, trace)
        assert peak_bytes(s, trace) == ref_peak_bytes(s, trace)
        dur = np.zeros(len(s.ops))
        dur[trace["op_id"].to_numpy()] = work_s(trace, s).to_numpy()
        for new, ref in zip(_heads_tails(s, dur), ref_heads_tails(s, dur), strict=True):
            assert np.array_equal(new, ref)


def test_the_walks_predecessor_is_the_references_for_every_op(runs):
    """The op the bubble walk steps back to, found as the walk reaches an op: for every op of
    each run, and of its trace jittered (ties, zero lengths, ops that never ran), the
    reference's (the first of the predecessors that ran that ended last)."""
    from core.bubbles import _Chain
    from tests.core.fast_path_refs import _RefChain

    for seed, (schedule, trace) in enumerate(runs):
        s = fresh(schedule)
        for tr in (trace, jittered(s, trace, seed, 0.1)):
            new, ref = _Chain(s, tr), _RefChain(s, tr)
            want = [max(ps, key=lambda d: ref.end[d]) if ps else -1 for ps in ref.preds]
            assert [new._pred(x) for x in range(len(s.ops))] == want
            assert idle_causes(s, tr) == ref_idle_causes(s, tr)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    drop=st.sampled_from([0.0, 0.0, 0.1, 0.5]),
    which=st.integers(0, len(RUNS) - 1),
)
def test_random_traces_give_the_same_causes_and_bounds(runs, seed, drop, which):
    """Any times (ties, zero lengths, late starts, ops that never ran) and any durations,
    NaN included: the vectorised bubble walk and DAG chains equal the references."""
    schedule, trace = runs[which]
    s = fresh(schedule)
    tr = jittered(s, trace, seed, drop)
    assert idle_causes(s, tr) == ref_idle_causes(s, tr)
    rng = np.random.default_rng(seed)
    dur = np.round(rng.random(len(s.ops)), 2) * (rng.random(len(s.ops)) > 0.3)
    if drop:
        dur[rng.random(len(s.ops)) < drop] = np.nan  # the fallback over every edge
    for new, ref in zip(_heads_tails(s, dur), ref_heads_tails(s, dur), strict=True):
        assert np.array_equal(new, ref, equal_nan=True)
    if not drop:
        assert peak_bytes(s, tr) == ref_peak_bytes(s, tr)


def outcome(check, schedule: Schedule) -> str:
    try:
        check(schedule, check_finishes=False)
    except (ScheduleError, CapacityError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    which=st.integers(0, len(RUNS) - 1),
    how=st.sampled_from(["gate dep", "forward dep", "id", "stream", "tier", "bytes"]),
)
def test_validate_names_the_same_first_bad_op(runs, seed, which, how):
    """A schedule broken at random ops (a gate dep taken out, a dep on a later op, a wrong id,
    an undeclared stream, a transfer without tiers, negative bytes): validate raises what the
    per-op reference raises, naming the same op."""
    schedule, _ = runs[which]
    rng = np.random.default_rng(seed)
    ops = list(schedule.ops)
    for i in rng.choice(len(ops), size=min(3, len(ops)), replace=False).tolist():
        o = ops[i]
        if how == "gate dep":
            gates = [d for d in o.deps if ops[d].kind == OpKind.GATE]
            if gates:
                ops[i] = o._replace(deps=tuple(d for d in o.deps if d != gates[0]))
        elif how == "forward dep":
            ops[i] = o._replace(deps=(*o.deps, min(i + 1, len(ops) - 1) if i else 0))
        elif how == "id":
            ops[i] = o._replace(id=o.id + 1)
        elif how == "stream":
            ops[i] = o._replace(stream=f"nowhere{i}")
        elif how == "tier":
            ops[i] = (
                o._replace(src=None)
                if o.src is not None
                else o._replace(alloc_tier=None, alloc_bytes=1)
            )
        else:
            ops[i] = o._replace(free_bytes=-1)
    broken = Schedule(
        ops, schedule.streams, schedule.capacity_bytes, schedule.resident_bytes, schedule.meta
    )
    assert outcome(validate, broken) == outcome(ref_validate, fresh(broken))


def test_every_run_validates_as_the_reference(runs):
    for schedule, _ in runs:
        assert outcome(validate, fresh(schedule)) == outcome(ref_validate, fresh(schedule)) == "ok"


def test_chrome_writer_writes_to_chromes_text(runs, tmp_path):
    """The columnar writer's file is json.dumps(to_chrome(...)) to the byte, a real-like trace
    (NaN sm_s / launch_s / alloc_s left out) beside the sim one."""
    schedule, trace = runs[0]
    real = jittered(schedule, trace, 0, 0.1)
    real["source"] = pd.Categorical(["real"] * len(real))
    write_chrome(tmp_path / "t.json", [trace, real])
    assert (tmp_path / "t.json").read_text() == json.dumps(to_chrome([trace, real]))


def test_builder_add_takes_ops_fields_in_order_with_their_defaults():
    """ScheduleBuilder.add builds an Op positionally: its keywords must be Op's fields (but id,
    kind, stream, deps), in Op's order, with Op's defaults, or ops would get shifted fields."""
    import inspect

    from core.schedule import ScheduleBuilder

    params = inspect.signature(ScheduleBuilder.add).parameters
    kw = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in kw] == [f for f in Op._fields[3:] if f != "deps"]
    assert {p.name: p.default for p in kw} == {
        k: v for k, v in Op._field_defaults.items() if k != "deps"
    }
    b = ScheduleBuilder({t: 1 << 30 for t in Tier})
    b.stream("s", Resource.GPU)
    i = b.add(OpKind.FFN, "s", (None,), layer=3, tokens=7, free_tier=Tier.GPU, free_bytes=5)
    j = b.add(OpKind.FFN, "s", (i, None))
    assert b.ops[i] == Op(0, OpKind.FFN, "s", layer=3, tokens=7, free_tier=Tier.GPU, free_bytes=5)
    assert b.ops[j] == Op(1, OpKind.FFN, "s", deps=(0,))
    k = b.add(OpKind.ATTENTION, "s", (j,), batch=2, batches=3)
    assert b.ops[k] == Op(2, OpKind.ATTENTION, "s", batch=2, deps=(1,), batches=3)
    assert (b.ops[k].batches, b.ops[j].batches) == (3, 1)
    assert type(b.ops[j]) is Op and b.ops[j].deps == (0,)


def test_make_trace_gives_the_per_op_frame(runs, tmp_path):
    """make_trace (from the schedule's columns) equals the per-op reference, dtypes and
    categories included, and writes the same parquet bytes."""
    for i, (schedule, trace) in enumerate(runs):
        start, end = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
        new, ref = (
            make_trace(fresh(schedule), start, end, "sim"),
            ref_make_trace(schedule, start, end),
        )
        pd.testing.assert_frame_equal(new, ref, check_exact=True, check_categorical=True)
        for c in ("source", "kind", "stream", "resource", "tensor"):
            assert list(new[c].cat.categories) == list(ref[c].cat.categories), c
            assert new[c].cat.codes.dtype == ref[c].cat.codes.dtype, c
        new.to_parquet(tmp_path / f"new{i}.parquet", index=False)
        ref.to_parquet(tmp_path / f"ref{i}.parquet", index=False)
        assert (tmp_path / f"new{i}.parquet").read_bytes() == (
            tmp_path / f"ref{i}.parquet"
        ).read_bytes()


def test_expert_chain_emits_what_expert_calls_would():
    """Emitter.expert_chain (one call per batch, its ops through ScheduleBuilder.extend) gives the
    ops that Emitter.expert, once per chosen expert, gives: fields, types and deps (a resident
    expert's load None, the first op with no op before, experts without tokens skipped)."""
    from core.cost import CostModel
    from core.planner import PlanContext
    from core.routing import CausalRouting
    from core.schedule import ScheduleBuilder
    from planners.common import Emitter, standard_placement

    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    routing = random_routing(model, wl)
    layer = model.moe_layers[0]

    def emitter() -> tuple[Emitter, ScheduleBuilder, list[int | None]]:
        causal = CausalRouting.replay(routing, wl)
        ctx = PlanContext(model, hw, wl, causal, CostModel(hw))
        b = ScheduleBuilder(hw.memory_bytes)
        em = Emitter(
            ctx, b, standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)
        )
        gates = [em.gate(0, layer, k, (), last_batch=False)[0] for k in range(2)]
        # the loads' ops (tiny's experts are resident: any op ids stand for them here), and a
        # resident expert's None
        loads: list[int | None] = [gates[e % 2] for e in range(model.n_experts)]
        loads[2] = None
        return em, b, loads

    counts = [3, 0, 2, 5][: model.n_experts]  # expert 1 gets no tokens
    for last, extra in ((None, ()), (0, (1, 2))):
        em, ref, loads = emitter()
        prev = last
        for e, count in enumerate(counts):
            if count:
                prev = em.expert(0, layer, 1, e, count, (loads[e], prev, *extra), last_use=False)
        em, new, loads = emitter()
        ids = em.expert_chain(0, layer, 1, counts, dict(enumerate(loads)), last, extra)
        assert list(ids) == list(range(len(new.ops) - len(ids), len(new.ops)))
        assert new.ops == ref.ops and loads[0] is not None
        first = next(o for o in ref.ops if o.kind == OpKind.EXPERT)
        assert first == Op(
            first.id,
            OpKind.EXPERT,
            em.compute,
            layer=layer,
            batch=1,
            expert=0,
            tensor=Tensor.EXPERT,
            tokens=3,
            flops=model.expert_flops(3),
            touch_bytes=model.expert_bytes,
            deps=tuple(
                d for d in (loads[0], last, *extra, em.gate_ops[0, layer][1]) if d is not None
            ),
        )
        assert [tuple(map(type, o)) for o in new.ops] == [tuple(map(type, o)) for o in ref.ops]


def test_emitter_reads_model_and_batch_size_as_plain_attributes():
    """The emitter's model and batch size, read for nearly every op a planner emits, are the
    context's, held as the emitter's own attributes (a property's call each time was a
    fortieth of a flexgen plan)."""
    from core.cost import CostModel
    from core.planner import PlanContext
    from core.routing import CausalRouting
    from core.schedule import ScheduleBuilder
    from planners.common import Emitter, standard_placement

    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    causal = CausalRouting.replay(random_routing(model, wl), wl)
    ctx = PlanContext(model, hw, wl, causal, CostModel(hw))
    place = standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)
    em = Emitter(ctx, ScheduleBuilder(hw.memory_bytes), place)
    assert vars(em)["model"] is model and vars(em)["bs"] == 2


def test_emitter_works_out_a_layers_attention_and_sizes_once(monkeypatch):
    """An attention op's fields but its batch and deps, and whether (and how many bytes of) a
    weight unit is streamed, are worked out once per emitter (the model and placement are
    frozen): three batches' attention at one step and layer ask the model once, and give the
    ops a fresh emitter gives each."""
    from core.cost import CostModel
    from core.planner import PlanContext
    from core.routing import CausalRouting
    from core.schedule import ScheduleBuilder
    from core.spec import ModelSpec
    from planners.common import Emitter, standard_placement

    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=3, prompt_len=8, gen_len=3)
    causal = CausalRouting.replay(random_routing(model, wl), wl)
    ctx = PlanContext(model, hw, wl, causal, CostModel(hw))
    place = standard_placement(ctx, kv_sequences=wl.n_sequences, layers_in_flight=2)

    def emitter() -> Emitter:
        return Emitter(ctx, ScheduleBuilder(hw.memory_bytes), place)

    asked = []
    real = ModelSpec.attention_flops
    monkeypatch.setattr(
        ModelSpec, "attention_flops", lambda m, *a, **k: asked.append(a) or real(m, *a, **k)
    )
    em = emitter()
    for k in range(3):
        em.attention(1, 0, k, (k - 1,), last_batch=k == 2)
        em.streamed(Tensor.ATTENTION, 0)
    assert len(asked) == 2  # once for batches 0 and 1, once for the last (it frees weights)
    for k in range(3):
        fresh = emitter()
        fresh.attention(1, 0, k, (k - 1,), last_batch=k == 2)
        assert fresh.out.ops[0][1:] == em.out.ops[k][1:]
    tiers = []
    monkeypatch.setattr(Emitter, "tensor_tier", lambda e, *a: tiers.append(a) or place.dense)
    em = emitter()
    assert [em.streamed(Tensor.GATE, 1) for _ in range(3)] == [em.streamed(Tensor.GATE, 1)] * 3
    assert len(tiers) == 1


def test_trace_parquet_reads_back_as_the_frame_it_was(runs, tmp_path):
    """write_trace_parquet (dictionaries only for categorical columns) gives back the frame
    pandas' default writer gives back, dtypes and categories included."""
    from experiments.common.pipeline import write_trace_parquet

    for i, (_, trace) in enumerate(runs):
        write_trace_parquet(trace, tmp_path / f"new{i}.parquet")
        trace.to_parquet(tmp_path / f"ref{i}.parquet", index=False)
        new, ref = (pd.read_parquet(tmp_path / f"{w}{i}.parquet") for w in ("new", "ref"))
        pd.testing.assert_frame_equal(new, ref, check_exact=True, check_categorical=True)
        pd.testing.assert_frame_equal(new, trace, check_exact=True, check_categorical=True)


def test_durations_plus_zero_added_in_numpy_are_pythons_sums():
    """The DAG bound's passes start from each duration + 0.0, added in numpy (`_plus_zero`), not
    in a Python loop over the ops: the same IEEE sums bit for bit (-0.0 made 0.0, a NaN kept,
    subnormals and infinities as they are)."""
    dur = np.array([-0.0, 0.0, 1.5, 1e-310, -1e-310, np.inf, -np.inf, np.nan, 0.1 + 0.2, -3.0])
    got = _plus_zero(dur)
    want = [x + 0.0 for x in dur.tolist()]
    assert type(got) is list and [type(x) for x in got] == [float] * len(want)
    assert np.array(got).tobytes() == np.array(want).tobytes()


def test_trace_parquet_is_pandas_writers_file_without_it(runs, tmp_path, monkeypatch):
    """write_trace_parquet writes the bytes `DataFrame.to_parquet` writes with its dictionaries,
    by pyarrow itself (pandas' writer converts on a pool of threads and writes through a Python
    file object): the same file, with to_parquet out of reach."""
    from experiments.common.pipeline import write_trace_parquet

    refs = []
    for i, (_, trace) in enumerate(runs):
        cats = [c for c in trace.columns if isinstance(trace[c].dtype, pd.CategoricalDtype)]
        trace.to_parquet(tmp_path / f"ref{i}.parquet", index=False, use_dictionary=cats)
        refs.append((tmp_path / f"ref{i}.parquet").read_bytes())
    monkeypatch.setattr(pd.DataFrame, "to_parquet", None)
    for i, (_, trace) in enumerate(runs):
        write_trace_parquet(trace, tmp_path / f"new{i}.parquet")
        assert (tmp_path / f"new{i}.parquet").read_bytes() == refs[i]


def test_streams_resumed_without_processes_run_as_simpy_processes(runs, monkeypatch):
    """The simulator's own resume of each stream (`sim.executor._start`) gives every planner's
    run the start, end and grant times simpy's `env.process` gives it, to the bit (pools, SM
    holds and memory waits included)."""
    import sim.executor
    from core.cost import CostModel

    for (schedule, _), (name, params) in zip(runs, RUNS, strict=True):
        hw = run_spec(name, params).hardware
        new = sim.executor.simulate_times(schedule, CostModel(hw))
        with monkeypatch.context() as m:
            m.setattr(sim.executor, "_start", as_process)
            ref = sim.executor.simulate_times(schedule, CostModel(hw))
        for a, b in zip(new, ref, strict=True):
            assert np.array_equal(a, b, equal_nan=True)


def test_coded_columns_are_each_ops_codes(runs):
    """Each op's kind, tensor, tiers and stream, coded once per distinct combination: the code
    of each field of each op (a field given as its string, a stream not declared: -1, on every
    planner's run); a value that is no member of its field raises KeyError naming it."""
    from core.schedule import StreamSpec

    tiers = {None: -1, **{t: i for i, t in enumerate(Tier)}}
    w = {"w": StreamSpec("w", Resource.H2D)}
    mixed = [
        Op(0, OpKind.LOAD, "w", tensor=Tensor.EXPERT, src=Tier.CPU, dst=Tier.GPU),
        Op(1, "load", "w", tensor="expert", src="cpu", dst="gpu"),  # type: ignore[arg-type]
        Op(2, OpKind.FREE, "nowhere", free_tier=Tier.GPU, free_bytes=1),
        Op(3, OpKind.LOAD, "w", tensor=Tensor.EXPERT, src=Tier.CPU, dst=Tier.GPU),
    ]
    for s in [fresh(schedule) for schedule, _ in runs] + [Schedule(mixed, w, {}, {})]:
        cols, streams = s.columns(), list(s.streams)
        for name, codes in (("kind", list(OpKind)), ("tensor", list(Tensor))):
            assert cols[name].tolist() == [codes.index(getattr(o, name)) for o in s.ops]
        for name in ("src", "dst", "alloc_tier", "free_tier"):
            assert cols[name].tolist() == [tiers[getattr(o, name)] for o in s.ops]
        want = [streams.index(o.stream) if o.stream in streams else -1 for o in s.ops]
        assert cols["stream"].tolist() == want
    with pytest.raises(KeyError, match="'loads'"):
        Schedule([*mixed, Op(4, "loads", "w")], w, {}, {}).columns()  # type: ignore[arg-type]


def as_process(env, stream):
    """A stream's generator run by a simpy Process (its own resumes, which it adds to each event
    it waits on, do nothing): the reference for `sim.executor._start`."""
    next(stream)
    stream.send(lambda _: None)
    env.process(stream)
