"""Tiny end-to-end sweeps: joblib multirun into a deterministic dir, skip on re-run, collect
(half-written runs reported, never mixed in), failed and infeasible points, progress. One sweep
(four tiny runs, tests/experiments/conftest.py `swept`) is shared with test_sweep_report.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from experiments.common.tables import collect, write_results
from experiments.report import main as report_main
from tests.experiments.conftest import POINT, SERIAL, TINY, sweep_args

# joblib's worker processes each import the project again (a second or two of CPU): the shared
# sweep (tests/experiments/conftest.py `swept`) runs on two of them, as a user's command; the other
# sweeps run in the sweep's own process (n_jobs=1, still through hydra's joblib launcher), whose
# results are the same, and that process is the test's (tests.conftest.cli_here)


# the end-of-sweep HTML report (a second or two of figures): the shared sweep writes one, and
# test_sweep_report.py reads it; these sweeps test the runs' dirs, counts and table
NO_REPORT = "+hydra.callbacks.summary.report=false"


@pytest.fixture
def sweep_here(cli_here: Any) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`sweep(sweep_dir, *extra)` of one process, in the test's process, without its report."""
    return lambda sweep_dir, *extra: cli_here(
        "experiments.run", *sweep_args(sweep_dir, NO_REPORT, *extra)
    )


@pytest.mark.slow  # two sweeps with their pools: .ci/run's slow suite
def test_sweep_writes_deterministic_run_dirs(swept: Path) -> None:
    runs = sorted(p.parent.parent.name for p in swept.glob(POINT))
    assert runs == sorted(
        f"tiny_tiny_{p}_bs{b}_n2_g8" for p in ("sequential", "fiddler") for b in (2, 4)
    )
    assert len(list(swept.rglob("summary.json"))) == 4


def test_points_that_differ_outside_the_dir_name_get_their_own_dirs(
    tmp_path: Path, sweep_here: Any
) -> None:
    """Sweeping a key the experiment's dir name leaves out (prompt length): one sub-dir per
    value, each with its own summary (before, both wrote one dir and one result was lost)."""
    r = sweep_here(
        tmp_path / "p", "planner=sequential", "workload.batch_size=2", "workload.prompt_len=8,16"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(
        p.parent.relative_to(tmp_path / "p").as_posix()
        for p in (tmp_path / "p").rglob("summary.json")
    )
    assert runs == [
        f"tiny_tiny_sequential_bs2_n2_g8/workload.prompt_len={n},workload=tiny" for n in (16, 8)
    ]
    df, _ = collect(tmp_path / "p")
    assert sorted(df["workload.prompt_len"]) == [8, 16]
    # the end-of-sweep table tells the two rows apart by those overrides
    assert "workload.prompt_len=8,workload=tiny" in r.stdout
    assert "workload.prompt_len=16,workload=tiny" in r.stdout


def test_planner_variants_of_one_name_get_their_own_run_dirs(
    tmp_path: Path, sweep_here: Any
) -> None:
    """klotski_at_n and klotski_hot are both planner `klotski`: the run dirs are named by the
    config choice, so neither overwrites the other (before, one dir held whichever ran last)."""
    r = sweep_here(tmp_path / "v", "planner=klotski_at_n,klotski_hot", "workload.batch_size=2")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.parent.parent.name for p in (tmp_path / "v").glob(POINT))
    assert runs == ["tiny_tiny_klotski_at_n_bs2_n2_g8", "tiny_tiny_klotski_hot_bs2_n2_g8"]


def test_collect_names_each_run_by_its_planner_choice(tmp_path: Path) -> None:
    """The `system` column: hydra's planner choice (klotski_hot, not planner klotski), the
    planner's name without one, and an oracle's run says so."""
    from experiments.common.tables import system_of

    run = tmp_path / "r"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  runtime:\n    choices:\n      planner: klotski_hot\n"
    )
    assert system_of(run, {"planner.name": "klotski"}) == "klotski_hot"
    oracle = {"planner.name": "oracle_replication", "planner_label": "x (oracle upper bound)"}
    assert system_of(tmp_path, oracle) == "oracle_replication (oracle upper bound)"
    # an oracle that is not a bound (a blend of the truth and the prior) still says it peeked
    blend = {"planner.name": "oracle_replication", "planner_label": "x (peeks at the routing)"}
    assert system_of(tmp_path, blend) == "oracle_replication (peeks at the routing)"


def test_rerun_skips_finished_runs(swept: Path, sweep_here: Any, tmp_path: Path) -> None:
    d = tmp_path / "tiny"  # a copy: another test process may be reading the shared folder
    shutil.copytree(swept, d)
    before = {p: p.stat().st_mtime_ns for p in d.glob(POINT)}
    r = sweep_here(d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "4 run(s) finished (4 already finished, reused)" in r.stderr
    assert {p: p.stat().st_mtime_ns for p in d.glob(POINT)} == before


def test_collect_skips_half_written_runs(swept: Path, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(swept, d)
    half = d / "tiny_tiny_fiddler_bs2_n2_g8" / "workload=tiny"
    (half / "summary.json").unlink()
    bad = d / "tiny_tiny_fiddler_bs4_n2_g8" / "workload=tiny"
    (bad / "summary.json").write_text('{"makespan_s": 1.0, "throu')  # torn write
    df, problems = collect(d)
    assert len(df) == 2 and set(df["planner.name"]) == {"sequential"}
    assert any("fiddler_bs2" in p and "no summary.json" in p for p in problems)
    assert any("fiddler_bs4" in p and "unreadable" in p for p in problems)
    assert {"workload.batch_size", "hardware.name", "throughput_tok_s", "busy_s.gpu"} <= set(
        df.columns
    )


def test_collect_cli_writes_parquet_and_csv(swept: Path, tmp_path: Path, cli_here: Any) -> None:
    r = cli_here("experiments.collect", f"dir={swept}", f"out={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert len(pd.read_parquet(tmp_path / "results.parquet")) == 4
    assert len(pd.read_csv(tmp_path / "results.csv")) == 4


def test_collect_keeps_true_false_of_a_param_some_planners_lack(tmp_path: Path) -> None:
    """FlexGen's rows lack Klotski's hot_prefetch: the column held True and NaN, and was written
    as the strings 'true' and 'NaN', so `isna()` missed FlexGen and `== True` matched nothing."""
    df = pd.DataFrame(
        {
            "planner.name": ["flexgen", "klotski"],
            "params.hot_prefetch": [float("nan"), True],
            "params.tasks": [float("nan"), ["law", "intent"]],
        }
    )
    pq, _ = write_results(df, tmp_path)
    back = pd.read_parquet(pq)
    assert back["params.hot_prefetch"].isna().tolist() == [True, False]
    assert bool(back["params.hot_prefetch"][1]) is True
    assert back["params.tasks"].isna().tolist() == [True, False]
    assert back["params.tasks"][1] == '["law", "intent"]'


def test_collect_cli_out_under_a_file_is_one_line(
    swept: Path, tmp_path: Path, cli_here: Any
) -> None:
    (tmp_path / "afile").write_text("")
    r = cli_here("experiments.collect", f"dir={swept}", f"out={tmp_path / 'afile'}")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and "out=" in err[0], r.stderr


def test_collect_has_one_column_per_quantity(swept: Path) -> None:
    """No summary.json key that repeats a config column (batch_size beside workload.batch_size,
    params.n beside planner.params.n, planner beside planner.name), and no spaces in names (the
    idle causes' `load expert@h2d` was a column name with a space)."""
    df, _ = collect(swept)
    cols = set(df.columns)
    assert not [c for c in cols if " " in c]
    assert (
        not {
            "batch_size",
            "prompt_len",
            "gen_len",
            "planner",
            "executor",
            "hardware",
            "planner_label",
        }
        & cols
    )
    assert not [c for c in cols if c.startswith("params.")]
    # a key under a config group is not repeated under its bare name; n_batches is the n a run
    # ran (Klotski picks its own), workload.n_batches the n it was given
    groups = ("model.", "hardware.", "workload.", "planner.", "executor.")
    repeated = [c for c in cols if c.startswith(groups) and c.split(".", 1)[1] in cols]
    assert repeated == ["workload.n_batches"] or repeated == []
    assert {"workload.batch_size", "planner.name", "system", "n_batches"} <= cols


def test_a_sweep_of_infeasible_runs_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cli_here: Any
) -> None:
    """Every run infeasible (Mixtral-8x22B on the tiny machine): the end-of-sweep table lists
    each with its reason, no report is attempted, and the report command says why in one line."""
    d = tmp_path / "inf"
    r = cli_here(
        "experiments.run",
        "-m",
        "experiment=compare",
        "model=mixtral-8x22b",
        "hardware=tiny",
        "planner=sequential",
        f"hydra.sweep.dir={d}",
        SERIAL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sequential           infeasible at bs 16: model mixtral-8x22b" in r.stdout
    assert "no report: every run" in r.stderr and "Traceback" not in r.stderr
    assert report_main([f"dir={d}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no feasible runs" in err[0] and "does not fit" in err[0]


def test_an_earlier_sweeps_failed_point_does_not_fail_the_next(
    tmp_path: Path, sweep_here: Any
) -> None:
    """A point that failed on bad input keeps its failed.txt; a later sweep of other points in
    the same dir exits 0, and collect names the old point as failed, not as interrupted. Both
    in this process, the second within a second of the first: a failed.txt written within the
    second before a sweep's start counted as that sweep's (mtimes, with a second's slack)."""
    d = tmp_path / "f"
    r = sweep_here(d, "planner=sequential", "workload.batch_size=-1,4")
    assert r.returncode == 2 and "1 run(s) failed (" in r.stderr
    r = sweep_here(d, "planner=sequential", "workload.batch_size=2")
    assert r.returncode == 0, r.stderr[-3000:]
    _, problems = collect(d)
    assert len(problems) == 1 and "bs-1" in problems[0] and "failed: " in problems[0]


@pytest.mark.slow  # two sweeps with their pools: .ci/run's slow suite
def test_two_sweeps_in_one_folder_count_their_own_runs(tmp_path: Path, cli_here: Any) -> None:
    """Two sweeps of other points into one folder, the second right after the first: each
    counts the runs its jobs ran. The second counted the first's runs whose job had started
    within the second before it as its own (mtimes, with a second's slack for file systems of
    whole seconds), and reported 2 finished runs for its 1."""
    d = tmp_path / "s"
    base = ["-m", *TINY, "planner=sequential", f"hydra.sweep.dir={d}", SERIAL]
    r = cli_here("experiments.run", *base, "workload.batch_size=2")
    assert r.returncode == 0 and f"sweep {d}: 1 run(s) finished, wall" in r.stderr, r.stderr
    r = cli_here("experiments.run", *base, "workload.batch_size=4")
    assert r.returncode == 0 and f"sweep {d}: 1 run(s) finished, wall" in r.stderr, r.stderr
    r = cli_here("experiments.run", *base, "workload.batch_size=2,4")
    assert f"sweep {d}: 2 run(s) finished (2 already finished, reused)" in r.stderr, r.stderr


def test_progress_counts_only_this_sweeps_runs(tmp_path: Path) -> None:
    """A fixed sweep dir (experiment=compare's) holds earlier sweeps' runs: the bar counts the
    runs whose job started in this sweep (marked with its token), reused ones among them, those
    whose summary.json is the one there when the job started (before, every summary.json under
    the dir counted, so a 2-run sweep could show 6/2)."""
    from experiments.common.callbacks import finished_runs, mark_run
    from experiments.common.run_dir import atomic_write_text

    def summary(name: str) -> None:
        atomic_write_text(tmp_path / name / "summary.json", "{}")  # a new file, as runs write

    for name in ("old", "reused", "new", "running", "unstarted"):
        (tmp_path / name).mkdir()
    mark_run(tmp_path / "old", "earlier")
    summary("old")
    summary("reused")
    mark_run(tmp_path / "reused", "mine")
    mark_run(tmp_path / "new", "mine")
    summary("new")
    mark_run(tmp_path / "running", "mine")
    summary("unstarted")
    assert finished_runs(tmp_path, "mine") == (2, 1)
    summary("reused")  # its rerun replaced the result: this sweep's, not reused
    assert finished_runs(tmp_path, "mine") == (2, 0)
    assert finished_runs(tmp_path, "earlier") == (1, 0)
    assert finished_runs(tmp_path / "absent", "mine") == (0, 0)


def test_progress_survives_a_run_dir_renamed_mid_walk(tmp_path: Path, monkeypatch) -> None:
    """The bar's poll thread walks the sweep while runs write: a folder gone between its listing
    and its reading (a run's `.partial-*` staging renamed into place) raised FileNotFoundError
    from `Path.rglob`, the thread died, and the bar stayed at 17/160 to the end of a Fig. 10
    sweep. A run's staged summary is no finished run either."""
    import os

    from experiments.common.callbacks import finished_runs, mark_run

    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        mark_run(tmp_path / name, "t")
        (tmp_path / name / "summary.json").write_text("{}")
    (tmp_path / "c" / ".partial-1").mkdir()
    (tmp_path / "c" / ".partial-1" / "summary.json").write_text("{}")
    real_scandir = os.scandir

    def scandir(path=".", *a, **k):  # "b" renamed away after the sweep dir was listed
        if os.fspath(path).endswith(os.sep + "b"):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(path))
        return real_scandir(path, *a, **k)

    monkeypatch.setattr(os, "scandir", scandir)
    assert finished_runs(tmp_path, "t") == (2, 0)  # a and c; b is counted on the next poll


@pytest.mark.slow  # two sweeps with their pools: .ci/run's slow suite
def test_an_infeasible_point_of_a_model_file_is_reused_and_named_after_it(
    tmp_path: Path, cli_here: Any
) -> None:
    """An infeasible point records what a finished one does: its config.yaml carries the model
    files' version (it lacked it, so every rerun found 'another config' and ran it again) and
    its summary names the model it ran, `model.hf_config`'s folder (collect filed it under
    model='s group, a panel of its own)."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text(
        json.dumps(
            dict(
                model_type="mixtral",
                vocab_size=256,
                torch_dtype="bfloat16",
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=128,
                head_dim=16,
            )
        )
    )
    args = [
        "-m",
        "experiment=compare",
        "hardware=tiny",
        "workload=tiny",
        f"+model.hf_config={ck}",
        "planner=sequential",
        "hardware.memory_gb.gpu=0.00001,1.0",
        f"hydra.sweep.dir={tmp_path / 's'}",
        SERIAL,
    ]
    first = cli_here("experiments.run", *args)
    assert first.returncode == 0 and "infeasible" in first.stderr, first.stderr[-3000:]
    again = cli_here("experiments.run", *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "running again" not in again.stderr and "(2 already finished, reused)" in again.stderr
    d = tmp_path / "s"
    rows, _ = collect(d)
    by_gpu = {float(r["hardware.memory_gb.gpu"]): r for r in rows.to_dict("records")}
    assert by_gpu[0.00001]["status"] == "infeasible" and by_gpu[0.00001]["model.name"] == "ck"
    assert by_gpu[1.0]["status"] == "ok" and by_gpu[1.0]["model.name"] == "ck"


def test_a_sweep_composes_one_point_per_new_value_before_launching(tmp_path, monkeypatch):
    """Hydra's sweeper checks the points of a sweep before it launches any; the command hands
    it only those that bring a value not seen before (3 of these 4), on the class hydra runs."""
    from hydra.plugins.sweeper import Sweeper

    from experiments.run import main

    seen: list[list[list[str]]] = []

    def record(self, batch):  # type: ignore[no-untyped-def]
        seen.append([list(p) for p in batch])
        raise SystemExit(3)  # stop before any job runs

    monkeypatch.setattr(Sweeper, "validate_batch_is_legal", record)
    argv = ["-m", *TINY, "planner=sequential,flexgen", "workload.batch_size=1,2"]
    assert main([*argv, f"hydra.sweep.dir={tmp_path}"]) == 3
    (points,) = seen
    assert len(points) == 3
    values = {o for p in points for o in p}
    assert {"planner=sequential", "planner=flexgen"} <= values
    assert {"workload.batch_size=1", "workload.batch_size=2"} <= values
    assert Sweeper.validate_batch_is_legal is record  # put back after the sweep
    # on Sweeper itself: hydra's plugin scan may load the basic sweeper's module afresh (as it
    # does in a fresh `python -m experiments.run`), so a patch of its class would not be seen
    from experiments.common.hydra_hooks import validate_each_value_once

    with validate_each_value_once():
        assert Sweeper.validate_batch_is_legal is not record
    assert Sweeper.validate_batch_is_legal is record


def test_the_checks_before_a_sweep_compose_each_point_once(tmp_path, monkeypatch):
    """A sweep's checks before it launches (its launcher, names, folders, shared values) read
    each point's config composed once: its first point was composed four times, 0.1 s each."""
    import hydra
    from hydra.plugins.sweeper import Sweeper

    from experiments.run import main

    composed: list[tuple[str, ...]] = []
    compose = hydra.compose

    def counted(config_name, overrides=(), **kwargs):  # type: ignore[no-untyped-def]
        composed.append(tuple(overrides))
        return compose(config_name, overrides=overrides, **kwargs)

    def stop(self, batch):  # type: ignore[no-untyped-def]
        raise SystemExit(3)  # before any job runs

    monkeypatch.setattr(hydra, "compose", counted)
    monkeypatch.setattr(Sweeper, "validate_batch_is_legal", stop)
    argv = ["-m", *TINY, "planner=sequential,flexgen", "workload.batch_size=1,2"]
    assert main([*argv, f"hydra.sweep.dir={tmp_path}"]) == 3
    assert len(composed) == len(set(composed)) <= 3, composed  # 7 before; 1 once only the
    # keys that can name a folder are composed per value (planner's cannot here)
