"""Routing statistics of a token stream (the metrics of `../shared/traces/README.md`, "Metric
definitions"): each expert's load, reuse of the previous token's experts, and how well the next
layer's experts are predicted from this layer's. `core.synthetic` fits its generator to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def _summary(x: np.ndarray) -> dict[str, float]:
    return {"mean": float(np.mean(x)), "min": float(np.min(x)), "max": float(np.max(x))}


def routing_stats(
    expert_ids: np.ndarray,
    gate_weights: np.ndarray,
    n_experts: int,
    seq_key: np.ndarray,
    test_mask: np.ndarray,
    set_predictor: bool = True,
) -> dict[str, Any]:
    """Routing metrics of a token stream, keyed as in `stats.json`.

    expert_ids, gate_weights: [T, L, k] tokens in sequence order; seq_key [T]: equal values mark
    tokens of one sequence (consecutive); test_mask [T]: held-out tokens for the predictors.
    set_predictor=False skips set_recall / set_pop_recall (the slow part) while fitting.
    """
    ids = expert_ids.astype(np.int64)
    t, n_layers, k = ids.shape
    e = n_experts
    test = np.asarray(test_mask, bool)
    train = ~test
    same_seq = seq_key[1:] == seq_key[:-1]  # [T-1] token t+1 continues token t's sequence
    top1 = np.take_along_axis(ids, gate_weights.argmax(-1)[..., None], -1)[..., 0]  # [T, L]
    counts, reuse_hits, scores = _scan_layers(ids, top1, e, same_seq, test, set_predictor)
    max_mean = counts.max(1) / counts.mean(1)  # [L]
    wsum = gate_weights.sum(-1)
    out: dict[str, Any] = {
        "tokens": int(t),
        "layers": int(n_layers),
        "experts": int(e),
        "top_k": int(k),
        "train_tokens": int(train.sum()),
        "test_tokens": int(test.sum()),
        **_load_skew(counts, e),
        "prev_token_reuse_same_layer": reuse_hits / max(1, int(same_seq.sum()) * n_layers * k),
        "random_set_recall": k / e,
        "gate_weight_sum_topk": _summary(wsum),
        "per_layer_max_over_mean": [round(float(x), 2) for x in max_mean],
    }
    if n_layers > 1 and test.any() and train.any():
        out |= {
            "top1_acc": _summary(np.array(scores["acc"])),
            "top1_pop_acc": _summary(np.array(scores["pop_acc"])),
            "top1_in_next_set": _summary(np.array(scores["in_set"])),
            "per_pair_top1_acc": [round(float(x), 3) for x in scores["acc"]],
        }
        if set_predictor:
            out |= {
                "set_recall": _summary(np.array(scores["recall"])),
                "set_pop_recall": _summary(np.array(scores["pop_recall"])),
                "per_pair_set_recall": [round(float(x), 3) for x in scores["recall"]],
            }
    return out


def _scan_layers(
    ids: np.ndarray,
    top1: np.ndarray,
    e: int,
    same_seq: np.ndarray,
    test: np.ndarray,
    set_predictor: bool,
) -> tuple[np.ndarray, int, dict[str, list[float]]]:
    """One pass over the layers of ids [T, L, k]: counts [L, E] of each expert's tokens, the
    hits of a token's experts in its predecessor's set (same layer and sequence), and per pair
    of adjacent layers the held-out scores of the successor predictors trained on the rest:
    top-1 by a successor table (acc, in_set) or by popularity (pop_acc), and the top-k set by
    co-occurrence (recall) or by popularity (pop_recall) when `set_predictor`.

    Each figure is counted from the ids, k per token, not from [T, E] membership matrices (a
    token's k experts are distinct); counts are cast to float32, the dtype the membership
    matrices had, so every score is the same float as theirs."""
    sorted_ids = np.sort(ids, axis=2)
    if (sorted_ids[..., 1:] == sorted_ids[..., :-1]).any():
        raise ValueError("routing statistics need distinct experts in each token's top-k")
    n_layers, k = ids.shape[1], ids.shape[2]
    by_layer = np.ascontiguousarray(ids.transpose(1, 0, 2), dtype=np.int32)  # [L, T, k]
    # [L, T] each token's set as bits where the experts fit in 64 (else None: compared id by id)
    masks = _bits(by_layer) if e <= 64 else None
    train = ~test
    counts = np.zeros((n_layers, e))
    reuse_hits = 0
    scores: dict[str, list[float]] = {
        n: [] for n in ("acc", "pop_acc", "in_set", "recall", "pop_recall")
    }
    for layer in range(n_layers):
        cur = by_layer[layer]  # [T, k]
        counts[layer] = np.bincount(cur.ravel(), minlength=e)
        sets = _Sets(cur, None if masks is None else masks[layer])
        hit = sets.member(cur[1:], slice(None, -1))  # [T-1, k] in the previous token's set?
        reuse_hits += int(hit[same_seq].sum())
        if layer == n_layers - 1:
            break
        nxt = by_layer[layer + 1]
        a, b = top1[:, layer], top1[:, layer + 1]
        table = np.zeros((e, e), np.int64)  # [E, E] train successor counts
        np.add.at(table, (a[train], b[train]), 1)
        pred = table.argmax(1)[a[test]]  # [T_test]
        scores["acc"].append(np.mean(pred == b[test]))
        scores["pop_acc"].append(np.mean(np.bincount(b[train], minlength=e).argmax() == b[test]))
        nxt_sets = _Sets(nxt, None if masks is None else masks[layer + 1])
        scores["in_set"].append(np.mean(nxt_sets.member(pred[:, None], test)[:, 0]))
        if not set_predictor:
            continue
        cur_train, nxt_train = cur[train], nxt[train]
        pairs = (cur_train[:, :, None] * e + nxt_train[:, None, :]).ravel()
        co = np.bincount(pairs, minlength=e * e).reshape(e, e).astype(np.float32)  # [E, E]
        cur_test = cur[test]
        score = co[cur_test[:, 0]]  # [T_test, E] co-occurrence summed over the token's set
        for j in range(1, k):
            score += co[cur_test[:, j]]
        top = np.argsort(-score, axis=1)[:, :k]  # [T_test, k]
        scores["recall"].append(nxt_sets.member(top, test).sum(1).mean() / k)
        pop = np.bincount(nxt_train.ravel(), minlength=e).astype(np.float32)
        pop_top = np.argsort(-pop)[:k]
        hits = nxt_sets.member(np.broadcast_to(pop_top, (len(top), k)), test)
        scores["pop_recall"].append(hits.sum(1).mean() / k)
    return counts, reuse_hits, scores


def _bits(ids: np.ndarray) -> np.ndarray:
    """[...] uint64: bit i set where expert i is in the set ids [..., k] (experts < 64)."""
    return np.bitwise_or.reduce(np.left_shift(np.uint64(1), ids.astype(np.uint64)), axis=-1)


@dataclass(frozen=True)
class _Sets:
    """Each token's top-k set of one layer: ids [T, k], and as bits [T] where they fit."""

    ids: np.ndarray
    bits: np.ndarray | None

    def member(self, x: np.ndarray, rows: slice | np.ndarray) -> np.ndarray:
        """[N, m] float32 1.0 where x[i, j] is in the set of the i-th of `rows`, else 0.0."""
        if self.bits is not None:
            shifted = self.bits[rows][:, None] >> x.astype(np.uint64)
            return (shifted & np.uint64(1)).astype(np.float32)
        sets = self.ids[rows]
        return (x[:, :, None] == sets[:, None, :]).any(axis=2).astype(np.float32)


def _load_skew(counts: np.ndarray, e: int) -> dict[str, Any]:
    """How uneven each layer's load is, over the layers: the busiest expert's tokens over the
    mean, and the share of the tokens the top quarter of the experts draw. counts [L, E]."""
    max_mean = counts.max(1) / counts.mean(1)  # [L]
    top_share = np.sort(counts, 1)[:, ::-1][:, : max(1, e // 4)].sum(1) / counts.sum(1)
    return {
        "max_over_mean_load": {
            "min": float(max_mean.min()),
            "median": float(np.median(max_mean)),
            "max": float(max_mean.max()),
            "argmax_layer_index": int(max_mean.argmax()),
        },
        "top25pct_experts_share": {
            "min": float(top_share.min()),
            "median": float(np.median(top_share)),
            "max": float(top_share.max()),
        },
    }


def stats_of(
    routing_ids: np.ndarray,
    gate_weights: np.ndarray,
    n_experts: int,
    test_every: int = 5,
    set_predictor: bool = True,
) -> dict[str, Any]:
    """`routing_stats` of [S, P, L, k] routing: sequences with index % test_every == 0 held out."""
    s, p, n_layers, k = routing_ids.shape
    seq = np.repeat(np.arange(s), p)  # [S*P]
    return routing_stats(
        routing_ids.reshape(s * p, n_layers, k),
        gate_weights.reshape(s * p, n_layers, k),
        n_experts,
        seq,
        seq % test_every == 0,
        set_predictor,
    )
