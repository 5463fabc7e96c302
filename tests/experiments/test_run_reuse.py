"""`python -m experiments.run` into a folder that holds a finished run: reused only for the same
config, code, model files and routing trace; a garbled or failed result runs again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from experiments import run as run_module
from tests.conftest import ROOT, command_here
from tests.experiments.test_run import TINY, run_dirs


@pytest.fixture
def run_in(capsys, monkeypatch):
    """`run` in this process (tests.conftest.command_here), as in test_run.py."""

    def go(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
        return command_here(run_module.main, [*args, *run_dirs(tmp_path)], capsys, monkeypatch)

    return go


@pytest.fixture(scope="session")
def _finished_runs() -> dict[str, Path]:
    return {}


@pytest.fixture
def finished(tmp_path, tmp_path_factory, run_in, _finished_runs) -> list[str]:
    """A finished tiny flexgen run in `tmp_path`, as `run_in([*TINY, "planner=flexgen"],
    tmp_path)` leaves it: run once per test process and copied (a tiny run's start-up in this
    process is most of a test's time); returns those arguments."""
    args = [*TINY, "planner=flexgen"]
    if "run" not in _finished_runs:
        first = tmp_path_factory.mktemp("finished")
        assert run_in(args, first).returncode == 0
        _finished_runs["run"] = first / "run"
    shutil.copytree(_finished_runs["run"], tmp_path / "run")
    return args


def test_rerun_reuses_a_finished_run_only_for_the_same_config(tmp_path, run_in):
    r1 = run_in([*TINY, "planner=flexgen"], tmp_path)
    summary = tmp_path / "run" / "summary.json"
    first = summary.stat().st_mtime_ns
    r2 = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert r1.returncode == r2.returncode == 0
    assert "already finished" in r2.stderr + r2.stdout and summary.stat().st_mtime_ns == first
    r3 = run_in([*TINY, "planner=flexgen", "workload.gen_len=4"], tmp_path)
    assert r3.returncode == 0 and "another config" in r3.stderr + r3.stdout
    assert json.loads(summary.read_text())["gen_len"] == 4


def test_a_model_rebuilt_at_the_same_path_runs_again(tmp_path, run_in):
    """A run of `+model.hf_config=DIR` (or a real run's checkpoint=DIR) is finished only for the
    files it read: the same path holding another model's config.json runs again (it was reused,
    the other model's result handed back as this one's)."""
    from core.hf_config import spec_to_hf_config
    from tests.conftest import model_from_conf

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    cfg = spec_to_hf_config(model_from_conf("tiny"))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    args = ["hardware=tiny", "workload=tiny", "planner=flexgen", f"+model.hf_config={ckpt}"]
    assert run_in(args, tmp_path).returncode == 0
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "already finished" in r.stderr + r.stdout
    (ckpt / "config.json").write_text(json.dumps(cfg | {"hidden_size": 128}))
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "another config" in r.stderr + r.stdout
    assert "# model files" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.slow  # runs in several fresh processes: .ci/run's slow suite
def test_runs_are_the_same_in_every_process(tmp_path):
    """A schedule must not depend on Python's per-process string hashing (set or dict order of
    names), or re-runs that reuse finished runs would mix results of different schedules. Two
    processes of other hash seeds each run klotski and predictive_replication (a sweep of the
    two in one process)."""
    planners = ("klotski", "predictive_replication")
    traces = []
    for seed in ("1", "2"):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "experiments.run",
                "-m",
                *TINY,
                f"planner={','.join(planners)}",
                "hydra.launcher.n_jobs=1",
                f"hydra.sweep.dir={tmp_path}/{seed}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert r.returncode == 0, r.stderr[-2000:]
        traces.append(
            {
                json.loads((p.parent / "summary.json").read_text())["planner"]: pd.read_parquet(p)
                for p in (tmp_path / seed).rglob("trace.parquet")
            }
        )
    assert sorted(traces[0]) == sorted(traces[1]) == sorted(planners)
    for planner in planners:
        assert len(traces[0][planner]) and traces[0][planner].equals(traces[1][planner]), planner


def test_a_garbled_summary_is_run_again(tmp_path, run_in, finished):
    """A summary.json that is not JSON (a full disk, a hand edit) is not a finished run."""
    (tmp_path / "run" / "summary.json").write_text('{"makespan_s": ')
    r = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert (
        r.returncode == 0
        and "summary.json is not a readable JSON object; running again" in r.stdout + r.stderr
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["makespan_s"] > 0


@pytest.mark.parametrize("value", ["-1", "NaN", '"fast"'])
def test_a_summary_with_a_metric_no_run_writes_is_run_again(tmp_path, run_in, finished, value):
    """A summary.json whose throughput is negative, NaN or a string (a hand edit, another tool)
    was reused, and went into tables and PASS verdicts as a result."""
    path = tmp_path / "run" / "summary.json"
    text = path.read_text()
    good = json.loads(text)["throughput_tok_s"]
    path.write_text(text.replace(f'"throughput_tok_s": {good}', f'"throughput_tok_s": {value}'))
    r = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert r.returncode == 0 and "throughput_tok_s is" in r.stdout + r.stderr
    assert "running again" in r.stdout + r.stderr
    assert json.loads(path.read_text())["throughput_tok_s"] == good


def test_a_run_of_other_code_or_a_failed_rerun_is_not_reused(tmp_path, run_in, finished):
    """A finished run dir records the code it ran with: under other code it runs again. A rerun
    with bad input fails before it touches the dir: the finished run stays, with its own
    config.yaml (it was deleted, a finished result lost to a typo), and is reused as before."""
    out = tmp_path / "run"
    (out / "code_version.txt").write_text("other code")
    r = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert r.returncode == 0 and "a run of other code; running again" in r.stdout + r.stderr
    kept = (out / "summary.json").read_text(), (out / "config.yaml").read_text()
    r = run_in([*TINY, "planner=flexgen", "workload.batch_size=0"], tmp_path)
    assert r.returncode == 2
    assert ((out / "summary.json").read_text(), (out / "config.yaml").read_text()) == kept
    r = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert r.returncode == 0 and "already finished" in r.stdout + r.stderr


def test_a_trace_rebuilt_at_the_same_path_runs_again(tmp_path, run_in):
    """A run whose routing is the ESFT trace is finished only for the trace file it read: a
    trace rebuilt at the same trace_dir runs again (it was reused, the old trace's result
    handed back); synthetic routing records no trace."""
    import shutil

    from core.traces import TRACE_FILE, TRACE_NAME, trace_path

    src = trace_path(ROOT / "../shared/traces")
    if not src.is_file():
        pytest.skip("no ESFT trace at ../shared/traces")
    copy = tmp_path / "traces" / TRACE_NAME / TRACE_FILE
    copy.parent.mkdir(parents=True)
    shutil.copy(src, copy)
    args = [
        "model=deepseek-v2-lite",
        "hardware=h200",
        "workload=tiny",
        "planner=flexgen",
        f"workload.routing.trace_dir={tmp_path / 'traces'}",
    ]
    assert run_in(args, tmp_path).returncode == 0
    assert "# routing trace" in (tmp_path / "run" / "config.yaml").read_text()
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "already finished" in r.stderr + r.stdout
    os.utime(copy, ns=(copy.stat().st_atime_ns, copy.stat().st_mtime_ns + 10**9))  # rebuilt
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "another config" in r.stderr + r.stdout
    assert run_in([*TINY, "planner=flexgen"], tmp_path / "syn").returncode == 0
    assert "# routing trace" not in (tmp_path / "syn" / "run" / "config.yaml").read_text()


@pytest.mark.parametrize("edit", ["junk", "deleted", "same-size"])
def test_a_result_file_edited_or_deleted_since_runs_again(tmp_path, run_in, finished, edit):
    """A finished run's files are listed with their sha256 in files.sha256; a rerun reuses the
    result only while each is the file the run wrote (a trace.parquet overwritten or deleted
    was handed back as the result before)."""
    args = finished
    trace = tmp_path / "run" / "trace.parquet"
    before = trace.read_bytes()
    if edit == "junk":
        trace.write_text("junk")
    elif edit == "deleted":
        trace.unlink()
    else:  # one byte flipped, the size and mtime put back
        st = trace.stat()
        data = bytearray(before)
        data[len(data) // 2] ^= 0xFF
        trace.write_bytes(bytes(data))
        os.utime(trace, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "trace.parquet is missing or not what" in r.stderr + r.stdout
    assert trace.read_bytes() == before  # the same run, written again
    r = run_in(args, tmp_path)
    assert "already finished" in r.stderr + r.stdout


def test_config_edited_in_place_with_its_mtime_put_back_runs_again(tmp_path, run_in):
    """A model file's version is its size, mtime and ctime: an edit in place that keeps the size
    and restores the mtime (cp -p, rsync -a, touch -r) moves the ctime, so the run runs again. A
    simulated run reads config.json alone, so that is the file whose edit counts (round 22a: the
    weights beside it do not)."""
    from core.hf_config import spec_to_hf_config
    from tests.conftest import model_from_conf

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    config = ckpt / "config.json"
    config.write_text(json.dumps(spec_to_hf_config(model_from_conf("tiny"))))
    args = ["hardware=tiny", "workload=tiny", "planner=flexgen", f"+model.hf_config={ckpt}"]
    assert run_in(args, tmp_path).returncode == 0
    st = config.stat()
    config.write_text(config.read_text().replace(", ", ",\n", 1))  # the same size and meaning
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))
    r = run_in(args, tmp_path)
    assert r.returncode == 0 and "another config" in r.stderr + r.stdout
