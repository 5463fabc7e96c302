"""Klotski planner (planners/klotski.py), its n-planner and placement, on the round-number tiny
model (4 experts, top-2, 2 layers; one expert = 49,152 B) and tiny hardware (1 GB/s links)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import yaml

from core.cost import CostModel
from core.errors import CapacityError, ConfigError
from core.hardware import HardwareSpec
from core.spec import Workload
from core.types import OpKind, Stream, Tensor
from experiments.common.pipeline import RunSpec, build_schedule, simulate_run
from planners.klotski import Klotski, KlotskiParams
from planners.n_planner import N_MAX, LayerTimes, smallest_n
from planners.registry import make_params
from tests.conftest import ROOT, conf, model_from_conf, random_routing

ABLATION = ("klotski_multi", "klotski_hot", "klotski")


def streamed(hw):
    """tiny hardware with a 460 kB GPU: dense weights, one layer of transfer space and buffers
    fit; resident experts do not, so every expert is streamed from CPU memory."""
    from core.types import Tier

    return replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: 460_000})


def plan(model, hw, wl, **params):
    hw = streamed(hw)
    routing = random_routing(model, wl, seed=3)
    params = {"n": -1, **params}
    schedule = build_schedule(RunSpec(model, hw, wl, "klotski", params), routing)
    return schedule, routing.counts(wl)  # counts [steps, L, n, E]


def experts_of(schedule, step, layer, kind=OpKind.EXPERT):
    return [
        o
        for o in schedule.ops
        if o.kind == kind and o.step == step and o.layer == layer and o.tensor == Tensor.EXPERT
    ]


@pytest.mark.parametrize("name", ABLATION)
def test_ablation_configs_are_klotski_params(name):
    cfg = yaml.safe_load((ROOT / "conf" / "planner" / f"{name}.yaml").read_text())
    assert cfg["name"] == "klotski"
    make_params("klotski", cfg["params"])


def test_reorder_runs_each_expert_once_over_the_group_hot_first(tiny_model, tiny_hw, tiny_workload):
    wl = tiny_workload.with_(n_batches=3)
    schedule, counts = plan(tiny_model, tiny_hw, wl, predictor="oracle")
    assert schedule.meta["oracle"]  # labelled as an upper bound
    for step in range(wl.n_steps):
        for layer in range(tiny_model.n_layers):
            ops = experts_of(schedule, step, layer)
            group = counts[step, layer].sum(0)  # [E] tokens per expert over the group
            assert [o.batch for o in ops] == [-1] * len(ops)
            assert sorted(o.expert for o in ops) == sorted(
                np.flatnonzero(group).tolist()
            )  # once each
            assert all(o.tokens == group[o.expert] for o in ops)
            hot = [int(e) for e in np.lexsort((np.arange(4), -group))[:2]]  # the oracle's top-2
            assert [o.expert for o in ops[:2]] == hot  # hot experts computed first
            for o in ops:  # freed right after its (only) use: the compute releases it
                assert o.free_bytes == tiny_model.expert_bytes


def test_prefetch_only_gate_and_k_hot_during_attention(tiny_model, tiny_hw, tiny_workload):
    schedule, counts = plan(tiny_model, tiny_hw, tiny_workload, predictor="oracle", hot_k=1)
    gates = {o.id for o in schedule.ops if o.kind == OpKind.GATE}
    for step in range(tiny_workload.n_steps):
        for layer in range(tiny_model.n_layers):
            loads = experts_of(schedule, step, layer, OpKind.LOAD)
            on_weights = [o for o in loads if o.stream == Stream.WEIGHTS]
            on_demand = [o for o in loads if o.stream == Stream.EXPERTS]
            assert len(on_weights) == 1  # K = 1 hot expert prefetched
            assert all(gates & set(o.deps) for o in on_demand)  # loaded after a gate
            # on-demand loads come in discovery order: batch 0's new experts, then batch 1's
            seen = [on_weights[0].expert]
            for k in range(tiny_workload.n_batches):
                seen += [int(e) for e in np.flatnonzero(counts[step, layer, k]) if e not in seen]
            assert [o.expert for o in on_demand] == seen[1:]


def test_hot_step_runs_experts_per_batch_in_index_order(tiny_model, tiny_hw, tiny_workload):
    schedule, counts = plan(tiny_model, tiny_hw, tiny_workload, reorder=False)
    ops = experts_of(schedule, 1, 0)
    want = [(k, int(e)) for k in range(2) for e in np.flatnonzero(counts[1, 0, k])]
    assert [(o.batch, o.expert) for o in ops] == want
    last = {e: k for k, e in want}  # each expert freed by its last batch's compute, only
    assert all((o.free_bytes > 0) == (last[o.expert] == o.batch) for o in ops)


def test_multi_step_prefetches_the_whole_layer(tiny_model, tiny_hw, tiny_workload):
    schedule, _ = plan(
        tiny_model, tiny_hw, tiny_workload, hot_prefetch=False, reorder=False, predictor="none"
    )
    loads = experts_of(schedule, 0, 0, OpKind.LOAD)
    assert [o.expert for o in loads] == [0, 1, 2, 3] and {o.stream for o in loads} == {
        Stream.WEIGHTS
    }


def test_ablation_runs_in_the_simulator(tiny_model, tiny_hw, tiny_workload):
    for name in ABLATION:
        params = {
            **yaml.safe_load((ROOT / "conf" / "planner" / f"{name}.yaml").read_text())["params"],
            "n": -1,
        }
        s = simulate_run(
            RunSpec(tiny_model, streamed(tiny_hw), tiny_workload, "klotski", params)
        ).summary
        assert s["makespan_s"] >= s["lower_bound_s"] > 0
        assert s["plan"]["n_plan"]["n"] == s["n_batches"]


def test_n_planner_smallest_n_hand_worked():
    """t_cA = 1 ms, t_cG = 0, t_IO_E = 10 ms, t_IO_A = 0.5 ms, every active expert 1 ms.

    Uniform shares over 4 experts, 100 tokens a batch: both cold experts are active (len(Q)=2).
    (5): n >= 20; (6): n + 2 >= 30 -> 28; (7): n + 2 + 2 >= 40 + 0.5 -> 36.5, so n = 37.
    All tokens on the two hot experts: len(Q) = 0, (7): n + 2 >= 20.5 -> 19, (5) n >= 20 binds.
    """
    t = LayerTimes(
        attention_s=1e-3, gate_s=0.0, io_attention_s=0.5e-3, io_gate_s=0.0, io_expert_s=10e-3
    )
    one_ms = lambda tokens: 1e-3 if tokens > 0 else 0.0  # noqa: E731
    uniform = np.full((1, 4), 0.25)
    c = smallest_n(lambda n: ([t], uniform), 100, k_hot=2, top_k=2, expert_time=one_ms)
    assert (c.n, c.binding) == (37, "(7) next attention ready")
    hot_only = np.array([[0.5, 0.5, 0.0, 0.0]])
    c = smallest_n(lambda n: ([t], hot_only), 100, k_hot=2, top_k=2, expert_time=one_ms)
    assert (c.n, c.binding) == (20, "(5) hot experts loaded")
    c = smallest_n(lambda n: ([t], uniform), 100, k_hot=2, top_k=2, expert_time=one_ms, n_max=10)
    assert c.n == 10 and not c.satisfied

    def fits_to_30(n):
        if n > 30:
            raise CapacityError(f"n={n} does not fit")
        return [t], uniform

    c = smallest_n(fits_to_30, 100, k_hot=2, top_k=2, expert_time=one_ms)
    assert c.n == 30 and not c.satisfied and c.binding.startswith("memory (n=31 does not fit")

    # a disk layer whose read-ahead takes 60 ms: n + 2 + 2 >= 60 -> 56; the other layer's (7) -> 37
    disk = replace(t, io_disk_layer_s=60e-3)
    c = smallest_n(
        lambda n: ([t, disk], np.vstack([uniform, uniform])),
        100,
        k_hot=2,
        top_k=2,
        expert_time=one_ms,
    )
    assert (c.n, c.binding) == (56, "disk read-ahead keeps pace")


def test_n_planner_times_disk_layers_by_the_disk(tiny_model, tiny_hw, tiny_workload):
    """Experts on disk: with CPU room for the rolling window the disk reads every expert of the
    layer, which the layer's compute must cover; without it, each expert's copy waits for its
    read, so the slower of disk and host link paces the copies."""
    from core.types import Resource, Tier
    from planners.n_planner import timing

    cost = CostModel(tiny_hw)
    shares = np.full((len(tiny_model.moe_layers), tiny_model.n_experts), 1 / tiny_model.n_experts)
    read_s = cost.transfer_s(Resource.DISK, tiny_model.expert_bytes)
    for cpu, window in ((1.5 * 4, True), (2.5, False)):
        mem = dict(streamed(tiny_hw).memory_bytes)
        mem[Tier.CPU] = int(cpu * tiny_model.expert_bytes)
        hw = replace(tiny_hw, memory_bytes=mem)
        times, streamed_shares = timing(tiny_model, hw, tiny_workload, cost, shares, 1)(1)
        assert len(times) == len(streamed_shares) == len(tiny_model.moe_layers)
        on_disk = [t for t in times if t.io_disk_layer_s or t.io_expert_s == read_s]
        assert on_disk, "some expert layer spills to disk"
        for t in on_disk:
            if window:
                assert t.io_disk_layer_s == pytest.approx(tiny_model.n_experts * read_s)
            else:
                assert t.io_disk_layer_s == 0 and t.io_expert_s == max(
                    read_s, cost.transfer_s(Resource.H2D, tiny_model.expert_bytes)
                )


def test_auto_n_is_used_and_recorded(tiny_model, tiny_hw, tiny_workload):
    spec = RunSpec(tiny_model, tiny_hw, tiny_workload, "klotski", {"n": 0})
    n = Klotski(KlotskiParams(n=0)).choose_n_batches(
        tiny_model, tiny_hw, tiny_workload, CostModel(tiny_hw)
    )
    s = simulate_run(spec).summary
    assert s["n_batches"] == n == s["plan"]["n_plan"]["n"]
    assert s["plan"]["n_plan"]["n_auto"] and s["plan"]["n_plan"]["binding"]


def test_a_run_chooses_its_n_once(tiny_model, tiny_hw, tiny_workload, monkeypatch):
    """The run sizes the workload, probes the plan's fit (routing of any size probed here) and
    plans with one planner, which makes its choice of n once (it was made three times) and
    builds each warm-up table once: the choice's and the predictor's (five before); the plan
    records the choice a new planner makes at the run's n."""
    import planners.klotski as k

    calls, tables = [], []
    solve, warm = k.solve_n, k.warmup_table
    monkeypatch.setattr(k, "solve_n", lambda *a, **kw: calls.append(a[2]) or solve(*a, **kw))
    monkeypatch.setattr(k, "warmup_table", lambda *a: tables.append(a[1]) or warm(*a))
    monkeypatch.setattr("experiments.common.pipeline.PROBE_ROUTING_BYTES", 0)
    hw = streamed(tiny_hw)
    s = simulate_run(RunSpec(tiny_model, hw, tiny_workload, "klotski", {"n": 0})).summary
    assert len(calls) == 1 and [wl.n_batches for wl in tables] == [N_MAX, s["n_batches"]]
    wl = tiny_workload.with_(n_batches=s["n_batches"])
    fresh = Klotski(KlotskiParams(n=0)).choose(tiny_model, hw, wl, CostModel(hw))
    assert s["plan"]["n_plan"] == fresh.meta() and len(calls) == 2


def test_a_planner_chooses_again_for_other_hardware(tiny_model, tiny_hw, tiny_workload):
    """The choice is kept for the inputs it read: other hardware (the same name, a smaller GPU)
    or another cost model gets its own, the one a new planner makes."""
    planner, hw = Klotski(KlotskiParams(n=0)), streamed(tiny_hw)
    for h, cost in [(tiny_hw, tiny_hw), (hw, tiny_hw), (hw, hw), (tiny_hw, tiny_hw)]:
        got = planner.choose(tiny_model, h, tiny_workload, CostModel(cost))
        assert got == Klotski(KlotskiParams(n=0)).choose(
            tiny_model, h, tiny_workload, CostModel(cost)
        )
    assert planner.choose(tiny_model, hw, tiny_workload, CostModel(hw)).n != got.n


def test_an_n_that_cannot_fit_names_what_it_needs(tiny_model, tiny_hw):
    from core.spec import Workload

    wl = Workload(batch_size=1000, n_batches=1, prompt_len=8, gen_len=3)
    planner = Klotski(KlotskiParams(n=400))
    with pytest.raises(CapacityError, match=r"n=400 batches of 1000 sequences does not fit: .*GB"):
        planner.choose_n_batches(tiny_model, tiny_hw, wl, CostModel(tiny_hw))


def test_a_batch_that_cannot_fit_alone_asks_for_a_smaller_batch(tiny_model, tiny_hw):
    """At n=1 a smaller n is no way out: the error names the batch size and context instead."""
    from core.spec import Workload

    wl = Workload(batch_size=400_000, n_batches=1, prompt_len=8, gen_len=3)
    with pytest.raises(
        CapacityError, match=r"n=1 batches .*lower workload.prompt_len or workload.batch_size"
    ) as e:
        Klotski(KlotskiParams(n=0)).choose_n_batches(tiny_model, tiny_hw, wl, CostModel(tiny_hw))
    assert "smaller n" not in str(e.value)


def test_auto_n_that_cannot_fit_is_lowered_to_the_largest_that_does(
    tiny_model, tiny_hw, tiny_workload
):
    """On tiny hardware compute is far too short to hide a 49 us expert load at any n <= 256, and
    256 groups do not fit: the planner takes the largest n that fits, and says memory bound it."""
    from planners.n_planner import placement_for

    hw = streamed(tiny_hw)
    planner = Klotski(KlotskiParams(n=0))
    choice = planner.choose(tiny_model, hw, tiny_workload, CostModel(tiny_hw))
    assert choice.binding.startswith(f"memory (n={choice.n + 1} does not fit")
    assert not choice.satisfied and 1 <= choice.n < 256
    placement_for(tiny_model, hw, tiny_workload.with_(n_batches=choice.n), 2)  # fits
    with pytest.raises(CapacityError):
        placement_for(tiny_model, hw, tiny_workload.with_(n_batches=choice.n + 1), 2)


def test_a_hand_set_n_says_whether_the_inequalities_hold(tiny_model, tiny_hw, tiny_workload):
    """n=1 on streamed tiny hardware hides no expert load: the plan records that (before, a hand
    set n always claimed they held)."""
    hw = streamed(tiny_hw)
    choice = Klotski(KlotskiParams(n=1)).choose(tiny_model, hw, tiny_workload, CostModel(hw))
    assert (choice.n, choice.auto, choice.satisfied) == (1, False, False)
    assert choice.binding.startswith("manual: (") and choice.binding.endswith("fails")


def test_bad_params_are_rejected():
    with pytest.raises(ConfigError, match="predictor"):
        make_params("klotski", {"predictor": "crystal_ball"})


def test_disk_layers_are_read_ahead_through_a_cpu_window(tiny_model, tiny_hw, tiny_workload):
    """CPU too small for the experts: they live on disk and are read ahead into a CPU window."""
    from core.types import Tier

    mem = dict(streamed(tiny_hw).memory_bytes)
    mem[Tier.CPU] = int(1.5 * 4 * tiny_model.expert_bytes)  # 1.5 expert layers: layer 1 spills

    hw = replace(tiny_hw, memory_bytes=mem)
    schedule, _ = plan(tiny_model, hw, tiny_workload, disk_window=1)
    assert "disk" in schedule.meta["placement"]["expert_layers"]
    reads = [o for o in schedule.ops if o.stream == Stream.DISK]
    assert reads and all(o.src == Tier.DISK and o.dst == Tier.CPU for o in reads)
    s = simulate_run(
        RunSpec(tiny_model, hw, tiny_workload, "klotski", {"n": -1, "disk_window": 1})
    ).summary
    assert s["peak_bytes"]["cpu"] <= mem[Tier.CPU]
    # with the 1-layer window staged, the other half layer holds no whole layer: both on disk
    assert s["plan"]["placement"]["expert_layers"] == {"disk": 2}


@pytest.mark.parametrize("name", ABLATION)
def test_disk_reads_run_ahead_when_cpu_cannot_hold_the_window(
    name, tiny_model, tiny_hw, tiny_workload
):
    """CPU too small for even one expert layer (no rolling window): each expert's disk read
    waits only for CPU room and the gates that chose it, not for the GPU side, so the disk reads
    the next layer while this one computes; the run neither deadlocks nor overfills CPU memory."""
    from core.types import Tier

    mem = dict(streamed(tiny_hw).memory_bytes)
    mem[Tier.CPU] = int(2.5 * tiny_model.expert_bytes)  # room for two experts in flight
    hw = replace(tiny_hw, memory_bytes=mem)
    params = {
        **yaml.safe_load((ROOT / "conf" / "planner" / f"{name}.yaml").read_text())["params"],
        "n": -1,
    }
    spec = RunSpec(tiny_model, hw, tiny_workload, "klotski", params)
    for seed in range(4):
        routing = random_routing(tiny_model, tiny_workload, seed=seed)
        schedule = build_schedule(spec, routing)
        assert schedule.meta["placement"]["expert_layers"] == {"disk": 2}
        ops = schedule.ops
        reads = [o for o in ops if o.stream == Stream.DISK]
        assert reads
        for r in reads:
            kinds = {ops[d].kind for d in r.deps}
            assert OpKind.EXPERT not in kinds and kinds <= {OpKind.GATE}
            if r.layer == 1:  # chosen with layer 0's routing (hot) or by a layer-1 gate (cold)
                assert kinds == {OpKind.GATE} or not params.get("hot_prefetch", True)
        result = simulate_run(spec, routing)
        assert result.summary["peak_bytes"]["cpu"] <= mem[Tier.CPU]
        tr = result.trace
        step0 = tr[tr["step"] == 0]
        read1 = step0[(step0["resource"] == "disk") & (step0["layer"] == 1)]["start_s"].min()
        expert0 = step0[(step0["kind"] == "compute-expert") & (step0["layer"] == 0)]["end_s"].max()
        assert read1 < expert0  # the disk was reading layer 1 before layer 0's experts were done


@pytest.mark.parametrize("speculate", [0, 1])
def test_without_the_window_the_next_ranked_expert_is_read_before_the_gates(
    speculate, tiny_model, tiny_hw, tiny_workload
):
    """No rolling window: per layer, the K hot experts and `disk_speculate` more (the predictor's
    next ranks) are read before that layer's gates, hot first; the rest after a gate chose them.
    A speculative copy no gate chose is dropped, so CPU memory never overfills."""
    from core.types import Tier

    mem = dict(streamed(tiny_hw).memory_bytes)
    mem[Tier.CPU] = int(2.5 * tiny_model.expert_bytes)
    hw = replace(tiny_hw, memory_bytes=mem)
    spec = RunSpec(tiny_model, hw, tiny_workload, "klotski", {"n": -1, "disk_speculate": speculate})
    k = tiny_model.top_k
    for seed in range(4):
        routing = random_routing(tiny_model, tiny_workload, seed=seed)
        schedule = build_schedule(spec, routing)
        ops = schedule.ops
        for step, layer in {(o.step, o.layer) for o in ops if o.stream == Stream.DISK}:
            reads = [
                o for o in ops if o.stream == Stream.DISK and (o.step, o.layer) == (step, layer)
            ]
            early = [
                o
                for o in reads
                if not any(ops[d].kind == OpKind.GATE and ops[d].layer == layer for d in o.deps)
            ]
            assert len(early) == k + speculate
            hot_loads = {
                o.expert
                for o in ops
                if o.stream == Stream.WEIGHTS
                and o.tensor == Tensor.EXPERT
                and (o.step, o.layer) == (step, layer)
            }
            assert {o.expert for o in early[:k]} == hot_loads  # hot first in the disk queue
        assert simulate_run(spec, routing).summary["peak_bytes"]["cpu"] <= mem[Tier.CPU]


def test_the_n_planners_warm_up_is_past_any_group_it_may_choose(
    tiny_model, tiny_hw, tiny_workload, monkeypatch
):
    """The warm-up routing statistics come from sequences the run cannot evaluate: past N_MAX
    batches (before, past one batch, so a chosen n > 1 evaluated the warm-up's sequences)."""
    import planners.klotski as k
    from planners.n_planner import N_MAX

    seen = []
    real = k.warmup_table
    monkeypatch.setattr(k, "warmup_table", lambda m, wl, s: seen.append(wl) or real(m, wl, s))
    Klotski(KlotskiParams(n=0)).choose(tiny_model, tiny_hw, tiny_workload, CostModel(tiny_hw))
    assert seen and seen[0].n_sequences >= N_MAX * tiny_workload.batch_size


def test_klotski_plans_with_room_for_the_dense_weights_but_not_the_whole_disk_window():
    """The tiny model with 0.3 MB of GPU and 0.4 MB of CPU: the dense weights (116 KB) fit the
    CPU beside one expert's staging, not beside the two-layer disk window (393 KB), which was set
    aside first, so every n was refused ("fit neither GPU nor CPU memory"; disk_window=1 ran).
    CPU memory goes to the weights first; the window takes what is left."""
    m = model_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=4, gen_len=3)
    d = conf("hardware", "tiny")
    d["memory_gb"] = {"gpu": 0.0003, "cpu": 0.0004, "disk": 100.0}
    hw = HardwareSpec.from_dict(d)
    s = simulate_run(RunSpec(m, hw, wl, "klotski", {}), random_routing(m, wl)).summary
    assert s["plan"]["placement"]["dense"] == "cpu"
    assert s["plan"]["placement"]["expert_layers"] == {"disk": 2}
    assert s["peak_bytes"]["cpu"] <= 400_000 and s["makespan_s"] > 0


def test_attention_spans_merge_batches_where_kv_stays_on_the_gpu(tiny_model, tiny_hw):
    """attn_batches: 1 (the default) is the paper's schedule op for op; 0 merges the group's
    attention at each decode layer into one op whose tokens, flops and KV bytes are the sums
    of its batches' and whose weights are read once; the gates after it run as one op over the
    same batches, which each batch's routing is seen at."""
    from core.schedule import validate

    wl = Workload(batch_size=2, n_batches=3, prompt_len=8, gen_len=3)
    base, _ = plan(tiny_model, tiny_hw, wl)
    same, _ = plan(tiny_model, tiny_hw, wl, attn_batches=1)
    assert same.ops == base.ops
    merged, _ = plan(tiny_model, tiny_hw, wl, attn_batches=0)
    validate(merged)
    assert base.meta["placement"]["kv_layers"] == {"gpu": 2}  # KV stays on the GPU

    def attn(s, step, layer):
        return [
            o for o in s.ops if o.kind == OpKind.ATTENTION and (o.step, o.layer) == (step, layer)
        ]

    per = attn(base, 0, 0)
    assert [(o.batch, o.batches) for o in attn(merged, 0, 0)] == [(k, 1) for k in range(3)]
    for step in (1, 2):
        for layer in (0, 1):
            (op,) = attn(merged, step, layer)
            per = attn(base, step, layer)
            assert (op.batch, op.batches) == (0, 3)
            assert op.tokens == sum(o.tokens for o in per)
            assert op.flops == pytest.approx(sum(o.flops for o in per))
            kv = sum(o.touch_bytes - tiny_model.attn_bytes for o in per)
            assert op.touch_bytes == tiny_model.attn_bytes + kv
            gates = [
                o
                for o in merged.ops
                if o.kind == OpKind.GATE and (o.step, o.layer) == (step, layer)
            ]
            (gate,) = gates
            assert (gate.batch, gate.batches) == (0, 3) and op.id in gate.deps
            assert gate.tokens == 3 * wl.batch_size * wl.step_tokens(step)
            # every expert op of the layer depends on the one gate of the span
            experts = [
                o
                for o in merged.ops
                if o.kind == OpKind.EXPERT and (o.step, o.layer) == (step, layer)
            ]
            assert experts and all(gate.id in o.deps for o in experts)
    # (n - 1) attention and (n - 1) gate ops fewer per decode layer
    assert len(base.ops) - len(merged.ops) == 2 * 2 * 2 * 2
    # the simulator prices the merged op from its sums: less time (per-op overhead once)
    a = simulate_run(RunSpec(tiny_model, streamed(tiny_hw), wl, "klotski", {"n": -1})).summary
    b = simulate_run(
        RunSpec(tiny_model, streamed(tiny_hw), wl, "klotski", {"n": -1, "attn_batches": 0})
    ).summary
    assert b["ops"] == a["ops"] - 16
    assert b["busy_s"]["gpu"] < a["busy_s"]["gpu"]  # per-op overhead once per span
    # (a span's gate reveals its first batches' cold experts after the span's other routers,
    # so their loads may start a router's time later: no slower than that)
    assert b["makespan_s"] <= a["makespan_s"] * 1.01
    # pairs at every step: the last span of the odd group is one batch
    pairs, _ = plan(tiny_model, tiny_hw, wl, attn_batches=2)
    assert [(o.batch, o.batches) for o in attn(pairs, 0, 1)] == [(0, 2), (2, 1)]


def test_attention_spans_keep_an_offloaded_kv_batch_by_batch(tiny_model, tiny_hw):
    """Where a layer's KV is offloaded (loaded and stored per batch), its attention stays batch
    by batch; the layer whose KV stays on the GPU merges at decode."""
    from core.types import Tier

    wl = Workload(batch_size=2, n_batches=3, prompt_len=8, gen_len=8)
    hw = replace(tiny_hw, memory_bytes={**tiny_hw.memory_bytes, Tier.GPU: 300_000})
    s = build_schedule(
        RunSpec(tiny_model, hw, wl, "klotski", {"n": -1, "attn_batches": 0}),
        random_routing(tiny_model, wl, seed=3),
    )
    assert s.meta["placement"]["kv_layers"] == {"gpu": 1, "cpu": 1}
    offloaded = {o.layer for o in s.ops if o.kind == OpKind.KV_LOAD}
    assert len(offloaded) == 1
    for o in (o for o in s.ops if o.kind == OpKind.ATTENTION):
        assert o.batches == (3 if o.step > 0 and o.layer not in offloaded else 1), o.label()


def test_attention_spans_param_is_checked():
    with pytest.raises(ConfigError, match="attn_batches"):
        make_params("klotski", {"attn_batches": -1})
