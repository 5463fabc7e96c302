"""replace_run keeps the earlier result until the new one is whole, even through a kill -9 in
the swap itself: the next run into the dir puts the earlier result back (restore_previous)."""

import json
import os

import pytest

from experiments.common import run_dir
from experiments.common.run_dir import PREVIOUS, replace_run, restore_previous


def _old_run(d):
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"makespan_s": 1.0}))
    (d / "trace.parquet").write_text("old trace")
    (d / "config.yaml").write_text("old: 1\n")


def test_a_finished_replace_leaves_the_new_result_and_no_previous(tmp_path):
    d = tmp_path / "run"
    _old_run(d)

    def files(tmp):
        (tmp / "trace.parquet").write_text("new trace")
        (tmp / "config.yaml").write_text("new: 1\n")

    replace_run(d, {"makespan_s": 2.0}, files)
    assert json.loads((d / "summary.json").read_text()) == {"makespan_s": 2.0}
    assert (d / "trace.parquet").read_text() == "new trace"
    assert not (d / PREVIOUS).exists()


@pytest.mark.parametrize("moved_in", [0, 1])
def test_a_kill_mid_swap_is_undone_by_the_next_run(tmp_path, monkeypatch, moved_in):
    """Kill the swap after `moved_in` of the new files moved in (os.replace raising stands for
    the kill: nothing after it runs, as nothing would after SIGKILL)."""
    d = tmp_path / "run"
    _old_run(d)
    real_replace, calls = os.replace, []

    def killed_replace(src, dst):
        if str(src).startswith(str(d / ".partial-")):
            if len(calls) == moved_in:
                raise SystemExit("killed")
            calls.append(src)
        real_replace(src, dst)

    def files(tmp):
        (tmp / "trace.parquet").write_text("new trace")
        (tmp / "config.yaml").write_text("new: 1\n")

    monkeypatch.setattr(run_dir.os, "replace", killed_replace)
    with pytest.raises(SystemExit):
        replace_run(d, {"makespan_s": 2.0}, files)
    monkeypatch.setattr(run_dir.os, "replace", real_replace)
    assert not (d / "summary.json").exists()  # no result is shown meanwhile, never a mix
    restore_previous(d)
    assert json.loads((d / "summary.json").read_text()) == {"makespan_s": 1.0}
    assert (d / "trace.parquet").read_text() == "old trace"
    assert (d / "config.yaml").read_text() == "old: 1\n"
    assert not (d / PREVIOUS).exists()


def test_a_kill_after_the_new_summary_keeps_the_new_result(tmp_path):
    d = tmp_path / "run"
    _old_run(d)
    (d / PREVIOUS).mkdir()
    (d / PREVIOUS / "summary.json").write_text(json.dumps({"makespan_s": 0.5}))
    restore_previous(d)
    assert json.loads((d / "summary.json").read_text()) == {"makespan_s": 1.0}
    assert not (d / PREVIOUS).exists()
