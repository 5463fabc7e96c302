"""The replication cross-validation: which cases each fold runs, the per-fold table and counts,
and that a completed fold is not run again (an interrupted run resumes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from core.errors import MoepipeError
from experiments import replication, replication_cv
from experiments.replication_cv import cv_lines, fold_cfg, run_fold
from tests.conftest import SHARED_TRACES

CONF = Path(__file__).resolve().parents[2] / "conf" / "experiment" / "replication.yaml"


pytestmark = pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")


def base(tmp_path: Path):
    cfg = OmegaConf.load(CONF)
    cfg.out_dir, cfg.trace_dir = str(tmp_path), str(SHARED_TRACES)
    return cfg


def test_a_fold_runs_the_target_cases_at_their_fresh_batch(tmp_path):
    """fold3 holds 5,722 held-out tokens: 8 batches of 8 x 64 fit (none revisited), 32 x 64 do
    not; 3 batches of 24 x 64 fit, of 32 x 64 do not; a case whose every batch size wraps falls
    back to its largest."""
    cfg = base(tmp_path)
    cfg.cases["esft-g4"].batch_sizes = [256, 128]
    f = fold_cfg(cfg, "fold3")
    assert f.split == "fold3" and f.out_dir == str(tmp_path / "cv" / "fold3")
    assert sorted(f.cases) == ["esft-g4", "esft-g4-b32", "esft-g8", "esft-g8-b32"]
    assert not f.variants
    assert all("variants" not in case for case in f.cases.values())  # the four planners only
    assert list(f.cases["esft-g8"].batch_sizes) == [8]
    assert list(f.cases["esft-g4"].batch_sizes) == [256]
    assert list(f.cases["esft-g8-b32"].batch_sizes) == [24]
    assert list(fold_cfg(cfg, "test").cases["esft-g8-b32"].batch_sizes) == [32]  # 7,197 tokens


def test_a_bad_case_value_is_one_line_before_any_fold(tmp_path):
    cfg = base(tmp_path)
    cfg.cases["esft-g8"].prompt_len = "abc"
    with pytest.raises(MoepipeError, match=r"cases.esft-g8.prompt_len=abc"):
        fold_cfg(cfg, "test")


def test_a_synthetic_target_case_is_one_clear_error(tmp_path):
    cfg = base(tmp_path)
    cfg.targets_cases = ["switch-base-128"]
    with pytest.raises(
        MoepipeError, match="cases.switch-base-128: routing 'synthetic_olmoe_top1' has no folds"
    ):
        fold_cfg(cfg, "test")


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
    # the folds' mean: balancedness diff (-0.002 + 0.002 + 0.001) / 3, gap closed (75 + 44 + 100) / 3
    mean = next(ln for ln in lines if ln.startswith("mean"))
    assert mean.split()[1:4] == ["3", "folds", "esft-g8"] and "+0.0003" in mean and "73%" in mean
    # predictive's distance from each batch's load: per fold, nan where not recorded, mean of the rest
    assert [ln.split()[-1] for ln in lines if ln.split()[:1] in (["0"], ["1"], ["2"])] == [
        "0.080",
        "0.060",
        "nan",
    ]
    assert mean.split()[-1] == "0.070"


def test_a_completed_fold_is_not_run_again(tmp_path, monkeypatch):
    calls = []

    def fake_run(cfg):
        calls.append(cfg.split)
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        return ["table"]

    monkeypatch.setattr(replication, "run", fake_run)
    monkeypatch.setattr(replication, "read_runs", lambda out: [])
    f = fold_cfg(base(tmp_path), "fold2")
    run_fold(f)
    run_fold(f)
    assert calls == ["fold2"]  # the second call found the report
    f.planners.eplb.window = 2  # other settings: run again
    run_fold(f)
    assert calls == ["fold2", "fold2"]
    (Path(f.out_dir) / "report.txt").unlink()  # interrupted before the report: run again
    run_fold(f)
    assert len(calls) == 3 and replication_cv.FOLDS[0] == "test"
    monkeypatch.setattr(replication_cv, "code_version", lambda: "other code")
    run_fold(f)  # the same config under other code: run again
    assert len(calls) == 4


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
    assert replication.gap_line("esft-g8", 128, st, pr, orc).startswith(
        "[FAIL] esft-g8 bs=128: no gap"
    )


def test_other_stream_orders_run_beside_the_config_seed(tmp_path):
    cfg = base(tmp_path)
    same, other = fold_cfg(cfg, "fold1", 0), fold_cfg(cfg, "fold1", 3)
    assert same.out_dir == str(tmp_path / "cv" / "fold1") and same.seed == 0
    assert other.out_dir == str(tmp_path / "cv" / "fold1-seed3") and other.seed == 3
    assert replication_cv.seeds_of(cfg) == [0]
    cfg.cv_seeds = [0, 3, 3]
    assert replication_cv.seeds_of(cfg) == [0, 3]
    cfg.cv_seeds = ["a"]
    with pytest.raises(MoepipeError, match=r"cv_seeds=\['a'\]: give a list of integers"):
        replication_cv.seeds_of(cfg)


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
