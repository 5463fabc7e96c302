"""Every conf/experiment/*.yaml runs (STYLE.md), on a tiny model, hardware and workload, through
the same command a user types (its `main(argv)`, in the test's process: tests.conftest.cli_here);
the replication experiment through its own command."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.conftest import ROOT, SHARED_TRACES, conf

EXPERIMENTS = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
TINY = [
    "model=tiny",
    "hardware=tiny",
    "workload.batch_size=2",
    "workload.n_batches=2",
    "workload.prompt_len=8",
    "workload.gen_len=2",
    "workload.routing.source=synthetic",
    "hydra.launcher.n_jobs=1",
]
# klotski_vs_flexgen is klotski_table3 (whose run is klotski_at_n's) and a `reproduce` block
# experiments.run does not read: its klotski_at_n point would be klotski_table3's run again
EXTRA = {"klotski_vs_flexgen": ["planner=flexgen"]}


# the sweeps of eight or more points: the slow suite (.ci/run runs it after the README's command)
LONG = {"compare", "fig10", "fig11"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(e, marks=pytest.mark.slow) if e in LONG else e
        for e in EXPERIMENTS
        if not e.startswith("replication")
    ],
)
def test_experiment_runs_on_a_tiny_workload(name, tmp_path, cli_here):
    r = cli_here(
        "experiments.run",
        "-m",
        f"experiment={name}",
        *TINY,
        *EXTRA.get(name, []),
        f"hydra.sweep.dir={tmp_path}",
    )
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


SMALL = ["workload.n_batches=2", "workload.prompt_len=8", "hydra.launcher.n_jobs=1"]
FOUR = "replication_row=ep_static,eplb,predictive_replication,oracle_replication"


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_replication_experiment_runs_small(replication_sweep):
    """Two cases swept small into one folder (a held-out ESFT one and a synthetic one; the
    session's, tests/experiments/conftest.py), then the report over both: its table, notes,
    plots and page."""
    out, r = replication_sweep.out, replication_sweep.report
    assert r.returncode == 0, r.stderr[-3000:]
    assert "predictive_replication" in r.stdout and "eplb[interval=8]" in r.stdout
    assert "ep_static[tbo]" in r.stdout and "gate=none" in r.stdout
    assert "[note] hardware h200-hgx8: a running all-to-all or all-reduce holds 20" in r.stdout
    assert len(list(out.glob("*.png"))) == 5
    for png in ("balancedness_per_batch.png", "balance_vs_makespan.png"):
        assert (out / png).stat().st_size > 0
    # a panel per target case, the synthetic one too: 4.5 inches each at 110 dpi (PNG width)
    head = (out / "balance_vs_makespan.png").read_bytes()[16:20]
    assert int.from_bytes(head, "big") == round(2 * 4.5 * 110)
    # the printed report is kept, and the page shows it with every plot of this run
    report = (out / "report.txt").read_text()
    assert report.startswith("case ") and report in r.stdout
    assert f"report: {out / 'index.html'}" in r.stdout
    page = (out / "index.html").read_text()
    assert all(f'src="{p.name}"' in page for p in out.glob("*.png"))
    import pandas as pd

    runs = sorted(out.glob("esft-g8/bs8/*/*/summary.json"))
    assert len(runs) == 8  # the four, gate=none, window, interval=8 and split_load
    for run in runs:  # one row per (step, layer, batch) of the 26 MoE layers, 2 batches
        balance = pd.read_csv(run.parent / "balance.csv")
        assert len(balance) == 26 * 2 and [f"tokens_{d}" for d in range(8)] == list(
            balance.columns[3:11]
        )


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_replication_cross_validation_runs_small(tmp_path, cli_here):
    """A fold (trained on the other four) in two stream orders swept into one folder;
    replication_cv counts two runs, a row per order. (How it keys and counts several folds and
    orders: tests/experiments/test_replication_cv.py; the test split swept: the session's sweep
    above.)"""
    r = cli_here(
        "experiments.run",
        "-m",
        "experiment=replication_esft_g8",
        f"hydra.sweep.dir={tmp_path}",
        "workload.batch_size=8",
        "replication.split=fold1",
        "workload.seed=0,1",
        FOUR,
        *SMALL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = cli_here("experiments.replication_cv", f"dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "esft-g8: predictive balancedness >= eplb's on" in r.stdout and "of 2 runs" in r.stdout
    folds = [ln.split()[:4] for ln in r.stdout.splitlines() if ln.split()[:1] == ["1"]]
    assert folds == [["1", "fold1", "s0", "esft-g8"], ["1", "fold1", "s1", "esft-g8"]]
