"""Every conf/experiment/*.yaml runs (STYLE.md), on a tiny model, hardware and workload, through
the same command a user types; the replication experiment through its own command."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SHARED_TRACES, conf

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = [
    "model=tiny", "hardware=tiny", "workload.batch_size=2", "workload.n_batches=2",
    "workload.prompt_len=8", "workload.gen_len=2", "workload.routing.source=synthetic",
    "hydra.launcher.n_jobs=1",
]  # fmt: skip
EXTRA = {"klotski_vs_flexgen": ["planner=klotski_at_n,flexgen"]}


@pytest.mark.parametrize("name", [e for e in EXPERIMENTS if e != "replication"])
def test_experiment_runs_on_a_tiny_workload(name, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        f"experiment={name}",
        *TINY,
        *EXTRA.get(name, []),
        f"hydra.sweep.dir={tmp_path}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in Path(tmp_path).rglob("summary.json")]
    assert summaries and all(s["model"] == "tiny" for s in summaries)
    assert all(s["throughput_tok_s"] > 0 for s in summaries)
    # every point of the sweep ran: the YAML's sweep, with the command line's values winning
    sweep = ((conf("experiment", name).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    given = dict(a.split("=", 1) for a in [*TINY, *EXTRA.get(name, [])])
    points = {k: str(v).split(",") for k, v in {**sweep, **given}.items()}
    assert len(summaries) == math.prod(len(v) for v in points.values())
    if "planner" in points:  # each planner config ran (summaries name the registered planner)
        assert {s["planner"] for s in summaries} == {
            conf("planner", c)["name"] for c in points["planner"]
        }


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_replication_experiment_runs_small(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.replication",
        f"out_dir={tmp_path}",
        f"trace_dir={SHARED_TRACES}",
        "~cases.esft-g4",
        "~cases.switch-base-128",
        "~cases.switch-base-256",
        "~cases.switch-base-128-shared",
        "~cases.switch-base-128-loop",
        "~cases.esft-g8-b32",
        "~cases.esft-g4-b32",
        "cases.esft-g8.batch_sizes=[8]",
        "cases.esft-g8.n_batches=2",
        "cases.esft-g8.prompt_len=8",
        "cases.switch-base-128-g8.batch_sizes=[16]",
        "cases.switch-base-128-g8.prompt_len=8",
        "cases.switch-base-128-g8.n_batches=2",
        "targets_cases=[esft-g8,switch-base-128-g8]",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "predictive_replication" in r.stdout and "eplb" in r.stdout
    assert "[note] hardware h200-hgx8: a running all-to-all or all-reduce holds 20" in r.stdout
    assert len(list(Path(tmp_path).glob("*.png"))) == 5
    for png in ("balancedness_per_batch.png", "balance_vs_makespan.png"):
        assert (Path(tmp_path) / png).stat().st_size > 0
    # a panel per target case, the synthetic one too: 4.5 inches each at 110 dpi (PNG width)
    head = (Path(tmp_path) / "balance_vs_makespan.png").read_bytes()[16:20]
    assert int.from_bytes(head, "big") == round(2 * 4.5 * 110)
    # the printed report is kept, and the page shows it with every plot of this run
    report = (Path(tmp_path) / "report.txt").read_text()
    assert report.startswith("case ") and report in r.stdout
    assert f"report: {Path(tmp_path) / 'index.html'}" in r.stdout
    page = (Path(tmp_path) / "index.html").read_text()
    assert all(f'src="{p.name}"' in page for p in Path(tmp_path).glob("*.png"))
    assert "predictive_replication" in page and "balancedness" in page
    import pandas as pd

    runs = sorted(Path(tmp_path).glob("esft-g8/bs8/*/summary.json"))
    assert len(runs) >= 4
    for run in runs:  # one row per (step, layer, batch) of the 26 MoE layers, 2 batches
        balance = pd.read_csv(run.parent / "balance.csv")
        assert len(balance) == 26 * 2 and [f"tokens_{d}" for d in range(8)] == list(
            balance.columns[3:11]
        )

    # run again with a variant dropped: the finished runs are reused (none simulated again),
    # and the table holds only this config's rows
    mtimes = {p: p.stat().st_mtime_ns for p in runs}
    r2 = subprocess.run([*cmd, "~variants"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert all(p.stat().st_mtime_ns == t for p, t in mtimes.items() if p.exists())
    assert "gate=none" in r.stdout and "gate=none" not in r2.stdout


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_replication_cross_validation_runs_small(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.replication_cv",
        f"out_dir={tmp_path}",
        f"trace_dir={SHARED_TRACES}",
        "targets_cases=[esft-g8]",
        "cases.esft-g8.batch_sizes=[8]",
        "cases.esft-g8.n_batches=2",
        "cases.esft-g8.prompt_len=8",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "esft-g8: predictive balancedness >= eplb's on" in r.stdout and "of 5 folds" in r.stdout
    assert len(list(Path(tmp_path).glob("cv/*/report.txt"))) == 5


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_replication_reuses_a_run_only_with_the_same_training_files(tmp_path):
    """`split=validation` and `split=fold1` run the same held-out sequences, but fold1 trains on
    more of the others: its training tables differ, so no run of the first is reused by the
    second. A variant's own params win over those the experiment sets."""
    import json as _json

    from omegaconf import OmegaConf

    from experiments import replication

    cfg = OmegaConf.load(ROOT / "conf" / "experiment" / "replication.yaml")
    case = dict(
        model="deepseek-v2-lite",
        routing="esft_heldout",
        n_devices=8,
        lanes=False,
        batch_sizes=[8],
        prompt_len=8,
        n_batches=2,
        variants={"eplb[balanced]": {"planner": "eplb", "params": {"dispatch": "balanced"}}},
    )
    cfg.merge_with(
        dict(
            out_dir=str(tmp_path),
            trace_dir=str(SHARED_TRACES),
            variants={},
            targets_cases=["esft-g8"],
        )
    )
    cfg.cases = {"esft-g8": case}

    def summary(label: str) -> dict:
        return _json.loads((tmp_path / "esft-g8" / "bs8" / label / "summary.json").read_text())

    cfg.split = "validation"
    replication.run(cfg)
    assert "validation" in summary("eplb")["routing"]
    assert summary("eplb")["plan"]["ep"]["dispatch"] == "even"  # the experiment's dispatch
    assert summary("eplb[balanced]")["plan"]["ep"]["dispatch"] == "balanced"
    assert summary("eplb[balanced]")["variant_of"] == "eplb"
    cfg.split = "fold1"
    replication.run(cfg)
    assert "fold1" in summary("eplb")["routing"]


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_split_load_variant_packs_from_the_evaluated_splits_own_load(tmp_path):
    """The config's `oracle_replication[split_load]` variant names `${out_dir}/esft_eval_load.npy`:
    the experiment writes that file before any run, the load of every token of the split it
    evaluates, and the variant reads it (not the training split's load the others get)."""
    import numpy as np
    from omegaconf import OmegaConf

    from experiments import replication

    cfg = OmegaConf.load(ROOT / "conf" / "experiment" / "replication.yaml")
    variant = cfg.cases["esft-g8-b32"].variants["oracle_replication[split_load]"]
    case = dict(
        model="deepseek-v2-lite",
        routing="esft_heldout",
        n_devices=8,
        lanes=False,
        batch_sizes=[8],
        prompt_len=8,
        n_batches=2,
        variants={"split_load": variant},
    )
    cfg.merge_with(
        dict(
            out_dir=str(tmp_path),
            trace_dir=str(SHARED_TRACES),
            variants={},
            targets_cases=["esft-g8"],
        )
    )
    cfg.cases = {"esft-g8": case}
    lines = replication.run(cfg)
    ev = np.load(tmp_path / "esft_eval_load.npy")
    test_ids, _ = replication.esft_split(str(SHARED_TRACES), 0, "test")
    assert ev.shape == (26, 64) and (ev.sum(1) == test_ids.shape[0] * test_ids.shape[2]).all()
    for m in (0, 25):  # every token of the split, counted per MoE layer
        assert (ev[m] == np.bincount(test_ids[:, m].ravel(), minlength=64)).all()
    key = json.loads((tmp_path / "esft-g8" / "bs8" / "split_load" / "run_key.json").read_text())
    assert key["files"]["initial_load"] == replication.file_sha1(
        str(tmp_path / "esft_eval_load.npy")
    )
    summary = json.loads((tmp_path / "esft-g8" / "bs8" / "split_load" / "summary.json").read_text())
    assert summary["planner_label"] == "split_load (peeks at the routing)"
    assert any(
        "distance of the load planned from" in line and "split_load" in line for line in lines
    )
