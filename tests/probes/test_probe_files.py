"""Probe class: a file a command reads back from its own output (reproduce_klotski's
results.csv, a run dir's summary.json, config.yaml and code_version.txt), malformed, hand-edited,
from another version or cut short: one line naming the file, or the run done again; never an
internal error, and never taken for a finished result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from experiments.common.run_dir import CODE, finished
from experiments.reproduce_klotski import report_of
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run

RESULTS = [
    ("a table it never writes", "table\nfoo\n", "tables foo"),
    ("no rows", "table\n", "tables none"),
    ("table 3 with a text column", "table,column,step\ntable3,x,y\n", "results.csv"),
    ("auto_n lacking its columns", "table,n,throughput\nauto_n,1,b\n", "model"),
    ("fig14 lacking throughput", "table\nfig14\n", "throughput_tok_s"),
    (
        "vs_flexgen lacking its planners",
        "table,model,hardware,batch_size,planner,"
        "throughput_tok_s,gen_len\nvs_flexgen,m,h,1,flexgen,1.0,4\n",
        "klotski",
    ),
    ("not UTF-8", b"\xff\xfe\x00bad", "not a readable CSV"),
    ("a binary file", bytes(range(256)), "results.csv"),
    ("one quote open", 'table,"column\ntable3,1\n', "results.csv"),
]


@pytest.mark.parametrize("text, words", [c[1:] for c in RESULTS], ids=[c[0] for c in RESULTS])
def test_a_results_csv_report_only_cannot_read_is_one_line(
    tmp_path: Path, text: str | bytes, words: str
) -> None:
    """`reproduce_klotski report_only=true` on a results.csv it did not write as it is: a table
    named `foo` was printed as an empty report (exit 0), a missing column or a text where a
    number belongs was a KeyError, AttributeError or ValueError deep in the report."""
    path = tmp_path / "results.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    raises_one_line(lambda: report_of(path), str(path), words)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (one subprocess for the module)."""
    return tiny_run(tmp_path_factory.mktemp("run") / "run")


BROKEN = [
    ("summary a JSON list", "summary.json", b"[1, 2]"),
    ("summary a JSON string", "summary.json", b'"done"'),
    ("summary null", "summary.json", b"null"),
    ("summary not UTF-8", "summary.json", b"\xff\xfe{}"),
    ("summary cut short", "summary.json", b'{"planner": "fl'),
    ("summary a folder", "summary.json", None),
    ("config not UTF-8", "config.yaml", b"\xff\xfe\x00"),
    ("config a folder", "config.yaml", None),
    ("code version not UTF-8", CODE, b"\xff\xfe"),
    ("code version a folder", CODE, None),
]


@pytest.mark.parametrize("name, data", [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_a_run_dir_with_a_broken_file_is_not_finished(
    run: Path, tmp_path: Path, name: str, data: bytes | None
) -> None:
    """A rerun into a run dir decides whether its result is finished from these files: a
    summary.json holding a JSON list was taken for a finished result (the run skipped, the list
    left as its summary), a config.yaml or code_version.txt not UTF-8 was a UnicodeDecodeError
    (an internal error). Each is a run not finished: it runs again."""
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    config = (mine / "config.yaml").read_text()
    assert finished(mine, config)
    (mine / name).unlink()
    if data is None:
        (mine / name).mkdir()
    else:
        (mine / name).write_bytes(data)
    assert not finished(mine, config)


def test_a_rerun_over_a_summary_that_is_a_list_runs_again(
    run: Path, tmp_path: Path, cli_here: Any
) -> None:
    """As a user meets it: the same command into the dir runs again and leaves a summary."""
    mine = tmp_path / "run"
    shutil.copytree(run, mine)
    (mine / "summary.json").write_text("[1, 2]")
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={mine}")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert isinstance(json.loads((mine / "summary.json").read_text()), dict)


def test_a_run_whose_config_was_edited_after_it_ran_is_skipped_by_collect(
    tmp_path: Path, cli_here: Any
) -> None:
    """`workload.batch_size: big` in a finished run's config.yaml went into results.csv as a
    batch size; a config that disagrees with its summary is not that run's."""
    from experiments.common.tables import collect

    run = tmp_path / "sweep" / "a"
    assert cli_here("experiments.run", *TINY, f"hydra.run.dir={run}").returncode == 0
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace("batch_size: 2", "batch_size: big", 1))
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and len(problems) == 1
    assert "workload.batch_size is 'big'" in problems[0] and "run the sweep again" in problems[0]


def test_a_failed_rerun_does_not_relabel_the_kept_result(tmp_path: Path, cli_here: Any) -> None:
    """A rerun of klotski into a finished flexgen run's folder, refused (bad param): flexgen's
    result stays, but hydra had rewritten .hydra at the rerun's start, and collect named the
    kept run 'klotski'."""
    from experiments.common.tables import collect

    run = tmp_path / "sweep" / "a"
    assert cli_here("experiments.run", *TINY, f"hydra.run.dir={run}").returncode == 0
    bad = [*TINY[:-1], "planner=klotski", "planner.params.disk_window=0"]
    assert cli_here("experiments.run", *bad, f"hydra.run.dir={run}").returncode == 2
    df, problems = collect(tmp_path / "sweep")
    assert not problems and list(df["system"]) == ["flexgen"]
    assert list(df["planner.name"]) == ["flexgen"]


@pytest.fixture()
def a_run(tmp_path: Path, cli_here: Any) -> Path:
    """A finished tiny run in a sweep-like folder whose name holds '=' (as a sweep's do)."""
    run = tmp_path / "sweep" / "workload=tiny"
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir='{run}'")
    assert r.returncode == 0, r.stderr
    return run


def test_a_run_dirs_bad_trace_or_summary_is_named(a_run: Path, cli_here: Any) -> None:
    """summary.json's processes of Infinity was an internal OverflowError and a count the trace
    does not have was taken; a trace.parquet of 0 rows or every row twice was drawn. A path
    holding '=' failed in hydra's grammar with no word of how to quote it (now one that is
    there is quoted for the user, round 24h)."""
    import pandas as pd

    out = f"out={a_run.parent / 'x.json'}"
    r = cli_here("experiments.trace_json", f"runs=[{a_run}]", out)  # quoted for the user
    assert r.returncode == 0, r.stderr
    r = cli_here("experiments.trace_json", f"runs=[{a_run}x]", out)  # a folder not there
    one_line(r, "must be quoted", f"runs=['{a_run}x']")
    quoted = f"runs='{a_run}'"
    summary = a_run / "summary.json"
    good = summary.read_text()
    for bad in ("Infinity", "5"):
        summary.write_text(good.rstrip().rstrip("}") + f', "processes": {bad}}}')
        one_line(cli_here("experiments.trace_json", quoted, out), "summary.json", "processes=")
    summary.write_text(good)
    trace = a_run / "trace.parquet"
    df = pd.read_parquet(trace)
    for name, bad_df in (("0 rows", df.iloc[:0]), ("repeat", pd.concat([df, df]))):
        bad_df.to_parquet(trace)
        one_line(cli_here("experiments.trace_json", quoted, out), "trace.parquet", name)
        one_line(cli_here("experiments.report", f"dir={a_run.parent}"), "trace.parquet", name)
    trace.unlink()
    r = cli_here("experiments.report", f"dir={a_run.parent}")
    assert r.returncode == 0, r.stderr
    assert f"warning: {a_run}/trace.parquet: no such file;" in r.stderr
    trace.mkdir()  # a folder in its place was "no trace.parquet" too
    r = cli_here("experiments.report", f"dir={a_run.parent}")
    assert r.returncode == 0, r.stderr
    assert f"warning: {a_run}/trace.parquet: a folder, where a file belongs;" in r.stderr
    trace.rmdir()


def test_collect_that_fails_to_write_leaves_no_folder_of_its_own(
    a_run: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a full disk collect left the empty out folder it had made."""
    import errno

    import experiments.collect

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(experiments.collect, "write_results", full)
    out = a_run.parent / "new" / "out"
    r = cli_here("experiments.collect", f"dir={a_run.parent}", f"out={out}")
    one_line(r, "No space left")
    assert not out.parent.exists()


def test_a_summary_nested_too_deep_for_json_is_not_a_result(tmp_path: Path) -> None:
    """json's parser recurses per bracket: a summary.json of 10^5 brackets was an internal
    RecursionError in collect and in the check that reuses a finished run."""
    from experiments.common.tables import collect

    run = tmp_path / "sweep" / "a"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("workload:\n  batch_size: 2\n")
    (run / "summary.json").write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and "nested too deeply" in problems[0]
    assert not finished(run, "workload:\n  batch_size: 2\n")
