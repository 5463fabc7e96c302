"""The routing statistics counted from expert ids equal the membership-matrix reference."""

from __future__ import annotations

import numpy as np
import pytest

from core.routing_stats import _scan_layers, stats_of
from core.spec import RoutingConfig
from core.synthetic import generate


def _reference_scan(ids, top1, e, same_seq, test, set_predictor):
    """The [T, E] float32 membership-matrix pass that _scan_layers replaced (its old code)."""

    def khot(x):
        out = np.zeros((x.shape[0], e), np.float32)
        np.put_along_axis(out, x, 1.0, axis=1)
        return out

    n_layers, k = ids.shape[1], ids.shape[2]
    train = ~test
    counts = np.zeros((n_layers, e))
    reuse_hits = 0
    scores = {n: [] for n in ("acc", "pop_acc", "in_set", "recall", "pop_recall")}
    nxt = khot(ids[:, 0])
    for layer in range(n_layers):
        cur = nxt
        counts[layer] = cur.sum(0)
        hit = np.take_along_axis(cur[:-1], ids[1:, layer], axis=1)
        reuse_hits += int(hit[same_seq].sum())
        if layer == n_layers - 1:
            break
        nxt = khot(ids[:, layer + 1])
        a, b = top1[:, layer], top1[:, layer + 1]
        table = np.zeros((e, e), np.int64)
        np.add.at(table, (a[train], b[train]), 1)
        pred = table.argmax(1)[a[test]]
        scores["acc"].append(np.mean(pred == b[test]))
        scores["pop_acc"].append(np.mean(np.bincount(b[train], minlength=e).argmax() == b[test]))
        scores["in_set"].append(np.mean(nxt[test, pred]))
        if not set_predictor:
            continue
        co = cur[train].T @ nxt[train]
        top = np.argsort(-(cur[test] @ co), axis=1)[:, :k]
        scores["recall"].append(np.take_along_axis(nxt[test], top, 1).sum(1).mean() / k)
        pop_top = np.argsort(-nxt[train].sum(0))[:k]
        scores["pop_recall"].append(nxt[test][:, pop_top].sum(1).mean() / k)
    return counts, reuse_hits, scores


def _inputs(cfg: RoutingConfig, layers: int, e: int, k: int, seed: int):
    ids, w = generate(cfg, 12, 40, layers, e, k, seed)
    s, p = ids.shape[:2]
    flat = ids.reshape(s * p, layers, k).astype(np.int64)
    top1 = np.take_along_axis(flat, w.reshape(s * p, layers, k).argmax(-1)[..., None], -1)[..., 0]
    seq = np.repeat(np.arange(s), p)
    return flat, top1, seq[1:] == seq[:-1], seq % 5 == 0


@pytest.mark.parametrize(
    "cfg,layers,e,k",
    [
        (RoutingConfig(skew=0.3, layer_corr=0.8, reuse=0.2), 5, 64, 6),
        (RoutingConfig(skew=1.5, layer_corr=0.0, reuse=0.0), 4, 8, 2),  # many ties
        (RoutingConfig(skew=0.0, layer_corr=0.5, reuse=0.5), 3, 16, 1),
        (RoutingConfig(skew=0.5, layer_corr=1.0, reuse=0.9), 2, 4, 4),  # k = E
        (RoutingConfig(skew=0.8, layer_corr=0.6, reuse=0.3), 3, 128, 8),  # sets not bits: E > 64
    ],
)
@pytest.mark.parametrize("set_predictor", [True, False])
def test_the_scan_is_the_reference_bit_for_bit(cfg, layers, e, k, set_predictor) -> None:
    ids, top1, same_seq, test = _inputs(cfg, layers, e, k, seed=layers + e)
    counts, hits, scores = _scan_layers(ids, top1, e, same_seq, test, set_predictor)
    ref_counts, ref_hits, ref_scores = _reference_scan(ids, top1, e, same_seq, test, set_predictor)
    assert counts.tobytes() == ref_counts.tobytes() and hits == ref_hits
    assert scores.keys() == ref_scores.keys()
    for name, values in scores.items():
        assert [(type(v), v) for v in values] == [(type(v), v) for v in ref_scores[name]], name


def test_a_repeated_expert_in_a_top_k_is_refused() -> None:
    ids, w = generate(RoutingConfig(), 2, 5, 2, 8, 2, 0)
    ids[0, 0, 0, 1] = ids[0, 0, 0, 0]
    with pytest.raises(ValueError, match="distinct experts"):
        stats_of(ids, w, 8)
