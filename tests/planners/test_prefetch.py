"""Prefetch predictors (planners/prefetch.py): hand-counted tables, group votes, online updates
that are never written back, and the shape check."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import ConfigError, TraceError
from planners.prefetch import ExpertTable, Predictor, top_k


def fig8_table() -> ExpertTable:
    """4 experts, top-1, 2 layers. Warm-up: prev 0 -> 1 (x3), prev 2 -> 2 (x1), prev 3 -> 0 (x1)."""
    ids = np.array([[[0], [1]]] * 3 + [[[2], [2]]] + [[[3], [0]]])  # [T=5, L=2, k=1]
    return ExpertTable.fit(ids, 4, "fig8")


def test_fit_counts_pairs_and_marginals():
    t = fig8_table()
    assert t.shape == (2, 4)
    assert t.marginal.tolist() == [[3, 0, 1, 1], [1, 3, 1, 0]]
    assert (
        t.pair[1, 0, 1] == 3
        and t.pair[1, 2, 2] == 1
        and t.pair[1, 3, 0] == 1
        and t.pair[1].sum() == 5
    )


def test_votes_are_summed_over_the_group():
    """Group: 2 tokens came from expert 0, 3 from expert 2 at layer 0. Rows are P(cur | prev):
    expert 1 gets 2 votes (from 0), expert 2 gets 3 (from 2): top-1 is expert 2, not the
    single most likely successor of the most popular expert."""
    t = fig8_table()
    prev = np.array([[0], [0], [2], [2], [2]])
    assert t.votes(1, prev).tolist() == [0, 2, 3, 0]
    assert Predictor("correlation", t, 1).predict(1, prev) == [2]
    assert Predictor("correlation", t, 2).predict(1, prev) == [2, 1]
    assert Predictor("popularity", t, 1).predict(1, prev) == [1]
    assert Predictor("none", t, 2).predict(1, prev) == []
    assert Predictor("oracle", None, 2).predict(1, prev, truth=np.array([5, 0, 1, 9])) == [3, 0]


def test_online_updates_change_predictions_but_never_the_warmup_table():
    t = fig8_table()
    p = Predictor("correlation", t, 1)
    prev = np.array([[3]])
    assert p.predict(1, prev) == [0]
    for _ in range(3):  # the run keeps seeing 3 -> 2
        p.observe(1, prev, np.array([[2]]))
    assert p.predict(1, prev) == [2]
    assert t.pair[1, 3].tolist() == [1, 0, 0, 0]  # not written back


def test_top_k_breaks_ties_by_index_and_skips_zeros():
    assert top_k(np.array([1.0, 3.0, 3.0, 0.0]), 3) == [1, 2, 0]
    assert top_k(np.array([0.0, 2.0, 0.0]), 2) == [1]


def test_a_table_for_another_model_shape_is_rejected():
    with pytest.raises(TraceError, match=r"\(2, 4\).*mixtral-8x7b has \(32, 8\)"):
        fig8_table().check_shape(32, 8, "mixtral-8x7b")


def test_unknown_or_tableless_predictors_are_rejected():
    with pytest.raises(ConfigError, match="valid: correlation"):
        Predictor("magic", None, 2)
    with pytest.raises(ConfigError, match="warm-up table"):
        Predictor("correlation", None, 2)


def test_correlation_beats_popularity_on_correlated_routing():
    """Layer 1 copies layer 0's expert; layer 0 is uniform: only the table can know which."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, 8, 400)
    ids = np.stack([first, first], axis=1)[:, :, None]  # [T, 2, 1]
    table = ExpertTable.fit(ids[:200], 8, "train")
    hits = {kind: 0 for kind in ("correlation", "popularity")}
    for tok in ids[200:]:
        for kind in hits:
            hits[kind] += Predictor(kind, table, 1).predict(1, tok[0][None]) == [int(tok[1, 0])]
    assert hits["correlation"] == 200 > hits["popularity"]


def test_pair_counts_of_256_experts_from_int16_ids():
    """Routing ids are int16; the pair index prev * 256 + cur passes 32,767 (it overflowed, and
    Klotski on Switch-base-256 failed in bincount)."""
    import numpy as np

    from planners.prefetch import ExpertTable

    ids = np.array([[[255], [254]], [[3], [200]]], dtype=np.int16)  # [T=2, L=2, k=1]
    table = ExpertTable.fit(ids, 256)
    assert table.pair[1, 255, 254] == 1 and table.pair[1, 3, 200] == 1 and table.pair.sum() == 2
