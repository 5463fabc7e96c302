"""Probe class: a routing trace file (the OLMoE repository's counts npz, the ESFT npz) that is
cut short, holds an array of another dtype or shape, or values with no meaning: one line naming
the file and the array, at load, never an internal error and never a fit or a run on it. The
ESFT converter applies the loader's rules to what it writes."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.trace_convert import convert_esft
from core.traces import (
    COUNTS_FILE,
    COUNTS_NAME,
    N_EXPERTS,
    N_LAYERS,
    TOP_K,
    TRACE_FILE,
    TRACE_NAME,
    load_counts,
    load_esft,
)
from experiments.common.ep_inputs import olmoe_counts
from tests.conftest import SHARED_TRACES
from tests.probes.conftest import deadline, one_line, raises_one_line, trace_args

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


def test_a_switch_sweep_names_the_counts_file_in_failed_txt(tmp_path: Path, cli_here: Any) -> None:
    """As the user ran it: the Mixtral array in OLMoE's place blamed the config (lower
    layer_corr) in failed.txt."""
    if not SHARED_TRACES.is_dir():
        pytest.skip("../shared/traces is absent")
    d = tmp_path / "traces"
    shutil.copytree(SHARED_TRACES / COUNTS_NAME, d / COUNTS_NAME)
    (d / COUNTS_NAME / COUNTS_FILE).unlink()
    _counts(d, **{KEY: MIXTRAL})
    r = cli_here(
        "experiments.run",
        "-m",
        "experiment=replication_switch_128",
        "workload.batch_size=1",
        "replication_row=eplb",
        f"workload.routing.trace_dir={d}",
        f"hydra.sweep.dir={tmp_path / 's'}",
        "hydra.launcher.n_jobs=1",  # its one point in this process: no pool of fresh workers
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (failed,) = (tmp_path / "s").rglob("failed.txt")
    line = failed.read_text().strip()
    assert COUNTS_FILE in line and KEY in line and "(5, 3, 8)" in line, line
    assert "layer_corr" not in line


# ---- ESFT trace npz -----------------------------------------------------------------------


def _esft(folder: Path, **change: np.ndarray) -> Path:
    """A 12-token trace (two sequences of 6 in task 0, intent), with `change`'s arrays."""
    t = 12
    rng = np.random.default_rng(0)
    ids = np.stack(
        [[rng.permutation(N_EXPERTS)[:TOP_K] for _ in range(N_LAYERS)] for _ in range(t)]
    )
    arrays = dict(
        expert_ids=ids.astype(np.uint8),  # [T, L, k], distinct per token
        gate_weights=np.full((t, N_LAYERS, TOP_K), 0.1, np.float32),
        task=np.zeros(t, np.uint8),
        seq_id=np.repeat(np.arange(2, dtype=np.int32), 6),
        pos=np.tile(np.arange(6, dtype=np.int32), 2),
        task_names=np.array(["intent", "law"]),
    )
    (folder / TRACE_NAME).mkdir(parents=True, exist_ok=True)
    np.savez(folder / TRACE_NAME / TRACE_FILE, **(arrays | change))
    return folder


def _task(value: int, dtype: type = np.int8) -> np.ndarray:
    a = np.zeros(12, dtype)
    a[7] = value
    return a


BAD_ESFT = [
    ({"task": _task(-1)}, ["task must be indices into task_names >= 0 (token 7 has -1)"]),
    ({"task": np.zeros(12, np.float64)}, ["task has dtype float64, expected integers"]),
    ({"seq_id": np.repeat([0.0, 1.5], 6)}, ["seq_id has dtype float64"]),
    ({"pos": np.arange(12, dtype=np.int32)}, ["token 6", "has pos 6, expected 0"]),
    ({"seq_id": np.repeat(np.array([1, 0], np.int32), 6)}, ["token 6", "comes after token 5"]),
    ({"task_names": np.array(["law", "law"])}, ["task_names", "repeats ['law']"]),
    ({"task_names": np.array([1, 2])}, ["task_names is int64", "strings"]),
    ({"task_names": np.array(["intent", " "])}, ["task_names", "an empty name"]),
    ({"gate_weights": np.zeros((12, N_LAYERS, TOP_K), np.float32)}, ["token 0", "largest 0.0000"]),
    (
        {"gate_weights": np.full((12, N_LAYERS, TOP_K), 0.1 + 0.1j, np.complex64)},
        ["gate_weights has dtype complex64"],
    ),
    ({"num_experts": np.array("64")}, ["num_experts is '64'"]),
]


@pytest.mark.parametrize(
    "change, names",
    BAD_ESFT,
    ids=[
        "task -1",
        "float task",
        "float seq_id",
        "pos unordered",
        "seq_id unordered",
        "dup names",
        "int names",
        "empty name",
        "zero weights",
        "complex weights",
        "str num_experts",
    ],
)
def test_a_bad_esft_array_is_named_at_load(
    tmp_path: Path, change: dict[str, np.ndarray], names: list[str]
) -> None:
    """task -1 tokens were dropped from every selection, a float seq_id, bad task_names and
    all-zero gate weights read as good; complex weights were cast with numpy's two-line warning;
    a float task array was blamed on workload.routing's tasks."""
    assert load_esft(_esft(tmp_path / "good")).n_tokens == 12
    d = _esft(tmp_path / "bad", **change)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy warning is a second line
        raises_one_line(lambda: load_esft(d), TRACE_FILE, "corrupt trace", *names)


def test_the_converter_and_the_loader_refuse_all_zero_weights(tmp_path: Path) -> None:
    """One rule for a token's top-k weights (a softmax's: the largest at least 1/E), in the
    converter as in the loader: the converter wrote all-zero weights the loader now refuses."""
    src = tmp_path / "src" / "t"
    src.mkdir(parents=True)
    zero = "\t".join(map(str, range(TOP_K))) + "\t\t" + "\t".join(["0.0000"] * TOP_K)
    for layer in range(1, N_LAYERS + 1):
        (src / f"expert_weights_{layer}.txt").write_text(zero + "\n")
    raises_one_line(
        lambda: convert_esft(src.parent, tmp_path / "o.npz", n_layers=N_LAYERS),
        "expert_weights_1.txt line 1",
        "token 0",
        "the largest at least 1/64",
    )
    assert not (tmp_path / "o.npz").exists()


def test_a_float_task_array_fails_the_run_naming_the_array(tmp_path: Path, cli_here: Any) -> None:
    """As the user ran it: 'workload.routing selects no tokens', naming the config."""
    d = _esft(tmp_path / "bad", task=np.zeros(12, np.float32))
    r = cli_here("experiments.run", *trace_args(d, tmp_path / "run"))
    line = one_line(r, TRACE_FILE, "task has dtype float32")
    assert "selects no tokens" not in line
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_routing_dump_past_any_real_one_is_refused_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each layer's dump is read whole into memory: a gzip bomb in the tarball (or a huge file
    in the folder) took all the RAM. The limit, 256 MiB, stands in at 100 bytes here."""
    import tarfile

    import core.trace_convert

    monkeypatch.setattr(core.trace_convert, "MAX_DUMP_BYTES", 100)
    src = tmp_path / "src" / "intent"
    src.mkdir(parents=True)
    line = "\t".join(map(str, range(TOP_K))) + "\t\t" + "\t".join(["0.1000"] * TOP_K) + "\n"
    (src / "expert_weights_1.txt").write_text(line * 10)  # 10 lines: over 100 bytes
    tar = tmp_path / "src.tar.gz"
    with tarfile.open(tar, "w:gz") as t:
        t.add(src, arcname="intent")
    for given in (src.parent, tar):
        raises_one_line(
            lambda given=given: convert_esft(given, tmp_path / "o.npz", n_layers=1),
            "expert_weights_1.txt",
            "upstream",
        )
    assert not (tmp_path / "o.npz").exists()
