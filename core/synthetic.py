"""Synthetic expert routing fitted to real traces.

`synthetic_routing` draws top-k experts per token with per-layer Zipf popularity (+ optional hot
experts), inter-layer correlation (a sparse transition table: slot j of a token follows the row of
its slot j's expert one layer up) and temporal reuse (a slot repeats the same slot of the previous
token's draw, before duplicates within a token are redrawn, so the measured reuse of the previous
token's experts is below `reuse` where steep skew makes duplicates common). `fit_synthetic` /
`fit_to_counts` pick generator parameters from the metrics `core.routing_stats` computes.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from core.errors import ConfigError
from core.routing import Routing
from core.routing_stats import stats_of
from core.spec import ModelSpec, RoutingConfig, Workload

log = logging.getLogger(__name__)

_Q = 1 << 16  # resolution of the popularity lookup tables (16 random bits)
_Q_TR = 1 << 10  # resolution of the transition lookup tables (10 of 16 random bits)
FANOUT = 2  # a transition-table row has FANOUT * k successors ...
DECAY = 0.5  # ... with weights proportional to DECAY ** rank
GATE_LOGIT_STD = (
    1.03  # router logits ~ N(0, std): top-6 of 64 then hold ~0.37 probability, as in ESFT
)
_GATE_POOL = 4096  # distinct gate-weight vectors drawn per routing
CHUNK_SEQS = 32  # sequences generated together (bounds the working set)


# ---- generator -------------------------------------------------------------------------------


def table_bytes(n_layers: int, n_experts: int) -> int:
    """About the generator's peak bytes before it draws a token: per MoE layer, the [E, E]
    float64 transition table (about six such arrays at once) and the float64 steps (about 32
    bytes an entry) of its [Q] popularity and [E, Q_TR] transition lookups (`_lut`). A model of
    1e5 layers or 2e4 experts asked for hundreds of GB."""
    return n_layers * (48 * n_experts**2 + 32 * _Q + 32 * n_experts * _Q_TR)


def popularity(cfg: RoutingConfig, n_layers: int, n_experts: int, seed: int) -> np.ndarray:
    """[L, E] per-layer selection probabilities: Zipf(skew) over a random expert order per layer."""
    rng = np.random.default_rng([seed, 1])
    with np.errstate(over="ignore"):  # a steep skew: rank**skew past 1e308 weighs 1/inf = 0
        zipf = 1.0 / np.arange(1, n_experts + 1) ** cfg.skew  # [E] by rank
    zipf /= zipf.sum()
    if cfg.hot_experts > n_experts:
        raise ConfigError(
            f"workload.routing.hot_experts={cfg.hot_experts} exceeds the model's {n_experts} "
            f"experts; pass at most {n_experts}"
        )
    if cfg.hot_experts > 0:
        h = cfg.hot_experts
        hot, cold = zipf[:h], zipf[h:]
        zipf = np.concatenate(
            [hot / hot.sum() * cfg.hot_share, cold / max(cold.sum(), 1e-300) * (1 - cfg.hot_share)]
        )
        if h == n_experts:
            zipf = hot / hot.sum()
    perm = np.argsort(rng.random((n_layers, n_experts)), axis=1)  # [L, E] rank -> expert
    pop = np.empty((n_layers, n_experts))
    np.put_along_axis(pop, perm, np.broadcast_to(zipf, pop.shape), axis=1)
    return pop


def transition_tables(pop: np.ndarray, top_k: int, seed: int) -> np.ndarray:
    """[L, E, E] row e of layer l: distribution of layer l's expert in a slot whose expert at
    layer l-1 was e (slot by slot: a token's slot j follows its slot j's expert).

    Each row has FANOUT*k successors drawn by popularity (so the layer's marginal stays close
    to its popularity), weighted DECAY**rank so every row has a clear favourite.
    """
    n_layers, n_experts = pop.shape
    m = min(n_experts, FANOUT * top_k)
    rng = np.random.default_rng([seed, 2])
    gumbel = -np.log(-np.log(rng.random((n_layers, n_experts, n_experts))))
    keys = (
        np.log(np.maximum(pop, 1e-300))[:, None, :] + gumbel
    )  # [L, E, E] sampling w/o replacement
    succ = np.argsort(-keys, axis=2)[:, :, :m]  # [L, E, m]
    table = np.zeros((n_layers, n_experts, n_experts))
    np.put_along_axis(table, succ, np.broadcast_to(DECAY ** np.arange(m), succ.shape), axis=2)
    return table / table.sum(axis=2, keepdims=True)


def _lut(prob: np.ndarray, q: int) -> np.ndarray:
    """[..., q] int16 inverse-CDF lookup table: lut[u] for u uniform in [0, q) draws from prob."""
    e = prob.shape[-1]
    cdf = np.cumsum(prob.reshape(-1, e), axis=1)  # [R, E]
    cdf /= cdf[:, -1:]
    rows, row = len(cdf), np.arange(len(cdf))[:, None]
    # lut[r, j] = #{e: cdf[r, e] + r < u[j] + r} (rows offset: the flattened arrays sorted), by
    # each CDF point searched into the R*q draws (q = 2**16), not each draw into the R*E points
    u = (np.arange(q) + 0.5) / q  # [q]
    k = np.searchsorted((u + row).ravel(), (cdf + row).ravel(), "right").reshape(-1, e) - row * q
    bounds = np.concatenate([np.zeros((rows, 1), np.int64), k, np.full((rows, 1), q)], axis=1)
    out = np.repeat(np.tile(np.arange(e + 1, dtype=np.int16), rows), np.diff(bounds).ravel())
    return np.minimum(out, e - 1).astype(np.int16).reshape(*prob.shape[:-1], q)


@functools.lru_cache(maxsize=8)
def gate_pool(n_experts: int, top_k: int, seed: int) -> np.ndarray:
    """[G, k] float32 descending top-k softmax probabilities of random router logits, read-only
    and kept for the next call with the same arguments (a fit generates dozens of routings)."""
    rng = np.random.default_rng([seed, 3])
    logits = rng.normal(0.0, GATE_LOGIT_STD, (_GATE_POOL, n_experts))
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = -np.sort(-p, axis=1)[:, :top_k].astype(np.float32)
    out.flags.writeable = False
    return out


def _dedupe(
    ids: np.ndarray, redraw: Callable[[np.ndarray, int], np.ndarray], n_experts: int
) -> None:
    """Make each row of ids [N, k] distinct in place: redraw later duplicate slots, then shift."""
    k = ids.shape[1]
    if k == 2:  # most models (top-2): the same steps, one column against the other
        _dedupe_pairs(ids, redraw, n_experts)
        return
    for j in range(1, k):
        rows = np.flatnonzero((ids[:, j : j + 1] == ids[:, :j]).any(axis=1))
        for attempt in range(2 + j):
            if rows.size == 0:
                break
            # redraw twice from the slot's own distribution, then step to the next expert id:
            # j + 1 steps always reach one the row does not use yet
            ids[rows, j] = redraw(rows, j) if attempt < 2 else (ids[rows, j] + 1) % n_experts
            rows = rows[(ids[rows, j : j + 1] == ids[rows, :j]).any(axis=1)]
        assert rows.size == 0


def _dedupe_pairs(
    ids: np.ndarray, redraw: Callable[[np.ndarray, int], np.ndarray], n_experts: int
) -> None:
    """`_dedupe` of ids [N, 2]: the same redraws of the same rows in the same order."""
    first, second = ids[:, 0], ids[:, 1]  # views: written in place
    rows = np.flatnonzero(first == second)
    for attempt in range(3):
        if rows.size == 0:
            break
        second[rows] = redraw(rows, 1) if attempt < 2 else (second[rows] + 1) % n_experts
        rows = rows[second[rows] == first[rows]]
    assert rows.size == 0


@dataclass(frozen=True)
class _Tables:
    pop_lut: np.ndarray  # [L, Q] int16 popularity draws
    trans_lut: np.ndarray  # [L, E*Q_TR] int16 transition draws, row e at e*Q_TR
    corr_thr: int  # 16-bit threshold: u < corr_thr follows the transition table
    reuse_thr: int  # 16-bit threshold: u < reuse_thr repeats the previous token
    layer_corr: float


def generate(*args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    """`draw`'s ([S, P, L, k] int16 expert ids, [S, P, L, k] float32 gate weights), the weights
    drawn at once; slot 0 is the top-1."""
    ids, weights = draw(*args, **kwargs)
    return ids, weights()


def draw(
    cfg: RoutingConfig,
    n_sequences: int,
    n_positions: int,
    n_layers: int,
    n_experts: int,
    top_k: int,
    seed: int,
    first_chunk: int = 0,
) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
    """([S, P, L, k] int16 expert ids, a function that draws their [S, P, L, k] float32 gate
    weights); slot 0 is the top-1.

    Blocks of CHUNK_SEQS sequences are drawn independently (each from its own stream, so a
    sequence does not depend on how many others are asked for) to keep the work in cache.
    `first_chunk`: start at that block (sequence first_chunk * CHUNK_SEQS of the same stream of
    sequences) without drawing the ones before it. The weights are each block's from its
    stream where its ids left it, the same numbers whenever the function is called: a
    simulated run reads none, and drawing them took a sixth of its routing's time.
    """
    if top_k > n_experts:
        raise ConfigError(f"top_k={top_k} exceeds n_experts={n_experts}; pass top_k <= n_experts")
    if not n_layers:  # a dense model: nothing routed
        shape = (n_sequences, n_positions, 0, top_k)
        return np.empty(shape, np.int16), lambda: np.empty(shape, np.float32)
    pop = popularity(cfg, n_layers, n_experts, seed)  # [L, E]
    tables = _Tables(
        pop_lut=_lut(pop, _Q),
        trans_lut=_lut(transition_tables(pop, top_k, seed), _Q_TR).reshape(n_layers, -1),
        corr_thr=round(cfg.layer_corr * _Q) if n_layers > 1 else 0,
        reuse_thr=round(cfg.reuse * _Q),
        layer_corr=cfg.layer_corr,
    )
    ids = np.empty((n_sequences, n_positions, n_layers, top_k), np.int16)
    states = []  # per block, its stream's kind and state once its ids are drawn
    for c, s0 in enumerate(range(0, n_sequences, CHUNK_SEQS)):
        s1 = min(s0 + CHUNK_SEQS, n_sequences)
        rng = np.random.default_rng([seed, 4, first_chunk + c])
        if s1 - s0 == CHUNK_SEQS:
            _chunk(tables, ids[s0:s1], n_experts, rng)
        else:  # a short last block is drawn full-size and cut, so sequences match any S
            part_ids = np.empty((CHUNK_SEQS, *ids.shape[1:]), np.int16)
            _chunk(tables, part_ids, n_experts, rng)
            ids[s0:s1] = part_ids[: s1 - s0]
        states.append((type(rng.bit_generator), rng.bit_generator.state))
    gates = gate_pool(n_experts, top_k, seed)

    def weights() -> np.ndarray:
        out = np.empty(ids.shape, np.float32)
        for c, s0 in enumerate(range(0, n_sequences, CHUNK_SEQS)):
            kind, state = states[c]
            bits = kind()
            bits.state = state
            w = _gate_weights(gates, bits, (CHUNK_SEQS, *ids.shape[1:]))
            out[s0 : s0 + CHUNK_SEQS] = w[: n_sequences - s0]
        return out

    return ids, weights


def _chunk(t: _Tables, out: np.ndarray, n_experts: int, rng: np.random.Generator) -> None:
    """Fill out [S, P, L, k] ids of a few sequences, layer by layer.

    Works on [P, S*k] arrays (positions first, so the reuse fill is a row-wise running max);
    each random decision is 16 bits of one raw 64-bit draw per slot.
    """
    s, p, n_layers, k = out.shape
    n = s * k  # columns: (sequence, slot)
    prev = np.zeros((p, n), np.int32)  # [P, S*k] experts at the previous layer
    pos_dtype = np.int16 if p < 2**15 else np.int32
    pos = np.arange(p, dtype=pos_dtype)[:, None]  # [P, 1]
    col = np.arange(n)[None, :]  # [1, S*k]
    wide = {1: np.int16, 2: np.int32, 4: np.int64}.get(k)  # a token's k slots as one element
    corr_64 = math.ceil(t.layer_corr * 64)
    for layer in range(n_layers):
        raw = rng.bit_generator.random_raw(p * n).view(np.uint16).reshape(p, n, 4)
        cand = np.take(t.pop_lut[layer], raw[..., 0])  # [P, S*k]
        corr = layer > 0 and t.corr_thr > 0
        if corr:
            idx = prev * _Q_TR  # [P, S*k] slot j follows the row of slot j's expert one layer up
            idx += raw[..., 1] >> 6  # np.where below: twice as fast as copyto's where= here
            cand = np.where(raw[..., 2] < t.corr_thr, np.take(t.trans_lut[layer], idx), cand)
        cur = cand
        if t.reuse_thr:
            # temporal reuse: a slot that is not fresh repeats the same slot of the previous token
            fresh = raw[..., 3] >= t.reuse_thr
            fresh[0] = True
            src = np.multiply(fresh, pos, dtype=pos_dtype)  # [P, S*k]
            np.maximum.accumulate(src, axis=0, out=src)  # last fresh position at or before p
            cur = np.take(cand, src.astype(np.intp) * n + col)

        prev_tok = prev.reshape(p * s, k)  # [P*S, k]

        def redraw(
            rows: np.ndarray,
            j: int,
            layer: int = layer,
            corr: bool = corr,
            prev_tok: np.ndarray = prev_tok,
        ) -> np.ndarray:
            u = rng.integers(0, _Q, (2, rows.size))
            from_pop = t.pop_lut[layer][u[0]]
            if not corr:
                return from_pop
            tr = t.trans_lut[layer][prev_tok[rows, j] * _Q_TR + (u[1] >> 6)]
            # u % 64 < layer_corr * 64, compared as integers: u % 64 < its ceiling
            return np.where((u[1] & 63) < corr_64, tr, from_pop)

        tokens = cur.reshape(p * s, k)  # view: [P*S, k]
        _dedupe(tokens, redraw, n_experts)
        if wide is None:
            out[:, :, layer] = tokens.reshape(p, s, k).transpose(1, 0, 2)
        else:
            out.view(wide)[:, :, layer, 0] = tokens.view(wide)[:, 0].reshape(p, s).T
        prev = cur.astype(np.int32)


def _gate_weights(
    gates: np.ndarray, bits: np.random.BitGenerator, shape: tuple[int, ...]
) -> np.ndarray:
    """[S, P, L, k] float32 gate weights of a block: per token and layer, one of the `gates`
    [G, k] vectors, picked by 16 bits of the block's stream after its ids."""
    n = shape[0] * shape[1] * shape[2]
    pick = bits.random_raw((n + 3) // 4).view(np.uint16)
    pick = (pick[:n] % len(gates)).astype(np.intp)
    return np.take(gates, pick, axis=0).reshape(shape)


def synthetic_routing(model: ModelSpec, workload: Workload, first_chunk: int = 0) -> Routing:
    """Generated routing shaped for the model and workload, seeded by workload.seed; from
    sequence first_chunk * CHUNK_SEQS of that stream on (`draw`), its gate weights drawn when
    first read."""
    cfg = workload.routing
    ids, w = draw(
        cfg,
        workload.n_sequences,
        workload.seq_positions,
        len(model.moe_layers),
        model.n_experts,
        model.top_k,
        workload.seed,
        first_chunk,
    )
    desc = (
        f"synthetic skew={cfg.skew:g} layer_corr={cfg.layer_corr:g} reuse={cfg.reuse:g}"
        + (f" hot={cfg.hot_experts}@{cfg.hot_share:g}" if cfg.hot_experts else "")
        + f" seed={workload.seed}"
    )
    fields = {
        "source": "synthetic",
        **{k: getattr(cfg, k) for k in ("skew", "layer_corr", "reuse", "hot_experts", "hot_share")},
        "seed": workload.seed,
        "moe_layers": len(model.moe_layers),
    }
    return Routing(ids, w, model.n_experts, desc, fields=fields)


# ---- fitting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticFit:
    routing: RoutingConfig  # fitted generator parameters (source=synthetic)
    target: dict[str, float]  # statistics aimed at
    achieved: dict[str, float]  # the generator's statistics at the fitted parameters


def headline(stats: dict[str, Any]) -> dict[str, float]:
    """The statistics the fit matches (flattened from a `routing_stats` dict)."""
    out = {
        "max_over_mean_median": stats["max_over_mean_load"]["median"],
        "top25pct_share_median": stats["top25pct_experts_share"]["median"],
        "prev_token_reuse": stats["prev_token_reuse_same_layer"],
    }
    for key in ("top1_acc", "top1_in_next_set", "set_recall"):
        if key in stats:
            out[key] = stats[key]["mean"]
    return out


def _bisect(f: Any, target: float, lo: float, hi: float, steps: int) -> float:
    """x in [lo, hi] with increasing f(x) closest to target (clamped to the ends)."""
    f_lo, f_hi = f(lo), f(hi)
    if target <= f_lo:
        return lo
    if target >= f_hi:
        return hi
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _with(cfg: RoutingConfig, name: str, value: float) -> RoutingConfig:
    kw: dict[str, Any] = {name: value}
    return replace(cfg, **kw)


def fit_synthetic(
    target: dict[str, Any],
    model_shape: tuple[int, int, int],
    hot_experts: int = 0,
    hot_share: float = 0.0,
    n_sequences: int = CHUNK_SEQS,
    n_positions: int = 160,
    seed: int = 0,
    rounds: int = 2,
) -> SyntheticFit:
    """Fit skew, layer_corr and reuse so the generator matches a target's headline statistics.

    target: a `routing_stats` dict or a `headline` dict (max_over_mean_median, top1_acc,
    prev_token_reuse). model_shape: (MoE layers, experts, top-k). Coordinate bisection on a
    fixed-seed sample (common random numbers keep each statistic monotone in its parameter);
    `achieved` is measured on a fresh, larger sample with every layer of the model.
    """
    want = headline(target) if "max_over_mean_load" in target else dict(target)
    n_layers, n_experts, top_k = model_shape
    fit_layers = min(n_layers, 8)  # the statistics are per-layer averages: 8 layers suffice
    cfg = RoutingConfig(
        skew=1.0, layer_corr=0.5, reuse=0.2, hot_experts=hot_experts, hot_share=hot_share
    )

    def measure(c: RoutingConfig, field: str) -> float:
        ids, w = generate(c, n_sequences, n_positions, fit_layers, n_experts, top_k, seed)
        return float(headline(stats_of(ids, w, n_experts, set_predictor=False))[field])

    plan = [("skew", "max_over_mean_median", 3.0)]
    if "top1_acc" in want and n_layers > 1:
        plan.append(("layer_corr", "top1_acc", 1.0))
    if "prev_token_reuse" in want:
        plan.append(("reuse", "prev_token_reuse", 0.95))
    for r in range(rounds):
        for param, stat, hi in plan:
            steps = 7 if r == 0 else 6
            x = _bisect(
                lambda v, c=cfg, p=param, s=stat: measure(_with(c, p, v), s),
                want[stat],
                0.0,
                hi,
                steps,
            )
            cfg = _with(cfg, param, round(x, 3))
    ids, w = generate(cfg, 2 * n_sequences, 2 * n_positions, n_layers, n_experts, top_k, seed + 1)
    achieved = headline(stats_of(ids, w, n_experts))
    log.info("fit %s -> %s", want, cfg)
    return SyntheticFit(cfg, {k: float(v) for k, v in want.items()}, achieved)


def counts_stats(counts: np.ndarray) -> dict[str, float]:
    """Headline popularity statistics of aggregate selection counts [E] or [..., E]."""
    c = np.asarray(counts, float).reshape(-1, np.shape(counts)[-1])  # [rows, E]
    e = c.shape[1]
    max_mean = c.max(1) / c.mean(1)
    share = np.sort(c, 1)[:, ::-1][:, : max(1, e // 4)].sum(1) / c.sum(1)
    return {
        "max_over_mean_median": float(np.median(max_mean)),
        "max_over_mean_min": float(max_mean.min()),
        "max_over_mean_max": float(max_mean.max()),
        "top25pct_share_median": float(np.median(share)),
    }


def fit_to_counts(
    counts: np.ndarray,
    top_k: int,
    layer_corr: float = 0.0,
    reuse: float = 0.0,
    hot_experts: int = 0,
    n_tokens: int = 20000,
    seed: int = 0,
    n_experts: int | None = None,
) -> SyntheticFit:
    """Fit skew to aggregate counts [E] or [rows, E] (rows: layers, domains...): median max/mean.

    n_experts: the expert count the routing will run at (default the counts' E). The skew is
    fitted there, so the routing has the counts' max/mean at that E: a Zipf exponent carried from
    64 experts to 128 doubles max/mean (0.99: 11.8 -> 23.2). With hot_experts > 0 the hot share
    is first set to what the hottest experts take in the counts, then skew is fitted. Correlation
    and reuse are not visible in counts; pass them.
    """
    c = np.asarray(counts, float)
    if (
        c.ndim == 0
        or c.shape[-1] < 2
        or not (c >= 0).all()
        or not (c.reshape(-1, c.shape[-1]).sum(1) > 0).all()
    ):
        raise ConfigError(
            f"counts must be non-negative [E] or [..., E] with E >= 2, got shape {c.shape}; "
            "pass each expert's token count, a row per layer, no row all zero"
        )
    rows = c.reshape(-1, c.shape[-1])
    e = rows.shape[1] if n_experts is None else int(n_experts)
    if e < 2:
        raise ConfigError(f"n_experts must be >= 2 to fit a skew at, got {e}; pass n_experts >= 2")
    want = counts_stats(rows)
    hot_share = 0.0
    if hot_experts > 0:
        hot_share = float(np.mean(np.sort(rows, 1)[:, ::-1][:, :hot_experts].sum(1) / rows.sum(1)))
    n_rows = min(len(rows), 8)

    def measure(cfg: RoutingConfig) -> dict[str, float]:
        ids, _ = generate(cfg, CHUNK_SEQS, n_tokens // CHUNK_SEQS, n_rows, e, top_k, seed)
        sel = np.zeros((n_rows, e))
        for layer in range(n_rows):
            sel[layer] = np.bincount(ids[:, :, layer].ravel(), minlength=e)
        return counts_stats(sel)

    base = RoutingConfig(
        layer_corr=layer_corr, reuse=reuse, hot_experts=hot_experts, hot_share=hot_share
    )
    skew = _bisect(
        lambda x: measure(replace(base, skew=x))["max_over_mean_median"],
        want["max_over_mean_median"],
        0.0,
        3.0,
        12,
    )
    cfg = replace(base, skew=round(skew, 3), hot_share=round(hot_share, 3))
    got = measure(cfg)
    target, reached = want["max_over_mean_median"], got["max_over_mean_median"]
    if abs(reached - target) > 0.05 * target:  # _bisect clamped: no skew in [0, 3] reaches it
        raise ConfigError(
            f"counts' median max/mean {target:.2f} is out of the synthetic generator's reach at "
            f"{e} experts, top-{top_k}, layer_corr={layer_corr}, reuse={reuse}, hot_experts="
            f"{hot_experts} (closest: {reached:.2f} at skew {cfg.skew}); "
            + (
                "the transition tables add skew of their own: lower layer_corr"
                if reached > target
                else "skew 3 is the fit's ceiling: set hot_experts for a few experts this hot"
            )
        )
    return SyntheticFit(cfg, want, got)
