"""Probe round 10b (issue 48): an empty value for an option with a default (read as the
current folder, or as a name), a benchmark's options for its own children given by a user
(ignored without a word), and the joblib launcher's limits that failed as internal errors once
a sweep was under way."""

from __future__ import annotations

import multiprocessing.context
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from core.spec import RoutingConfig
from experiments.common.cli import error_line
from experiments.common.launcher_checks import check_joblib
from real.checkpoint import reduced_spec
from tests.conftest import overridden
from tests.probes.conftest import ROOT, SLOW_COMMAND, TINY, one_line, pasted, raises_one_line


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.replication", ["dir="], "dir=''"),
        ("experiments.replication_cv", ["dir="], "dir=''"),
        ("experiments.routing_stats", ["trace_dir=", "out={tmp}/s.json"], "trace_dir=''"),
        ("experiments.prefetch_eval", ["trace_dir="], "trace_dir=''"),
        ("experiments.validate", ["checkpoint={tmp}", "hardware="], "hardware=''"),
        ("experiments.bench.lanes", ["model=", "device=cpu"], "model=''"),
        ("experiments.trace_json", ["runs=['']"], "an empty item"),
        ("experiments.convert_traces", ["src=", "out={tmp}/t.npz"], "src=''"),
    ],
)
def test_an_empty_value_for_an_option_with_a_default_is_refused(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], key: str
) -> None:
    """'' was the current folder: replication read the repository as its sweep ("skipped
    conf: no summary.json"), trace_json looked for the repository's trace.parquet; or a name:
    hardware='' was conf/hardware/.yaml, with "run calibrate hardware.name=" as the fix."""
    r = cli_here(module, *(a.format(tmp=tmp_path) for a in args))
    line = one_line(r, key)
    assert "an empty" in line
    assert list(tmp_path.iterdir()) == []


def test_bench_real_refuses_an_empty_hardware_before_writing(tmp_path: Path, cli_here: Any) -> None:
    """bench.real hardware= wrote the checkpoint, then calibrated a profile named '' and
    failed with two error lines."""
    r = cli_here(
        "experiments.bench.real",
        "model=tiny",
        "budget_gb=0.0003",
        f"out_dir={tmp_path}/b",
        "hardware=",
    )
    one_line(r, "hardware=''", "an empty value", "this-machine")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("arg", ["acc_batch=8", "acc_limit_s=3", "host_room_mb=100"])
def test_a_bench_childs_option_from_a_user_is_refused(
    tmp_path: Path, cli_here: Any, arg: str
) -> None:
    """bench.accelerate sets these for its own children, over the user's: `acc_batch=8` ran
    every accelerate row at the batch the bench picked, without a word (as role= is refused)."""
    r = cli_here("experiments.bench.accelerate", f"checkpoint={tmp_path}/none", arg)
    one_line(r, arg.split("=")[0], "leave it out")


def test_an_accelerate_childs_limit_is_checked() -> None:
    """acc_limit_s=nan went unchecked into the child's generate loop."""
    from experiments.bench.accelerate import checked
    from experiments.common.schema import BenchAccelerateOptions

    opts = BenchAccelerateOptions(
        checkpoint="ck", role="accelerate", acc_batch=1, acc_limit_s=float("nan")
    )
    raises_one_line(lambda: checked(opts), "acc_limit_s=nan")


def _joblib(**launcher: Any) -> Any:
    """A config whose launcher is joblib's, at its defaults but `launcher`."""
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf

    base = OmegaConf.to_container(OmegaConf.structured(JobLibLauncherConf))
    return OmegaConf.create({"hydra": {"launcher": {**base, **launcher}}})


@pytest.mark.parametrize(
    "setting",
    [
        {"timeout": 0},
        {"timeout": float("nan")},
        {"batch_size": 0},
        {"batch_size": "foo"},
        {"pre_dispatch": "foo"},
        {"pre_dispatch": 0},
        {"max_nbytes": "foo"},
        {"max_nbytes": -1},
        {"mmap_mode": "foo"},
    ],
)
def test_a_joblib_limit_joblib_refuses_is_named(setting: dict[str, Any]) -> None:
    """batch_size=0, pre_dispatch=foo, max_nbytes=foo were internal errors once the sweep had
    started, timeout=0 its first point stopped; mmap_mode=foo and max_nbytes=-1 ran silently."""
    ((key, value),) = setting.items()
    raises_one_line(lambda: check_joblib(_joblib(**setting)), f"hydra.launcher.{key}={value}")


@pytest.mark.parametrize(
    "setting",
    [
        {"timeout": 100},
        {"batch_size": "auto"},
        {"batch_size": 2},
        {"pre_dispatch": "3*n_jobs"},
        {"pre_dispatch": "all"},
        {"max_nbytes": "1M"},
        {"max_nbytes": 0},
    ],
)
def test_a_joblib_limit_joblib_takes_is_taken(setting: dict[str, Any]) -> None:
    check_joblib(_joblib(**setting))


def test_a_point_past_the_launchers_timeout_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """A point that ran past `hydra.launcher.timeout` (multiprocessing's TimeoutError, which
    is no OSError) was an internal error."""
    line = error_line(multiprocessing.context.TimeoutError())
    assert line is not None and "hydra.launcher.timeout" in line
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "workload.seed=0,1",
        "hydra.launcher.timeout=0.0001",
        f"hydra.sweep.dir={tmp_path}/s",
    )
    # the sweep's progress bar comes first on stderr; its error line is the last
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: a run of the sweep ran past")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", ["holds nothing"]),
        ("- a\n- b\n", ["holds a list"]),
        ("5\n", ["holds a single value"]),
        ((ROOT / "conf" / "model" / "tiny.yaml").read_text() + "n_layers: 3\n", ["duplicate"]),
    ],
    ids=["empty", "list", "scalar", "key twice"],
)
def test_a_model_file_that_is_no_mapping_is_named(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    """bench.real's and make_checkpoint's `model=FILE.yaml` (reduced_spec): an empty file, a
    list or a number was an internal TypeError; a key given twice took the later value without
    a word, where a run refuses it."""
    path = tmp_path / "m.yaml"
    path.write_text(text)
    raises_one_line(lambda: reduced_spec(str(path)), f"model={path}", *words)


def test_bench_lanes_reads_a_model_file(tmp_path: Path, cli_here: Any) -> None:
    """bench.lanes took only a conf/model name: model=FILE.yaml looked for FILE.yaml.yaml (and
    read conf/model's files past the checks a run's model has)."""
    path = tmp_path / "m.yaml"
    path.write_text((ROOT / "conf" / "model" / "tiny.yaml").read_text())
    r = cli_here("experiments.bench.lanes", f"model={path}", "lanes=2", "rows=8", "device=cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0].startswith("tiny expert")
    path.write_text("")
    one_line(cli_here("experiments.bench.lanes", f"model={path}", "device=cpu"), "nothing")


def test_a_bench_sim_childs_error_is_its_line() -> None:
    """A failed run was named as a Python list of its line: `-m experiments.run failed:
    ["error: expert parallelism ..."]`."""
    from experiments.bench.sim import _child

    fail = "import sys; sys.stderr.write('progress\\nerror: it broke\\n'); sys.exit(2)"
    line = raises_one_line(lambda: _child([sys.executable, "-c", fail]), "failed: it broke")
    assert line.endswith(" failed: it broke"), line


@pytest.mark.parametrize(
    ("module", "args", "twice"),
    [
        ("experiments.bench.lanes", ["model=tiny", "lanes=2", "rows=[8,8]", "device=cpu"], "8"),
        ("experiments.report", ["dir={tmp}", "columns=[workload.seed,workload.seed]"], "seed"),
        ("experiments.reproduce_klotski", ["out={tmp}/k", "only=[table3,table3]"], "table3"),
    ],
)
def test_a_list_item_given_twice_is_refused(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], twice: str
) -> None:
    """rows=[8,8] printed the row twice, columns=[a,a] drew each line's label twice; most list
    options refused it one by one, now every command's do."""
    r = cli_here(module, *(a.format(tmp=tmp_path) for a in args))
    one_line(r, twice, "given twice")


def test_the_quoting_shown_for_a_value_with_brackets_is_an_override(cli_here: Any) -> None:
    """variants=eplb[interval=8] was told to pass variants="['eplb[interval=8']": every bracket
    stripped, the suggestion was one hydra refuses in turn."""
    line = one_line(cli_here("experiments.replication", "variants=eplb[interval=8]"), "quoted")
    fix = pasted(line.rsplit(": ", 1)[1])  # as a shell hands it over (round 26c)
    assert fix == "variants=['eplb[interval=8]']", fix
    again = one_line(cli_here("experiments.replication", "dir=/nonexistent", fix))
    assert "quoted" not in again


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["-m", "hydra.run.dir={tmp}/r"], "hydra.run.dir="),
        (["hydra.mode=MULTIRUN", "hydra.run.dir={tmp}/r"], "hydra.run.dir="),
        (["hydra.job.name=../x", "hydra.run.dir={tmp}/r"], "hydra.job.name=../x"),
        (["hydra.output_subdir={tmp}/rec", "hydra.run.dir={tmp}/r"], "hydra.output_subdir="),
    ],
)
def test_a_hydra_key_that_writes_a_runs_files_elsewhere_is_refused(
    tmp_path: Path, cli_here: Any, args: list[str], key: str
) -> None:
    """-m with hydra.run.dir ran the sweep into multirun/<date>/ of the current folder (the
    repository), not the folder given; hydra.job.name=../x wrote the run's log beside its dir;
    hydra.output_subdir moved the record a failed rerun puts back out of .hydra."""
    before = sorted(p.name for p in ROOT.iterdir())
    r = cli_here("experiments.run", *TINY, *(a.format(tmp=tmp_path) for a in args))
    one_line(r, key)
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_a_plain_job_name_runs(tmp_path: Path, cli_here: Any) -> None:
    r = cli_here("experiments.run", *TINY, "hydra.job.name=mine", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "mine.log").is_file() and (tmp_path / "summary.json").is_file()


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("experiments.run", overridden(TINY, "model=deepseek-v2-lite", "hardware=h200")),
        ("experiments.prefetch_eval", []),
    ],
)
def test_a_trace_dir_that_is_a_looping_link_is_one_line(
    tmp_path: Path, cli_here: Any, module: str, args: list[str]
) -> None:
    """pathlib's resolve() raises RuntimeError, not OSError, on a link that leads back to
    itself: `trace_dir=LOOP` was an internal error (any path resolved is the same)."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    where = [f"hydra.run.dir={tmp_path}/r"] if module == "experiments.run" else []
    key = "workload.routing.trace_dir" if module == "experiments.run" else "trace_dir"
    r = cli_here(module, *args, f"{key}={loop}", *where)
    one_line(r, str(loop), "a symbolic link that loops")
    line = error_line(RuntimeError(f"Symlink loop from '{loop}'"))
    assert line is not None and str(loop) in line


def test_a_routing_task_given_twice_is_refused() -> None:
    """workload.routing.tasks=[law,law] ran as [law], in a run dir (and a sweep's point) of
    its own."""
    raises_one_line(lambda: RoutingConfig(tasks=("law", "law")), "tasks", "law given twice")
    raises_one_line(lambda: RoutingConfig(exclude_tasks=["a", "a"]), "exclude_tasks", "a given")


@pytest.mark.parametrize(
    ("module", "args", "name"),
    [
        ("experiments.trace_json", ["runs={run}", "out={theirs}"], "config.json"),
        pytest.param(
            "experiments.routing_stats", ["out={theirs}"], "config.json", marks=SLOW_COMMAND
        ),
        pytest.param(  # fits the ESFT trace, seconds: the slow suite
            "experiments.prefetch_eval", ["out={theirs}"], "results.csv", marks=SLOW_COMMAND
        ),
        ("experiments.collect", ["dir={sweep}", "out={folder}"], "results.csv"),
        ("experiments.report", ["dir={sweep}", "out={folder}"], "results.csv"),
        pytest.param(  # the whole report drawn first, 2 s: the slow suite
            "experiments.report", ["dir={sweep}", "out={folder}"], "index.html", marks=SLOW_COMMAND
        ),
    ],
)
def test_an_output_over_a_file_the_command_did_not_write_is_refused(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], name: str
) -> None:
    """trace_json's and routing_stats' out=CKPT/config.json wrote their JSON over a
    checkpoint's config, prefetch_eval's out= a results.csv of the user's its CSV, report's
    out= a folder of the user's its index.html over theirs: exit 0, the file lost. A file the
    command wrote itself is still replaced (the same command again)."""
    run = tmp_path / "sweep" / "run"
    if module in ("experiments.trace_json", "experiments.collect", "experiments.report"):
        assert cli_here("experiments.run", *TINY, f"hydra.run.dir={run}").returncode == 0
    theirs = tmp_path / "theirs" / name
    theirs.parent.mkdir()
    theirs.write_text("theirs\n")
    fill = {"run": run, "sweep": run.parent, "theirs": theirs, "folder": theirs.parent}
    one_line(cli_here(module, *(a.format(**fill) for a in args)), str(theirs), "did not write")
    assert theirs.read_text() == "theirs\n"
    ours = tmp_path / "ours"
    fill |= {"theirs": ours / name, "folder": ours}
    for _ in range(2):
        r = cli_here(module, *(a.format(**fill) for a in args))
        assert r.returncode == 0, r.stderr


def test_reproduce_klotski_refuses_a_results_csv_it_did_not_write(
    tmp_path: Path, cli_here: Any
) -> None:
    """out= a folder holding a collect's (or a user's) results.csv: the runs went ahead, and
    their results replaced it once they ended. Its own results.csv (a `table` column) is one
    to resume from, or replace."""
    from experiments.common.tables import csv_of_ours

    (tmp_path / "results.csv").write_text("run_dir,model.name\nr,tiny\n")
    r = cli_here("experiments.reproduce_klotski", f"out={tmp_path}", "only=[table3]")
    one_line(r, "results.csv", "did not write")
    assert (tmp_path / "results.csv").read_text() == "run_dir,model.name\nr,tiny\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]
    (tmp_path / "results.csv").write_text("label,table\nx,table3\n")
    csv_of_ours(tmp_path / "results.csv", "table", "reproduce_klotski")


def test_validate_refuses_a_validate_csv_it_did_not_write(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any
) -> None:
    """out= a folder holding a validate.csv of another kind: the runs went ahead, and their
    table replaced it once they ended."""
    (tmp_path / "validate.csv").write_text("x,y\n1,2\n")
    r = cli_here(
        "experiments.validate", f"checkpoint={tiny_ckpt}", "hardware=tiny", f"out={tmp_path}"
    )
    one_line(r, "validate.csv", "did not write")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["validate.csv"]
