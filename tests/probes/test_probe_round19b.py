"""Probe round 19b (issue 48): the files a user hands the simulated side and the analysis
commands.

Two commands writing one output file at once (`convert_traces`, `routing_stats`, `prefetch_eval`
with the same `out=`): the last to end replaced the first's file, unsaid. The output's lock,
`.<name>.lock` beside it, is held while a command runs; the second is refused in one line.

A logging config's key that Python's logging.config.dictConfig skips, from a config file of the
user's as well as the command line (a formatter's `defaults`, which only Python 3.12 reads): the
key is refused in one line naming it.

A summary.json of an older moepipe, without a metric every run writes now (`dag_efficiency`):
its row went into the table with those columns empty, unsaid. It is kept (a result) and collect's
and report's count line names the run and the keys it lacks; one without a key the table needs
(`makespan_s`) is skipped in one line, as before, and counted by both.

A run dir linked into a sweep (`ln -s`) was not followed: collect and report left it out, unsaid.
Its config.yaml with a key twice in one mapping was read with the later value, unsaid: the run is
skipped in one line naming the key and its line, as a config file hydra reads is refused.

A value with a unit where a bare number belongs (`hardware.memory_gb.gpu=16GB`, a hardware YAML's
`gbps: 25GB/s`) said "not a number": the line says the unit the key's name carries.

An ESFT routing npz holding an array no trace has (a misspelled `num_expert`, whose check of the
model then did not run) was read, unsaid: it is refused in one line naming the array.

A file where a folder belongs (`trace_dir=`, `--config-dir`, replication's and replication_cv's
`dir=`) was called "no such folder", or named a path under it "Not a directory": the line says
what is there (a file, a FIFO, a link to nothing).

A hardware file's (calibrate's) time table with a point that is no [flops, seconds] pair said so
of the whole table, printed whole in the line: the line names the point by its index.

A true/false field given a whole number in a YAML file (`sync: 2`) was read as true, unsaid
(the command line refuses `planner.params.sync=2`): refused in one line naming key and file.

A routing trace's task name with a newline or a tab (convert_traces names a task by its folder)
was written and read, and split every line that names the tasks: both refuse it. A sweep's run
dir whose name holds a newline split collect's and report's `skipped` line: it is shown quoted.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from experiments.common.dir_lock import output_locked
from experiments.common.plugin_keys import check_logging_config
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run

OUTPUTS = [
    ("experiments.convert_traces", "out.npz", ["src=nosuch"]),
    ("experiments.routing_stats", "out.json", ["trace_dir=nosuch"]),
    ("experiments.prefetch_eval", "out.csv", ["trace_dir=nosuch"]),
]


@pytest.mark.parametrize(("module", "name", "args"), OUTPUTS, ids=[m[12:] for m, *_ in OUTPUTS])
def test_a_second_writer_of_one_output_file_is_refused(
    tmp_path: Path, cli_here: Any, module: str, name: str, args: list[str]
) -> None:
    out = tmp_path / name
    with output_locked(out, "out", "other"):  # another command writing it now
        r = cli_here(module, f"out={out}", *args)
    one_line(r, f"out={out}", "is writing this file now", "another out=")
    assert not out.exists() and not list(tmp_path.iterdir())  # its lock went as it let go


LOGGING = {
    "version": 1,
    "formatters": {"simple": {"format": "%(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "simple"}},
    "loggers": {"my.dotted.name": {"level": "INFO"}},
    "root": {"level": "INFO", "handlers": ["console"]},
}


def test_a_logging_config_files_keys_dictconfig_reads_pass() -> None:
    check_logging_config(OmegaConf.create({"hydra": {"job_logging": LOGGING}}).hydra.job_logging)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's dictConfig reads it")
@pytest.mark.parametrize(
    ("where", "key"),
    [
        ("formatters.simple", "defaults"),
        ("loggers.my.dotted.name", "nosuch"),
        ("root", "propagate"),
        ("", "nosuch"),
    ],
)
def test_a_logging_config_files_key_dictconfig_skips_is_refused(where: str, key: str) -> None:
    cfg = OmegaConf.create({"hydra": {"job_logging": LOGGING}})
    node = OmegaConf.select(cfg, f"hydra.job_logging.{where}".rstrip("."))
    if where.startswith("loggers."):
        node = cfg.hydra.job_logging.loggers["my.dotted.name"]
    node[key] = 1
    raises_one_line(lambda: check_logging_config(cfg.hydra.job_logging), key, "leave it out")


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="Python 3.12's dictConfig reads it")
def test_a_formatters_defaults_on_the_command_line_is_refused(
    tmp_path: Path, cli_here: Any
) -> None:
    key = "hydra.job_logging.formatters.simple.defaults"
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={tmp_path / 'r'}", f"+{key}={{a:1}}")
    one_line(r, key, "dictConfig skips it")
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep of three runs: one as written, one of an older summary (no dag_efficiency or
    dag_lower_bound_s), one without makespan_s; the two edited as by hand (no files.sha256)."""
    sweep = tmp_path_factory.mktemp("older")
    tiny_run(sweep / "a")
    for name, drop in (("b", ("dag_efficiency", "dag_lower_bound_s")), ("c", ("makespan_s",))):
        shutil.copytree(sweep / "a", sweep / name)
        (sweep / name / "files.sha256").unlink()
        summary = json.loads((sweep / name / "summary.json").read_text())
        (sweep / name / "summary.json").write_text(
            json.dumps({k: v for k, v in summary.items() if k not in drop})
        )
    return sweep


@pytest.mark.parametrize("module", ["experiments.collect", "experiments.report"])
def test_an_older_summary_is_kept_and_named_a_cut_one_skipped(
    older: Path, tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch, module: str
) -> None:
    from experiments import report

    # the page's figures are report's own tests': here, the line that counts its runs
    monkeypatch.setattr(report, "write_report", lambda *a, **k: tmp_path / "out" / "index.html")
    r = cli_here(module, f"dir={older}", f"out={tmp_path / 'out'}")
    assert r.returncode == 0, r.stderr
    said = "2 run(s), 1 skipped, 1 with an older summary.json (b/summary.json"
    assert said in r.stdout and "without dag_lower_bound_s, dag_efficiency" in r.stdout
    assert f"skipped {older / 'c'}: summary.json has no makespan_s" in r.stderr


def test_a_run_dir_linked_into_a_sweep_is_read(older: Path, tmp_path: Path) -> None:
    from experiments.common.tables import collect

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    os.symlink(older / "a", sweep / "linked")
    df, problems = collect(sweep)
    assert list(df["run_dir"]) == ["linked"] and not problems


def test_a_run_dirs_config_with_a_key_twice_is_skipped_naming_it(
    older: Path, tmp_path: Path
) -> None:
    from experiments.common.tables import collect

    run = tmp_path / "sweep" / "r"
    shutil.copytree(older / "b", run)  # no files.sha256: as made by hand
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(f"{text}planner: {{name: other}}\n")
    df, problems = collect(run.parent)
    assert df.empty and "found duplicate key 'planner'" in problems[0], problems


@pytest.mark.parametrize(
    ("key", "value", "unit"),
    [
        ("hardware.memory_gb.gpu", "16GB", "GB"),
        ("hardware.links.h2d.gbps", "25GB/s", "GB/s"),
        ("hardware.gpu.overhead_us", "5us", "microseconds"),
    ],
)
def test_a_number_with_a_unit_is_told_the_unit_its_key_names(
    tmp_path: Path, cli_here: Any, key: str, value: str, unit: str
) -> None:
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={tmp_path / 'r'}", f"{key}={value}")
    one_line(r, f"{key}={value}", f"the unit is {unit}", "without a unit")
    assert not (tmp_path / "r").exists()


def test_an_esft_trace_with_an_array_no_trace_has_is_refused(tmp_path: Path) -> None:
    import numpy as np

    from core.traces import load_esft
    from tests.probes.test_probe_traces import _esft

    d = _esft(tmp_path, num_expert=np.array(64))
    raises_one_line(lambda: load_esft(str(d)), "esft_routing.npz", "['num_expert']", "no routing")


@pytest.mark.parametrize(
    ("module", "args", "names"),
    [
        ("experiments.prefetch_eval", ["trace_dir={f}"], ["trace_dir={f}: a file, where a folder"]),
        ("experiments.replication_cv", ["dir={f}"], ["dir={f}: a file, where a folder belongs"]),
        ("experiments.replication", ["dir={f}"], ["dir={f}: a file, where a folder belongs"]),
        ("experiments.run", ["--config-dir", "{f}", *TINY], ["--config-dir {f}: a file, where"]),
    ],
    ids=["prefetch_eval", "replication_cv", "replication", "config-dir"],
)
def test_a_file_where_a_folder_belongs_is_called_a_file(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], names: list[str]
) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("mine\n")
    r = cli_here(module, *(a.format(f=f) for a in args))
    one_line(r, *(n.format(f=f) for n in names))
    assert f.read_text() == "mine\n"


@pytest.mark.parametrize(
    ("table", "names"),
    [
        ([[1e5, 1e-3], [2e5, "fast"]], ["compute-attention[1]: [200000.0, 'fast']", "a pair"]),
        ([[1e5, 1e-3], [2e5]], ["compute-attention[1]: [200000.0]", "a pair of numbers"]),
        ([[2e5, 1e-3], [1e5, 1e-3]], ["flops ascending", "[1] is [100000.0, 0.001]"]),
        ("abc", ["compute-attention: 'abc' is not a list"]),
    ],
    ids=["word", "single", "descending", "scalar"],
)
def test_a_time_tables_bad_point_is_named_not_the_whole_table(table: Any, names: list[str]) -> None:
    import yaml

    from core.hardware import HardwareSpec

    d = yaml.safe_load((Path(__file__).parents[2] / "conf/hardware/tiny.yaml").read_text())
    d["gpu"]["time_tables"] = {"compute-attention": table}
    raises_one_line(lambda: HardwareSpec.from_dict(d), *names)


@pytest.mark.parametrize("value", ["2", "'-1'"])
def test_a_whole_number_for_a_yaml_files_bool_is_refused(
    tmp_path: Path, cli_here: Any, value: str
) -> None:
    (tmp_path / "conf" / "planner").mkdir(parents=True)
    text = (Path(__file__).parents[2] / "conf/planner/flexgen.yaml").read_text()
    (tmp_path / "conf/planner/mine.yaml").write_text(text.replace("sync: true", f"sync: {value}"))
    args = ["--config-dir", str(tmp_path / "conf"), *TINY[:3], "planner=mine"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, "planner.params.sync=", "must be true or false", "planner/mine.yaml")
    assert not (tmp_path / "r").exists()


def test_a_task_name_with_a_newline_is_refused_written_or_read(tmp_path: Path) -> None:
    import numpy as np

    from core.trace_convert import convert_esft
    from core.traces import load_esft
    from tests.probes.test_probe_traces import _esft

    d = _esft(tmp_path / "read", task_names=np.array(["in\ntent", "law"]))
    raises_one_line(lambda: load_esft(str(d)), "esft_routing.npz", "'in\\ntent'", "rename")
    src = tmp_path / "src" / "t\nx"
    src.mkdir(parents=True)
    (src / "expert_weights_1.txt").write_text("0\t1\t\t0.5\t0.5\n")
    out = tmp_path / "out.npz"
    raises_one_line(lambda: convert_esft(src.parent, out), "task folder", "rename it")
    assert not out.exists()


def test_a_skipped_run_dir_with_a_newline_is_one_line(
    older: Path, tmp_path: Path, cli_here: Any
) -> None:
    sweep = tmp_path / "sweep"
    shutil.copytree(older / "c", sweep / "a\nb")  # no makespan_s: skipped
    r = cli_here("experiments.collect", f"dir={sweep}")
    one_line(r, "no finished run", "'a\\nb': summary.json has no makespan_s")
