"""Expert prefetch predictors (any planner may use them): which K experts of a MoE layer the
whole batch group will use most, decided before that layer's gates run.

- `correlation`: Klotski's table `[layer][previous expert][expert]` (path length 1) built from a
  warm-up on routing that is *not* the evaluation routing; each token of the group votes with
  its previous-layer experts' rows (row-normalised), votes are summed over the group, top-K.
  Layer 0 uses the warm-up's marginal counts. Counts are updated online as gates reveal routing
  and never written back (the warm-up table is copied).
- `popularity`: per-layer marginal counts (warm-up + online), top-K.
- `none`: predicts nothing.
- `oracle`: the group's true top-K, read ahead through `CausalRouting.peek` (an upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.errors import ConfigError, TraceError

PREDICTORS = ("correlation", "popularity", "none", "oracle")


@dataclass
class ExpertTable:
    """Warm-up counts. `pair[l, a, b]`: tokens choosing a at MoE layer l-1 and b at l (l >= 1)."""

    pair: np.ndarray  # [L, E, E] float64; pair[0] unused (zeros)
    marginal: np.ndarray  # [L, E] float64: selections per expert per layer
    source: str = ""  # what the warm-up ran on

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.marginal.shape[0]), int(self.marginal.shape[1])

    @classmethod
    def empty(cls, n_layers: int, n_experts: int, source: str = "empty") -> ExpertTable:
        return cls(
            np.zeros((n_layers, n_experts, n_experts)), np.zeros((n_layers, n_experts)), source
        )

    @classmethod
    def fit(cls, ids: np.ndarray, n_experts: int, source: str = "") -> ExpertTable:
        """Count a warm-up routing: ids [T, L, k] (or [S, P, L, k]) expert ids per token."""
        ids = np.asarray(ids)
        ids = ids.reshape(-1 if ids.size else 0, *ids.shape[-2:])  # [T, L, k]
        table = cls.empty(ids.shape[1], n_experts, source)
        for layer in range(ids.shape[1]):
            table.observe(layer, ids[:, layer - 1] if layer else None, ids[:, layer])
        return table

    def copy(self) -> ExpertTable:
        return ExpertTable(self.pair.copy(), self.marginal.copy(), self.source)

    def check_shape(self, n_layers: int, n_experts: int, model_name: str) -> None:
        if self.shape != (n_layers, n_experts):
            raise TraceError(
                f"prefetch table ({self.source}) is for (moe_layers, experts) = {self.shape}, "
                f"model {model_name} has {(n_layers, n_experts)}; "
                "build the table from routing of this model"
            )

    def observe(self, layer: int, prev: np.ndarray | None, cur: np.ndarray) -> None:
        """Add one group's routing: prev, cur [T, k] ids of the same tokens at layers l-1 and l."""
        e = self.marginal.shape[1]
        self.marginal[layer] += np.bincount(cur.ravel(), minlength=e)
        if layer and prev is not None and len(prev):
            k1, k2 = prev.shape[1], cur.shape[1]
            # [T*k1*k2] every (prev, cur) pair of a token; int64: a * e + b overflows int16 ids
            # at 256 experts
            a = np.repeat(prev, k2, axis=1).ravel().astype(np.int64)
            b = np.tile(cur, (1, k1)).ravel().astype(np.int64)
            self.pair[layer] += np.bincount(a * e + b, minlength=e * e).reshape(e, e)

    def votes(self, layer: int, prev: np.ndarray | None) -> np.ndarray:
        """[E] summed tendencies of the group's tokens (prev [T, k] ids at layer l-1)."""
        if layer == 0 or prev is None or not len(prev):
            return self.marginal[layer].copy()
        rows = self.pair[layer]
        norm = rows / np.maximum(rows.sum(1, keepdims=True), 1.0)  # P(cur | prev)
        return np.bincount(prev.ravel(), minlength=len(rows)) @ norm


def top_k(scores: np.ndarray, k: int) -> list[int]:
    """The k best experts, ties broken by index (deterministic); zero scores never chosen."""
    order = np.lexsort((np.arange(len(scores)), -scores))
    return [int(e) for e in order[:k] if scores[e] > 0]


class Predictor:
    """One prefetch policy. `predict` before a layer's gates; `observe` after them (online)."""

    def __init__(self, kind: str, table: ExpertTable | None, k: int) -> None:
        if kind not in PREDICTORS:
            raise ConfigError(f"predictor {kind!r} unknown; valid: {', '.join(PREDICTORS)}")
        if kind in ("correlation", "popularity") and table is None:
            raise ConfigError(
                f"predictor {kind} needs a warm-up table; give it one, or use another"
            )
        self.kind = kind
        self.k = k
        self.table = table.copy() if table is not None else None  # online updates stay here

    @property
    def oracle(self) -> bool:
        return self.kind == "oracle"

    def predict(
        self,
        layer: int,
        prev: np.ndarray | None,
        truth: np.ndarray | None = None,
        k: int | None = None,
    ) -> list[int]:
        """K experts to prefetch for the group at MoE layer `layer` (`k` more or fewer: the
        ranking goes on past the K hot ones).

        prev: [T, k] the group's ids at layer-1 (already seen); truth: [E] the group's counts
        at this layer, only for the oracle (read through CausalRouting.peek by the caller).
        """
        k = self.k if k is None else k
        if self.kind == "none":
            return []
        if self.kind == "oracle":
            assert truth is not None, "the oracle needs the peeked counts"
            return top_k(np.asarray(truth, float), k)
        assert self.table is not None
        if self.kind == "popularity":
            return top_k(self.table.marginal[layer], k)
        return top_k(self.table.votes(layer, prev), k)

    def observe(self, layer: int, prev: np.ndarray | None, cur: np.ndarray) -> None:
        if self.table is not None:
            self.table.observe(layer, prev, cur)
