"""Probe round 15b (issue 48): the simulated and analysis commands (run, its sweeps and hydra's
features, collect, report, trace_json, convert_traces, routing_stats, prefetch_eval,
replication_cv, reproduce_klotski, bench.sim, bench.host). What this round found: a
replication block's param named as the planner reads it, not as the user wrote it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import NEEDS_TRACES, SHARED_TRACES
from tests.probes.conftest import TINY, cli, one_line, tiny_run

REPLICATION = ["-m", "experiment=replication_switch_128", "workload.batch_size=2"]


@NEEDS_TRACES  # a switch case reads the shipped OLMoE counts
@pytest.mark.parametrize(
    ("row", "given", "named"),
    [
        ("eplb", "replication.planners.eplb.interval=0", "replication.planners.eplb.interval=0"),
        ("eplb_interval8", "replication.params.interval=0", "replication.params.interval=0"),
        ("eplb", "+replication.planners.eplb.nosuch=1", "unknown param(s) replication.planners"),
    ],
)
def test_a_replication_blocks_param_is_named_as_written(
    cli_here: Any, tmp_path: Path, row: str, given: str, named: str
) -> None:
    """`replication.planners.eplb.interval=0` failed naming `planner.params.interval=0`, a key
    the user never wrote (the block's values reach the planner as its params), and an unknown
    one as `unknown param(s) nosuch`. (A split of the ESFT sequences on a synthetic case, which
    ran as if it were not given, is refused before the sweep: test_probe_round16a.)"""
    args = [*REPLICATION, f"replication_row={row}", given, f"hydra.sweep.dir={tmp_path}"]
    r = cli_here("experiments.run", *args, "hydra.launcher.n_jobs=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "1 run(s) failed" in r.stderr
    (failed,) = tmp_path.rglob("failed.txt")
    assert named in failed.read_text() and "planner.params" not in failed.read_text()
    assert not list(tmp_path.rglob("summary.json"))


@pytest.mark.parametrize(
    ("blocked", "named"), [("runs", "runs is a file"), ("report.md", "report.md")]
)
def test_reproduce_klotski_checks_every_output_before_its_runs(
    cli_here: Any, tmp_path: Path, blocked: str, named: str
) -> None:
    """A file where reproduce_klotski's runs/ goes failed only when the first run ended (minutes
    in, with its result lost); a folder at report.md, once every run had ended."""
    (tmp_path / blocked).mkdir() if "." in blocked else (tmp_path / blocked).touch()
    r = cli_here("experiments.reproduce_klotski", "quick=true", f"out={tmp_path}", "only=[auto_n]")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr and line.startswith("error: ")
    assert named in line and "reproduce_klotski: " not in r.stderr  # no run started
    assert sorted(p.name for p in tmp_path.iterdir()) == [blocked]


@pytest.mark.parametrize("subdir", ["tiny_tiny_sequential_bs2_n2_g3", "1"])
def test_a_sweep_checks_every_runs_folder_before_its_first_run(
    cli_here: Any, tmp_path: Path, subdir: str
) -> None:
    """A file where a sweep's second run dir goes failed the sweep when it reached that run,
    after the first (a whole figure's minutes in); the rest of the sweep never ran."""
    (tmp_path / subdir).touch()
    args = [*TINY[:3], "planner=flexgen,sequential", f"hydra.sweep.dir={tmp_path}"]
    args += ["hydra.sweep.subdir=${hydra.job.num}"] if subdir == "1" else []
    r = cli_here("experiments.run", "-m", *args, "hydra.launcher.n_jobs=1")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr and line.startswith("error: ")
    assert f"{tmp_path / subdir} is a file" in line and "before any run" in line
    assert not list(tmp_path.rglob("summary.json"))


@pytest.mark.parametrize(
    ("sweep", "named"),
    [
        ("planner=flexgen,flexgen", "planner=flexgen,flexgen: sweeps flexgen twice"),
        ("workload.batch_size=choice(2,2)", "sweeps 2 twice"),
        ("workload.batch_size=1,2,1", "workload.batch_size=1,2,1: sweeps 1 twice"),
    ],
)
def test_a_value_swept_twice_is_refused(
    cli_here: Any, tmp_path: Path, sweep: str, named: str
) -> None:
    """`-m planner=flexgen,flexgen` ran one run and reported the second as "already finished,
    reused" though no earlier sweep had run it: both points are one run dir (keyed by the
    config), and the sweep ended one run short of its points."""
    r = cli_here("experiments.run", "-m", *TINY[:3], sweep, f"hydra.sweep.dir={tmp_path}")
    one_line(r, named, "drop the repeat")
    assert not list(tmp_path.rglob("summary.json"))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of two finished tiny runs, `a` and `b` (its tests edit copies)."""
    top = tmp_path_factory.mktemp("two_runs")
    tiny_run(top / "a")
    shutil.copytree(top / "a", top / "b", symlinks=True)
    return top


@pytest.mark.parametrize("module", ["experiments.collect", "experiments.report"])
def test_a_run_whose_config_yaml_was_deleted_is_skipped_naming_it(
    cli_here: Any, two_runs: Path, tmp_path: Path, module: str
) -> None:
    """collect and report read a run whose config.yaml was deleted from hydra's
    .hydra/config.yaml (its record before resolving) without a word: a run dir's config is its
    resolved config.yaml (docs/commands.md)."""
    runs = tmp_path / "runs"
    shutil.copytree(two_runs, runs, symlinks=True)
    (runs / "a" / "config.yaml").unlink()
    r = cli_here(module, f"dir={runs}", f"out={tmp_path / 'out'}")
    assert r.returncode == 0 and "Traceback" not in r.stderr
    (line,) = [s for s in r.stderr.splitlines() if s.startswith("skipped")]
    assert line.startswith(f"skipped {runs / 'a'}: no config.yaml") and "run it again" in line


def test_a_pool_closed_after_a_sweep_leaves_no_folder_for_exit() -> None:
    """What a sweep runs in (`sweep_pool_closed`, around hydra's launcher) closes joblib's
    reusable pool and its memmapping folder (an array over joblib's 1 MB memmaps one) while
    the tracker that registered them runs, not at exit."""
    import joblib.externals.loky.reusable_executor as reusable
    import numpy as np
    from joblib import Parallel, delayed

    from experiments.common.pool import sweep_pool_closed

    with sweep_pool_closed():
        Parallel(n_jobs=2)(delayed(np.sum)(np.ones(200_000)) for _ in range(2))
        assert reusable._executor._temp_folder_manager._finalizers  # a folder for exit
    assert reusable._executor._flags.shutdown
    assert not reusable._executor._temp_folder_manager._finalizers


@pytest.mark.slow  # a joblib pool of fresh workers
def test_a_sweep_in_process_leaves_no_worker_pool_behind(cli_here: Any, tmp_path: Path) -> None:
    """A sweep run in-process (a test, a notebook) left joblib's reusable loky pool alive with
    its memmapping folders registered until exit: once the resource tracker had been stopped
    meanwhile (an interrupted command's), the one loky started in its place printed a KeyError
    traceback per folder at the end of the whole pytest run."""
    import joblib.externals.loky.reusable_executor as reusable

    args = [*TINY[:3], "planner=flexgen,sequential", f"hydra.sweep.dir={tmp_path}"]
    r = cli_here("experiments.run", "-m", *args, "hydra.launcher.n_jobs=2")
    assert r.returncode == 0, r.stderr
    executor = reusable._executor
    assert executor is not None and executor._flags.shutdown  # this sweep's, closed
    assert not executor._temp_folder_manager._finalizers  # no folder left for exit


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.report", ["dir={runs}", "out={runs}/a"], "out="),
        ("experiments.collect", ["dir={runs}", "out={runs}/a"], "out="),
        ("experiments.collect", ["dir={runs}/a"], "dir="),
        ("experiments.reproduce_klotski", ["out={runs}/a", "quick=true"], "out="),
    ],
)
def test_an_output_folder_that_is_a_run_is_refused(
    cli_here: Any, two_runs: Path, tmp_path: Path, module: str, args: list[str], key: str
) -> None:
    """report's page, plots and results.*, and collect's results.* (its default out= being
    dir=, one run's folder) went in among a run's summary.json and trace, exit 0, where
    make_checkpoint's weights were refused there."""
    runs = tmp_path / "runs"
    shutil.copytree(two_runs, runs, symlinks=True)
    before = sorted(p.name for p in (runs / "a").iterdir())
    r = cli_here(module, *(a.format(runs=runs) for a in args))
    one_line(r, f"{key}{runs / 'a'}: a run's folder (its summary.json)")
    assert sorted(p.name for p in (runs / "a").iterdir()) == before


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["hydra.runtime.cwd=/tmp"], ["hydra.runtime.cwd=/tmp: hydra sets", "leave it out"]),
        (["hydra.runtime.output_dir=OUT"], ["hydra.runtime.output_dir", "hydra.run.dir="]),
        (["hydra.job.override_dirname=x"], ["hydra.job.override_dirname=x: hydra sets"]),
        (["~workload.batch_size=3"], ["~workload.batch_size=3: workload.batch_size is 2, not 3"]),
        (["--config-name", "model/tiny"], ["--config-name model/tiny: a file of config group"]),
        (["-cn", "hardware/tiny.yaml"], ["a file of config group hardware", "hardware=tiny"]),
    ],
)
def test_a_hydra_feature_misused_is_one_line(
    cli_here: Any, tmp_path: Path, args: list[str], names: list[str]
) -> None:
    """`hydra.runtime.cwd=/tmp` (and the other keys hydra computes as a run starts) ran with
    hydra's value over the user's, exit 0; `~key=3` where key is 2 was hydra's line with no
    fix; `--config-name model/tiny` failed on "Key 'executor' is not in struct"."""
    run = tmp_path / "r"
    given = [a.replace("OUT", str(tmp_path / "o")) for a in args]
    r = cli_here("experiments.run", *TINY, *given, f"hydra.run.dir={run}")
    one_line(r, *names)
    assert not run.exists() and not (tmp_path / "o").exists()


def test_a_resumed_sweeps_own_files_do_not_make_it_compose_every_point(tmp_path: Path) -> None:
    """The up-front check of a sweep's run folders composes every point only where something
    could be in the way: not for a sweep dir holding hydra's record, finished runs and the
    sweep's own table and report (Fig. 10's 160 points, resumed, would compose each)."""
    from experiments.common.hydra_hooks import might_block

    for name in ("multirun.yaml", "results.csv", "results.parquet", "report/index.html"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    run = tmp_path / "tiny_tiny_flexgen_bs2_n2_g3" / "workload=tiny"
    (run / ".hydra").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    assert not might_block(tmp_path)
    (tmp_path / "tiny_tiny_flexgen_bs2_n2_g3" / "stray").write_text("x")
    assert might_block(tmp_path)


@NEEDS_TRACES  # a switch case reads the shipped OLMoE counts
def test_a_replication_planners_entry_of_null_runs_as_none(cli_here: Any, tmp_path: Path) -> None:
    """`replication.planners.eplb=null` (no params of its own) failed its point with an
    internal error (TypeError: 'NoneType' object is not a mapping) in failed.txt."""
    args = [*REPLICATION, "replication_row=eplb", "replication.planners.eplb=null"]
    r = cli_here("experiments.run", *args, f"hydra.sweep.dir={tmp_path}", "hydra.launcher.n_jobs=1")
    assert r.returncode == 0 and "1 run(s) finished" in r.stderr, r.stderr
    assert not list(tmp_path.rglob("failed.txt"))


def test_a_point_whose_run_folder_leaves_the_sweep_is_refused(
    cli_here: Any, tmp_path: Path
) -> None:
    """`replication.case=..` (a value hydra.sweep.subdir names) ran its point into a folder
    beside the sweep's: the sweep said "0 run(s) finished", exit 0, its result elsewhere."""
    args = [*REPLICATION, "replication_row=eplb", "replication.case=.."]
    r = cli_here("experiments.run", *args, f"hydra.sweep.dir={tmp_path / 's'}")
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and line.startswith("error: ") and "replication.case=.." in line
    assert "outside the sweep folder" in line and not list(tmp_path.iterdir())


@NEEDS_TRACES
def test_routing_stats_refuses_a_trace_too_small_to_fit(tmp_path: Path, cli_here: Any) -> None:
    """A converted trace of 12 held-out tokens (none to train on) was fitted without a word:
    the generator's layer_corr kept its start value, written to routing_stats.json as fitted."""
    from tests.probes.test_probe_traces import _esft

    shutil.copytree(SHARED_TRACES / "olmoe-aggregates", tmp_path / "olmoe-aggregates")
    _esft(tmp_path, seq_id=np.full(12, 5, np.int32), pos=np.arange(12, dtype=np.int32))
    out = tmp_path / "stats.json"
    r = cli_here("experiments.routing_stats", f"trace_dir={tmp_path}", f"out={out}")
    one_line(r, f"trace_dir={tmp_path}", "0 to train on and 12 held out", "convert_traces")
    assert not out.exists()


def test_a_sweep_points_write_error_names_its_folder_once(tmp_path: Path) -> None:
    """A point that could not write its files (a file-size limit, a full disk) said
    `error: run DIR: DIR: cannot write ...`, its folder twice in the one line."""
    import resource

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

    args = [*TINY[:3], "planner=flexgen", "workload.batch_size=1,2", f"hydra.sweep.dir={tmp_path}"]
    r = cli("experiments.run", "-m", *args, "hydra.launcher.n_jobs=1", preexec_fn=limited)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    points = [s for s in r.stderr.split("\n") if "error: run " in s]
    assert len(points) == 2, r.stderr
    for line in points:
        run = line.split("error: run ", 1)[1].split(": ", 1)[0]
        assert line.count(run) == 1 and "cannot write the run's files" in line, line
    assert not list(tmp_path.rglob("summary.json"))


@pytest.mark.parametrize(
    ("sweep", "named"),
    [
        (f"hardware.name=tiny,{'x' * 300}", "a name of 300 bytes"),
        ("model.name=tiny,a/b", "model.name='a/b': a name is letters"),
    ],
)
def test_a_name_no_folder_can_take_is_refused_before_the_sweep_starts(
    cli_here: Any, tmp_path: Path, sweep: str, named: str
) -> None:
    """A sweep point's model or hardware name too long for its folder, or not a plain name,
    was that point's error once the pool had started and the points before it had run; it is
    refused before any run, as a single run's is."""
    d = tmp_path / "sweep"
    r = cli_here("experiments.run", "-m", *TINY, sweep, f"hydra.sweep.dir={d}")
    one_line(r, named)
    assert not d.exists()


def test_the_replication_experiment_without_a_case_is_refused_before_it_runs(
    cli_here: Any, tmp_path: Path
) -> None:
    """`-m experiment=replication` (the cases' shared base, no case named) failed its one point
    under the pool and left `None/bs16/ep_static/failed.txt`; it is refused before any run,
    naming a case to run."""
    d = tmp_path / "sweep"
    r = cli_here("experiments.run", "-m", "experiment=replication", f"hydra.sweep.dir={d}")
    one_line(r, "replication.case is not set", "experiment=replication_esft_g8")
    assert not d.exists()
