"""Expert parallelism on 2 processes (torchrun, gloo; NCCL when marked gpu) against the plain
single-process forward.

Fixtures: mixtral-tiny (GQA: 4 heads, 2 kv heads; 4 MoE layers, 8 experts, top-2, float32) and
deepseek-tiny (DeepSeek-V2's MLA with 4 heads; a dense layer, then 2 MoE layers of 16 experts,
top-6, with shared experts; float32), 8 prompt tokens, 3 generated: batch 2 of mixtral-tiny is
2 x (8 + 2) positions x 4 layers x 2 = 160 (token, slot) pairs through experts.
Tolerance: generated tokens equal exactly; last logits within atol=rtol=1e-5 (float32: an expert
runs over a different subset of rows than in the reference, which can change BLAS blocking, and
dense=tensor sums heads' and FFN columns' parts in another order; seen ~1e-6).
"""

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from core.dispatch import copies_sent, copy_moves, source_counts, traffic
from core.errors import ConfigError
from core.routing import load_routing
from core.types import Tensor
from experiments.ep_run import DEFAULTS, ep_workload
from planners.expert_parallel import split_tokens
from real.checkpoint import Unit, load_checkpoint, load_units, reduced_spec, write_checkpoint
from real.distributed import check_dense, destinations, shard
from real.model import KVCache, Model, ffn_shard, head_shard, kv_shard, reference_generate
from tests.real.conftest import small_overrides

ATOL = RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def deepseek_tiny(f32_ckpt) -> Path:
    return f32_ckpt("deepseek-v2-lite")


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


def torchrun(ckpt: Path, out: Path, *args: str, nproc: int = 2) -> dict:
    """`torchrun --nproc_per_node=2 -m experiments.ep_run ...` (through tests/real/live_probe.py,
    which marks the ranks that run a live routing's reference forward); returns rank 0's
    summary."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", str(ROOT / "tests" / "real" / "live_probe.py"),
           f"checkpoint={ckpt}", "batch_size=2", "prompt_len=8", "gen_len=3", f"out={out}",
           *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def reference(ckpt: Path, out: Path, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = torch.load(out / "outputs.pt")["prompts"]
    forced = None
    if routing == "replay":  # the routing ep_run forced: the workload's synthetic routing
        opts = dict(DEFAULTS, batch_size=str(len(prompts)), prompt_len="8", gen_len="3")
        forced = load_routing(load_checkpoint(ckpt)[0], ep_workload(opts))
    return reference_generate(ckpt, prompts, 3, forced)


def check(ckpt: Path, out: Path, summary: dict, routing: str, tol: float = ATOL) -> None:
    got = torch.load(out / "outputs.pt")
    tokens, logits = reference(ckpt, out, routing)
    assert torch.equal(got["tokens"], tokens)
    torch.testing.assert_close(got["logits"], logits, atol=tol, rtol=tol)
    ranks, spec = summary["ranks"], load_checkpoint(ckpt)[0]
    pairs = summary["batch_size"] * (8 + 3 - 1) * len(spec.moe_layers) * spec.top_k
    assert sum(r["pairs_computed"] for r in ranks) == pairs
    assert all(r["outside_placement"] == 0 for r in ranks)
    steps = summary["placement"]  # [step][moe][rank]
    for r in ranks:  # computed only experts the placement gave it at some step
        for layer, done in r["experts_computed"].items():
            m = spec.moe_index(int(layer))
            assert set(done) <= {e for step in steps for e in step[m][r["rank"]]}
    # every expert a step's placement adds to a rank arrived by a copy from another rank
    added = sum(len(set(new[m][r]) - set(old[m][r])) for old, new in pairwise(steps)
                for m in range(len(spec.moe_layers)) for r in range(len(ranks)))  # fmt: skip
    assert sum(r["copies_in"] for r in ranks) == added
    assert summary["ep"]["copies"] == added  # the simulator charges the copies the run makes
    if routing == "replay":  # and the all-to-all volumes each rank sends (dense=tensor: none)
        assert [r["pairs_sent"] for r in ranks] == summary["ep"]["pairs_sent"]


@pytest.mark.parametrize("routing", ["replay", "live"])
def test_ep_static_two_ranks_match_reference(mixtral_tiny, tmp_path, routing):
    summary = torchrun(mixtral_tiny, tmp_path, "planner=ep_static", f"routing={routing}")
    assert (summary["world_size"], summary["backend"]) == (2, "gloo")
    check(mixtral_tiny, tmp_path, summary, routing)
    # live: one rank ran the reference forward (the whole model) and sent its routing
    ran = sorted(p.name for p in tmp_path.glob("live_routing.*"))
    assert ran == (["live_routing.0"] if routing == "live" else [])
    for r in summary["ranks"]:  # round-robin homes: rank r holds the experts e with e % 2 == r
        assert all(held == list(range(r["rank"], 8, 2)) for held in r["experts_held"].values())
    if routing == "replay":  # the same token split the simulator's expert ops carry
        assert [r["pairs_computed"] for r in summary["ranks"]] == summary["ep"]["planned_pairs"]


def test_replicas_split_and_match_reference(mixtral_tiny, tmp_path):
    """EPLB with 2 replica slots per rank: 12 copies of 8 experts, each rank holds 6 per layer."""
    summary = torchrun(mixtral_tiny, tmp_path, "planner=eplb", "replica_slots=2")
    check(mixtral_tiny, tmp_path, summary, "replay")
    assert summary["ep"]["replicas"] == 4
    assert all(len(held) == 6 for step in summary["placement"] for moe in step for held in moe)
    assert [r["pairs_computed"] for r in summary["ranks"]] == summary["ep"]["planned_pairs"]


def test_balanced_dispatch_matches_reference(mixtral_tiny, tmp_path):
    """predictive_replication with one replica slot per rank, batch 4: copies of an expert on
    both ranks, so dispatch=balanced splits its pairs otherwise than evenly. Both match the
    single-process forward, and each rank computes the pairs the simulator planned for it."""
    planned = {}
    for dispatch in ("even", "balanced"):
        out = tmp_path / dispatch
        summary = torchrun(mixtral_tiny, out, "planner=predictive_replication", "replica_slots=1",
                           "batch_size=4", f"dispatch={dispatch}")  # fmt: skip
        check(mixtral_tiny, out, summary, "replay")
        assert summary["dispatch"] == summary["ep"]["dispatch"] == dispatch
        planned[dispatch] = summary["ep"]["planned_pairs"]
        assert [r["pairs_computed"] for r in summary["ranks"]] == planned[dispatch]
    assert planned["even"] != planned["balanced"], "the test needs a split that differs"


@pytest.mark.parametrize(
    "batch, routing, planner",
    [
        (4, "replay", ["planner=predictive_replication", "replica_slots=1"]),
        (3, "replay", ["planner=ep_static"]),
        (4, "live", ["planner=eplb", "replica_slots=1"]),
    ],
    ids=["predictive-b4-replay", "ep_static-b3-replay", "eplb-b4-live"],
)
def test_micro_batches_match_reference(mixtral_tiny, tmp_path, batch, routing, planner):
    """Two-batch overlap on 2 ranks: each rank splits its sequences in two micro-batches whose
    all-to-alls are posted async and waited for only before that micro-batch's experts and next
    attention. Tokens equal the single-process forward; with replayed routing each rank computes
    and sends exactly the pairs the simulator planned with micro_batches=2 (each micro-batch's
    replicated experts split their own pairs), which differ from the whole batch's. Batch 3:
    rank 1's second micro-batch holds no sequence and still serves its experts' pairs."""
    summary = torchrun(mixtral_tiny, tmp_path, *planner, f"batch_size={batch}",
                       f"routing={routing}", "micro_batches=2")  # fmt: skip
    assert summary["micro_batches"] == summary["params"]["micro_batches"] == 2
    check(mixtral_tiny, tmp_path, summary, routing)
    assert all(r["a2a_wait_s"] >= 0 for r in summary["ranks"])
    if routing == "replay":
        assert [r["pairs_computed"] for r in summary["ranks"]] == summary["ep"]["planned_pairs"]
    if "replica_slots=1" in planner and routing == "replay":  # the split is the micro-batches'
        whole = torchrun(mixtral_tiny, tmp_path / "whole", *planner, f"batch_size={batch}")
        assert whole["ep"]["planned_pairs"] != summary["ep"]["planned_pairs"], (
            "needs a split that differs"
        )


def test_micro_batches_run_in_the_overlapped_order(mixtral_tiny, monkeypatch):
    """One process, batch 2 as two micro-batches: per MoE layer each micro-batch's attention and
    gate (posting its dispatch) in turn, then each one's experts (posting its combine); a
    combine is waited for only before its micro-batch's next attention, so micro-batch 1's
    results travel while micro-batch 0's next attention runs (the simulator's order,
    `EPRunner.overlapped`). Tokens equal the single-process forward."""
    from experiments.ep_run import init_group
    from real.distributed import EPRank, InFlight, ep_generate

    log: list[tuple] = []
    micro_of: dict[int, int] = {}  # id(InFlight) -> micro-batch

    def logged(name, fn):  # type: ignore[no-untyped-def]
        def run(self, *args):  # type: ignore[no-untyped-def]
            out = fn(self, *args)
            if name == "start":
                micro_of[id(out)] = args[4]
                log.append((name, args[1], micro_of[id(out)]))
            else:
                f = args[-1]
                assert isinstance(f, InFlight)
                log.append((name, micro_of[id(f)]))
            return out

        return run

    monkeypatch.setattr(EPRank, "start_moe", logged("start", EPRank.start_moe))
    monkeypatch.setattr(EPRank, "run_moe", logged("run", EPRank.run_moe))
    monkeypatch.setattr(EPRank, "finish_moe", logged("finish", EPRank.finish_moe))
    spec = load_checkpoint(mixtral_tiny)[0]
    moe = list(spec.moe_layers)
    assert moe == list(range(spec.n_layers)), "the order below assumes every layer is MoE"
    placement = [[[list(range(spec.n_experts))] for _ in moe]] * 2
    prompts = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    init_group("cpu")
    try:
        out = ep_generate(mixtral_tiny, spec, prompts, 2, placement, micro_batches=2)
    finally:
        dist.destroy_process_group()
    tokens, _ = reference_generate(mixtral_tiny, prompts, 2)
    assert torch.equal(out.tokens, tokens)
    step = []
    for layer in moe:
        if layer:  # the previous layer's combines, each just before its micro-batch's attention
            step += [("finish", 0), ("start", layer, 0), ("finish", 1), ("start", layer, 1)]
        else:
            step += [("start", layer, 0), ("start", layer, 1)]
        step += [("run", 0), ("run", 1)]
    step += [("finish", 0), ("finish", 1)]  # before the head
    assert log == step * 2


def test_micro_batch_refusals():
    """Two-batch overlap the run cannot make: one line each, before any rank waits."""
    from real.distributed import check_micro_batches

    check_micro_batches(2, "data", 4, 2)
    with pytest.raises(ConfigError, match="micro_batches=2 .* dense=tensor moves no tokens"):
        check_micro_batches(2, "tensor", 4, 2)
    with pytest.raises(ConfigError, match="batch 2 over 2 ranks gives a rank at most 1"):
        check_micro_batches(2, "data", 2, 2)
    with pytest.raises(ConfigError, match="micro_batches=0 must be >= 1"):
        check_micro_batches(0, "data", 2, 2)


@pytest.mark.parametrize(
    "model, batch, planner",
    [
        ("mixtral", 2, ["planner=ep_static"]),
        ("mixtral", 1, ["planner=eplb", "replica_slots=2"]),
        ("deepseek", 1, ["planner=ep_static"]),
        ("deepseek", 2, ["planner=eplb", "replica_slots=2"]),
        ("olmoe_mqa", 1, ["planner=predictive_replication", "replica_slots=2"]),
    ],
    ids=[
        "mixtral-ep_static-b2",
        "mixtral-eplb-b1",
        "deepseek-ep_static-b1",
        "deepseek-eplb-b2",
        "olmoe_mqa-predictive-b1",
    ],
)
def test_tensor_dense_matches_reference(model, batch, planner, request, tmp_path):
    """dense=tensor: each rank 2 of the 4 query heads (mixtral: 1 of its 2 kv heads; deepseek:
    its kv_b heads, the latent whole; olmoe_mqa: both hold its one kv head, and QK-norm sums its
    statistics over them), half of every dense and shared FFN and of the vocabulary.
    Batch 1 is one sequence on 2 ranks, which dense=data refuses."""
    fixture = {"mixtral": "mixtral_tiny", "deepseek": "deepseek_tiny"}.get(model, model)
    ckpt = request.getfixturevalue(fixture)
    summary = torchrun(ckpt, tmp_path, *planner, f"batch_size={batch}", "dense=tensor")
    assert summary["dense"] == summary["params"]["dense"] == "tensor"
    assert summary["dispatcher"] == "all_reduce"
    check(ckpt, tmp_path, summary, "replay")
    # the same pairs per rank as dense=data and the simulator's expert ops, none sent
    assert [r["pairs_computed"] for r in summary["ranks"]] == summary["ep"]["planned_pairs"]
    assert all(r["pairs_sent"] == 0 for r in summary["ranks"])
    assert all(r["a2a_wait_s"] is None for r in summary["ranks"])  # no all-to-all to wait for


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


def test_tensor_dense_refusals(mixtral_tiny):
    """Query heads must split evenly (4 on 3 ranks do not); kv heads must split evenly or divide
    the ranks (6 kv heads of 12 query heads on 4 ranks do neither); 2 kv heads on 4 ranks are
    replicated, and OLMoE's QK-norm splits (its statistics by another all-reduce)."""
    spec = load_checkpoint(mixtral_tiny)[0]
    check_dense(spec, "tensor", 2)
    check_dense(spec, "tensor", 4)
    with pytest.raises(ConfigError, match="n_heads=4 does not split evenly over 3 ranks"):
        check_dense(spec, "tensor", 3)
    with pytest.raises(ConfigError, match="n_kv_heads=6 neither splits evenly over 4 ranks"):
        check_dense(replace(spec, n_heads=12, n_kv_heads=6), "tensor", 4)
    check_dense(reduced_spec("olmoe-1b-7b", **small_overrides("olmoe-1b-7b")), "tensor", 2)


def test_destinations_split_replicas_evenly():
    """Expert 0 has 5 pairs, in (token, slot) order, and copies on ranks 0 and 1: the first
    3 pairs go to rank 0, the last 2 to rank 1 (split_tokens' 5 // 2 + 1, 5 // 2)."""
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3], [0, 2]])  # [T=5, k=2]
    dest = destinations(ids, [[2, 0, 3], [0, 1]], n_experts=4)  # rank 0: 2, 0, 3; rank 1: 0, 1
    assert dest.tolist() == [[0, 1], [0, 0], [1, 0], [1, 0], [1, 0]]


def test_destinations_even_follow_split_tokens():
    """Each rank computes per expert what the simulator's even split gives its copies (the
    remainder turning with the expert), on random routings and placements."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        e, ranks = 6, int(rng.integers(2, 4))
        copies = [list(range(r, e, ranks)) + rng.integers(0, e, 2).tolist() for r in range(ranks)]
        ids = torch.as_tensor(rng.integers(0, e, (int(rng.integers(1, 12)), 2)))
        dest = destinations(ids, copies, n_experts=e)
        got = [[int(((dest == r) & (ids == x)).sum()) for x in range(e)] for r in range(ranks)]
        slots = np.array([held + [-1] * (4 + e - len(held)) for held in copies])
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=e)
        assert got == split_tokens(slots, counts).tolist()


def test_destinations_balanced_follow_split_tokens():
    """Expert 0 (5 pairs) is on both ranks; rank 0 also has expert 1's 4 pairs, rank 1 expert 2's
    1 pair. Balanced, rank 0 takes 1 of expert 0's pairs and rank 1 the other 4 (5 each; evenly
    it would be 3 + 4 against 2 + 1). A rank listing expert 0 twice still takes one run."""
    ids = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 2], [1, 0]])  # [T=5, k=2]
    dest = destinations(ids, [[1, 0], [0, 2, 0]], n_experts=3, dispatch="balanced")
    assert dest.tolist() == [[0, 0], [1, 0], [0, 1], [1, 1], [0, 1]]
    got = [[int(((dest == r) & (ids == e)).sum()) for e in range(3)] for r in range(2)]
    slots = np.array([[1, 0, -1], [0, 2, 0]])
    assert (
        got
        == split_tokens(slots, np.array([5, 4, 1]), "balanced").tolist()
        == [[1, 4, 0], [4, 0, 1]]
    )


@pytest.mark.parametrize("dispatch", ["even", "balanced"])
def test_traffic_counts_what_destinations_send(dispatch):
    """The simulator's all-to-all volumes (`core.dispatch.traffic`) are the pairs the real run
    sends: rank s's tokens (its `shard` of the sequences) whose destination is rank d, on random
    routings, placements (duplicate slots included) and batches smaller than the group."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        e, ranks, per = 6, int(rng.integers(2, 5)), int(rng.integers(1, 4))
        batch = int(rng.integers(1, 7))
        copies = [list(range(r, e, ranks)) + rng.integers(0, e, 2).tolist() for r in range(ranks)]
        ids = torch.as_tensor(rng.integers(0, e, (batch * per, 2)))
        dest = destinations(ids, copies, n_experts=e, dispatch=dispatch)
        rows = [(hi - lo) * per for lo, hi in (shard(batch, ranks, r) for r in range(ranks))]
        owner = np.repeat(np.arange(ranks), rows)
        want = np.zeros((ranks, ranks), dtype=np.int64)
        np.add.at(want, (np.repeat(owner, 2), dest.reshape(-1).numpy()), 1)
        slots = np.array([held + [-1] * (4 + e - len(held)) for held in copies])
        counts = np.bincount(ids.reshape(-1).numpy(), minlength=e)
        moved = traffic(split_tokens(slots, counts, dispatch), source_counts(ids.numpy(), rows, e))
        assert moved.tolist() == want.tolist()


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
        want = np.bincount([src for _, src, _ in copy_moves(old.tolist(), new.tolist())],
                           minlength=4)  # fmt: skip
        assert copies_sent(old, new).tolist() == want.tolist()


def test_placement_changes_travel_rank_to_rank(mixtral_tiny, tmp_path):
    """predictive_replication re-places replicas between steps: each rank starts with the first
    step's experts only, receives what later steps add from another rank, and never holds more
    than its slots plus the experts it still has to send."""
    summary = torchrun(mixtral_tiny, tmp_path, "planner=predictive_replication",
                       "replica_slots=1", "gen_len=3")  # fmt: skip
    check(mixtral_tiny, tmp_path, summary, "replay")
    steps, spec = summary["placement"], load_checkpoint(mixtral_tiny)[0]
    assert sum(r["copies_in"] for r in summary["ranks"]) > 0, "the test needs a moving placement"
    unit = load_units(mixtral_tiny)[1][Unit(Tensor.EXPERT, 1, 0)]
    expert_bytes = sum(t.numel() * t.element_size() for t in unit.values())
    assert all(r["copy_bytes_in"] == r["copies_in"] * expert_bytes for r in summary["ranks"])
    assert all(isinstance(r["copy_wait_s"], float) for r in summary["ranks"])  # gloo: timed
    for r in summary["ranks"]:
        for layer, first in r["experts_held"].items():
            m, me = spec.moe_index(int(layer)), r["rank"]
            assert first == sorted(set(steps[0][m][me]))
            sent_away = max(
                len({e for e, src, _ in copy_moves(old[m], new[m]) if src == me} - set(new[m][me]))
                for old, new in pairwise(steps)
            )
            assert r["most_held"][layer] <= max(len(set(s[m][me])) for s in steps) + sent_away


def test_copies_overlap_the_layers_before_theirs(mixtral_tiny, tmp_path):
    """Every MoE layer moves at every step (tests/real/overlap_probe.py): each step's copies are
    posted at its start, and each layer waits for its own just before its gate, while the copies
    of every later MoE layer are still in flight (they travel while this layer computes)."""
    out = tmp_path / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(ROOT / "tests" / "real" / "overlap_probe.py"),
           str(mixtral_tiny), str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    moe = list(load_checkpoint(mixtral_tiny)[0].moe_layers)
    for log in json.loads(out.read_text()):
        assert ["early wait"] not in log  # no copy is waited for when posted
        waits = [(i, ev) for i, ev in enumerate(log) if ev[0] == "wait"]
        assert len(waits) == 2 * len(moe)  # steps 1 and 2, every MoE layer
        for i, (_, layer, in_flight) in waits:
            _, step, gated = log[i + 1]
            assert gated == layer and step >= 1  # the wait is just before the layer's gate
            assert in_flight == [m for m in moe if m >= layer]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("planner=flexgen", "not expert-parallel"),
        ("dense=bogus", "valid: data, tensor"),
        ("dispatch=bogus", "dispatch='bogus' unknown; valid: even, balanced"),
        ("micro_batches=0", "micro_batches='0' must be an integer >= 1"),
        ("micro_batches=3", "batch 2 over 1 ranks gives a rank at most 2"),
        ("device=gpu", "device='gpu'; valid: cpu, cuda, cuda:N"),
        pytest.param(
            "device=cuda",
            "no CUDA device here; use device=cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA"),
        ),  # fmt: skip
        ("out=FILE", "cannot write there"),
        ("out=/proc", "out=/proc: cannot write there"),  # exists, but takes no files
    ],
)
def test_bad_input_is_one_line(tmp_path, mixtral_tiny, arg, message):
    """Refused before any planning or process group, so nothing is left half done."""
    (tmp_path / "FILE").write_text("")
    if arg.startswith("out="):
        arg = arg.replace("FILE", str(tmp_path / "FILE"))
    cmd = [sys.executable, "-m", "experiments.ep_run", f"checkpoint={mixtral_tiny}", f"out={tmp_path}",
           arg]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr


def test_eplb_on_processes_that_do_not_divide_the_experts(tmp_path, mixtral_tiny):
    """3 processes for 8 experts, 1 replica slot each: eplb lays out 9 physical experts, 3 a rank
    (its replicas rounded down to split evenly), and the run matches the reference; with no
    replica slots 8 experts cannot be 3 equal shares, one line naming replica_slots, exit 2."""
    summary = torchrun(mixtral_tiny, tmp_path, "planner=eplb", "replica_slots=1", "batch_size=3",
                       nproc=3)  # fmt: skip
    check(mixtral_tiny, tmp_path, summary, "replay")
    assert all(len(held) == 3 for step in summary["placement"] for moe in step for held in moe)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
           f"--master_port={free_port()}", "-m", "experiments.ep_run", f"checkpoint={mixtral_tiny}",
           "planner=eplb", "replica_slots=0", "batch_size=3", f"out={tmp_path / 'none'}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert (
        "need at least 1 replicas" in proc.stderr and "raise planner replica_slots" in proc.stderr
    )


@pytest.mark.parametrize(
    "env, message",
    [
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE is set but RANK is not: launch with torchrun"),
        ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not: launch with torchrun"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
         "rank 0 of 2: the process group at 127.0.0.1:"),
    ],
)  # fmt: skip
def test_a_half_set_up_process_group_is_one_line(tmp_path, mixtral_tiny, env, message):
    """A launch environment that would plan for one number of ranks and run on another (it ran
    2 ranks' plan on 1 process, with wrong logits and exit 0), or a group whose other process
    never starts (torch waits 30 minutes): one line, exit 2, within `rendezvous_s`."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(ROOT), **env}  # fmt: skip
    cmd = [sys.executable, "-m", "experiments.ep_run", f"checkpoint={mixtral_tiny}",
           f"out={tmp_path}", "rendezvous_s=2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr


def test_a_placement_for_another_number_of_ranks_is_refused(mixtral_tiny):
    """ep_generate on a group of 1 with a placement for 2 ranks: pairs for rank 1 would go
    nowhere and their outputs stay zero; one line instead."""
    from experiments.ep_run import init_group
    from real.distributed import ep_generate

    init_group("cpu")
    try:
        spec = load_checkpoint(mixtral_tiny)[0]
        two = [[[[0, 2, 4, 6], [1, 3, 5, 7]] for _ in spec.moe_layers]]  # [step][moe][rank]
        with pytest.raises(
            ConfigError, match=r"step 0, MoE layer 0: 2 ranks' experts for a process group of 1"
        ):
            ep_generate(mixtral_tiny, spec, torch.zeros(1, 4, dtype=torch.long), 1, two)
    finally:
        dist.destroy_process_group()


def test_planning_hardware_holds_a_full_size_model():
    """ep_run's planning hardware is sized from the model and the replica slots: Mixtral-8x7B
    (90 GB of experts) plans on 8 processes with 1 or 2 slots (a fixed 64 GB per device refused it
    at any G, and twice the model refused 2 slots)."""
    import yaml

    from core.spec import ModelSpec
    from experiments.ep_run import ep_hardware, plan_placement
    from experiments.pipeline import RunSpec

    model = ModelSpec.from_dict(yaml.safe_load((ROOT / "conf/model/mixtral-8x7b.yaml").read_text()))
    wl = ep_workload(dict(DEFAULTS, batch_size="8", prompt_len="4", gen_len="2"))
    for slots in (1, 2):  # each device's replicas, all weighed against one device's memory
        params = {"n_devices": 8, "replica_slots": slots}
        spec = RunSpec(model, ep_hardware(8, model, slots), wl, "eplb", params)
        placement, meta = plan_placement(spec, load_routing(model, wl))
        assert len(placement) == 2 and all(len(held) == 1 + slots for held in placement[0][0])


def test_one_process_needs_no_port(tmp_path, mixtral_tiny):
    """Without torchrun, G = 1 runs on an in-memory store: two at once do not collide on a port."""
    cmd = [sys.executable, "-m", "experiments.ep_run", f"checkpoint={mixtral_tiny}", "gen_len=2"]
    procs = [subprocess.Popen([*cmd, f"out={tmp_path / str(i)}"], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dense, micro", [("data", 1), ("tensor", 1), ("data", 2)])
def test_nccl_matches_reference(mixtral_tiny, tmp_path, dense, micro):
    """2 ranks on 2 GPUs; on a 1-GPU machine 1 rank (NCCL cannot put 2 ranks on one GPU).
    CUDA kernels against the CPU reference: logits within 1e-4. micro 2: two-batch overlap,
    its all-to-alls async on NCCL's stream."""
    nproc = min(2, torch.cuda.device_count())
    summary = torchrun(mixtral_tiny, tmp_path, "planner=ep_static", "device=cuda", f"dense={dense}",
                       "batch_size=4", f"micro_batches={micro}", nproc=nproc)  # fmt: skip
    assert (summary["world_size"], summary["backend"], summary["dense"]) == (nproc, "nccl", dense)
    check(mixtral_tiny, tmp_path, summary, "replay", tol=1e-4)


@pytest.mark.parametrize("routing", ["replay", "live"])
def test_data_mode_batch_smaller_than_the_ranks(mixtral_tiny, tmp_path, routing):
    """dense=data, batch 1 on 2 ranks (the simulator's batch-1 expert-parallel cases): rank 1
    runs no sequence but still computes its experts' pairs (replay once cut its empty [0, S, k]
    routing with reshape(0, -1) and raised). Tokens equal the reference, and with replayed
    routing each rank sends the pairs the simulator's all-to-all charges it (rank 1: none)."""
    summary = torchrun(mixtral_tiny, tmp_path, "planner=ep_static", "batch_size=1",
                       f"routing={routing}")  # fmt: skip
    check(mixtral_tiny, tmp_path, summary, routing)
    ranks = summary["ranks"]
    assert min(r["pairs_computed"] for r in ranks) > 0
    assert ranks[0]["pairs_sent"] > 0 and ranks[1]["pairs_sent"] == 0
