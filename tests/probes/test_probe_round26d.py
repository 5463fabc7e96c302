"""Round 26d of issue 48: a fresh probe of the 20 commands as a new user and a failing machine
would run them (`tests.probes.harness26d` over `tests.probes.cases26d_cmd.CASES`: malformed
config.json and safetensors, OSErrors on full, read-only and size-limited disks, hydra,
inputs accepted silently, results lost). Classes found, one test group each:

1. A write that failed on the machine (a full disk, a file size limit) said what failed but
   not what fixes it in report, replication, trace_json, collect, routing_stats,
   prefetch_eval and calibrate, where run and make_checkpoint say it: "out=X: cannot write
   it (File too large)"; collect said "pass out= a writable folder" for a full disk. Each now
   ends in the fix for its errno (`core.files.cannot_write`).
2. A failed write of one file of a pair (collect's results.parquet and results.csv,
   validate_lanes' csv and md) named the other: an error that names no file (pyarrow's,
   pandas') took the name of the last file entered. Each write now names its own
   (`core.args.naming`).
3. A run into a folder holding another model's checkpoint (hydra.run.dir=, a simulated run
   or a real run of another checkpoint) wrote its summary, trace and tokens.safetensors among
   that model's weights without a word; make_checkpoint then refused that folder as "a run's".
   collect's and report's out= alike. A run refused only its own checkpoint's folder. Now any
   folder holding config.json beside safetensors weights is refused as an output folder
   (`core.args.checkpoint_folder`), except by make_checkpoint, which writes checkpoints.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line, tiny_run

FULL = "free space on that disk, or write elsewhere"
TOO_LARGE = "raise it, or make the output smaller"


def test_the_case_list_covers_each_class_with_over_200_cases() -> None:
    """The harness's cases, to run again: over 200, every class of issue 48, ids unique."""
    from tests.probes.cases26d_cmd import CASES

    ids = Counter(c.id for c in CASES)
    assert len(CASES) > 200 and max(ids.values()) == 1
    classes = {c.cls for c in CASES}
    assert classes == {"hf_config", "safetensors", "oserror", "hydra", "silent", "lost"}


def test_the_harness_sorts_each_outcome(tmp_path: Path) -> None:
    """`classify`: one line is good; an exit 0 of a bad input silent; two lines, a traceback,
    a line that does not name the fault, a summary.json left and a user's file gone each
    their kind."""
    import subprocess

    from tests.probes.harness26d import Case, classify

    def outcome(rc: int, err: str, case: Case | None = None) -> str:
        done = subprocess.CompletedProcess([], rc, "", err)
        return classify(case or Case("c", "silent", "m", ()), tmp_path, done, set())[0]

    named = Case("c", "silent", "m", (), names=("seed",))
    assert outcome(2, "error: workload.seed=-1: bad\n", named) == "good"
    assert outcome(2, "error: workload.batch_size: bad\n", named) == "wrong"
    assert outcome(0, "") == "silent"
    assert outcome(2, "error: a\nerror: b\n") == "multiline"
    assert outcome(1, "Traceback (most recent call last):\n  ...\nKeyError: 1\n") == "traceback"
    assert outcome(2, "sweep s: 1 run(s) finished\nerror: sweep s: 1 failed\n") == "good"
    assert outcome(0, "", Case("c", "lost", "m", (), expect="ok")) == "designed"
    gone = Case("c", "lost", "m", (), expect="ok", after=lambda t: "lost")
    assert outcome(0, "", gone) == "lost"
    (tmp_path / "summary.json").write_text("{}")
    assert outcome(2, "error: x\n") == "other"


def test_a_write_error_line_ends_in_its_errnos_fix() -> None:
    """`cannot_write`: what failed, the system's reason, and the fix of its errno."""
    from core.files import cannot_write

    line = cannot_write("out=x", OSError(errno.EFBIG, "File too large"))
    assert line.startswith("out=x: cannot write it (File too large); ")
    assert line.endswith(TOO_LARGE)


def _raises(code: int) -> Any:
    def write(*args: Any, **kw: Any) -> None:
        raise OSError(code, os.strerror(code))

    return write


@pytest.mark.parametrize(("code", "fix"), [(errno.ENOSPC, FULL), (errno.EFBIG, TOO_LARGE)])
def test_trace_json_and_report_say_what_fixes_a_failed_write(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch, code: int, fix: str
) -> None:
    """Class 1: trace_json's and report's line for a write the disk refused ends in its fix."""
    import experiments.report as report
    import experiments.trace_json as trace_json

    run = tiny_run(tmp_path / "sweep" / "run")
    monkeypatch.setattr(trace_json, "write_chrome", _raises(code))
    one_line(cli_here("experiments.trace_json", f"runs={run}"), "trace.json", fix)
    monkeypatch.setattr(report, "write_report", _raises(code))
    one_line(cli_here("experiments.report", f"dir={tmp_path / 'sweep'}"), "report", fix)
    assert not (tmp_path / "sweep" / "report").exists()


def test_collect_says_what_fixes_pyarrows_full_disk(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Class 1: collect's line for pyarrow's full disk ends in a full disk's fix."""
    import pandas as pd

    def full(*args: Any, **kw: Any) -> None:
        detail = "Error writing bytes to file. Detail: [errno 28] No space left on device"
        raise OSError(errno.ENOSPC, detail)  # as pyarrow raises it

    tiny_run(tmp_path / "run")
    monkeypatch.setattr(pd.DataFrame, "to_parquet", full)
    line = one_line(cli_here("experiments.collect", f"dir={tmp_path}"), "No space left", FULL)
    assert not list(tmp_path.glob("results.*"))
    # class 2: the parquet file failed, and the line names it, not the csv written after it
    assert line.startswith(f"error: {tmp_path / 'results.parquet'}: "), line


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("experiments.run", [*TINY, "hydra.run.dir=CK"]),
        ("experiments.run", ["-m", *TINY, "workload.seed=0,1", "hydra.sweep.dir=CK"]),
        ("experiments.collect", ["dir=RUNS", "out=CK"]),
        ("experiments.report", ["dir=RUNS", "out=CK"]),
    ],
    ids=["run", "sweep", "collect", "report"],
)
def test_an_output_folder_holding_a_checkpoint_is_refused(
    tmp_path: Path, cli_here: Any, tiny_ckpt: Path, module: str, args: list[str]
) -> None:
    """Class 3: a command's outputs never go in among another model's weights."""
    ck = tmp_path / "downloaded"
    shutil.copytree(tiny_ckpt, ck)
    held = sorted(p.name for p in ck.iterdir())
    tiny_run(tmp_path / "runs" / "run")
    args = [a.replace("RUNS", str(tmp_path / "runs")).replace("CK", str(ck)) for a in args]
    one_line(cli_here(module, *args), f"={ck}: a checkpoint's folder", "another folder")
    assert sorted(p.name for p in ck.iterdir()) == held
