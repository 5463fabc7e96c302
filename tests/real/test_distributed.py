"""Expert parallelism on 2 processes (torchrun, gloo; NCCL when marked gpu) against the plain
single-process forward.

Fixture: mixtral-tiny (4 layers, 8 experts, top-2, float32), batch 2, 8 prompt tokens, 3 generated:
2 x (8 + 2) positions x 4 layers x 2 = 160 (token, slot) pairs go through experts.
Tolerance: generated tokens equal exactly; last logits within atol=rtol=1e-5 (float32: an expert
runs over a different subset of rows than in the reference, which can change BLAS blocking; seen
~1e-6).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.routing import load_routing
from experiments.ep_run import DEFAULTS, ep_workload
from real.checkpoint import load_checkpoint
from real.distributed import destinations
from real.model import reference_generate

ATOL = RTOL = 1e-5
PAIRS = 2 * (8 + 2) * 4 * 2
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(ckpt: Path, out: Path, *args: str, nproc: int = 2) -> dict:
    """`torchrun --nproc_per_node=2 -m experiments.ep_run ...`; returns rank 0's summary."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "-m", "experiments.ep_run", f"checkpoint={ckpt}",
           "batch_size=2", "prompt_len=8", "gen_len=3", f"out={out}", *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def reference(ckpt: Path, out: Path, routing: str) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = torch.load(out / "outputs.pt")["prompts"]
    forced = None
    if routing == "replay":  # the routing ep_run forced: the workload's synthetic routing
        opts = dict(DEFAULTS, batch_size="2", prompt_len="8", gen_len="3")
        forced = load_routing(load_checkpoint(ckpt)[0], ep_workload(opts))
    return reference_generate(ckpt, prompts, 3, forced)


def check(ckpt: Path, out: Path, summary: dict, routing: str, tol: float = ATOL) -> None:
    got = torch.load(out / "outputs.pt")
    tokens, logits = reference(ckpt, out, routing)
    assert torch.equal(got["tokens"], tokens)
    torch.testing.assert_close(got["logits"], logits, atol=tol, rtol=tol)
    ranks = summary["ranks"]
    assert sum(r["pairs_computed"] for r in ranks) == PAIRS
    assert all(r["outside_placement"] == 0 for r in ranks)
    for r in ranks:  # computed only experts it held
        for layer, done in r["experts_computed"].items():
            assert set(done) <= set(r["experts_held"][layer])


@pytest.mark.parametrize("routing", ["replay", "live"])
def test_ep_static_two_ranks_match_reference(mixtral_tiny, tmp_path, routing):
    summary = torchrun(mixtral_tiny, tmp_path, "planner=ep_static", f"routing={routing}")
    assert (summary["world_size"], summary["backend"]) == (2, "gloo")
    check(mixtral_tiny, tmp_path, summary, routing)
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


def test_destinations_split_replicas_evenly():
    """Expert 0 has 5 pairs, in (token, slot) order, and copies on ranks 0 and 1: the first
    3 pairs go to rank 0, the last 2 to rank 1 (split_tokens' 5 // 2 + 1, 5 // 2)."""
    ids = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3], [0, 2]])  # [T=5, k=2]
    dest = destinations(ids, [[2, 0, 3], [0, 1]], n_experts=4)  # rank 0: 2, 0, 3; rank 1: 0, 1
    assert dest.tolist() == [[0, 1], [0, 0], [1, 0], [1, 0], [1, 0]]


def test_bad_input_is_one_line(tmp_path, mixtral_tiny):
    cmd = [sys.executable, "-m", "experiments.ep_run", f"checkpoint={mixtral_tiny}",
           "planner=flexgen", f"out={tmp_path}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not expert-parallel" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nccl_matches_reference(mixtral_tiny, tmp_path):
    """2 ranks on 2 GPUs; on a 1-GPU machine 1 rank (NCCL cannot put 2 ranks on one GPU).
    CUDA kernels against the CPU reference: logits within 1e-4."""
    nproc = min(2, torch.cuda.device_count())
    summary = torchrun(mixtral_tiny, tmp_path, "planner=ep_static", "device=cuda", nproc=nproc)
    assert (summary["world_size"], summary["backend"]) == (nproc, "nccl")
    check(mixtral_tiny, tmp_path, summary, "replay", tol=1e-4)
