"""Round 28d of issue 48: a fresh probe of the FILES every command reads and writes
(`tests.probes.harness28d` over `tests.probes.cases28d.CASES` and its `SCENARIOS`: a run dir's
summary.json, trace.parquet and config.yaml as collect, report and trace_json read them, a
checkpoint's config.json and safetensors headers as validate, calibrate and the benches read
them, ESFT dumps, a user's conf dir; full and read-only disks, odd paths, two writers at once
and a writer killed mid-write). Classes found, one test group each:

1. A link leading nowhere inside a run dir (its trace.parquet, a link that loops or whose file
   was moved) was counted as a run dir of its own that collect and report skipped ("2 run(s),
   1 skipped" of two runs, both collected), and a summary.json that is such a link was called
   "no summary.json (unfinished or interrupted; run the sweep again)", which does not help:
   running the sweep again reuses the point; trace_json drew such a run's trace as a run's
   of one process (its summary.json, which says how many, taken for deleted). A run dir's own
   dead link is no run now, and a dead link of a run's file is named as the link it is.
2. reproduce_klotski's report_only=true read back a results.csv cut short (a copy or a disk
   that stopped mid-row) without a word: pandas fills a short row's missing fields with NaN,
   and the report printed that row's half. A CSV a command wrote is now read back whole or
   refused in one line (`core.files.whole_csv`); a count column (n, batch_size, gen_len,
   column) edited to a fraction was printed as Klotski's n (`klotski_conf.check_results`).
3. A config.json whose activation (hidden_act, Switch's dense_act_fn) is no name transformers'
   ACT2FN has (`nosuch`) was timed by a simulated run (`+model.hf_config=`) without a word:
   no framework builds that model. It is refused as the real model refuses it; an ACT2FN
   name moepipe's real model does not run (gelu_new there; prelu) is still a simulated model.
4. A command that sets up no logging of its own (collect, report, trace_json, validate) said
   a logged warning through Python's last-resort handler, as the bare message: above an
   `error: ` line it read as part of the error, a second line of it. Every such command now
   says it as `warning: ...` (`cli.warnings_as_lines`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.probes.conftest import cli, tiny_run


@pytest.fixture(scope="module")
def sweep_of_two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder of two finished tiny runs, a and b (tests copy it)."""
    sw = tmp_path_factory.mktemp("sw28d") / "sw"
    tiny_run(sw / "a")
    tiny_run(sw / "b")
    return sw


def _copy(sweep: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(sweep, to / "sw", symlinks=True))


def test_the_case_list_covers_every_file_kind_with_over_200_cases() -> None:
    """The harness's cases, to run again: over 200, ids unique, each kind of file."""
    from tests.probes.cases28d import CASES
    from tests.probes.harness28d import SCENARIOS

    ids = Counter([c.id for c in CASES] + [s[0] for s in SCENARIOS])
    assert len(ids) > 200 and max(ids.values()) == 1
    classes = {c.cls for c in CASES} | {s[1] for s in SCENARIOS}
    assert classes >= {"rundir", "hf_config", "safetensors", "esft", "output", "conf", "killed",
                       "together"}  # fmt: skip


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_a_run_dirs_dead_link_is_no_run_dir(sweep_of_two: Path, tmp_path: Path, link: str) -> None:
    """Class 1: b's trace.parquet a dead link: the sweep's runs are still a and b, no third."""
    from experiments.common.tables import run_dirs

    sw = _copy(sweep_of_two, tmp_path)
    trace = sw / "b/trace.parquet"
    trace.unlink()
    trace.symlink_to(trace.name if link == "loop" else "moved.parquet")
    assert run_dirs(sw) == [sw / "a", sw / "b"]


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_a_dead_summary_link_is_named_as_a_link(
    sweep_of_two: Path, tmp_path: Path, link: str
) -> None:
    """Class 1: b's summary.json a dead link: read_run names the link, not an unfinished run."""
    from experiments.common.tables import read_run

    sw = _copy(sweep_of_two, tmp_path)
    summary = sw / "b/summary.json"
    summary.unlink()
    summary.symlink_to(summary.name if link == "loop" else "moved.json")
    row, why = read_run(sw / "b")
    assert row is None and why is not None
    assert "symbolic link" in why and "unfinished" not in why, why


@pytest.mark.parametrize("link", ["loop", "dangling"])
def test_trace_json_names_a_dead_summary_link(
    sweep_of_two: Path, tmp_path: Path, link: str
) -> None:
    """Class 1: trace_json of a run whose summary.json is a dead link: one error naming the
    link; a summary.json deleted (a bare trace) is still drawn."""
    from core.errors import MoepipeError
    from experiments.trace_json import read_traces

    sw = _copy(sweep_of_two, tmp_path)
    summary = sw / "b/summary.json"
    summary.unlink()
    assert read_traces(sw / "b")
    summary.symlink_to(summary.name if link == "loop" else "moved.json")
    with pytest.raises(MoepipeError) as e:
        read_traces(sw / "b")
    assert str(e.value).startswith(f"{summary} unreadable (a symbolic link"), str(e.value)


def _results_csv(path: Path) -> str:
    import pandas as pd

    rows = [{"table": "table3", "step": s, "column": 0, "planner": "flexgen", "n": 15,
             "throughput_tok_s": 12.932566851820622} for s in ("multi", "hot")]  # fmt: skip
    pd.DataFrame(rows).to_csv(path, index=False)
    return path.read_text()


@pytest.mark.parametrize("cut", [-20, -1])  # mid-row, and only its newline
def test_a_results_csv_cut_short_is_refused(tmp_path: Path, cut: int) -> None:
    """Class 2: report_only's results.csv cut short is one line naming it; whole, it is read."""
    from core.errors import MoepipeError
    from experiments.reproduce_klotski import read_results

    path = tmp_path / "results.csv"
    text = _results_csv(path)
    assert len(read_results(path)) == 2
    path.write_text(text[:cut])
    with pytest.raises(MoepipeError) as e:
        read_results(path)
    assert str(e.value).startswith(f"{path}: not a readable CSV") and "cut short" in str(e.value)


@pytest.mark.parametrize("col, value", [("n", "1.5"), ("column", "x")])
def test_a_results_csv_count_not_whole_is_refused(tmp_path: Path, col: str, value: str) -> None:
    """Class 2: a count column of report_only's results.csv edited to a fraction or a word is
    one line naming the column and the value."""
    import pandas as pd

    from core.errors import MoepipeError
    from experiments.reproduce_klotski import read_results

    path = tmp_path / "results.csv"
    _results_csv(path)
    df = pd.read_csv(path, dtype=str)
    df.loc[1, col] = value
    df.to_csv(path, index=False)
    with pytest.raises(MoepipeError) as e:
        read_results(path)
    assert f"row 2 has {col}={value}," in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "family, field, act, ok",
    [("mixtral", "hidden_act", "nosuch", False), ("switch_transformers", "dense_act_fn", "gelu_9",
      False), ("mixtral", "hidden_act", "prelu", True), ("olmoe", "hidden_act", "gelu_new", True)],
)  # fmt: skip
def test_an_activation_transformers_lacks_is_refused_in_a_simulated_run(
    tmp_path: Path, family: str, field: str, act: str, ok: bool
) -> None:
    """Class 3: the config.json's spec (what a simulated run times) refuses an activation name
    ACT2FN lacks in one line naming the file and the field; an ACT2FN name is a model."""
    import json

    from core.errors import ConfigError
    from core.spec import ModelSpec
    from tests.probes.test_probe_hf_config import BASE

    (tmp_path / "config.json").write_text(json.dumps(BASE[_short(family)] | {field: act}))
    if ok:
        ModelSpec.from_hf_config(tmp_path)
        return
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_hf_config(tmp_path)
    line = str(e.value)
    assert line.startswith(str(tmp_path / "config.json")) and f"{field}={act!r}" in line, line
    assert "\n" not in line


def _short(family: str) -> str:
    return "switch" if family == "switch_transformers" else family


def test_a_commands_logged_warning_is_said_as_a_warning(sweep_of_two: Path, tmp_path: Path) -> None:
    """Class 4: collect reading a summary.json with a key given twice warns (Python's json
    takes the last value) before its error line; the warning said as `warning: ...`."""
    sw = _copy(sweep_of_two, tmp_path)
    summary = sw / "a" / "summary.json"
    summary.write_text(summary.read_text().replace("{", '{"planner": "x", ', 1))
    r = cli("experiments.collect", f"dir={sw}", f"out={tmp_path / 'out'}")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    twice = [line for line in lines if "appears twice" in line]
    assert len(twice) == 1 and twice[0].startswith("warning: "), r.stderr
    assert all(line.startswith(("warning: ", "error: ", "skipped ")) for line in lines), r.stderr
