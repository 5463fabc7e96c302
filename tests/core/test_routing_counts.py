"""Routing.counts and batch_ids by hand, and every hardware profile says where its numbers come
from (DESIGN.md: spec sheet, a paper's calibration point, or experiments.calibrate)."""

from __future__ import annotations

import numpy as np
import pytest

from core.routing import Routing
from core.spec import RoutingConfig, Workload
from tests.conftest import ROOT, conf


def test_counts_by_hand():
    """4 sequences in 2 batches of 2, prompt 2, gen 2 (positions 0-1 prefill, 2 = step 1), one
    MoE layer, 3 experts, top-1. Sequence s routes position p to expert (s + p) % 3:
      s0: 0 1 2   s1: 1 2 0   s2: 2 0 1   s3: 0 1 2
    step 0, batch 0 (s0, s1 at p 0-1): experts 0,1,1,2 -> [1, 2, 1]
    step 0, batch 1 (s2, s3 at p 0-1): 2,0,0,1 -> [2, 1, 1]
    step 1, batch 0 (p 2): 2, 0 -> [1, 0, 1];  step 1, batch 1: 1, 2 -> [0, 1, 1]"""
    s, p = np.arange(4)[:, None], np.arange(3)[None, :]
    ids = ((s + p) % 3).astype(np.int16)[:, :, None, None]  # [S, P, L=1, k=1]
    routing = Routing(ids, np.ones(ids.shape, np.float32), 3, "by hand")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=2, gen_len=2, routing=RoutingConfig())
    counts = routing.counts(wl)  # [steps, L, n_batches, E]
    assert counts[0, 0].tolist() == [[1, 2, 1], [2, 1, 1]]
    assert counts[1, 0].tolist() == [[1, 0, 1], [0, 1, 1]]
    for step in (0, 1):
        for b in (0, 1):
            ids_b = routing.batch_ids(step, 0, b, wl)  # [T, k]
            assert np.bincount(ids_b.ravel(), minlength=3).tolist() == counts[step, 0, b].tolist()


@pytest.mark.parametrize("block", [1, 5, 1 << 30])
def test_counts_in_blocks_of_any_size_are_one_count(block, monkeypatch):
    """Routing.counts over blocks of batches (COUNT_BLOCK ids: one batch, a few, all) gives
    the per-batch bincounts of batch_ids."""
    import core.routing

    monkeypatch.setattr(core.routing, "COUNT_BLOCK", block)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 5, (6, 7, 3, 2)).astype(np.int16)  # [S, P, L, k]
    routing = Routing(ids, np.ones(ids.shape, np.float32), 5, "random")
    wl = Workload(batch_size=2, n_batches=3, prompt_len=4, gen_len=3, routing=RoutingConfig())
    counts = routing.counts(wl)
    for step in range(wl.n_steps):
        for layer in range(3):
            for b in range(3):
                want = np.bincount(routing.batch_ids(step, layer, b, wl).ravel(), minlength=5)
                assert counts[step, layer, b].tolist() == want.tolist()


@pytest.mark.parametrize(
    "name", sorted(p.stem for p in (ROOT / "conf" / "hardware").glob("*.yaml"))
)
def test_hardware_profile_names_its_sources(name):
    sources = conf("hardware", name).get("sources") or {}
    assert sources and all(isinstance(v, str) and v.strip() for v in sources.values())


def test_a_replayed_gate_shows_the_batch_s_ids_when_read():
    """CausalRouting.replay's views make their ids when first read: the batch's batch_ids, and
    counts equal to their bincount."""
    from core.routing import CausalRouting

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5, (4, 6, 2, 2)).astype(np.int16)  # [S, P, L, k]
    routing = Routing(ids, np.ones(ids.shape, np.float32), 5, "random")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=3, gen_len=3, routing=RoutingConfig())
    causal = CausalRouting.replay(routing, wl)
    for step in range(wl.n_steps):
        for layer in range(2):
            for b in range(2):
                view = causal.at_gate(0, step, layer, b)
                want = routing.batch_ids(step, layer, b, wl)
                assert np.array_equal(view.ids, want) and view.ids is view.ids
                assert view.counts.tolist() == np.bincount(want.ravel(), minlength=5).tolist()
