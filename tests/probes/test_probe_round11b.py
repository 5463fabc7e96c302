"""Probe round 11b (issue 48): the environment a command meets and boundary values. stdout
whose reader has left (`... | head -1`, `| true`) or on a full disk (`> /dev/full`): a log line
printed logging's "--- Logging error ---" traceback, a print() stopped the command before it
wrote its files, and the full disk's line named no file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import user_env
from tests.probes.conftest import ROOT, SLOW_COMMAND, TINY, one_line


def writing_to(stdout: int, module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args... >&stdout`, as a user runs it; stderr captured (stdout: '')."""
    r = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=user_env(),
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
    )
    r.stdout = ""
    return r


def gone_reader(module: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m module args... | true`, the reader gone before the command writes: stdout is
    a pipe whose read end is closed."""
    read, write = os.pipe()
    os.close(read)
    try:
        return writing_to(write, module, *args)
    finally:
        os.close(write)


@pytest.mark.parametrize(
    ("module", "args", "written"),
    [
        ("experiments.run", [*TINY, "hydra.run.dir={tmp}/run"], "run/summary.json"),
        ("experiments.run", ["-m", *TINY, "hydra.sweep.dir={tmp}/sweep"], "sweep"),
        ("experiments.run", ["--info"], None),
        pytest.param(
            "experiments.routing_stats", ["out={tmp}/s.json"], "s.json", marks=SLOW_COMMAND
        ),
        ("experiments.bench.lanes", ["device=cpu", "rows=[8]", "lanes=2"], None),
    ],
    ids=["run", "sweep", "info", "routing_stats", "bench.lanes"],
)
def test_a_reader_that_left_stdout_loses_nothing_and_prints_no_traceback(
    tmp_path: Path, module: str, args: list[str], written: str | None
) -> None:
    """The command finishes its work and its files, quietly (stdout goes nowhere after)."""
    r = gone_reader(module, *(a.format(tmp=tmp_path) for a in args))
    assert "Traceback" not in r.stderr and "Logging error" not in r.stderr, r.stderr
    assert r.returncode == 0, r.stderr
    if written == "sweep":
        assert list((tmp_path / "sweep").rglob("summary.json")), r.stderr
    elif written is not None:
        assert (tmp_path / written).is_file(), r.stderr


@pytest.mark.parametrize(
    ("module", "args", "written"),
    [
        ("experiments.run", [*TINY, "hydra.run.dir={tmp}/run"], "run/summary.json"),
        pytest.param(
            "experiments.routing_stats", ["out={tmp}/s.json"], "s.json", marks=SLOW_COMMAND
        ),
        ("experiments.collect", ["--help"], None),
    ],
    ids=["run", "routing_stats", "help"],
)
def test_stdout_on_a_full_disk_is_one_line_naming_it_after_the_work(
    tmp_path: Path, module: str, args: list[str], written: str | None
) -> None:
    """run printed a log line's traceback and exited 0; routing_stats stopped before its out=
    file with "No space left on device" naming no file."""
    with open("/dev/full", "w") as full:
        r = writing_to(full.fileno(), module, *(a.format(tmp=tmp_path) for a in args))
    one_line(r, "stdout: No space left on device")
    if written is not None:
        assert (tmp_path / written).is_file(), r.stderr


LONG = "x" * 300


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.run", [*TINY, f"model.name={LONG}"], "model.name"),
        ("experiments.run", [*TINY, f"hardware.name={LONG}"], "hardware.name"),
        ("experiments.run", ["-m", *TINY, f"hardware.name={LONG}"], "hardware.name"),
        ("experiments.calibrate", [f"hardware.name={LONG}"], "hardware.name"),
    ],
)
def test_a_name_too_long_for_the_folder_it_names_is_refused_naming_its_key(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], key: str
) -> None:
    """A 300-byte model.name failed once the run was set up, "runs/.../<time>_xxx..._flexgen:
    File name too long; check the file and the disk", naming neither the key nor the fix."""
    r = cli_here(module, *args, f"hydra.run.dir={tmp_path}/r", f"hydra.sweep.dir={tmp_path}/s")
    if "-m" in args:  # the sweep's progress bar comes first on stderr; its error line is the last
        r.stderr = r.stderr.splitlines()[-1]
    one_line(r, f"{key}=", "300 bytes", f"a shorter {key}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("experiments.run", [*TINY]),
        ("experiments.collect", ["dir=sweep"]),
        ("experiments.routing_stats", ["--help"]),
        ("experiments.make_checkpoint", ["model=mixtral-tiny", "out=ck"]),
    ],
)
def test_a_current_folder_deleted_is_one_line_saying_so(
    tmp_path: Path, module: str, args: list[str]
) -> None:
    """A shell in a folder deleted since: "error: No such file or directory; check the path",
    naming no path (even for --help)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    r = subprocess.run(
        ["bash", "-c", 'cd "$0" && rmdir "$0" && exec "$@"', gone, sys.executable, "-m", module]
        + args,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_line(r, "the current folder", "cd to a folder that exists")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("experiments.run", [*TINY, "hydra.run.dir={tmp}/" + LONG]),
        ("experiments.collect", ["dir={tmp}/" + LONG]),
        ("experiments.trace_json", ["runs=[{tmp}/" + LONG + "]"]),
        ("experiments.routing_stats", ["out={tmp}/" + LONG + ".json"]),
        ("experiments.make_checkpoint", ["model=mixtral-tiny", "out={tmp}/" + LONG]),
        ("experiments.bench.lanes", ["hardware={tmp}/" + LONG + ".yaml", "device=cpu"]),
    ],
)
def test_a_name_over_the_file_systems_limit_says_to_shorten_it(
    tmp_path: Path, cli_here: Any, module: str, args: list[str]
) -> None:
    """A path with a 300-byte name: "File name too long; check the file and the disk"."""
    r = cli_here(module, *(a.format(tmp=tmp_path) for a in args))
    one_line(r, LONG, "File name too long", "shorten it")


def test_a_path_through_a_file_says_so() -> None:
    """bench.real out_dir=file.txt/sub: "Not a directory; check the file and the disk"."""
    import errno

    from experiments.common.cli import error_line

    e = OSError(errno.ENOTDIR, "Not a directory", "notes.txt/sub")
    assert error_line(e) == (
        "notes.txt/sub: Not a directory; a folder in that path is a file: check the path"
    )
