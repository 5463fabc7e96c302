"""Probe class: a routing trace file (the OLMoE repository's counts npz, the ESFT npz) that is
cut short, holds an array of another dtype or shape, or values with no meaning: one line naming
the file and the array, at load, never an internal error and never a fit or a run on it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.traces import COUNTS_FILE, COUNTS_NAME, load_counts
from experiments.common.ep_inputs import olmoe_counts
from tests.conftest import SHARED_TRACES
from tests.probes.conftest import cli, deadline, raises_one_line

# ---- OLMoE counts npz -------------------------------------------------------------------------

KEY = "olmoe_counts_top1"
GOOD = np.full((5, 3, 64), 10, np.int64)  # [domains, layers, E]
MIXTRAL = np.full((5, 3, 8), 10, np.int64)  # the Mixtral array, 8 experts


def _counts(folder: Path, **arrays: np.ndarray) -> Path:
    (folder / COUNTS_NAME).mkdir(parents=True, exist_ok=True)
    np.savez(folder / COUNTS_NAME / COUNTS_FILE, **arrays)
    return folder


def _with(value: float, at: tuple[int, int, int] = (1, 2, 3)) -> np.ndarray:
    c = GOOD.astype(np.float64)
    c[at] = value
    return c


BAD_COUNTS = [
    (np.full((5, 3, 64), "7"), ["dtype <U1", "integer counts"]),
    (GOOD.astype(np.complex128), ["dtype complex128"]),
    (np.zeros((5, 3, 64), np.int64), ["counts no tokens at domain 0, layer 0"]),
    (_with(-1.0), ["holds -1.0 at domain 1, layer 2, expert 3", "negative"]),
    (_with(np.nan), ["holds nan at domain 1, layer 2, expert 3"]),
    (MIXTRAL, ["has shape (5, 3, 8)", "[domains, layers, 64]"]),
    (np.ones(3, np.int64), ["has shape (3,)"]),
]


@pytest.mark.parametrize(
    "counts, names", BAD_COUNTS, ids=["str", "complex", "zero", "neg", "nan", "mixtral", "[3]"]
)
def test_a_bad_olmoe_counts_array_is_named_at_load(
    tmp_path: Path, counts: np.ndarray, names: list[str]
) -> None:
    """Strings were an internal ValueError; zero, negative and NaN counts blamed the shape and
    named no file; the Mixtral array blamed layer_corr; a [3] array was fitted."""
    d = _counts(tmp_path, **{KEY: counts})
    raises_one_line(lambda: olmoe_counts(str(d)), COUNTS_FILE, KEY, *names)


def test_an_olmoe_counts_file_cut_short_or_lacking_the_array_is_named(tmp_path: Path) -> None:
    d = _counts(tmp_path / "short", **{KEY: GOOD})
    f = d / COUNTS_NAME / COUNTS_FILE
    f.write_bytes(f.read_bytes()[:200])
    raises_one_line(lambda: olmoe_counts(str(d)), COUNTS_FILE, "not a readable npz")
    d = _counts(tmp_path / "other", mixtral_counts_top1=MIXTRAL)
    raises_one_line(lambda: olmoe_counts(str(d)), COUNTS_FILE, f"lacks array {KEY}")


def test_an_olmoe_counts_path_that_is_no_regular_file_is_named(tmp_path: Path) -> None:
    """A FIFO blocked np.load; a link to /dev/zero read without end."""
    (tmp_path / COUNTS_NAME).mkdir()
    os.mkfifo(tmp_path / COUNTS_NAME / COUNTS_FILE)
    with deadline(20):
        raises_one_line(lambda: olmoe_counts(str(tmp_path)), COUNTS_FILE, "not a regular", "FIFO")
    (tmp_path / COUNTS_NAME / COUNTS_FILE).unlink()
    (tmp_path / COUNTS_NAME / COUNTS_FILE).symlink_to("/dev/zero")
    with deadline(20):
        raises_one_line(lambda: olmoe_counts(str(tmp_path)), COUNTS_FILE, "character device")


def test_the_shipped_counts_load() -> None:
    if not (SHARED_TRACES / COUNTS_NAME / COUNTS_FILE).exists():
        pytest.skip("../shared/traces is absent")
    assert load_counts(SHARED_TRACES, KEY, 64).shape == (5, 3, 64)
    assert load_counts(SHARED_TRACES, "mixtral_counts_topk", 8).shape == (5, 3, 8)


def test_a_switch_sweep_names_the_counts_file_in_failed_txt(tmp_path: Path) -> None:
    """As the user ran it: the Mixtral array in OLMoE's place blamed the config (lower
    layer_corr) in failed.txt."""
    if not SHARED_TRACES.is_dir():
        pytest.skip("../shared/traces is absent")
    d = tmp_path / "traces"
    shutil.copytree(SHARED_TRACES / COUNTS_NAME, d / COUNTS_NAME)
    (d / COUNTS_NAME / COUNTS_FILE).unlink()
    _counts(d, **{KEY: MIXTRAL})
    r = cli(
        "experiments.run",
        "-m",
        "experiment=replication_switch_128",
        "workload.batch_size=1",
        "replication_row=eplb",
        f"workload.routing.trace_dir={d}",
        f"hydra.sweep.dir={tmp_path / 's'}",
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (failed,) = (tmp_path / "s").rglob("failed.txt")
    line = failed.read_text().strip()
    assert COUNTS_FILE in line and KEY in line and "(5, 3, 8)" in line, line
    assert "layer_corr" not in line
