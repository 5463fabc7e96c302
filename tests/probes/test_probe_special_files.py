"""Probe class: a path that names no regular file where a command reads one (a directory, a
FIFO, a link to /dev/zero) or a file far larger than its kind: one line saying what it is. A
FIFO blocked the read forever, /dev/zero grew the process without bound (SIGINT ignored), and a
weights file that was a directory was called absent."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.files import SMALL_FILE_BYTES
from core.spec import ModelSpec
from core.trace_convert import convert_esft
from core.traces import TRACE_FILE, TRACE_NAME, load_esft
from experiments.common.hardware import read_hardware
from real.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint
from tests.probes.conftest import deadline, one_line, raises_one_line, real_run


def _dir(p: Path) -> None:
    p.mkdir()


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


KINDS: list[tuple[str, Callable[[Path], None], str]] = [
    ("directory", _dir, "a folder, where a file belongs"),
    ("fifo", _fifo, "a FIFO"),
    ("dev zero", _zero, "a character device"),
]


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    make(path)


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d, ignore=shutil.ignore_patterns("offload"))
    return d


@pytest.mark.parametrize("kind, make, words", KINDS, ids=[k for k, _, _ in KINDS])
@pytest.mark.parametrize("name", ["config.json", SINGLE_FILE, INDEX_FILE])
def test_a_checkpoint_file_that_is_no_regular_file(
    ckpt: Path, name: str, kind: str, make: Callable[[Path], None], words: str
) -> None:
    _replace(ckpt / name, make)
    with deadline(20):
        raises_one_line(lambda: load_checkpoint(ckpt), str(ckpt / name), words)


def test_an_oversized_config_json_is_refused_unread(ckpt: Path) -> None:
    with open(ckpt / "config.json", "r+b") as f:  # sparse: no disk used
        f.truncate(SMALL_FILE_BYTES + 1)
    raises_one_line(lambda: ModelSpec.from_hf_config(ckpt), "config.json", "MiB")


@pytest.mark.parametrize("kind, make, words", KINDS, ids=[k for k, _, _ in KINDS])
def test_a_trace_or_hardware_file_that_is_no_regular_file(
    tmp_path: Path, kind: str, make: Callable[[Path], None], words: str
) -> None:
    (tmp_path / TRACE_NAME).mkdir()
    _replace(tmp_path / TRACE_NAME / TRACE_FILE, make)
    hw = tmp_path / "hw.yaml"
    _replace(hw, make)
    src = tmp_path / "src"
    _replace(src, make) if kind != "directory" else None
    with deadline(20):
        raises_one_line(lambda: load_esft(tmp_path), TRACE_FILE, words)
        raises_one_line(lambda: read_hardware(str(hw)), "hw.yaml", words)
        if kind != "directory":  # a folder is a source the converter reads
            raises_one_line(lambda: convert_esft(src, tmp_path / "o.npz"), "src", words)


def test_convert_traces_names_a_fifo_source(tmp_path: Path, cli_here: Any) -> None:
    """As the user ran it: 'no such file or directory' for a FIFO that is there."""
    os.mkfifo(tmp_path / "src")
    with deadline(20):
        r = cli_here(
            "experiments.convert_traces", f"src={tmp_path / 'src'}", f"out={tmp_path / 'o'}"
        )
    one_line(r, "src", "not a regular file (a FIFO)")
    assert not (tmp_path / "o.npz").exists()


def test_a_run_with_config_json_on_dev_zero_ends_in_one_line(ckpt: Path, tmp_path: Path) -> None:
    """As the user ran it: the run read /dev/zero until 8 GB, Ctrl-C ignored."""
    _replace(ckpt / "config.json", _zero)
    r = real_run(ckpt, tmp_path / "run", timeout=120)
    one_line(r, "config.json", "not a regular file (a character device)")
    assert np.isscalar(r.returncode)
