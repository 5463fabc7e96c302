"""Shared fixtures of the experiments tests: one small replication sweep and its report, run
once per session (for both test processes) and read by every test that checks a sweep's folder
or the report over it (tests/experiments/test_replication_sweep.py, test_experiment_configs.py);
and the tiny compare sweep that test_sweep.py and test_sweep_report.py read."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ROOT, built_once, overridden

# the esft-g8 case's rows (its seven) and the split-load row, small: 2 batches of 8 x 8 tokens
ESFT_ROWS = (
    "ep_static,eplb,predictive_replication,oracle_replication,predictive_replication_gate_none,"
    "predictive_replication_window,eplb_interval8,oracle_replication_split_load"
)
SMALL = ("workload.n_batches=2", "workload.prompt_len=8")
# the points in the sweep's own process (still through hydra's joblib launcher): joblib's worker
# processes each import the project again, a second or two of CPU each; sweeps on two workers
# are test_sweep.py's shared sweep
SERIAL = "hydra.launcher.n_jobs=1"


def replication_sweep_args(out: Path, *args: str) -> list[str]:
    """`experiments.run`'s arguments: `-m` of the small esft-g8 sweep into `out` (`args`
    replace the keys they set)."""
    base = [
        "-m",
        "experiment=replication_esft_g8",
        "workload.batch_size=8",
        *SMALL,
        f"replication_row={ESFT_ROWS}",
        f"hydra.sweep.dir={out}",
    ]
    return overridden(base, *args)


def run_module(*args: str) -> subprocess.CompletedProcess:
    """`python -m args...` from the repository root."""
    cmd = [sys.executable, "-m", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@dataclass(frozen=True)
class ReplicationSweep:
    out: Path  # the sweep folder: esft-g8 (bs 8) and switch-base-128-g8 (bs 16) runs
    esft: subprocess.CompletedProcess  # the esft-g8 sweep's command
    switch: subprocess.CompletedProcess  # the switch-base-128-g8 sweep's command
    report: subprocess.CompletedProcess  # experiments.replication over the folder


@pytest.fixture(scope="session")
def replication_sweep(tmp_path_factory: pytest.TempPathFactory) -> ReplicationSweep:
    """Two cases swept small into one folder (a held-out ESFT one, every row of it and the
    split-load row, and a synthetic one), then `experiments.replication` over both; built once
    for both test processes (tests.conftest.built_once). Tests that change the folder work on a
    copy."""

    def build(folder: Path) -> list[list]:
        out = folder / "r"
        esft = run_module("experiments.run", *replication_sweep_args(out, SERIAL))
        assert esft.returncode == 0, esft.stderr[-3000:]
        switch = run_module(
            "experiments.run",
            "-m",
            "experiment=replication_switch_128_g8",
            f"hydra.sweep.dir={out}",
            "workload.batch_size=16",
            *SMALL,
            SERIAL,
        )
        assert switch.returncode == 0, switch.stderr[-3000:]
        report = run_module(
            "experiments.replication", f"dir={out}", "targets_cases=[esft-g8,switch-base-128-g8]"
        )
        return [[r.args, r.returncode, r.stdout, r.stderr] for r in (esft, switch, report)]

    folder, done = built_once(tmp_path_factory, "replication", build)
    esft, switch, report = (subprocess.CompletedProcess(*r) for r in done)
    return ReplicationSweep(folder / "r", esft, switch, report)


# the shared compare sweep (tests/experiments/test_sweep.py, test_sweep_report.py): tiny runs
TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]
# a run's dir: its name (the keys an experiment sweeps), then the overrides it leaves out
POINT = "*/workload=tiny/summary.json"


def sweep_args(sweep_dir: Path, *extra: str, n_jobs: int = 1) -> list[str]:
    """`experiments.run`'s arguments: the tiny compare sweep into `sweep_dir` (`extra` replace
    the keys they set)."""
    base = [
        "-m",
        "experiment=compare",
        *TINY,
        "planner=sequential,fiddler",
        "workload.batch_size=2,4",
        f"hydra.sweep.dir={sweep_dir}",
        f"hydra.launcher.n_jobs={n_jobs}",
    ]
    return overridden(base, *extra)


def sweep(sweep_dir: Path, *extra: str, n_jobs: int = 1) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "experiments.run", *sweep_args(sweep_dir, *extra, n_jobs=n_jobs)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="session")
def swept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared sweep's folder, swept once for both test processes (tests.conftest.built_once):
    tests that would change it work on a copy."""

    def build(folder: Path) -> None:
        r = sweep(folder / "tiny", n_jobs=2)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "tok/s" in r.stdout and "report:" in r.stdout  # the end-of-sweep table + report

    folder, _ = built_once(tmp_path_factory, "sweep", build)
    return folder / "tiny"
