"""Probe class: a .npy file or an .npz member that numpy's own parser trips on (no .npy header,
an empty or cut-short member, a header that promises more bytes than the file holds, another
file type) given as a planner's load file, the ESFT trace or the OLMoE counts: one line naming
the file and the array, never np.load's traceback, a hang, or "out of memory" blamed on the
workload."""

from __future__ import annotations

import io
import os
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numpy.lib import format as npy_format

from core.traces import COUNTS_FILE, COUNTS_NAME, TRACE_FILE, TRACE_NAME, load_counts, load_esft
from planners.ep.placement import read_load
from tests.probes.conftest import deadline, raises_one_line
from tests.probes.test_probe_traces import GOOD, KEY, _counts, _esft


def _header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    b = io.BytesIO()
    npy_format.write_array_header_1_0(b, {"descr": descr, "fortran_order": False, "shape": shape})
    return b.getvalue()


# (case, the bytes of a .npy of a [2 MoE layers, 4 experts] float64 load, words of the line);
# each was an internal error (EOFError, AttributeError, tokenize's TokenError), taken as the
# load (bytes past the data), or "out of memory; make the workload smaller" (a header of 16 TB)
NPY: list[tuple[str, bytes, str]] = [
    ("empty", b"", "no .npy header"),
    ("header not a dict", b"\x93NUMPY\x01\x00\x10\x00{'descr': (\n", "no .npy header"),
    ("an npz", b"PK\x03\x04" + b"\0" * 60, "no .npy header"),
    ("header of 16 TB", _header((2, 10**12)) + b"\0" * 64, "(16000000000000 bytes)"),
    ("data cut short", _header((2, 4)) + b"\0" * 16, "but 16 bytes follow"),
    ("bytes past the data", _header((2, 4)) + b"\0" * 640, "but 640 bytes follow"),
]


@pytest.mark.parametrize("case, data, words", NPY, ids=[c[0] for c in NPY])
def test_a_load_file_numpy_cannot_parse_is_one_line(
    tmp_path: Path, case: str, data: bytes, words: str
) -> None:
    path = tmp_path / "load.npy"
    path.write_bytes(data)
    raises_one_line(lambda: read_load(str(path), 2, 4, "eplb"), str(path), words)


def test_a_load_file_that_is_a_fifo_is_refused_unread(tmp_path: Path) -> None:
    """np.load blocked on a FIFO until something wrote to it."""
    path = tmp_path / "load.npy"
    os.mkfifo(path)
    with deadline(10):
        raises_one_line(lambda: read_load(str(path), 2, 4, "eplb"), str(path), "FIFO")


def test_a_load_file_written_by_np_save_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "load.npy"
    load = np.arange(8.0).reshape(2, 4)
    np.save(path, np.asfortranarray(load))
    assert (read_load(str(path), 2, 4, "eplb") == load).all()


def _replace_member(npz: Path, name: str, data: bytes) -> None:
    with zipfile.ZipFile(npz) as z:
        members = {n: z.read(n) for n in z.namelist()}
    with zipfile.ZipFile(npz, "w") as z:
        for n, b in (members | {f"{name}.npy": data}).items():
            z.writestr(n, b)


MEMBERS = [(case, data, words) for case, data, words in NPY if case != "an npz"]


@pytest.mark.parametrize("case, data, words", MEMBERS, ids=[c[0] for c in MEMBERS])
def test_an_npz_member_numpy_cannot_parse_is_one_line(
    tmp_path: Path, case: str, data: bytes, words: str
) -> None:
    """The same bytes as one array of the ESFT trace and of the OLMoE counts."""
    loads: list[tuple[Path, str, Callable[[], object]]] = []
    esft = _esft(tmp_path / "esft")
    loads.append((esft / TRACE_NAME / TRACE_FILE, "expert_ids", lambda: load_esft(esft)))
    counts = _counts(tmp_path / "counts", **{KEY: GOOD})
    loads.append((counts / COUNTS_NAME / COUNTS_FILE, KEY, lambda: load_counts(counts, KEY, 64)))
    for npz, name, load in loads:
        _replace_member(npz, name, data)
        raises_one_line(load, str(npz), f"array {name}", words)


def test_an_npz_holding_an_array_twice_is_refused(tmp_path: Path) -> None:
    """A zip may hold two members of one name; np.load read the last without a word."""
    esft = _esft(tmp_path / "esft")
    npz = esft / TRACE_NAME / TRACE_FILE
    with zipfile.ZipFile(npz) as z:
        task = z.read("task.npy")
    with zipfile.ZipFile(npz, "a") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("task.npy", task)
    raises_one_line(lambda: load_esft(esft), str(npz), "array task twice")
