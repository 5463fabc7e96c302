"""experiments.bench.host: the KV copies of both host layouts reproduce the cache, the slabs hold
the units at close to their size where PyTorch's pinned allocator rounds each up to a power of
two, and bad input is one line (CUDA: the gpu-marked run, and scripts/gpu_check.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import experiments.bench.host as bench
from experiments.bench.host import report

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(batch=2, kv_heads=3, positions=40, head_dim=16, unit_mb="1.5", units=5, repeats=1)


def test_dry_run_copies_and_counts_host_bytes():
    lines = report(dict(device="cpu", **SMALL))
    copies = [ln.split()[0] + " " + ln.split()[1] for ln in lines[3:7]]
    assert copies == [
        "load, strided",
        "load, position-major",
        "store, strided",
        "store, position-major",
    ]
    # 1.5 MiB units: PyTorch 2 MiB each (x1.33); slabs of 42 slots (64 MiB): 63 MiB for 5 units
    buffers = lines[7]
    assert "PyTorch's pinned allocator 10.0 MiB (x1.33, computed)" in buffers
    assert "the store's slabs 63.0 MiB" in buffers


@pytest.mark.parametrize("skipped", range(4))
def test_a_copy_that_did_not_happen_is_caught(monkeypatch, skipped):
    """The bench checks each KV copy on its own against the cache it came from: timing that
    skipped any one of them fails."""
    real, calls = bench.timed, []

    def skipping(copy, device, repeats):
        calls.append(copy)
        return (1.0, 1.0) if len(calls) - 1 == skipped else real(copy, device, repeats)

    monkeypatch.setattr(bench, "timed", skipping)
    with pytest.raises(RuntimeError, match="did not reproduce"):
        report(dict(device="cpu", **SMALL))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slab_slots_are_pinned():
    lines = report(dict(device="cuda", **SMALL))
    assert all("(pinned: True)" in ln for ln in lines if ln.startswith("host -> cuda"))


def test_bad_argument_is_one_line(cli_here):
    r = cli_here("experiments.bench.host", "unit_mb=lots")
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "unit_mb" in err[0]
