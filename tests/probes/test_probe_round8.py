"""Probe round 8 (issue 48): the last round's leftovers, each fixed as a class: a disk probe on
a filesystem in memory, a summary.json of a run without the keys every run writes, a routing
dump's field Python's int() limit refuses, a bench child's error naming the run's keys, a
warning said twice, a planner's count of iterations the run never reaches, and a value of the
wrong kind in a user's YAML where the schema has a mapping or a list."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from core import files
from core.trace_convert import _parse_line
from experiments import calibrate
from experiments.common.peers import side_failed
from experiments.common.tables import read_run
from real import checkpoint
from tests.conftest import ROOT
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run


def test_memory_filesystems_are_told_from_disks() -> None:
    assert files.memory_filesystem("/proc/self") == "proc"
    assert files.memory_filesystem("/sys/kernel") == "sysfs"


def test_a_disk_dir_in_memory_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """disk_dir=/dev/shm timed RAM and recorded it as the disk's bandwidth (the mount table
    here says tmp_path is tmpfs, so nothing is written under /dev)."""
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\ntmpfs {tmp_path / 'shm'} tmpfs rw 0 0\n")
    monkeypatch.setattr(files, "MOUNTS", str(mounts))
    disk = tmp_path / "shm" / "d"
    args = ["hardware.name=x", f"out={tmp_path / 'p.yaml'}", f"disk_dir={disk}"]
    assert calibrate.main(args) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: ") and "\n" not in line
    assert f"disk_dir={disk}" in line and "tmpfs" in line and "on the disk" in line
    assert not disk.exists() and not (tmp_path / "p.yaml").exists()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("round8") / "sweep" / "run")


def edited(run: Path, tmp_path: Path, change: Any) -> Path:
    """A copy of `run` under tmp_path/sweep whose summary.json `change` edited."""
    out = Path(shutil.copytree(run, tmp_path / "sweep" / "run"))
    summary = json.loads((out / "summary.json").read_text())
    change(summary)
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "files.sha256").unlink()  # the edit is the case, not its checksum
    return out


@pytest.mark.parametrize("key", ["model", "planner", "makespan_s"])
def test_a_summary_without_a_key_every_run_writes_is_skipped(
    tmp_path: Path, finished_run: Path, key: str
) -> None:
    """collect and report tabulated a run with no model (an empty column) or no makespan."""
    run = edited(finished_run, tmp_path, lambda s: s.pop(key))
    row, problem = read_run(run)
    assert row is None and problem is not None and f"has no {key}" in problem


@pytest.mark.parametrize(
    "key, value", [("plan", 5), ("params", [1]), ("executor", 5), ("status", "weird")]
)
def test_a_summary_key_of_the_wrong_type_is_not_tabulated(
    tmp_path: Path, finished_run: Path, cli_here: Any, key: str, value: Any
) -> None:
    run = edited(finished_run, tmp_path, lambda s: s.__setitem__(key, value))
    r = cli_here("experiments.collect", f"dir={run.parent}")
    one_line(r, key)
    assert not (run.parent / "results.csv").exists()


@pytest.mark.parametrize(
    "text, words",
    [
        ("9" * 5000 + "\t1\t\t0.5\t0.5", ["f.txt:3", "expert id 0", "5000 characters"]),
        ("9" * 30 + "\t1\t\t0.5\t0.5", ["f.txt:3", "expert id 0", "not an integer"]),
        ("1\t2\t\t0.5\tx", ["f.txt:3", "gate weight 1", "'x'"]),
    ],
    ids=["5000 digits", "past int64", "a word"],
)
def test_a_routing_dump_field_that_is_no_number_is_named(text: str, words: list[str]) -> None:
    """An id of 5000 digits said to call sys.set_int_max_str_digits; one past int64 was an
    OverflowError's traceback."""
    line = raises_one_line(lambda: _parse_line(text, "f.txt:3", 2, 64), *words)
    assert "set_int_max_str_digits" not in line


def test_a_bench_childs_error_names_the_benchs_options() -> None:
    why = "n=15 batches does not fit; pick a smaller n (planner.params.n; workload.batch_size)"
    line = str(side_failed("moepipe klotski", why))
    assert "klotski_n" in line and "batch_size" in line and "planner.params" not in line
    line = str(side_failed("moepipe klotski", why, {"planner.params.n": "n"}))
    assert "(n;" in line


def test_a_checkpoint_cut_by_its_config_is_said_once(
    tmp_path: Path, tiny_ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real run loads its checkpoint twice (to resolve the model, then to run it): the
    warning came twice."""
    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (ck / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        checkpoint.load_checkpoint(ck)
        checkpoint.load_checkpoint(ck)
    assert sum("runs its first 1" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize(
    "planner, key",
    [
        ("eplb", "interval"),
        ("predictive_replication", "rehome_interval"),
    ],
)
def test_an_interval_the_run_never_reaches_is_said(
    tmp_path: Path, cli_here: Any, planner: str, key: str
) -> None:
    """1000000000000 (for "never") ran as if it were a re-placement interval, without a word.
    The run goes on without re-placing, as the value says (a sweep's row of interval 8 run at a
    small size is no error either), and its log says that it never re-places."""
    run = tmp_path / "r"
    args = [*TINY[:-1], f"planner={planner}", f"planner.params.{key}=1000000000000"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    log = r.stdout + "".join(p.read_text() for p in run.glob("*.log"))
    assert f"planner.params.{key}=1000000000000" in log and "never re-places" in log
    assert (run / "summary.json").exists()


@pytest.mark.parametrize("planner", ["eplb", "predictive_replication"])
def test_a_window_longer_than_the_run_runs(tmp_path: Path, cli_here: Any, planner: str) -> None:
    """A load window longer than the run is no interval that never fires: it averages every
    iteration so far, as a window of the run's length would, so it runs."""
    run = tmp_path / "r"
    args = [*TINY[:-1], f"planner={planner}", "planner.params.window=1000000"]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    assert (run / "summary.json").exists()


@pytest.mark.parametrize("value", [5, "abc"])
def test_a_scalar_where_a_hardware_file_has_a_mapping_names_key_and_file(
    tmp_path: Path, cli_here: Any, value: object
) -> None:
    """`sources: 5` in a user's hardware file gave "In 'hardware/file_hw': ValidationError
    raised while composing config:; Cannot assign int to Dict[str, str]": neither the key nor
    the file."""
    hw = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**hw, "name": "mine", "sources": value}))
    run = tmp_path / "r"
    r = cli_here(
        "experiments.run", "model=tiny", "workload=tiny", f"hardware={path}", f"hydra.run.dir={run}"
    )
    one_line(r, "hardware.sources:", "where a mapping belongs", str(path))
    assert not run.exists()


def test_a_broken_symbolic_link_is_named_as_one(tmp_path: Path, cli_here: Any) -> None:
    """A dangling or looping symbolic link as `dir=`, `runs=` or `out=` was "not a folder" or
    "cannot create folder (File exists)": right, but the name looked right to the user."""
    loop, dangling = tmp_path / "loop", tmp_path / "dangling"
    loop.symlink_to(loop)
    dangling.symlink_to(tmp_path / "gone")
    assert files.broken_link(loop) == " (a symbolic link that loops)"
    assert "gone, which does not exist" in files.broken_link(dangling)
    assert files.broken_link(tmp_path) == ""
    r = cli_here("experiments.collect", f"dir={dangling}")
    one_line(r, f"dir={dangling}", "a symbolic link to", "does not exist")
    r = cli_here("experiments.trace_json", f"runs={loop}")
    one_line(r, str(loop), "a symbolic link that loops")
    r = cli_here("experiments.make_checkpoint", "model=tiny", f"out={loop / 'sub'}")
    one_line(r, f"out={loop / 'sub'}", "a symbolic link that loops")
