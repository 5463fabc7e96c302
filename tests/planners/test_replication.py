"""Expert-parallel planners (ep_static, eplb, predictive_replication, oracle_replication) run
in the simulator: balance reported, tokens and copies over p2p or lanes, memory per GPU, the
SM share of collectives and copies, and bad input as one error."""

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.errors import CapacityError, ConfigError
from core.hardware import HardwareSpec, LinkSpec
from core.spec import ModelSpec, RoutingConfig, Workload
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from experiments.common.pipeline import RunSpec, simulate_run
from tests.planners.ep_common import tiny_spec

PLANNERS = ["ep_static", "eplb", "predictive_replication", "oracle_replication"]


@pytest.mark.parametrize("planner", PLANNERS)
def test_planner_runs_and_reports_balance(planner):
    """Validates, simulates on 2 lanes; each routed token computed once; summary has the fields."""
    params = {} if planner == "ep_static" else {"replica_slots": 1}
    res = simulate_run(tiny_spec(planner, lanes=True, **params))
    s = res.summary
    ex = res.trace[res.trace["kind"].astype(str) == str(OpKind.EXPERT)]
    assert (
        ex["tokens"].sum() == 2 * 3 * (8 + 1) * 2 * 2
    )  # bs x batches x (prompt + 1 decode) x top_k x 2 MoE layers
    assert set(ex["resource"].astype(str)) <= {"gpu", "gpu:1"}
    assert 0 < s["balancedness"] <= 1 and 0 < s["utilisation"] <= 1
    # the GPU bubble is the one GPU's time with no lane running a kernel (it was lane 0's and
    # the whole-GPU ops' idle time), and on 2 GPUs their mean idle time (it was GPU 0's)
    assert s["gpu_bubble_frac"] == pytest.approx(1 - s["gpu_load"])
    g2 = simulate_run(tiny_spec(planner, lanes=False, **params)).summary
    assert g2["gpu_bubble_frac"] == pytest.approx(1 - g2["utilisation"])
    assert g2["gpu_bubble_frac"] != pytest.approx(1 - g2["device_busy_frac"][0])
    assert ("oracle upper bound" in s["planner_label"]) == (planner == "oracle_replication")
    # the planners that plan from a load say how far it was from the truth
    tv = s["plan"]["ep"].get("prediction_tv")
    assert (tv is not None) == (planner in ("predictive_replication", "oracle_replication"))
    assert tv is None or (tv == 0.0) == (planner == "oracle_replication") and 0 <= tv <= 1


def test_blended_oracle_plans_at_a_known_distance_and_is_not_called_a_bound(tmp_path):
    prior = tmp_path / "prior.npy"
    np.save(prior, np.array([[8.0, 1, 1, 1], [1, 1, 1, 8]]))  # tiny: 2 MoE layers, 4 experts
    tv = {}
    for w in (1.0, 0.5, 0.0):
        s = simulate_run(
            tiny_spec(
                "oracle_replication", replica_slots=1, initial_load=str(prior), truth_weight=w
            )
        ).summary
        tv[w] = s["plan"]["ep"]["prediction_tv"]
        assert s["planner_label"] == "oracle_replication" + (
            " (oracle upper bound)" if w == 1.0 else " (peeks at the routing)"
        )
    # the blend's shares are w x the truth's + (1 - w) x the prior's: its distance scales by 1 - w
    assert tv[1.0] == 0.0 and tv[0.0] > 0.1
    assert tv[0.5] == pytest.approx(tv[0.0] / 2)


def test_gpus_mode_moves_tokens_and_replicas_over_p2p():
    """Each replica copy arrives over its destination's link and leaves its source's by the
    outgoing direction, from the source the real run sends it from (`copy_moves`); the
    destination's experts wait for both ends."""
    res = simulate_run(tiny_spec("oracle_replication", replica_slots=1))
    kinds = set(res.trace["kind"].astype(str))
    assert {str(OpKind.DISPATCH), str(OpKind.COMBINE)} <= kinds
    tr = res.trace[(res.trace["kind"].astype(str) == str(OpKind.LOAD))]
    into = tr[tr["stream"].astype(str).str.fullmatch(r"replicas\d")]
    out = tr[tr["stream"].astype(str).str.startswith("replicas_out")]
    assert len(into) == len(out) == res.summary["plan"]["ep"]["copies"] > 0
    assert len(into) + len(out) == len(tr)
    assert set(into["resource"].astype(str)) <= {"p2p", "p2p:1"}
    assert set(out["resource"].astype(str)) <= {"p2p_out", "p2p_out:1"}
    ops, streams = res.schedule.ops, res.schedule.streams
    # each direction of a GPU's link is one pool: copies and the all-to-all share its bandwidth
    # (NCCL's kernels on the copies' own process group run beside the all-to-all's)
    for spec in streams.values():
        if spec.resource in (Resource.P2P, Resource.P2P_OUT):
            assert spec.pool == f"{spec.resource}:{spec.device}", spec.name
    for o in ops:  # a copy's two ends (emitted together) are on different GPUs, for one expert
        if (
            o.kind == OpKind.LOAD
            and streams[o.stream].name.startswith("replicas")
            and not streams[o.stream].name.startswith("replicas_out")
        ):
            twin = ops[o.id + 1]
            assert streams[twin.stream].name.startswith("replicas_out")
            assert (twin.expert, twin.layer, twin.deps) == (o.expert, o.layer, o.deps)
            assert streams[twin.stream].device != streams[o.stream].device
    waited = 0
    for o in ops:  # experts wait for both ends of each copy they wait for
        if o.kind == OpKind.EXPERT:
            names = [streams[ops[d].stream].name for d in o.deps if ops[d].kind == OpKind.LOAD]
            n_out = sum(n.startswith("replicas_out") for n in names)
            assert n_out == len(names) - n_out
            waited += n_out
    assert waited > 0


def test_all_to_all_leaves_the_gpu_holding_the_sequences():
    """Batch 1 on 2 GPUs: GPU 0 holds the one sequence, so every pair GPU 1 computes comes from
    it. They leave by GPU 0's outgoing link (`send0`, p2p_out) and arrive by GPU 1's incoming
    one; the results travel back the other way. Before, each GPU was charged half of its own
    pairs as received, and GPU 0's sends were charged nowhere. GPU 1's experts wait for both
    ends of the dispatch, and GPU 0's receive of the results for GPU 1's experts."""
    spec = tiny_spec("ep_static")
    res = simulate_run(replace(spec, workload=replace(spec.workload, batch_size=1)))
    ops, streams = res.schedule.ops, res.schedule.streams
    name = {o.id: streams[o.stream].name for o in ops}
    remote = sum(o.tokens for o in ops if o.kind == OpKind.EXPERT and name[o.id] == "compute1")
    assert remote > 0
    assert res.summary["plan"]["ep"]["pairs_sent"] == [remote, 0]
    for kind, out, into in (
        (OpKind.DISPATCH, "send0", "dispatch1"),
        (OpKind.COMBINE, "send1", "combine0"),
    ):
        moved = [o for o in ops if o.kind == kind]
        assert {name[o.id] for o in moved} == {out, into}
        for stream in (out, into):
            assert sum(o.tokens for o in moved if name[o.id] == stream) == remote
    assert [streams[s].resource_id for s in ("send0", "send1")] == ["p2p_out", "p2p_out:1"]
    for o in ops:
        deps = {name[d] for d in o.deps}
        if o.kind == OpKind.EXPERT and name[o.id] == "compute1":
            assert {"send0", "dispatch1"} <= deps
        if o.kind == OpKind.COMBINE and name[o.id] == "combine0":
            assert "compute1" in deps


def test_lanes_copy_on_the_one_gpus_queue():
    """Lanes are one GPU: every lane's replica copies run on its one copy path (`replicas` on
    `d2d`, at half its HBM bandwidth), so they add up there, not on a link per lane."""
    res = simulate_run(
        tiny_spec(
            "predictive_replication", lanes=True, replica_slots=1, predictor="last", gate="none"
        )
    )
    copies = res.trace[res.trace["kind"].astype(str) == str(OpKind.LOAD)]
    assert len(copies) == res.summary["plan"]["ep"]["copies"] > 1
    assert set(copies["stream"].astype(str)) == {"replicas"}
    assert set(copies["resource"].astype(str)) == {"d2d"}
    # no link between GPUs is declared: lanes move no tokens (the validator rejects p2p here)
    links = {s.resource for s in res.schedule.streams.values()}
    assert not links & {Resource.P2P, Resource.P2P_OUT}
    spec = tiny_spec("ep_static")
    d2d = spec.hardware.link(Resource.D2D)
    assert d2d.bandwidth_bytes_per_s == spec.hardware.gpu.mem_bw_bytes_per_s / 2
    took = (copies["end_s"] - copies["start_s"]).to_numpy()
    assert took == pytest.approx(d2d.time_s(spec.model.expert_bytes))
    ends = copies.sort_values("start_s")
    assert (ends["start_s"].to_numpy()[1:] >= ends["end_s"].to_numpy()[:-1] - 1e-12).all()


def test_lanes_gate_charges_every_lanes_copies_as_one_queue(monkeypatch):
    """The time+copy gate on lanes judges a placement by the copies of all lanes on the one
    queue: with each lane's queue judged alone (the gate before) it accepts more copies."""
    from planners import expert_parallel as ep

    spec = tiny_spec(
        "predictive_replication",
        lanes=True,
        replica_slots=1,
        predictor="last",
        gate="time+copy",
        n_devices=4,
    )
    spec = replace(
        spec,
        workload=replace(spec.workload, batch_size=8),
        hardware=replace(
            spec.hardware, links={**spec.hardware.links, Resource.D2D: LinkSpec(1e10, 0.0)}
        ),
    )
    one = simulate_run(spec).summary["plan"]["ep"]["copies"]
    queue = ep.ExpertTime.queue  # each lane's queue judged alone, as on G GPUs
    monkeypatch.setattr(
        ep.ExpertTime, "queue", lambda self, s, r: queue(replace(self, one_link=False), s, r)
    )
    each = simulate_run(spec).summary["plan"]["ep"]["copies"]
    assert one < each


def test_too_many_replica_slots_name_the_param():
    """Past the model's experts (a device holds one copy of each at most), or past memory."""
    with pytest.raises(
        ConfigError, match=r"planner\.params\.replica_slots=\d+ exceeds the model's"
    ):
        simulate_run(tiny_spec("predictive_replication", replica_slots=10**6))
    spec = tiny_spec("predictive_replication", replica_slots=4)  # the model's 4 experts
    small = {**spec.hardware.memory_bytes, Tier.GPU: 500_000}  # room for one slot
    spec = replace(spec, hardware=replace(spec.hardware, memory_bytes=small))
    with pytest.raises(
        CapacityError, match=r"planner\.params\.replica_slots=\d+: .* lower replica_slots"
    ):
        simulate_run(spec)


def test_memory_is_checked_per_gpu():
    """On G GPUs each holds the dense weights, its share of the experts, its slots and its
    sequences' KV. Mixtral-8x22B's experts (271 GB) fit 8 H200s, not one: all G GPUs' experts
    were checked against one GPU's memory, so it was refused, and the replica slots that fit
    were 1/G of the truth. Lanes are one GPU: every lane's slots count against it."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/mixtral-8x22b.yaml").read_text()))
    wl = Workload(
        batch_size=8,
        n_batches=1,
        prompt_len=16,
        gen_len=1,
        routing=RoutingConfig(source="synthetic"),
    )
    slot = len(m.moe_layers) * m.expert_bytes
    held = m.total_bytes - m.n_experts * slot + m.n_experts // 8 * slot  # dense + 1/8 experts
    fit = int((hw.memory_bytes[Tier.GPU] - held) // slot)  # KV at 17 tokens: under one slot
    s = simulate_run(RunSpec(m, hw, wl, "eplb", {"n_devices": 8, "replica_slots": fit})).summary
    assert s["peak_bytes"]["gpu"] <= 8 * hw.memory_bytes[Tier.GPU]
    with pytest.raises(CapacityError, match=rf"lower replica_slots \(at most {fit} fit\)"):
        simulate_run(RunSpec(m, hw, wl, "eplb", {"n_devices": 8, "replica_slots": fit + 1}))
    with pytest.raises(CapacityError, match=r"do not fit 1 GPU\(s\) of 149 GB"):
        simulate_run(RunSpec(m, hw, wl, "ep_static", {"n_devices": 8, "lanes": True}))


@pytest.mark.parametrize(
    "planner, params, match",
    [
        (
            "predictive_replication",
            {"replica_slots": 1, "replicas": 3},
            "exceeds the 2 replica slots",
        ),
        ("ep_static", {"n_devices": 5}, r"n_devices=5 must be in \[1, 4\]"),
        ("eplb", {"initial_load": "tests/planners/missing.npy"}, "cannot read"),
        ("oracle_replication", {"truth_weight": 1.5}, r"truth_weight=1.5 must be in \[0, 1\]"),
        # ran as -1 (every slot)
        ("predictive_replication", {"replicas": -5}, r"replicas=-5: must be an integer >= -1"),
        # accepted and never read
        ("eplb", {"gate": "time+copy"}, "gate='time\\+copy': eplb has no replica cost gate"),
        ("ep_static", {"gate": "time"}, "gate='time': ep_static has no replica cost gate"),
    ],
)
def test_bad_input_is_one_config_error(planner, params, match):
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec(planner, **params))


def test_more_gpus_than_the_hardware_has_is_one_config_error():
    """G GPUs on hardware with fewer: refused (memory would be G x the GPU's, and the device
    links fall back to PCIe); G lanes of the one GPU are not GPUs and run."""
    spec = tiny_spec("ep_static")
    spec = replace(spec, hardware=replace(spec.hardware, n_gpus=1))
    with pytest.raises(ConfigError, match=r"n_devices=2 exceeds hardware tiny's n_gpus=1"):
        simulate_run(spec)
    assert simulate_run(replace(spec, params={**spec.params, "lanes": True})).summary


def test_eplb_rounds_its_replicas_down_to_equal_devices():
    """4 experts on 3 devices with 2 replica slots each: 10 physical experts do not split evenly
    over 3 devices as EPLB lays them out, so eplb uses 9 (5 replicas, within the budget of 6);
    with no replica slots 4 experts cannot be 3 equal shares, one line naming the fix."""
    s = simulate_run(tiny_spec("eplb", n_devices=3, lanes=True, replica_slots=2)).summary
    assert s["plan"]["eplb"]["replicas_used"] == 5
    with pytest.raises(
        ConfigError, match=r"need at least 2 replicas .* raise planner.params.replica_slots"
    ):
        simulate_run(tiny_spec("eplb", n_devices=3, lanes=True, replica_slots=0))


def test_eplb_load_matrix_of_wrong_shape(tmp_path):
    bad = tmp_path / "load.npy"
    np.save(bad, np.ones((3, 4)))  # tiny has 2 MoE layers
    with pytest.raises(ConfigError, match=r"shape \(3, 4\).*\[2 MoE layers, 4 experts\]"):
        simulate_run(tiny_spec("eplb", initial_load=str(bad)))


@pytest.mark.parametrize(
    "values, match",
    [
        (np.full((2, 4), np.nan), r"finite counts in \[0, 1e\+15\].*8 NaN"),
        (np.full((2, 4), 1e308), "max 1e"),  # its sums overflowed, with numpy's warnings
        (-np.ones((2, 4)), "min -1.0"),
        (np.array([["a"] * 4] * 2), "not numbers"),
        (np.ones((2, 4), np.complex64), "complex64, not numbers"),  # was cast with a warning
    ],
)
def test_eplb_load_matrix_that_is_no_load(values, match, tmp_path):
    """A load matrix of the right shape but no loads in it (NaN, negative, text) is
    refused, not turned into a placement."""
    bad = tmp_path / "load.npy"
    np.save(bad, values)
    with pytest.raises(ConfigError, match=match):
        simulate_run(tiny_spec("eplb", initial_load=str(bad)))


def test_cli_exits_non_zero_with_one_line(tmp_path, cli_here):
    r = cli_here(
        "experiments.run",
        "model=tiny",
        "hardware=tiny",
        "workload=tiny",
        "planner=predictive_replication",
        "+planner.params.replicas=9",
        f"hydra.run.dir={tmp_path}",
    )
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith("error: planner.params.replicas=9 exceeds")


def test_grouped_gemm_is_one_op_per_device_and_layer():
    """grouped_gemm: one expert op per (step, layer, batch, device), reading the weights of the
    distinct experts it serves; per-expert mode: one op per (device, expert), same tokens."""
    grouped = simulate_run(tiny_spec("ep_static", lanes=True, grouped_gemm=True))
    loop = simulate_run(tiny_spec("ep_static", lanes=True, grouped_gemm=False))
    keys = ["step", "layer", "batch", "resource"]
    ex_g, ex_l = (
        r.trace[r.trace["kind"].astype(str) == str(OpKind.EXPERT)] for r in (grouped, loop)
    )
    assert ex_g.groupby(keys, observed=True).size().max() == 1
    assert len(ex_l) > len(ex_g)
    assert ex_g["tokens"].sum() == ex_l["tokens"].sum()
    n_busy = ex_l.groupby(keys, observed=True).size()  # distinct experts per device and layer
    g_ops = [o for o in grouped.schedule.ops if o.kind == OpKind.EXPERT]
    l_ops = [o for o in loop.schedule.ops if o.kind == OpKind.EXPERT]
    assert (
        sum(o.touch_bytes for o in g_ops)
        == sum(o.touch_bytes for o in l_ops)
        == len(l_ops) * l_ops[0].touch_bytes
    )
    assert len(n_busy) == len(g_ops)


def test_lanes_partition_one_gpu_and_dense_work_runs_on_all_of_it():
    """G = 2 lanes: each expert op runs on its lane's stream at half the GPU (roofline x 2 plus
    one overhead), and every dense op is one whole-GPU op over the batch's tokens on `compute`;
    as 2 GPUs the dense work is split over the devices' sequences instead."""
    from core.cost import CostModel

    spec = tiny_spec("ep_static", lanes=True)
    res = simulate_run(spec)
    cost, sched = CostModel(spec.hardware), res.schedule
    ex = [o for o in sched.ops if o.kind == OpKind.EXPERT]
    assert {sched.streams[o.stream].name for o in ex} == {"lane0", "lane1"}
    assert {sched.streams[o.stream].share for o in ex} == {0.5}
    t = res.trace.set_index("op_id")
    for o in ex:
        half = cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes, 0.5)
        assert t.loc[o.id, "end_s"] - t.loc[o.id, "start_s"] == pytest.approx(half)
        full = cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes)
        assert half > full
    whole = simulate_run(tiny_spec("ep_static", lanes=True, lane_share=1.0))  # the whole GPU each
    o = next(o for o in whole.schedule.ops if o.kind == OpKind.EXPERT)
    w = whole.trace.set_index("op_id").loc[o.id]
    assert w["end_s"] - w["start_s"] == pytest.approx(
        cost.compute_s(Resource.GPU, o.kind, o.flops, o.touch_bytes)
    )
    dense = [o for o in sched.ops if o.kind in COMPUTE_KINDS and o.kind != OpKind.EXPERT]
    assert {o.stream for o in dense} == {"compute"}
    attn = [o for o in dense if o.kind == OpKind.ATTENTION]
    assert all(o.tokens == 2 * (8 if o.step == 0 else 1) for o in attn)  # batch 2, prompt 8
    gpus = simulate_run(tiny_spec("ep_static")).schedule
    attn_g = [o for o in gpus.ops if o.kind == OpKind.ATTENTION]
    assert len(attn_g) == 2 * len(attn) and {o.tokens for o in attn_g} == {8, 1}


def test_shared_lanes_share_the_gpus_sms_and_utilisation_reads_sm_time():
    """lane_sharing=shared: the lanes and the whole-GPU stream form one pool (share 1 each); an
    expert op's width is its GEMMs' 128 x 128 tiles (tiny: H 64, F 128, SwiGLU: the fused
    gate/up GEMM has 256 columns, 2 tiles per 128 rows; down 64 columns, 1 tile), averaged 2:1;
    utilisation and expert_phase_util count the whole-GPU seconds of work (`sm_s`), not the
    wall time the ops overlap; the work-conserving estimate is moot there."""
    from experiments.common.ep_inputs import work_conserving_s
    from planners.expert_parallel import POOL, expert_width

    spec = tiny_spec("predictive_replication", lanes=True, lane_sharing="shared", grouped_gemm=True)
    res = simulate_run(spec)
    sched, t = res.schedule, res.trace
    used = {o.stream for o in sched.ops if o.kind in COMPUTE_KINDS}
    assert used == {"lane0", "lane1", "compute"}
    assert {(sched.streams[s].pool, sched.streams[s].share) for s in used} == {(POOL, 1.0)}
    m = spec.model
    assert expert_width(m, [5]) == round((2 * 2 + 1) / 3)  # one expert, 5 rows
    assert expert_width(m, [5, 130]) == round((2 * 6 + 3) / 3)  # 1 + 2 row tiles
    ex = [o for o in sched.ops if o.kind == OpKind.EXPERT]
    assert ex and all(o.width >= 1 for o in ex)
    sm = t["sm_s"].to_numpy()
    pooled = t["kind"].astype(str).isin([str(k) for k in COMPUTE_KINDS]).to_numpy()
    assert not np.isnan(sm[pooled]).any() and np.isnan(sm[~pooled]).all()
    assert res.summary["utilisation"] == pytest.approx(sm[pooled].sum() / t["end_s"].max())
    phases = t[t["kind"].astype(str) == str(OpKind.EXPERT)].groupby(["step", "layer", "batch"])
    span = (phases["end_s"].max() - phases["start_s"].min()).sum()
    assert res.summary["expert_phase_util"] == pytest.approx(phases["sm_s"].sum().sum() / span)
    assert res.summary["plan"]["ep"]["lane_sharing"] == "shared"
    assert work_conserving_s(res, spec.hardware) is None
    with pytest.raises(ConfigError, match="lane_sharing='mps' unknown; valid: partition, shared"):
        simulate_run(tiny_spec("ep_static", lanes=True, lane_sharing="mps"))


def test_lane_share_outside_zero_one_is_a_config_error():
    with pytest.raises(ConfigError, match=r"lane_share=1.5 must be 0 .* or in \[0.001, 1\]"):
        simulate_run(tiny_spec("ep_static", lanes=True, lane_share=1.5))


def test_unknown_gate_is_a_config_error():
    with pytest.raises(ConfigError, match="gate='fast' unknown"):
        simulate_run(tiny_spec("oracle_replication", gate="fast"))


def test_expert_parallel_memory_holds_one_batchs_activations_and_every_batchs_kv():
    """Mixtral-8x7B on 8 H200s, batches of 8 x 256 tokens: a second batch adds its KV, 8 x 257
    tokens x 4 KiB x 32 layers = 269.5 MB, and no activations: batches run one after another,
    so one batch's hidden states are live (each batch's 50 MB was counted as its KV)."""
    hw = HardwareSpec.from_dict(yaml.safe_load(Path("conf/hardware/h200-hgx8.yaml").read_text()))
    m = ModelSpec.from_dict(yaml.safe_load(Path("conf/model/mixtral-8x7b.yaml").read_text()))
    wl = Workload(
        batch_size=8,
        n_batches=1,
        prompt_len=256,
        gen_len=1,
        routing=RoutingConfig(source="synthetic"),
    )

    def resident_gb(n_batches: int) -> float:
        s = simulate_run(
            RunSpec(m, hw, wl.with_(n_batches=n_batches), "ep_static", {"n_devices": 8})
        )
        return s.summary["plan"]["placement"]["resident_gb"]["gpu"]

    kv_batch = 8 * 257 * m.kv_bytes_per_token * m.n_layers / 1e9
    assert resident_gb(2) - resident_gb(1) == pytest.approx(kv_batch, abs=2e-3)


def test_replica_moves_reserve_room_for_the_experts_in_flight():
    """eplb re-placing every iteration moves experts: each one a GPU gains is held beside the
    copy it replaces until that is sent (real/distributed.py holds them so), so the run reserves
    the most one iteration brings to a GPU, a whole number of experts; a GPU with room for the
    slots but not for that is refused in one line, where a run without moves still fits."""
    spec = tiny_spec("eplb", interval=1, replica_slots=1)
    moving = simulate_run(spec)
    eb = spec.model.expert_bytes
    staging = moving.summary["plan"]["ep"]["staging_bytes"]
    copies = [o for o in moving.schedule.ops if o.kind == OpKind.LOAD and o.tensor == Tensor.EXPERT]
    assert 0 < staging <= len(copies) * eb and staging % eb == 0
    never = spec.workload.n_steps * spec.workload.n_batches  # the run's iterations: no re-place
    still = simulate_run(replace(spec, params={**spec.params, "interval": never}))
    assert "staging_bytes" not in still.summary["plan"]["ep"]
    grown = moving.schedule.resident_bytes[Tier.GPU] - still.schedule.resident_bytes[Tier.GPU]
    assert grown >= staging  # every GPU's, at least the fullest's
    # the GPU memory at which the moves no longer fit but the slots still do
    lo, hi = 0, spec.hardware.memory_bytes[Tier.GPU]  # refused / fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        hw = replace(spec.hardware, memory_bytes={**spec.hardware.memory_bytes, Tier.GPU: mid})
        try:
            simulate_run(replace(spec, hardware=hw))
            hi = mid
        except CapacityError:
            lo = mid
    hw = replace(spec.hardware, memory_bytes={**spec.hardware.memory_bytes, Tier.GPU: lo})
    with pytest.raises(CapacityError, match=r"replica moves bring up to \d+ experts .* re-home"):
        simulate_run(replace(spec, hardware=hw))
    never = spec.workload.n_steps * spec.workload.n_batches
    simulate_run(replace(spec, hardware=hw, params={**spec.params, "interval": never}))


def test_copy_waits_count_the_experts_a_late_copy_held_back():
    """tiny's 1 GB/s GPU link: a replica copy outlasts the layers before its own, and its
    expert op starts when the copy ends, after everything else it waited for; those ops are
    `late_copy_ops`, and `copy_wait_s` the most one device waited so. On a link as fast as
    one likes every copy is in time and both are 0."""
    spec = tiny_spec("oracle_replication", replica_slots=1)
    res = simulate_run(spec)
    ops, t = res.schedule.ops, res.trace.set_index("op_id")
    late, held = 0, [0.0, 0.0]
    for o in ops:
        copies = [d for d in o.deps if ops[d].kind == OpKind.LOAD]
        if o.kind != OpKind.EXPERT or not copies:
            continue
        start, arrived = t.loc[o.id, "start_s"], max(t.loc[d, "end_s"] for d in copies)
        others = max(t.loc[d, "end_s"] for d in o.deps if d not in copies)
        if start == arrived > others:  # the copy was the last thing it waited for
            late += 1
            held[res.schedule.streams[o.stream].device] += arrived - others
    assert res.summary["late_copy_ops"] == late > 0
    assert res.summary["copy_wait_s"] == pytest.approx(max(held), rel=1e-9)
    fast = {**spec.hardware.links, Resource.P2P: LinkSpec(1e18)}
    quick = simulate_run(replace(spec, hardware=replace(spec.hardware, links=fast)))
    assert quick.summary["plan"]["ep"]["copies"] > 0
    assert (quick.summary["late_copy_ops"], quick.summary["copy_wait_s"]) == (0, 0.0)


def test_collectives_slow_exactly_the_compute_they_overlap():
    """tiny on 2 GPUs with two-batch overlap and replica copies, the GPUs' collectives holding
    2 of 4 SMs (`gpu.comm_sms`): a compute op whose work overlaps no dispatch or combine of its
    GPU takes its cost-model duration (a replica copy beside it, the copy engine's, included),
    one that overlaps some takes longer, by at most the overlap (half the SMs: at half rate
    while it lasts), and the run is no shorter than without the cost. With NCCL's p2p kernels
    moving the copies (`gpu.copy_sms`) an op beside a copy alone is slowed too."""
    from core.cost import CostModel

    spec = tiny_spec("oracle_replication", replica_slots=1, micro_batches=2)
    spec = replace(spec, workload=replace(spec.workload, batch_size=4))
    gpu = replace(spec.hardware.gpu, sms=4, comm_sms=2)
    held = replace(spec, hardware=replace(spec.hardware, gpu=gpu))
    base, res = simulate_run(spec), simulate_run(held)
    assert res.summary["makespan_s"] >= base.summary["makespan_s"]
    sched, t = res.schedule, res.trace.set_index("op_id").sort_index()
    cost = CostModel(held.hardware).durations(sched)
    dev = {o.id: sched.streams[o.stream].device for o in sched.ops}
    a2a = [o.id for o in sched.ops if o.kind in (OpKind.DISPATCH, OpKind.COMBINE)]
    copies = [o.id for o in sched.ops if o.kind == OpKind.LOAD and o.tensor == Tensor.EXPERT]

    def overlap(o: int, ops: list[int]) -> float:
        s0, s1 = t.loc[o, "start_s"], t.loc[o, "end_s"]
        return sum(
            max(0.0, min(s1, t.loc[c, "end_s"]) - max(s0, t.loc[c, "start_s"]))
            for c in ops
            if dev[c] == dev[o]
        )

    slowed = beside_copies = 0
    for o in sched.ops:
        if o.kind not in COMPUTE_KINDS:
            continue
        took, over = t.loc[o.id, "end_s"] - t.loc[o.id, "start_s"], overlap(o.id, a2a)
        if over == 0:
            assert took == pytest.approx(cost[o.id], rel=1e-9, abs=1e-15)
            beside_copies += overlap(o.id, copies) > 0
        else:
            slowed += took > cost[o.id] * (1 + 1e-9)
            assert cost[o.id] <= took <= cost[o.id] + over + 1e-12
    assert slowed > 0 and beside_copies > 0, (slowed, beside_copies)
    assert not res.summary["plan"]["ep"]["copy_kernels"]
    # copies by NCCL's p2p kernels (gpu.copy_sms, 1 of the 4 SMs): the ops beside copies alone
    # are slowed now, and gpu_load counts the copies' time
    nccl = replace(held, hardware=replace(held.hardware, gpu=replace(gpu, comm_sms=1, copy_sms=1)))
    res = simulate_run(nccl)
    t = res.trace.set_index("op_id").sort_index()
    assert res.summary["plan"]["ep"]["copy_kernels"]
    by_copies = [
        o.id
        for o in sched.ops
        if o.kind in COMPUTE_KINDS and overlap(o.id, a2a) == 0 and overlap(o.id, copies) > 0
    ]
    took = [t.loc[i, "end_s"] - t.loc[i, "start_s"] for i in by_copies]
    assert any(d > cost[i] * (1 + 1e-9) for i, d in zip(by_copies, took, strict=True))
