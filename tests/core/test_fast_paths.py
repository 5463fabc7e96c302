"""The vectorised paths (Schedule.columns, validate, the bubble walk, the DAG bound, peak
memory, the Chrome writer) give what the per-op Python they replaced gave, to the bit: the
references are kept here, and compared on every planner's run and on random traces (hypothesis:
jittered times, ops that never ran, schedules with a gate dep taken out)."""

from __future__ import annotations

import json
from collections import defaultdict, deque  # noqa: F401  (the references' imports)
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.bubbles import _EPS, _gpu_of, _label_of, idle_causes
from core.chrome_trace import to_chrome, write_chrome
from core.errors import CapacityError, ScheduleError
from core.schedule import (
    _ANY,
    Op,
    Schedule,
    _check_finishes,
    _ep_problem,
    _shape_problem,
    validate,
)
from core.spec import Workload
from core.trace import TRACE_COLUMNS, _heads_tails, make_trace, peak_bytes, work_s
from core.types import OpKind, Resource, Tensor, Tier
from experiments.common.pipeline import RunSpec, build_schedule, simulate_trace
from planners import planner_names
from tests.conftest import RESIDENT, hardware_from_conf, model_from_conf, random_routing
from tests.planners.test_replication import tiny_spec


def ref_idle_causes(schedule: Schedule, trace: pd.DataFrame) -> dict[str, float]:
    """core.bubbles.idle_causes with a Python list of predecessors per op."""
    gpu_of = _gpu_of(schedule)
    if not schedule.ops or not gpu_of or not len(trace):
        return {}
    chain = _RefChain(schedule, trace)
    gpus = sorted(set(gpu_of.values()))
    makespan = float(np.nanmax(chain.end))
    last = int(np.nanargmax(chain.end))
    stream_gpu = np.array([gpu_of.get(name, -1) for name in schedule.streams])
    op_gpu = np.where(np.isnan(chain.start), -1, stream_gpu[schedule.columns()["stream"]])
    for g in gpus:
        mine = np.flatnonzero(op_gpu == g)
        kstart = chain.start[mine] + chain.launch[mine]
        reach = 0.0  # the end of the kernels so far
        for i in np.argsort(kstart, kind="stable"):
            if kstart[i] > reach + _EPS:
                chain.walk(int(mine[i]), reach, float(kstart[i]), waiting=True)
            reach = max(reach, float(chain.end[mine[i]]))
        if makespan > reach + _EPS:
            chain.walk(last, reach, makespan, waiting=False)
    causes = sorted(chain.out.items(), key=lambda kv: -kv[1])
    return {k: float(v) / len(gpus) for k, v in causes if v > 0}


class _RefChain:
    """A run's ops as arrays, and the seconds laid on each cause so far."""

    def __init__(self, schedule: Schedule, trace: pd.DataFrame) -> None:
        n = len(schedule.ops)
        ids = trace["op_id"].to_numpy()
        self.start, self.end, launch, self.alloc = (np.full(n, np.nan) for _ in range(4))
        self.start[ids], self.end[ids] = trace["start_s"].to_numpy(), trace["end_s"].to_numpy()
        if "launch_s" in trace:
            launch[ids] = trace["launch_s"].to_numpy()
        if "alloc_s" in trace:
            self.alloc[ids] = trace["alloc_s"].to_numpy()
        # a GPU kernel's launch (a pool op's); a pooled transfer's latency is the transfer's
        on_gpu = np.array([s.resource == Resource.GPU for s in schedule.streams.values()])
        self.launch = np.where(on_gpu[schedule.columns()["stream"]], np.nan_to_num(launch), 0.0)
        res = {name: str(s.resource) for name, s in schedule.streams.items()}
        self.label = [_label_of(o.kind, o.tensor, res[o.stream]) for o in schedule.ops]
        self.resource = [res[o.stream] for o in schedule.ops]
        self.tier = [str(o.alloc_tier) if o.alloc_bytes > 0 else "" for o in schedule.ops]
        # predecessors that ran: deps, the op before on the same stream, and the op that held
        # the same resource before it (a stream's transfer queued behind another stream's)
        ran = (~np.isnan(self.end)).tolist()
        held = self._held_before(schedule)
        self.preds: list[list[int]] = []
        prev: dict[str, int] = {}
        for o in schedule.ops:
            ps = [*o.deps, prev.get(o.stream, -1), held[o.id]]
            self.preds.append([d for d in ps if d >= 0 and ran[d]])
            prev[o.stream] = o.id
        self.out: defaultdict[str, float] = defaultdict(float)

    def _held_before(self, schedule: Schedule) -> list[int]:
        """Per op, the op that ran on its resource just before it (-1: none), where the resource
        runs one op at a time (not a pool's, whose ops share it)."""
        held = np.full(len(schedule.ops), -1)
        sid = schedule.columns()["stream"]
        one_at_a_time = np.array(
            [not s.pool and s.resource != Resource.NONE for s in schedule.streams.values()]
        )
        rid = np.array([s.resource_id for s in schedule.streams.values()])[sid]
        ok = one_at_a_time[sid] & ~np.isnan(self.start)
        for r in np.unique(rid[ok]):
            ids = np.flatnonzero(ok & (rid == r))
            ids = ids[np.lexsort((self.end[ids], self.start[ids]))]  # zero-length ops first
            held[ids[1:]] = ids[:-1]
        return held.tolist()

    def walk(self, x: int, a: float, t: float, waiting: bool) -> None:
        """Lay idle time [a, t) on the chain that ends at op x: at x's kernel start where x
        ends the gap (`waiting`), else at x's end (x ran through t)."""
        while t > a + _EPS:
            kernel = self.start[x] + self.launch[x]
            if not waiting:  # x ran until t: its kernel's time is its own
                s = max(kernel, a)
                self.out[self.label[x]] += max(t - s, 0.0)
                t = min(t, s)
            s = max(self.start[x], a)  # before its kernel, its launch
            self.out["launch"] += max(t - s, 0.0)
            t = min(t, s)
            if t <= a + _EPS:
                return
            ps = self.preds[x]
            if not ps:
                self.out["late@" + self.resource[x]] += t - a
                return
            p = max(ps, key=lambda d: self.end[d])
            ready = max(float(self.end[p]), a)
            if ready < t:
                self._wait(x, ready, t)
                t = ready
            x, waiting = p, False

    def _wait(self, x: int, ready: float, t: float) -> None:
        """Op x, ready at `ready`, started at `t`: memory until its allocation was granted, then
        the executor's delay (`late`)."""
        mem = 0.0
        if self.tier[x]:
            granted = self.alloc[x] if not np.isnan(self.alloc[x]) else self.start[x]
            mem = min(max(float(granted), ready), t) - ready
            if mem > 0:
                self.out["memory@" + self.tier[x]] += mem
        if t - ready - mem > 0:
            self.out["late@" + self.resource[x]] += t - ready - mem


def ref_validate(schedule: Schedule, check_finishes: bool = True) -> None:
    """core.schedule.validate with a Python loop per op."""
    streams = schedule.streams
    for t in Tier:
        if schedule.resident_bytes.get(t, 0) > schedule.capacity_bytes[t]:
            raise CapacityError(
                f"resident {t} memory {schedule.resident_bytes[t] / 1e9:.3g} GB exceeds the "
                f"{t} capacity {schedule.capacity_bytes[t] / 1e9:.3g} GB"
            )
    pools: dict[str, set[str]] = {}  # resource -> the pools of its streams ("" for none)
    for spec in streams.values():
        pools.setdefault(spec.resource_id, set()).add(spec.pool)
    mixed = next((r for r, p in pools.items() if len(p) > 1), None)
    if mixed:
        raise ScheduleError(
            f"resource {mixed}: streams "
            f"{sorted(s.name for s in streams.values() if s.resource_id == mixed)} "
            f"mix pools {sorted(pools[mixed])} (a stream outside the pool would run beside its ops "
            "on the same SMs): put every stream of one GPU in one pool, or none"
        )
    ops = schedule.ops
    for i, op in enumerate(ops):
        if op.id != i:
            raise ScheduleError(f"{op.label()}: id must equal its position {i}")
        if op.deps and not (min(op.deps) >= 0 and max(op.deps) < i):
            raise ScheduleError(f"{op.label()}: deps {op.deps} must name earlier ops")
    # Ops of one shape (kind, stream, tiers, memory effect) pass or fail together: check each
    # shape once, at its first op, in op order, so the error names the first bad op.
    first: dict[tuple[Any, ...], Op] = {}
    for o in ops:
        shape = (
            o.kind,
            o.stream,
            o.src,
            o.dst,
            o.alloc_tier,
            o.free_tier,
            o.alloc_bytes < 0
            or o.free_bytes < 0
            or (o.alloc_bytes > 0 and o.alloc_tier is None)
            or (o.free_bytes > 0 and o.free_tier is None),
        )
        first.setdefault(shape, o)
    for shape, op in first.items():
        problem = _shape_problem(shape, streams)
        if problem:
            raise ScheduleError(f"{op.label()}: {problem}")
    ep = schedule.ep
    if ep is not None:  # an expert-parallel layout: G lanes of one GPU, or G GPUs
        problem = _ep_problem(first.values(), streams, ep.lanes)
        if problem:
            raise ScheduleError(problem)
    cols = schedule.columns()
    for ti, tier in enumerate(Tier):
        room = schedule.capacity_bytes[tier] - schedule.resident_bytes.get(tier, 0)
        over = np.flatnonzero((cols["alloc_tier"] == ti) & (cols["alloc_bytes"] > room))
        if len(over):
            op = ops[int(over[0])]
            raise CapacityError(
                f"{op.label()}: allocates {op.alloc_bytes / 1e9:.3f} GB of {tier}, "
                f"only {room / 1e9:.3f} GB is not resident"
            )
    ref_gates_causal(schedule)
    if check_finishes:
        _check_finishes(schedule)


def ref_gates_causal(schedule: Schedule) -> None:
    """ref_validate's causality rule: each expert op depends on the gate ops of the batches
    it serves."""
    ops = schedule.ops
    # (step, layer) -> batch -> its gate ops (one, or one per device gating a share of the
    # batch), each with its micro-batch (-1: the whole batch)
    gates: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
    for op in ops:
        if op.kind == OpKind.GATE:
            gates.setdefault((op.step, op.layer), {}).setdefault(op.batch, []).append(
                (op.micro, op.id)
            )
    for op in schedule.ops:
        if op.kind != OpKind.EXPERT:
            continue
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
            raise ScheduleError(
                f"{op.label()}: an expert compute must depend on the gate op(s) of the batches "
                f"it serves (planners are causal); missing {missing or 'gate'}"
            )


def ref_heads_tails(schedule: Schedule, dur: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dag_bound's heads and tails as they were: every dep of every op."""
    n = len(schedule.ops)
    d = dur.tolist()
    head = [0.0] * n
    preds: list[tuple[int, ...]] = [()] * n
    last_in_stream: dict[str, int] = {}
    for o in schedule.ops:
        prev = last_in_stream.get(o.stream)
        ps = o.deps if prev is None else (*o.deps, prev)
        last_in_stream[o.stream] = o.id
        preds[o.id] = ps
        if ps:
            head[o.id] = max([head[p] + d[p] for p in ps])
    tail = [0.0] * n
    for i in range(n - 1, -1, -1):
        t = d[i] + tail[i]
        for p in preds[i]:
            if tail[p] < t:
                tail[p] = t
    return np.asarray(head), np.asarray(tail)


def ref_peak_bytes(schedule: Schedule, trace: pd.DataFrame) -> dict[str, int]:
    """peak_bytes as it was: each tier's allocations read op by op."""
    out: dict[str, int] = {}
    ops = schedule.ops
    granted = trace["alloc_s"] if "alloc_s" in trace else trace["start_s"]
    start = granted.fillna(trace["start_s"]).to_numpy()
    end = trace["end_s"].to_numpy()
    for tier in Tier:
        alloc = np.fromiter(
            (o.alloc_bytes if o.alloc_tier == tier else 0 for o in ops), np.int64, len(ops)
        )
        free = np.fromiter(
            (o.free_bytes if o.free_tier == tier else 0 for o in ops), np.int64, len(ops)
        )
        a, f = alloc > 0, free > 0
        times = np.concatenate([end[f], start[a]])
        deltas = np.concatenate([-free[f], alloc[a]])
        order = np.lexsort((deltas, times))
        live = np.cumsum(deltas[order]) if len(order) else np.zeros(1, np.int64)
        out[str(tier)] = int(
            schedule.resident_bytes.get(tier, 0) + max(0, int(live.max(initial=0)))
        )
    return out


def ref_columns(schedule: Schedule) -> dict[str, np.ndarray]:
    """Schedule.columns as it was: a row per op."""
    ops = schedule.ops
    stream_idx = {s: i for i, s in enumerate(schedule.streams)}
    tier_idx: dict[Any, int] = {None: -1, **{t: i for i, t in enumerate(Tier)}}
    kind_idx = {k: i for i, k in enumerate(OpKind)}
    rows = [
        (
            kind_idx[o.kind],
            stream_idx[o.stream],
            o.nbytes,
            o.flops,
            o.touch_bytes,
            tier_idx[o.alloc_tier],
            o.alloc_bytes,
            tier_idx[o.free_tier],
            o.free_bytes,
            o.width,
        )
        for o in ops
    ]
    arr = np.array(rows, dtype=np.float64).reshape(len(ops), 10)
    return {
        "kind": arr[:, 0].astype(np.int16),
        "stream": arr[:, 1].astype(np.int16),
        "nbytes": arr[:, 2].astype(np.int64),
        "flops": arr[:, 3],
        "touch_bytes": arr[:, 4],
        "alloc_tier": arr[:, 5].astype(np.int8),
        "alloc_bytes": arr[:, 6].astype(np.int64),
        "free_tier": arr[:, 7].astype(np.int8),
        "free_bytes": arr[:, 8].astype(np.int64),
        "width": arr[:, 9].astype(np.int64),
    }


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
        spec = tiny_spec(name, **params)
        if not params:
            spec = RunSpec(
                model_from_conf("tiny"),
                hardware_from_conf("tiny"),
                Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3),
                name,
            )
        schedule = build_schedule(spec, random_routing(spec.model, spec.workload))
        out.append((schedule, simulate_trace(schedule, spec.hardware)))
    return out


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


def test_bubble_walk_in_small_blocks_equals_the_reference(runs, monkeypatch):
    """The predecessor search runs a block of ops at a time (memory); blocks of 7 ops, which cut
    every op's candidates at arbitrary places, give the reference's causes."""
    import core.bubbles

    monkeypatch.setattr(core.bubbles, "_BLOCK", 7)
    for seed, (schedule, trace) in enumerate(runs):
        s = fresh(schedule)
        tr = jittered(s, trace, seed, 0.1)
        assert idle_causes(s, trace) == ref_idle_causes(s, trace)
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


def ref_make_trace(schedule: Schedule, start_s: np.ndarray, end_s: np.ndarray) -> pd.DataFrame:
    """core.trace.make_trace's columns from the ops, one Python object per op."""
    ops = schedule.ops
    res = {name: s.resource_id for name, s in schedule.streams.items()}
    nan = np.full(len(ops), np.nan)
    cols = {
        "source": pd.Categorical(["sim"] * len(ops)),
        "op_id": np.arange(len(ops), dtype=np.int64),
        "kind": pd.Categorical([str(o.kind) for o in ops]),
        "stream": pd.Categorical([o.stream for o in ops]),
        "resource": pd.Categorical([res[o.stream] for o in ops]),
        "step": np.fromiter((o.step for o in ops), np.int32, len(ops)),
        "layer": np.fromiter((o.layer for o in ops), np.int32, len(ops)),
        "batch": np.fromiter((o.batch for o in ops), np.int32, len(ops)),
        "micro": np.fromiter((o.micro for o in ops), np.int32, len(ops)),
        "batches": np.fromiter((o.batches for o in ops), np.int32, len(ops)),
        "expert": np.fromiter((o.expert for o in ops), np.int32, len(ops)),
        "tensor": pd.Categorical([str(o.tensor) for o in ops]),
        "bytes": np.fromiter((o.nbytes for o in ops), np.int64, len(ops)),
        "tokens": np.fromiter((o.tokens for o in ops), np.int64, len(ops)),
        "start_s": np.asarray(start_s, dtype=np.float64),
        "end_s": np.asarray(end_s, dtype=np.float64),
        "sm_s": nan,
        "launch_s": nan.copy(),
        "alloc_s": nan.copy(),
    }
    return pd.DataFrame(cols, columns=TRACE_COLUMNS)


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
    """Emitter.expert_chain (one call per batch, rows through ScheduleBuilder.extend) gives the
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
