"""Hand-worked run metrics (`core.trace.summarize`) and the Chrome trace export on a 5-op
schedule: 1 TFLOP/s GPU, 1 GB/s h2d and d2h links, no latency, no overhead.

The schedule (prefill = step 0, one decode step = step 1), with its simulated times:

    op 0 load 1 GB cpu->gpu on `weights` (h2d), allocates 1 GB of gpu      [0.0, 1.0]
    op 1 attention 0.5 TFLOP, step 0, on `compute` (gpu), after op 0       [1.0, 1.5]
    op 2 kv-store 0.5 GB gpu->cpu on `kv_store` (d2h), allocates 0.5 GB
         of cpu, after op 1                                                [1.5, 2.0]
    op 3 free of op 0's 1 GB of gpu on `memory` (none), after op 1         [1.5, 1.5]
    op 4 attention 1 TFLOP, step 1, on `compute` (gpu), after op 1         [1.5, 2.5]

and 0.25 GB of gpu held resident for the whole run.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from core.chrome_trace import to_chrome, write_chrome
from core.cost import CostModel
from core.hardware import HardwareSpec
from core.schedule import Schedule, ScheduleBuilder, validate
from core.spec import Workload
from core.trace import TRACE_COLUMNS, make_trace, prefill_s, summarize
from core.types import OpKind, Resource, Tier
from sim.executor import simulate

GB = 10**9


def round_hw() -> HardwareSpec:
    return HardwareSpec.from_dict(
        {
            "name": "round",
            "memory_gb": {"gpu": 2, "cpu": 4, "disk": 100},
            "gpu": {"tflops": 1.0, "mem_bw_gbps": 1000.0},
            "cpu": {"tflops": 0.1, "mem_bw_gbps": 100.0},
            "links": {"h2d": {"gbps": 1.0}, "d2h": {"gbps": 1.0}, "disk": {"gbps": 0.5}},
        }
    )


def five_ops(h: HardwareSpec) -> Schedule:
    b = ScheduleBuilder(h.memory_bytes)
    b.stream("weights", Resource.H2D)
    b.stream("compute", Resource.GPU)
    b.stream("kv_store", Resource.D2H)
    b.stream("memory", Resource.NONE)
    b.reserve(Tier.GPU, GB // 4)
    w = b.add(
        OpKind.LOAD,
        "weights",
        src=Tier.CPU,
        dst=Tier.GPU,
        nbytes=GB,
        alloc_tier=Tier.GPU,
        alloc_bytes=GB,
        layer=0,
    )
    a0 = b.add(OpKind.ATTENTION, "compute", (w,), step=0, layer=0, flops=0.5e12)
    b.add(
        OpKind.KV_STORE,
        "kv_store",
        (a0,),
        step=0,
        layer=0,
        src=Tier.GPU,
        dst=Tier.CPU,
        nbytes=GB // 2,
        alloc_tier=Tier.CPU,
        alloc_bytes=GB // 2,
    )
    b.add(OpKind.FREE, "memory", (a0,), free_tier=Tier.GPU, free_bytes=GB)
    b.add(OpKind.ATTENTION, "compute", (a0,), step=1, layer=0, flops=1e12)
    s = b.build()
    validate(s)
    return s


@pytest.fixture
def sim_run():
    h = round_hw()
    s = five_ops(h)
    start, end = simulate(s, CostModel(h))
    return s, start, end


def test_simulated_times(sim_run):
    """The times of the module docstring: op 0 1 GB / 1 GB/s = 1 s; op 1 0.5e12 / 1e12 = 0.5 s
    after op 0; op 2 0.5 GB / 1 GB/s = 0.5 s after op 1; op 3 instant at op 1's end; op 4
    1e12 / 1e12 = 1 s after op 1 (and after op 1 in the `compute` FIFO)."""
    _, start, end = sim_run
    assert start == pytest.approx([0.0, 1.0, 1.5, 1.5, 1.5])
    assert end == pytest.approx([1.0, 1.5, 2.0, 1.5, 2.5])


def test_make_trace_one_row_per_op(sim_run):
    """5 ops -> 5 rows in op order with the schema's columns; `resource` is the stream's resource
    (`none` for the free), `bytes` the op's nbytes (1 GB, 0, 0.5 GB, 0, 0)."""
    s, start, end = sim_run
    tr = make_trace(s, start, end, "sim")
    assert list(tr.columns) == TRACE_COLUMNS
    assert tr["op_id"].tolist() == [0, 1, 2, 3, 4]
    assert set(tr["source"].astype(str)) == {"sim"}
    assert tr["resource"].astype(str).tolist() == ["h2d", "gpu", "d2h", "none", "gpu"]
    assert tr["kind"].astype(str).tolist() == [
        "load",
        "compute-attention",
        "kv-store",
        "free",
        "compute-attention",
    ]
    assert tr["bytes"].tolist() == [GB, 0, GB // 2, 0, 0]
    assert tr["step"].tolist() == [0, 0, 0, 0, 1]


def test_summarize_hand_worked(sim_run):
    """Workload: 1 batch of 1 sequence, 2 generated tokens (prefill + 1 decode step).

    makespan = last end = 2.5 s; prefill_s = the time some step-0 op runs: ops 0-2 cover
    0 -> 2.0 s (op 3, the free, is step 0 too but takes no time); decode_s = 2.5 - 2.0 = 0.5 s;
    throughput = 2 tokens / 2.5 s = 0.8 tok/s.
    busy: h2d 1.0 s (op 0), gpu 0.5 + 1.0 = 1.5 s (ops 1, 4), d2h 0.5 s (op 2); `none` not a
    resource. gpu_bubble = 2.5 - 1.5 = 1.0 s (frac 0.4); lower bound = busiest = gpu 1.5 s;
    efficiency = 1.5 / 2.5 = 0.6.
    dag bound: the chain op 0 -> op 1 -> op 4 = 1 + 0.5 + 1 = 2.5 s, the critical path, above
    the resource bound; dag efficiency 2.5 / 2.5 = 1.
    bytes moved: h2d 1 GB, d2h 0.5 GB.
    peak: gpu = 0.25 GB resident + op 0's 1 GB (live from 0 s until op 3 frees it at 1.5 s)
    = 1.25 GB; cpu = op 2's 0.5 GB (never freed); disk 0.
    """
    s, start, end = sim_run
    tr = make_trace(s, start, end, "sim")
    wl = Workload(batch_size=1, n_batches=1, prompt_len=4, gen_len=2)
    m = summarize(s, tr, wl, planner="hand", executor="sim")
    assert list(m)[:2] == ["planner", "executor"]  # labels first
    assert m["tokens_generated"] == 2
    assert m["makespan_s"] == pytest.approx(2.5)
    assert m["prefill_s"] == pytest.approx(2.0)
    assert m["decode_s"] == pytest.approx(0.5)
    assert m["throughput_tok_s"] == pytest.approx(0.8)
    assert m["busy_s"] == pytest.approx({"h2d": 1.0, "gpu": 1.5, "d2h": 0.5})
    assert m["gpu_bubble_s"] == pytest.approx(1.0)
    assert m["gpu_bubble_frac"] == pytest.approx(0.4)
    assert m["lower_bound_s"] == pytest.approx(1.5)
    assert m["efficiency"] == pytest.approx(0.6)
    assert m["dag_lower_bound_s"] == pytest.approx(2.5)
    assert m["dag_bound_binds"] == "critical path"
    assert m["dag_efficiency"] == pytest.approx(1.0)
    assert m["bytes_moved"] == {"h2d": GB, "d2h": GB // 2}
    assert m["peak_bytes"] == {"gpu": GB + GB // 4, "cpu": GB // 2, "disk": 0}
    assert m["ops"] == 5
    json.dumps(m)  # summary.json must serialise as is


def test_summarize_with_other_durations_changes_the_metrics(sim_run):
    """The metrics read the trace, not the cost model: a real trace where op 4 took 2 s
    (1.5 -> 3.5) gives makespan 3.5, gpu busy 0.5 + 2 = 2.5 s, bubble 3.5 - 2.5 = 1.0 s,
    lower bound 2.5 s, efficiency 2.5 / 3.5; prefill still ends at 2.0 s, decode 1.5 s."""
    s, start, end = sim_run
    end = end.copy()
    end[4] = 3.5
    tr = make_trace(s, start, end, "real")
    m = summarize(s, tr, Workload(batch_size=1, n_batches=1, prompt_len=4, gen_len=2))
    assert m["makespan_s"] == pytest.approx(3.5)
    assert m["decode_s"] == pytest.approx(1.5)
    assert m["busy_s"]["gpu"] == pytest.approx(2.5)
    assert m["gpu_bubble_s"] == pytest.approx(1.0)
    assert m["lower_bound_s"] == pytest.approx(2.5)
    assert m["efficiency"] == pytest.approx(2.5 / 3.5)


def test_prefill_of_a_batch_by_batch_schedule_leaves_out_the_decode_between():
    """Two batches run one after the other, each prefill then decode: batch 0 prefills over
    0-2 s (a load 0-1.5 and an attention 1-2 overlapping it) and decodes 2-5 s, batch 1
    prefills 5-6 s and decodes 6-9 s. Prefill is 2 + 1 = 3 s, not the 6 s to its last end."""
    tr = pd.DataFrame(
        {
            "step": [0, 0, 1, 0, 1],
            "batch": [0, 0, 0, 1, 1],
            "start_s": [0.0, 1.0, 2.0, 5.0, 6.0],
            "end_s": [1.5, 2.0, 5.0, 6.0, 9.0],
        }
    )
    assert prefill_s(tr) == pytest.approx(3.0)
    assert prefill_s(tr.iloc[::-1]) == pytest.approx(3.0)  # row order does not matter


def test_chrome_trace_merges_sim_and_real(sim_run, tmp_path):
    """A sim trace and a `real` trace of the same schedule, shifted by 0.1 s, in one Chrome file:
    2 processes (pid 1 = sim, pid 2 = real), each with 4 threads named after the streams in
    order of first use (weights, compute, kv_store, memory -> tid 1..4), every op_id 0..4 once per
    process; the load is a complete event at ts 0 us (sim) / 100000 us (real) lasting 1e6 us,
    the free an instant event."""
    s, start, end = sim_run
    sim = make_trace(s, start, end, "sim")
    real = make_trace(s, start + 0.1, end + 0.1, "real")
    path = tmp_path / "trace.json"
    write_chrome(path, [sim, real])
    doc = json.loads(path.read_text())
    assert path.read_text() == json.dumps(to_chrome([sim, real]))  # the columnar writer's text
    events = doc["traceEvents"]

    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert procs == {1: "sim", 2: "real"}
    streams = ["weights", "compute", "kv_store", "memory"]
    for pid in (1, 2):
        threads = {
            e["tid"]: e["args"]["name"]
            for e in events
            if e.get("name") == "thread_name" and e["pid"] == pid
        }
        assert threads == {i + 1: name for i, name in enumerate(streams)}
        ops = [e for e in events if e["ph"] in ("X", "i") and e["pid"] == pid]
        assert sorted(e["args"]["op_id"] for e in ops) == [0, 1, 2, 3, 4]
        by_id = {e["args"]["op_id"]: e for e in ops}
        assert [by_id[i]["tid"] for i in range(5)] == [1, 2, 3, 4, 2]
        assert by_id[0]["ph"] == "X" and by_id[0]["dur"] == pytest.approx(1e6)
        assert by_id[3]["ph"] == "i"  # the zero-length free
        assert by_id[0]["args"]["source"] == procs[pid]
    ts = {e["pid"]: e["ts"] for e in events if e["ph"] == "X" and e["args"]["op_id"] == 0}
    assert ts == pytest.approx({1: 0.0, 2: 1e5})
    # joined on op_id, real - sim start = 0.1 s for every op
    real_ts = {e["args"]["op_id"]: e["ts"] for e in events if e.get("pid") == 2 and "ts" in e}
    sim_ts = {e["args"]["op_id"]: e["ts"] for e in events if e.get("pid") == 1 and "ts" in e}
    assert np.array([real_ts[i] - sim_ts[i] for i in range(5)]) == pytest.approx([1e5] * 5)


def test_chrome_trace_carries_sm_seconds_only_where_there_are_some(sim_run, tmp_path):
    """`sm_s` (whole-GPU seconds of a pool op's work) goes into an event's args where it has a
    value; NaN (an op that held its resource, or any real op) is left out, so the file stays
    strict JSON."""
    s, start, end = sim_run
    sm = np.full(len(s.ops), np.nan)
    sm[1] = 0.25
    doc = to_chrome([make_trace(s, start, end, "sim", sm_s=sm)])
    json.dumps(doc, allow_nan=False)
    write_chrome(tmp_path / "t.json", [make_trace(s, start, end, "sim", sm_s=sm)])
    assert (tmp_path / "t.json").read_text() == json.dumps(doc)
    ops = {e["args"]["op_id"]: e["args"] for e in doc["traceEvents"] if e["ph"] in ("X", "i")}
    assert ops[1]["sm_s"] == 0.25 and all("sm_s" not in a for i, a in ops.items() if i != 1)


def pool_half_tflop_each(b: ScheduleBuilder, lanes: list[str], source: str = "sim") -> dict:
    """The summary of one 0.5 TFLOP op on each of `lanes` (streams of one pool on round_hw),
    simulated."""
    for s in lanes:
        b.add(OpKind.FFN, s, flops=0.5e12)
    sched = b.build()
    validate(sched)
    cost = CostModel(round_hw())
    parts = cost.pool_parts(sched)
    start, end = simulate(sched, cost, parts)
    # a real trace has the ops' intervals only: no SM-seconds, no launch
    known = dict(sm_s=parts[1], launch_s=parts[0]) if source == "sim" else {}
    trace = make_trace(sched, start, end, source, **known)
    return summarize(sched, trace, Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1))


@pytest.mark.parametrize("source", ["sim", "real"])
def test_bounds_count_a_pools_ops_by_their_work(source):
    """Two 0.5 TFLOP ops on two streams of one pool (CUDA streams sharing the GPU's SMs, both on
    resource `gpu`) run side by side, each at half the GPU: both end at 1 s. The GPU did 1 s of
    work, so the bounds are 1 s, not the 2 s their wall times add up to; a real trace (no
    `sm_s`) gets it from their intervals, half of the overlap each."""
    h = round_hw()
    b = ScheduleBuilder(h.memory_bytes)
    lanes = [b.stream(name, Resource.GPU, 0, pool="sms") for name in ("lane0", "compute")]
    m = pool_half_tflop_each(b, lanes, source)
    assert m["makespan_s"] == pytest.approx(1.0)
    assert m["lower_bound_s"] == pytest.approx(1.0) and m["busy_s"]["gpu"] == pytest.approx(1.0)
    assert m["dag_lower_bound_s"] == pytest.approx(1.0) and m["gpu_bubble_s"] == pytest.approx(0.0)


def test_shares_split_each_overlap_evenly():
    """[0, 2), [1, 3) and [1, 2): on [1, 2) three are open, a third each. Shares: 1 + 1/3,
    1/3 + 1 and 1/3, adding up to the 3 s the union covers; a lone interval gets its length,
    a zero-length one nothing, and a gap between intervals belongs to none."""
    from core.trace import shares_s

    got = shares_s(np.array([0.0, 1.0, 1.0, 5.0, 6.0]), np.array([2.0, 3.0, 2.0, 5.5, 6.0]))
    assert got == pytest.approx([4 / 3, 4 / 3, 1 / 3, 0.5, 0.0])
    assert shares_s(np.zeros(0), np.zeros(0)).shape == (0,)


@pytest.mark.parametrize("source", ["sim", "real"])
def test_bounds_count_a_pools_lanes_as_one_gpu(source):
    """Two lanes of one pool under their own device ids (`gpu`, `gpu:1`: the shared-SM lanes of
    the expert-parallel planners), 0.5 TFLOP each, run side by side at half the GPU each and end
    at 1 s. The one GPU they share did 1 s of work: both bounds are 1 s, not the 0.5 s of the
    busier lane's resource id alone. A real trace, which has the intervals only, gets the same:
    each lane takes half of the second the two overlap (`core.trace.shares_s`)."""
    h = round_hw()
    b = ScheduleBuilder(h.memory_bytes)
    lanes = [b.stream(f"lane{d}", Resource.GPU, d, pool="sms") for d in range(2)]
    m = pool_half_tflop_each(b, lanes, source)
    assert m["makespan_s"] == pytest.approx(1.0)
    assert m["busy_s"] == pytest.approx({"gpu": 0.5, "gpu:1": 0.5})  # per lane, as reported
    assert m["lower_bound_s"] == pytest.approx(1.0)
    assert m["dag_lower_bound_s"] == pytest.approx(1.0)
