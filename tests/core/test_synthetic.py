"""Synthetic routing generator, the routing statistics (checked against stats.json) and fitting."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.errors import ConfigError
from core.routing import load_routing
from core.routing_stats import routing_stats, stats_of
from core.spec import ModelSpec, RoutingConfig, Workload
from core.synthetic import (
    CHUNK_SEQS,
    fit_synthetic,
    fit_to_counts,
    generate,
    headline,
    synthetic_routing,
)
from core.traces import N_EXPERTS, TRACE_FILE, TRACE_NAME, load_esft

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def traces_dir() -> Path:
    d = (REPO / ".." / "shared" / "traces").resolve()
    if not (d / TRACE_NAME / TRACE_FILE).exists() or not (d / "stats.json").exists():
        pytest.skip("../shared/traces is absent")
    return d


def cfg(**kw: float) -> RoutingConfig:
    base: dict[str, float] = dict(skew=1.0, layer_corr=0.5, reuse=0.25)
    return RoutingConfig(**(base | kw))  # type: ignore[arg-type]


def gen(
    c: RoutingConfig,
    s: int = 20,
    p: int = 100,
    layers: int = 6,
    e: int = 16,
    k: int = 2,
    seed: int = 0,
    first_chunk: int = 0,
):  # type: ignore[no-untyped-def]
    return generate(c, s, p, layers, e, k, seed, first_chunk)


def test_shapes_dtypes_and_distinct_topk() -> None:
    for e, k in ((8, 2), (64, 6), (4, 4), (16, 1)):
        ids, w = gen(cfg(skew=1.5, layer_corr=0.9, reuse=0.6), s=35, e=e, k=k)
        assert ids.shape == w.shape == (35, 100, 6, k)
        assert ids.dtype == np.int16 and w.dtype == np.float32
        assert ids.min() >= 0 and ids.max() < e
        srt = np.sort(ids, axis=-1)
        assert (np.diff(srt, axis=-1) != 0).all(), f"repeated expert within a token's top-{k}"


def test_gate_weights_decreasing_probabilities() -> None:
    _, w = gen(cfg(), e=64, k=6)
    assert (np.diff(w, axis=-1) <= 0).all()
    assert (w > 0).all() and (w.sum(-1) <= 1 + 1e-6).all()
    assert 0.3 < w.sum(-1).mean() < 0.45  # ESFT: top-6 of 64 hold 0.37 on average


def test_deterministic_by_seed() -> None:
    a, wa = gen(cfg(), seed=3)
    b, wb = gen(cfg(), seed=3)
    c, _ = gen(cfg(), seed=4)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(wa, wb)
    assert (a != c).mean() > 0.3


def test_sequences_do_not_depend_on_how_many_are_asked_for() -> None:
    a, _ = gen(cfg(), s=40)
    b, _ = gen(cfg(), s=70)
    np.testing.assert_array_equal(a, b[:40])
    # from a later block on, without drawing the ones before it: the same sequences
    c, _ = gen(cfg(), s=70, first_chunk=1)
    np.testing.assert_array_equal(c[: 70 - CHUNK_SEQS], b[CHUNK_SEQS:])


def _h(c: RoutingConfig, e: int = 16, k: int = 2) -> dict[str, float]:
    ids, w = gen(c, s=30, p=120, layers=6, e=e, k=k)
    return headline(stats_of(ids, w, e, set_predictor=False))


def test_skew_raises_max_over_mean() -> None:
    flat, mid, steep = (_h(cfg(skew=s))["max_over_mean_median"] for s in (0.0, 0.8, 1.6))
    assert flat + 0.2 < mid < steep - 0.2


def test_hot_experts_take_their_share() -> None:
    ids, _ = gen(cfg(skew=0.0, hot_experts=2, hot_share=0.4, layer_corr=0.0, reuse=0.0), e=16, k=1)
    counts = np.bincount(ids[:, :, 0].ravel(), minlength=16)
    assert np.sort(counts)[-2:].sum() / counts.sum() == pytest.approx(0.4, abs=0.02)


def test_reuse_raises_prev_token_reuse() -> None:
    lo, hi = (_h(cfg(reuse=r))["prev_token_reuse"] for r in (0.0, 0.6))
    assert hi > lo + 0.3


def test_layer_corr_raises_top1_acc() -> None:
    lo, hi = (_h(cfg(layer_corr=c, skew=0.5), e=32)["top1_acc"] for c in (0.0, 0.9))
    assert lo < 0.15 < 0.3 < hi


@pytest.mark.parametrize(
    ("s", "first_chunk", "ids_sha", "weights_sha"),
    [
        (40, 0, "3d94523dbb05cf2a", "0352a837476e4f4e"),
        (20, 1, "8b15ce622559af77", "9ede694c5bc3c66b"),
    ],
)
def test_weights_are_drawn_when_read_and_are_the_same_numbers(
    s: int, first_chunk: int, ids_sha: str, weights_sha: str
) -> None:
    """A synthetic routing's gate weights (which a simulated run never reads) are drawn when
    first read, from each block's stream where its ids left it: the numbers `generate` gave
    when it drew them with the ids (the digests: before it drew them lazily; 40 sequences end
    in a short block, and a first block other than 0)."""
    import hashlib

    from core.synthetic import draw

    def sha(a: np.ndarray) -> str:
        return hashlib.sha256(a.tobytes()).hexdigest()[:16]

    args = (cfg(), s, 30, 3, 8, 2, 7, first_chunk)
    ids, weights = draw(*args)
    assert callable(weights) and sha(ids) == ids_sha
    assert sha(weights()) == sha(weights()) == weights_sha  # the same on every call
    assert [sha(a) for a in generate(*args)] == [ids_sha, weights_sha]


@pytest.mark.parametrize(
    ("k", "layer_corr", "reuse", "e", "layers", "ids_sha"),
    [
        (2, 0.5, 0.25, 8, 3, "2eecdf6dda295b05"),
        (2, 0.0, 0.0, 8, 3, "0aff574f586ba3b7"),
        (2, 0.3, 0.0, 4, 3, "6c75fb66b8ffceed"),
        (2, 0.7, 0.5, 8, 9, "7d1cfc3424d8cfea"),
        (2, 0.5, 0.25, 2, 3, "b4f66c9cde2e36f4"),  # two experts: redrawn twice, then shifted
        (3, 0.5, 0.25, 8, 3, "8c8e0fd4063446a3"),
        (4, 0.9, 0.1, 6, 6, "7e82ba53583d0604"),
    ],
)
def test_expert_ids_are_the_numbers_they_were(
    k: int, layer_corr: float, reuse: float, e: int, layers: int, ids_sha: str
) -> None:
    """The ids, duplicates redrawn (top-2 over its two columns, others slot by slot), are the
    numbers the generator gave before (digests of its output then), with and without layer
    correlation and reuse, and with as many experts as slots."""
    import hashlib

    from core.synthetic import draw

    c = RoutingConfig(skew=1.0, layer_corr=layer_corr, reuse=reuse)
    ids, _ = draw(c, 40, 30, layers, e, k, 5)
    assert hashlib.sha256(ids.tobytes()).hexdigest()[:16] == ids_sha


def test_a_routings_weights_are_made_once_and_kept() -> None:
    """`Routing.gate_weights` of lazily drawn weights: made on the first read, kept after;
    `last_routing`'s (a sweep's runs share it) read-only, as its ids are."""
    from experiments.common.pipeline import last_routing
    from tests.conftest import model_from_conf

    m = model_from_conf("tiny")
    wl = Workload(batch_size=3, n_batches=2, prompt_len=7, gen_len=4, seed=5)
    r = synthetic_routing(m, wl)
    assert callable(r.weights)
    w = r.gate_weights
    assert r.weights is w and r.gate_weights is w and w.shape == r.expert_ids.shape
    shared = last_routing(m, wl)
    np.testing.assert_array_equal(shared.gate_weights, w)
    assert not shared.gate_weights.flags.writeable and not shared.expert_ids.flags.writeable


def test_a_routing_whose_weights_are_not_made_yet_pickles() -> None:
    """A distributed run's ranks are sent the routing pickled; lazily drawn weights (a function
    local to the generator) failed it ("Can't pickle local object 'draw.<locals>.weights'").
    Pickled, the weights are made and travel as the array."""
    import pickle

    from tests.conftest import model_from_conf

    m = model_from_conf("tiny")
    r = synthetic_routing(m, Workload(batch_size=3, n_batches=2, prompt_len=7, gen_len=4, seed=5))
    assert callable(r.weights)
    back = pickle.loads(pickle.dumps(r))
    assert isinstance(back.weights, np.ndarray)
    np.testing.assert_array_equal(back.gate_weights, r.gate_weights)
    np.testing.assert_array_equal(back.expert_ids, r.expert_ids)


def test_synthetic_routing_fits_the_model() -> None:
    m = ModelSpec(
        name="mixtral-like",
        family="mixtral",
        n_layers=4,
        hidden_size=64,
        expert_ffn_size=32,
        n_experts=8,
        top_k=2,
        n_heads=2,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=100,
        moe_layers=(0, 1, 2, 3),
    )
    wl = Workload(batch_size=3, n_batches=2, prompt_len=7, gen_len=4, seed=5)
    r = load_routing(m, wl)
    assert r.expert_ids.shape == (6, 10, 4, 2)
    assert "seed=5" in r.description
    np.testing.assert_array_equal(r.expert_ids, synthetic_routing(m, wl).expert_ids)


def test_stats_by_hand() -> None:
    """One sequence of 3 tokens, 1 layer, top-2; E=4. Token 1 reuses 1 of 2, token 2 both."""
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 1]]])  # [T=3, L=1, k=2]
    w = np.tile(np.array([0.5, 0.25], np.float32), (3, 1, 1))
    st = routing_stats(ids, w, 4, np.zeros(3), np.zeros(3, bool))
    assert st["prev_token_reuse_same_layer"] == pytest.approx(3 / 4)
    assert st["max_over_mean_load"]["median"] == pytest.approx(3 / 1.5)  # expert 1: 3 of 6
    split = routing_stats(ids, w, 4, np.array([0, 0, 1]), np.zeros(3, bool))  # new seq at t=2
    assert split["prev_token_reuse_same_layer"] == pytest.approx(1 / 2)


def test_stats_reproduce_stats_json(traces_dir: Path) -> None:
    """Our metrics on the real trace, README split (seq_id % 5 == 0 held out) == stats.json."""
    ref = json.loads((traces_dir / "stats.json").read_text())
    tr = load_esft(traces_dir)
    st = routing_stats(tr.expert_ids, tr.gate_weights, N_EXPERTS, tr.seq_key, tr.seq_id % 5 == 0)
    want = ref["esft_pooled"]
    assert (st["train_tokens"], st["test_tokens"]) == (want["train_tokens"], want["test_tokens"])
    assert st["prev_token_reuse_same_layer"] == pytest.approx(
        want["prev_token_reuse_same_layer"], abs=5e-4
    )
    for key in (
        "max_over_mean_load",
        "top25pct_experts_share",
        "top1_acc",
        "top1_pop_acc",
        "top1_in_next_set",
        "set_recall",
        "set_pop_recall",
        "gate_weight_sum_topk",
    ):
        for agg, value in want[key].items():
            assert st[key][agg] == pytest.approx(value, abs=5e-4), f"{key}.{agg}"
    assert st["per_layer_max_over_mean"] == want["per_layer_max_over_mean"]
    assert st["per_pair_top1_acc"] == want["per_pair_top1_acc"]
    law = tr.task == tr.task_names.index("law")
    st_law = routing_stats(
        tr.expert_ids[law],
        tr.gate_weights[law],
        N_EXPERTS,
        tr.seq_key[law],
        tr.seq_id[law] % 5 == 0,
    )
    for key in ("top1_acc", "set_recall", "max_over_mean_load"):
        assert st_law[key]["min"] == pytest.approx(ref["esft_law"][key]["min"], abs=5e-4), key


def test_fit_recovers_known_parameters() -> None:
    truth = cfg(skew=0.8, layer_corr=0.6, reuse=0.3)
    ids, w = generate(truth, 30, 160, 8, 32, 2, seed=7)
    target = headline(stats_of(ids, w, 32, set_predictor=False))
    fit = fit_synthetic(target, (8, 32, 2), rounds=1)
    for key in ("max_over_mean_median", "top1_acc", "prev_token_reuse"):
        assert fit.achieved[key] == pytest.approx(target[key], rel=0.1), key
    assert fit.routing.skew == pytest.approx(0.8, abs=0.2)
    assert fit.routing.layer_corr == pytest.approx(0.6, abs=0.15)
    assert fit.routing.reuse == pytest.approx(0.3, abs=0.1)


def test_fit_to_mixtral_counts(traces_dir: Path) -> None:
    with np.load(traces_dir / "olmoe-aggregates" / "olmoe_mixtral_counts.npz") as z:
        counts = z["mixtral_counts_topk"]  # [5 domains, 3 layers, 8]
    fit = fit_to_counts(counts, top_k=2)
    assert fit.target["max_over_mean_median"] == pytest.approx(1.172, abs=1e-3)
    assert fit.achieved["max_over_mean_median"] == pytest.approx(
        fit.target["max_over_mean_median"], abs=0.02
    )
    assert 0.05 < fit.routing.skew < 0.4
    hot = fit_to_counts(counts[0, 0], top_k=2, hot_experts=1)
    assert hot.routing.hot_share == pytest.approx(66285 / counts[0, 0].sum(), abs=1e-3)


def test_fit_to_counts_at_another_expert_count(traces_dir: Path) -> None:
    """OLMoE's top-1 counts (64 experts, max/mean 11.8) fitted for a 128-expert model: the skew is
    fitted there, so the routing reaches 11.8 at 128 experts; the 64-expert exponent would give
    about twice that."""
    with np.load(traces_dir / "olmoe-aggregates" / "olmoe_mixtral_counts.npz") as z:
        counts = z["olmoe_counts_top1"]  # [5 domains, 3 layers, 64]
    at64 = fit_to_counts(counts, top_k=1, layer_corr=0.5, reuse=0.25)
    at128 = fit_to_counts(counts, top_k=1, layer_corr=0.5, reuse=0.25, n_experts=128)
    want = at64.target["max_over_mean_median"]
    assert want == pytest.approx(11.85, abs=0.01) and at128.target == at64.target
    assert at128.achieved["max_over_mean_median"] == pytest.approx(want, rel=0.05)
    assert at128.routing.skew < at64.routing.skew - 0.2
    ids, _ = generate(at64.routing, 64, 40, 3, 128, 1, 0)  # the old way: 64's exponent at 128
    steep = np.median(
        [
            np.bincount(ids[:, :, m].ravel(), minlength=128).max() * 128 / ids[:, :, m].size
            for m in range(3)
        ]
    )
    assert steep > 1.6 * want
    with pytest.raises(ConfigError, match="n_experts must be >= 2"):
        fit_to_counts(counts, top_k=1, n_experts=1)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"hot_experts": 2}, "hot_experts=2 needs hot_share > 0"),
        ({"hot_experts": -3, "hot_share": 0.4}, "hot_experts=-3: must be a non-negative integer"),
        ({"hot_experts": 2.5, "hot_share": 0.4}, "hot_experts=2.5: must be a non-negative integer"),
    ],
)
def test_bad_hot_experts_is_one_line(kw, match) -> None:
    """hot_experts without hot_share gave the hottest ranks no share at all (never drawn, the
    opposite of the ask); a negative count passed and a fractional one failed deep in numpy."""
    with pytest.raises(ConfigError, match=rf"workload.routing.{match}"):
        RoutingConfig(**kw)


def test_fit_to_counts_refuses_a_target_out_of_reach(traces_dir: Path) -> None:
    """Mixtral's top-2 counts (median max/mean 1.17) at layer_corr 0.82 (conf/workload/paper.yaml):
    the 8-expert transition tables alone give ~1.7 at skew 0, so the bisection clamped to skew 0
    and returned a fit 40% off its target without a word."""
    with np.load(traces_dir / "olmoe-aggregates" / "olmoe_mixtral_counts.npz") as z:
        counts = z["mixtral_counts_topk"]
    with pytest.raises(ConfigError, match=r"1.17 is out of the synthetic generator's reach"):
        fit_to_counts(counts, top_k=2, layer_corr=0.82, reuse=0.171)


def test_fit_to_counts_says_which_way_a_target_is_out_of_reach() -> None:
    """One expert holding nearly every token (median max/mean 60 at 64 experts) is past what
    skew 3, the bisection's ceiling, gives: the advice is the hot experts (which then fit it),
    not the lower layer_corr that helps a target below the tables' own skew."""
    counts = np.ones((4, 64))
    counts[:, 0] = 1000
    with pytest.raises(ConfigError, match=r"ceiling: set hot_experts") as err:
        fit_to_counts(counts, top_k=1, layer_corr=0.0, reuse=0.0)
    assert "lower layer_corr" not in str(err.value)
    fit_to_counts(counts, top_k=1, layer_corr=0.0, reuse=0.0, hot_experts=1)
