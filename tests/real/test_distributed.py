"""Expert parallelism on 2 processes (gloo): every rank runs its own device's ops of the one
schedule with the single-process executor's op semantics (real/distributed.py), started by
`experiments.run executor=real executor.distributed=true` or under torchrun.

Fixture: mixtral-tiny (GQA: 4 heads, 2 kv heads; 4 MoE layers, 8 experts, top-2, float32), 2
batches, 6 prompt tokens, 3 generated, synthetic routing; two resident GPUs of 50 MB to plan on.
Tolerance: generated tokens equal exactly; last logits within atol=rtol=1e-5 (float32: an expert
runs over a different subset of rows than in the reference, which can change BLAS blocking).
Each 2-process run costs ~20 s on 2 cores (two interpreters importing torch, planning twice).
"""

import json
import os
import socket
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from core.balance import device_of
from core.dispatch import copies_sent, copy_moves
from core.hardware import HardwareSpec
from core.routing import load_routing
from core.spec import RoutingConfig, Workload
from core.trace import TRACE_COLUMNS
from core.types import OpKind, RoutingSource, Tensor, Tier
from experiments import run as run_module
from experiments.common.dist_run import run_distributed
from experiments.common.pipeline import RunSpec, build_schedule, simulate_run
from experiments.common.real_run import open_store, prompts_for
from real.checkpoint import Unit, load_checkpoint, load_units, reduced_spec
from real.checkpoint_write import write_checkpoint
from real.executor import Executor
from real.model import KVCache, Model, ffn_shard, head_shard, kv_shard, reference_generate
from real.state import resident_units
from real.tensor_parallel import TensorParallel, ThreadCollective
from tests.conftest import command_here, overridden
from tests.real.conftest import small_overrides, two_rank_builder

ATOL = RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]
TWO_GPUS = HardwareSpec.from_dict(
    dict(
        name="test-2gpu",
        memory_gb=dict(gpu=0.05, cpu=0.05, disk=1.0),
        gpu=dict(tflops=0.05, mem_bw_gbps=10),
        cpu=dict(tflops=0.02, mem_bw_gbps=5),
        links=dict(h2d=dict(gbps=5), d2h=dict(gbps=5), disk=dict(gbps=1)),
        n_gpus=2,
    )
)
# the command-line runs: h200-hgx8 has the GPUs, n_devices takes 2 of them
RUN = [
    "executor=real",
    "executor.distributed=true",
    "hardware=h200-hgx8",
    "workload.batch_size=2",
    "workload.n_batches=2",
    "workload.prompt_len=6",
    "workload.gen_len=3",
]


def shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous [lo, hi) of n items: n // G each, the first n % G ranks one more."""
    lo = rank * (n // world) + min(rank, n % world)
    return lo, lo + n // world + (rank < n % world)


@pytest.fixture(scope="session")
def olmoe_mqa(ckpt_root) -> Path:
    """OLMoE-shaped (QK-norm over all heads) with one kv head for its 4 query heads, float32: on 2
    tensor-parallel ranks both hold the kv head and QK-norm's statistics are summed over them."""
    spec = reduced_spec("olmoe-1b-7b", **small_overrides("olmoe-1b-7b"), dtype_bytes=4)
    return write_checkpoint(replace(spec, n_kv_heads=1), ckpt_root / "olmoe-mqa", seed=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spec_of(ckpt: Path, planner: str, batch: int = 2, **params) -> RunSpec:
    wl = Workload(
        batch_size=batch,
        n_batches=2,
        prompt_len=6,
        gen_len=3,
        routing=RoutingConfig(source=RoutingSource.SYNTHETIC),
    )
    return RunSpec(load_checkpoint(ckpt)[0], TWO_GPUS, wl, planner, params)


def expert_tokens_per_device(trace: pd.DataFrame) -> pd.Series:
    ex = trace[trace["kind"].astype(str) == OpKind.EXPERT.value]
    return ex.groupby(device_of(ex["resource"]))["tokens"].sum()


# what the schedule fixes of an op (not what a run measures): a real trace's equal the simulated
OP_FIELDS = [
    c
    for c in TRACE_COLUMNS
    if c not in ("source", "start_s", "end_s", "sm_s", "launch_s", "alloc_s")
]


@pytest.mark.parametrize(
    "planner, mode, batch, params",
    [
        ("ep_static", "replay", 2, {}),
        ("eplb", "live", 2, {}),
        ("predictive_replication", "live", 5, {"micro_batches": 2}),
        ("oracle_replication", "replay", 4, {"micro_batches": 2}),
        ("eplb", "replay", 4, {"dispatch": "balanced"}),
    ],
)
def test_replication_planners_on_two_processes(mixtral_tiny, planner, mode, batch, params):
    """Each replication planner on 2 gloo processes: tokens and logits are the in-memory
    forward's under the routing the gates used; the trace holds every op of the schedule once,
    each on its device, the same ops as the simulated run of the same config and routing, so
    each device's expert tokens equal the simulator's (batch 5: GPU 0's 3 sequences and GPU 1's 2
    each in two micro-batches; live: the planner on each rank sees the routing as it is gated;
    dispatch=balanced: a replicated expert's pairs split over its copies as `split_tokens`
    balances them, on the receiving and the sending rank alike)."""
    spec = spec_of(mixtral_tiny, planner, batch, **params)
    out = run_distributed(str(mixtral_tiny), spec, mode, None, 60)
    res, wl = out.result, spec.workload
    ref_tokens, ref_logits = reference_generate(
        mixtral_tiny, prompts_for(spec.model, wl), wl.gen_len, out.routing
    )
    assert torch.equal(out.tokens, ref_tokens)
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=RTOL)
    if mode == "replay":  # the routing forced is the workload's
        assert np.array_equal(out.routing.expert_ids, load_routing(spec.model, wl).expert_ids)
    real = res.trace
    assert sorted(real["op_id"]) == list(range(len(res.schedule)))  # every op exactly once
    assert (real["end_s"] >= real["start_s"]).all() and set(real["source"]) == {"real"}
    sim = simulate_run(spec, routing=out.routing).trace
    pd.testing.assert_frame_equal(real[OP_FIELDS].astype(str), sim[OP_FIELDS].astype(str))
    tokens = expert_tokens_per_device(real)
    assert len(tokens) == 2 and tokens.equals(expert_tokens_per_device(sim))
    assert res.summary["processes"] == 2
    assert set(res.summary) == set(simulate_run(spec).summary) | {"processes"}
    if planner != "ep_static":  # replicas moved between the processes, by copy ops
        copies = real[(real["kind"].astype(str) == OpKind.LOAD.value)]
        assert set(device_of(copies["resource"])) == {0, 1}


@pytest.mark.parametrize(
    "name, planner, mode, micro",
    [
        ("mixtral-tiny", "eplb", "live", 1),
        ("mixtral-tiny", "ep_static", "replay", 1),
        ("olmoe-mqa", "predictive_replication", "replay", 1),
        ("deepseek-v2-lite", "oracle_replication", "replay", 1),
        ("olmoe-mqa", "predictive_replication", "live", 2),
    ],
)
def test_tensor_parallel_dense_on_two_processes(
    mixtral_tiny, olmoe_mqa, f32_ckpt, name, planner, mode, micro
):
    """dense=tensor on 2 gloo processes: each rank runs every sequence on its half of the heads
    (mixtral: GQA, a kv head each; olmoe-mqa: QK-norm's statistics summed inside attention over
    the one kv head both hold; DeepSeek: MLA's latent whole on each, its dense layer's and shared
    experts' FFN columns halved) and of the vocabulary; the all-reduce ops are collectives each
    rank issues in schedule order (micro=2: each micro-batch's own, in the schedule's order of
    the two). Tokens and logits are the in-memory forward's; the trace holds every op once, the
    simulated run's op set, all-reduces on both ranks and no all-to-all."""
    ckpt = {"mixtral-tiny": mixtral_tiny, "olmoe-mqa": olmoe_mqa}.get(name) or f32_ckpt(name)
    spec = spec_of(ckpt, planner, 3, dense="tensor", micro_batches=micro)
    out = run_distributed(str(ckpt), spec, mode, None, 60)
    wl = spec.workload
    ref_tokens, ref_logits = reference_generate(
        ckpt, prompts_for(spec.model, wl), wl.gen_len, out.routing
    )
    assert torch.equal(out.tokens, ref_tokens)
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=RTOL)
    real = out.result.trace
    assert sorted(real["op_id"]) == list(range(len(out.result.schedule)))
    assert set(real["source"]) == {"real"}
    sim = simulate_run(spec, routing=out.routing).trace
    pd.testing.assert_frame_equal(real[OP_FIELDS].astype(str), sim[OP_FIELDS].astype(str))
    kinds = real["kind"].astype(str)
    reduce = real[kinds == OpKind.ALL_REDUCE.value]
    assert set(device_of(reduce["resource"])) == {0, 1}
    assert not kinds.isin([OpKind.DISPATCH.value, OpKind.COMBINE.value]).any()
    assert expert_tokens_per_device(real).equals(expert_tokens_per_device(sim))


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "olmoe-mqa", "mixtral-tiny"])
def test_a_rank_keeps_only_its_shard_of_the_dense_weights(mixtral_tiny, olmoe_mqa, f32_ckpt, name):
    """dense=tensor on 2 processes: rank 1 keeps its half of each attention, FFN (DeepSeek's dense
    layer and shared experts) and head unit, copied out of the whole and equal to the slices the
    one-process run computes with, and gives the whole units' buffers back to the store; the
    routers, embeddings and experts stay as they are. The pieces every head reads (MLA's latent
    projection, a kv head both ranks share, the norms) are kept whole, so a shard is over half."""
    ckpt = {"mixtral-tiny": mixtral_tiny, "olmoe-mqa": olmoe_mqa}.get(name) or f32_ckpt(name)
    spec = spec_of(ckpt, "ep_static", 3, dense="tensor")
    model = load_checkpoint(ckpt)[0]
    schedule = build_schedule(spec, load_routing(model, spec.workload))
    ex = Executor(
        open_store(ckpt, spec),
        Model.from_checkpoint(ckpt, model),
        spec.workload,
        prompts_for(model, spec.workload),
    )
    ex._reset(schedule.capacity_bytes, schedule.resident_bytes, None)
    ex._preload(resident_units(schedule))
    whole = {u: {k: t.clone() for k, t in w.items()} for u, w in ex._resident.items()}
    group = ThreadCollective(2, lambda: False, lambda: None)
    tp, ref = (TensorParallel(ex, 2, (1,), group, group) for _ in range(2))
    tp.keep_shards(1)
    cut = {Tensor.ATTENTION, Tensor.FFN, Tensor.HEAD}
    assert {Tensor.ATTENTION, Tensor.HEAD} <= {u.kind for u in tp.sharded}
    assert tp.sharded == {u for u in whole if u.kind in cut}
    for u, w in whole.items():
        held = ex._resident[u]
        want = ref.shard_of(u, 1, w)
        assert held.keys() == want.keys() and all(torch.equal(held[k], want[k]) for k in held)
        assert (not ex.store.holds(u, Tier.GPU)) == (u in tp.sharded)
        assert tp.shard_of(u, 1, held).keys() == held.keys()  # no second cut
        size, full = (sum(t.nbytes for t in x.values()) for x in (held, w))
        assert size < full if u in tp.sharded else size == full
    size, full = (
        sum(t.nbytes for u in tp.sharded for t in x[u].values()) for x in (ex._resident, whole)
    )
    assert full / 2 <= size < 0.8 * full


def test_a_batch_smaller_than_the_processes(mixtral_tiny):
    """Batch 1 on 2 processes: rank 1 holds no sequence, runs no dense op, and still computes
    the pairs its experts are given, from the routing rank 0's gate sends it."""
    spec = spec_of(mixtral_tiny, "eplb", 1)
    out = run_distributed(str(mixtral_tiny), spec, "replay", None, 60)
    wl = spec.workload
    ref_tokens, ref_logits = reference_generate(
        mixtral_tiny, prompts_for(spec.model, wl), wl.gen_len, out.routing
    )
    assert torch.equal(out.tokens, ref_tokens)
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=RTOL)
    t = out.result.trace
    on_1 = t[device_of(t["resource"]) == 1]["kind"].astype(str)
    assert OpKind.EXPERT.value in set(on_1) and OpKind.GATE.value not in set(on_1)


def command(ckpt: Path, out: Path, *args: str, devices: int | None = 2) -> list[str]:
    n = [f"+planner.params.n_devices={devices}"] if devices else []
    base = [f"checkpoint={ckpt}", *RUN, *n, f"hydra.run.dir={out}"]
    return [sys.executable, "-m", "experiments.run", *overridden(base, *args)]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


@pytest.mark.parametrize("dense", ["data", "tensor"])
def test_run_command_writes_one_run_dir(mixtral_tiny, tmp_path, dense, capsys, monkeypatch):
    """`experiments.run ... executor.distributed=true` starts the 2 processes itself and writes
    the run dir every run writes; trace.json shows one process per device. (The command's main
    in this process: the rank processes are its own either way, and the command as a user
    starts it is the subprocess of test_a_rank_that_dies_stops_the_run and the probes'.)"""
    dense_arg = f"+planner.params.dense={dense}"
    argv = command(mixtral_tiny, tmp_path, "planner=eplb", dense_arg, "trace_json=true")[3:]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as env() gives the subprocesses
    proc = command_here(run_module.main, argv, capsys, monkeypatch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.yaml", "summary.json", "trace.parquet", "trace.json"):
        assert (tmp_path / name).exists(), name
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["executor"] == "real"
    assert {"balancedness", "utilisation", "max_over_mean_load"} <= set(summary)
    chrome = json.loads((tmp_path / "trace.json").read_text())
    names = [e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["real:gpu0", "real:gpu1"]
    trace = pd.read_parquet(tmp_path / "trace.parquet")
    assert sorted(trace["op_id"]) == list(range(summary["ops"]))
    reduce = trace[trace["kind"].astype(str) == OpKind.ALL_REDUCE.value]
    assert set(device_of(reduce["resource"])) == ({0, 1} if dense == "tensor" else set())


@pytest.mark.parametrize(
    "name, world",
    [
        ("mixtral-tiny", 2),
        ("mixtral-tiny", 4),
        ("qwen1.5-moe-a2.7b", 2),
        ("deepseek-v2-lite", 2),
        ("olmoe-1b-7b", 2),
        ("olmoe-mqa", 4),
    ],
)
def test_head_shards_sum_to_attention(name, world, mixtral_tiny, olmoe_mqa, f32_ckpt):
    """4 query heads in `world` shards, a 5-token prefill then a decode step: hidden plus the
    shards' parts is `attention`, and GQA shards' caches, each kv head once, side by side are the
    whole cache. mixtral: 2 kv heads, one per shard (world 4: each held by 2 shards); Qwen: biases
    cut alike; deepseek: kv_b's heads, the latent whole; OLMoE: QK-norm's sums added over the
    shards (olmoe-mqa: its one kv head's counted once over 4 holders)."""
    ckpt = {"mixtral-tiny": mixtral_tiny, "olmoe-mqa": olmoe_mqa}.get(name) or f32_ckpt(name)
    spec, units = load_units(ckpt)
    model, w = Model.from_checkpoint(ckpt, spec), units[Unit(Tensor.ATTENTION, 1)]
    whole = KVCache.allocate(spec, 2, 6)
    heads = [shard(spec.n_heads, world, r) for r in range(world)]
    kv_heads = [kv_shard(spec, h) for h in heads]
    shards = [
        (head_shard(spec, w, h), KVCache.allocate(spec, 2, 6, kv_heads=hi - lo))
        for h, (lo, hi) in zip(heads, kv_heads, strict=True)
    ]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for positions in (torch.arange(5), torch.arange(5, 6)):
            hidden = torch.randn(2, len(positions), spec.hidden_size, generator=g)  # [B, S, H]
            want = model.attention(1, w, hidden, whole, positions)
            parts = shard_parts(model, shards, hidden, positions)
            torch.testing.assert_close(hidden + sum(parts), want, atol=ATOL, rtol=RTOL)
    if spec.family != "deepseek_v2":
        first = [i for i, kv in enumerate(kv_heads) if i == 0 or kv != kv_heads[i - 1]]
        side_by_side = torch.cat(
            [shards[i][1].layers[1][0] for i in first], dim=1
        )  # [B, Hkv, M, D]
        torch.testing.assert_close(side_by_side, whole.layers[1][0], atol=ATOL, rtol=RTOL)


def shard_parts(model, shards, hidden, positions) -> list[torch.Tensor]:
    """Each shard's `attention_part`, its `reduce` the sum over shards as an all-reduce gives
    it: a first pass records each shard's contribution (on a copy of its cache), the second
    hands every shard the total."""
    sums: list[torch.Tensor] = []

    def record(t: torch.Tensor) -> torch.Tensor:
        sums.append(t.clone())
        return t

    for ws, kv in shards:
        model.attention_part(1, ws, hidden, kv.map(torch.clone), positions, record)
    total = sum(sums)
    return [
        model.attention_part(1, ws, hidden, kv, positions, lambda t: t.copy_(total))
        for ws, kv in shards
    ]


@pytest.mark.parametrize("name", ["qwen1.5-moe-a2.7b", "deepseek-v2-lite", "switch-base-128"])
def test_ffn_shards_sum_to_whole(name, f32_ckpt):
    """Layer 0's FFN in two column shards: Qwen's gated shared expert (the gate scales each part
    as it scales the sum), DeepSeek's dense SwiGLU layer, Switch's dense ReLU layer."""
    ckpt = f32_ckpt(name)
    spec, units = load_units(ckpt)
    model, w = Model.from_checkpoint(ckpt, spec), units[Unit(Tensor.FFN, 0)]
    width = (w["wi"] if "wi" in w else w["w1"]).shape[0]
    shards = [ffn_shard(w, shard(width, 2, r)) for r in range(2)]
    hidden = torch.randn(6, spec.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
    run = model.shared_ffn if spec.is_moe(0) else model.dense_ffn_part
    torch.testing.assert_close(run(shards[0], hidden) + run(shards[1], hidden), run(w, hidden))


def test_moves_copy_from_a_rank_that_keeps_the_expert():
    """Rank 0 swaps replica 5 for 6, rank 1 swaps 2 for 5. Expert 6 comes from rank 1, which
    holds it before and after; 5 from rank 0, its only holder, which drops it after sending."""
    old = [[0, 2, 5], [1, 3, 6, 2]]
    new = [[0, 2, 6], [1, 3, 6, 5]]
    assert copy_moves(old, new) == [(5, 0, 1), (6, 1, 0)]
    assert copy_moves(old, old) == []


def test_copies_sent_counts_copy_moves_sources():
    """The replica gate's vectorised count of the copies each device sends equals the count of
    `copy_moves`' sources, on random re-placements of 3 homes + 2 replica slots on 4 devices
    (12 experts; replicas and homes redrawn, slots left empty, an expert twice on one device)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        homes = rng.permutation(12).reshape(4, 3)
        old = np.concatenate([homes, rng.integers(-1, 12, (4, 2))], 1)
        new = old.copy()
        new[:, 3:] = rng.integers(-1, 12, (4, 2))
        if rng.random() < 0.5:  # re-homing: homes permuted among the devices
            new[:, :3] = rng.permutation(homes.ravel()).reshape(4, 3)
        want = np.bincount(
            [src for _, src, _ in copy_moves(old.tolist(), new.tolist())], minlength=4
        )
        assert copies_sent(old, new).tolist() == want.tolist()


def test_ops_start_when_their_remote_deps_and_other_ends_are_ready():
    """Times as two ranks record them, in ms: gate g0 (GPU 0) 0-1 and g1 (GPU 1) 0-3; GPU 0
    sends its tokens (d0, p2p_out) 1-6, GPU 1 posts its receive (d1, p2p) at 3, so 3-6; GPU 1's
    expert e1 (after its receive and GPU 0's send) recorded 6-8. GPU 0's receive of the combine
    (c0, after e1) was posted at 1, GPU 1's send of it (c1) ran 8-9. As one process runs them:
    d0 starts once GPU 1's gate ended (3), d1 with it (3, its own), e1 at 6 as recorded (d0
    ended at 6), c0 once e1 ended (8), with its other end c1."""
    from real.gathered_times import from_ready, transfer_partners

    b = two_rank_builder()
    g0 = b.add(OpKind.GATE, "gpu0", layer=0)
    g1 = b.add(OpKind.GATE, "gpu1", layer=0)
    d0 = b.add(OpKind.DISPATCH, "send0", (g0, g1), layer=0, nbytes=8)
    d1 = b.add(OpKind.DISPATCH, "in1", (g0, g1), layer=0, nbytes=8)
    e1 = b.add(OpKind.EXPERT, "gpu1", (d1, d0, g0, g1), layer=0, expert=0)
    c1 = b.add(OpKind.COMBINE, "send1", (e1,), layer=0, nbytes=8)
    c0 = b.add(OpKind.COMBINE, "in0", (e1,), layer=0, nbytes=8)
    s = b.build()
    assert transfer_partners(s.ops, s.streams) == {d0: [d1], d1: [d0], c1: [c0], c0: [c1]}
    start = [0.0, 0.0, 1.0, 3.0, 6.0, 8.0, 1.0]
    end = [1.0, 3.0, 6.0, 6.0, 8.0, 9.0, 9.0]
    from_ready(s.ops, s.streams, start, end)
    assert start == [0.0, 0.0, 3.0, 3.0, 6.0, 8.0, 8.0]


def test_a_rank_holds_no_unit_for_an_empty_replica_slot(mixtral_tiny):
    """A placement's empty replica slot (-1) became the unit `expert -1`, and every distributed
    run of a planner that leaves one empty (oracle_replication's defaults) failed with 'unit
    L2.expert-1 is not in this model'."""
    from types import SimpleNamespace

    from real.distributed import Peers

    spec = load_checkpoint(mixtral_tiny)[0]
    moe = spec.moe_layers
    slots = {(0, 0, m): np.array([[0, 1, -1], [2, 3, -1]]) for m in range(len(moe))}
    slots[(0, 0, 0)] = np.array([[0, 1, 4], [2, 3, -1]])
    rank = SimpleNamespace(spec=spec, rank=1)
    own = Peers.own_units(rank, {Unit(Tensor.ATTENTION, 0): Tier.GPU}, slots)  # type: ignore[arg-type]
    experts = {(u.layer, u.expert) for u in own if u.kind == Tensor.EXPERT}
    assert experts == {(layer, e) for layer in moe for e in (2, 3)}
    assert Unit(Tensor.ATTENTION, 0) in own
