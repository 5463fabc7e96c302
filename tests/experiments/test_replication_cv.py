"""The replication cross-validation over a collected sweep: which runs each (fold, stream
order) counts, the per-fold table and the counts."""

from __future__ import annotations

from experiments.common.ep_rows import gap_line
from experiments.replication_cv import cv_lines, fold_rows


def row(planner: str, bal: float, ms: float, dist: float | None = None) -> dict:
    return dict(
        case="esft-g8",
        planner=planner,
        batch_size=128,
        balancedness=bal,
        makespan_s=ms / 1e3,
        plan={"ep": {"prediction_tv": dist}},
    )


def fold(pred_bal: float, pred_ms: float, dist: float | None = None) -> list[dict]:
    """ep_static 74 ms, oracle 66 ms: a gap of 8 ms."""
    return [
        row("ep_static", 0.79, 74.0),
        row("eplb", 0.97, 68.0),
        row("oracle_replication", 0.99, 66.0),
        row("predictive_replication", pred_bal, pred_ms, dist),
    ]


def test_cv_lines_count_the_folds_each_target_meets():
    rows = {
        "test": fold(0.968, 68.0, 0.08),
        "fold1": fold(0.972, 70.5, 0.06),
        "fold2": fold(0.971, 66.0),
    }
    lines = cv_lines(rows)
    assert any(
        ln.split()[:3] == ["0", "test", "esft-g8"] and "-0.0020" in ln and "75%" in ln
        for ln in lines
    )
    assert any(ln.split()[:2] == ["1", "fold1"] and "+0.0020" in ln and "44%" in ln for ln in lines)
    assert "[FAIL] esft-g8: predictive balancedness >= eplb's on 2 of 3 folds" in lines
    assert any(
        ln.startswith("[FAIL] esft-g8: predictive closes >= 50% of the gap on 2 of the 3 ")
        for ln in lines
    )
    # the folds' mean: balancedness diff (-0.002 + 0.002 + 0.001) / 3,
    # gap closed (75 + 44 + 100) / 3
    mean = next(ln for ln in lines if ln.startswith("mean"))
    assert mean.split()[1:4] == ["3", "folds", "esft-g8"] and "+0.0003" in mean and "73%" in mean
    # predictive's distance from each batch's load: per fold, unknown where unrecorded, mean of
    # the rest
    assert [ln.split()[-1] for ln in lines if ln.split()[:1] in (["0"], ["1"], ["2"])] == [
        "0.080",
        "0.060",
        "unknown",
    ]
    assert mean.split()[-1] == "0.070"


def test_the_mean_gap_closed_skips_folds_without_a_gap():
    """A fold where the oracle is not faster than ep_static, or faster by under 1% (noise), has
    no share to average: the mean is over the folds that have one (not nan). A noise gap is not
    judged; no gap at all is, and fails, as the report's gap_line says of the same fold."""
    no_gap = [
        row("ep_static", 0.79, 66.0),
        row("eplb", 0.97, 68.0),
        row("oracle_replication", 0.99, 66.0),
        row("predictive_replication", 0.97, 67.0),
    ]
    noise = [
        row("ep_static", 0.79, 66.0),
        row("eplb", 0.97, 68.0),
        row("oracle_replication", 0.99, 65.8),
        row("predictive_replication", 0.97, 67.0),
    ]
    lines = cv_lines({"test": fold(0.968, 68.0), "fold1": no_gap, "fold2": noise})
    mean = next(ln for ln in lines if ln.startswith("mean"))
    assert "75%" in mean and "over the 1 with a gap >= 1%" in mean
    verdict = next(ln for ln in lines if "closes >= 50%" in ln)
    assert verdict.startswith("[FAIL] esft-g8: predictive closes >= 50% of the gap on 1 of the 2 ")
    assert "(1 under it, noise; 1 with no gap, the oracle not faster, close none)" in verdict
    lines = cv_lines({"test": fold(0.968, 68.0), "fold2": noise})
    assert next(ln for ln in lines if "closes >= 50%" in ln).startswith(
        "[PASS] esft-g8: predictive closes >= 50% of the gap on 1 of the 1 "
    )
    lines = cv_lines({"fold2": noise})
    assert next(ln for ln in lines if "closes >= 50%" in ln).startswith("[n/a ]")
    st, _, orc, pr = no_gap  # the report's line of the same fold
    assert gap_line("esft-g8", 128, st, pr, orc).startswith("[FAIL] esft-g8 bs=128: no gap")


def test_cv_lines_count_every_fold_and_seed():
    rows = {
        "test s0": fold(0.968, 68.0),
        "test s1": fold(0.972, 68.0),
        "fold1 s0": fold(0.972, 66.0),
    }
    lines = cv_lines(rows)
    assert any(ln.split()[:4] == ["0", "test", "s1", "esft-g8"] and "+0.0020" in ln for ln in lines)
    assert any(ln.split()[:4] == ["1", "fold1", "s0", "esft-g8"] for ln in lines)
    assert "[FAIL] esft-g8: predictive balancedness >= eplb's on 2 of 3 runs" in lines
    assert next(ln for ln in lines if ln.startswith("mean")).split()[1:3] == ["3", "runs"]


def _run(case: str, planner: str, split: str, seed: int, bs: int, tokens: int) -> dict:
    return dict(
        case=case,
        planner=planner,
        split=split,
        batch_size=bs,
        prompt_len=64,
        n_batches=8,
        split_tokens=tokens,
        run_dir=f"{case}/bs{bs}/{planner}/{split},{seed}",
        workload={"seed": seed},
        replication={"routing": "esft_heldout"},
    )


def test_fold_rows_keep_each_folds_fresh_batch_and_the_four_planners():
    """fold3 holds 5,722 held-out tokens: 8 batches of 8 x 64 fit, 32 x 64 do not; the test
    split's 7,197 alike; a variant row and a batch that wraps are left out; two stream orders
    key the folds by seed."""
    four = ("ep_static", "eplb", "predictive_replication", "oracle_replication")
    rows = [
        _run("esft-g8", p, split, seed, bs, tokens)
        for split, tokens in (("test", 7197), ("fold3", 5722))
        for seed in (0, 1)
        for bs in (8, 32)
        for p in (*four, "eplb[interval=8]")
    ]
    folds = fold_rows(rows)
    assert list(folds) == ["test s0", "fold3 s0", "test s1", "fold3 s1"]
    for kept in folds.values():
        assert sorted(r["planner"] for r in kept) == sorted(four)
        assert {r["batch_size"] for r in kept} == {8}
    one_seed = fold_rows([r for r in rows if r["workload"]["seed"] == 0])
    assert list(one_seed) == ["test", "fold3"]


def test_a_fold_without_one_planners_run_is_named():
    """A fold whose predictive run is missing (deleted, or its summary unreadable) ended in an
    internal error (KeyError); it names the fold, case and planner, and how to finish it."""
    import pytest

    from core.errors import MoepipeError

    rows = {"test": fold(0.968, 68.0), "fold1": fold(0.972, 70.5)[:3]}
    with pytest.raises(MoepipeError, match="fold fold1, case esft-g8: no finished run of predict"):
        cv_lines(rows)


def test_replication_initial_load_is_train_or_eval():
    """`replication.initial_load=bogus` was taken as `train` without a word."""
    import pytest
    from omegaconf import OmegaConf

    from core.errors import ConfigError
    from experiments.common.ep_inputs import block

    rep = {"routing": "esft_heldout", "case": "esft-g4"}
    for value in ("train", "eval", None):
        assert block(OmegaConf.create({"replication": {**rep, "initial_load": value}}))
    with pytest.raises(ConfigError, match="replication.initial_load='bogus' unknown; valid"):
        block(OmegaConf.create({"replication": {**rep, "initial_load": "bogus"}}))
