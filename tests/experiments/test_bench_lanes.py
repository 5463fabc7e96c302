"""experiments.bench.lanes: the shared-lanes model's overlap of G identical expert ops is
min(G, 1 / cap), and on CUDA the measured overlap lies between 1 (serialised) and G."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.bench.lanes import report

ROOT = Path(__file__).resolve().parents[2]


def rows_of(lines: list[str]) -> list[list[str]]:
    return [ln.split() for ln in lines[2:]]


def test_model_overlap_is_lanes_or_one_over_cap():
    """Switch-base-128 (fp32, 768 x 3072) on the H200 profile: 8 rows fill one 128-row tile,
    15 blocks on average (24 + 6), cap 15 x 73 / 4800 = 0.228 (memory-bound): 8 lanes overlap
    1 / 0.228 = 4.38 times; 4096 rows fill the GPU: no overlap."""
    lines = report(
        dict(
            model="switch-base-128",
            hardware="h200",
            lanes=8,
            rows="8,4096",
            device="cpu",
            repeats=1,
        )
    )
    (r8, r4096) = rows_of(lines)
    assert r8[:3] == ["8", "15", "0.228"] and float(r8[5]) == pytest.approx(1 / 0.228, abs=0.02)
    assert r4096[2] == "1.000" and float(r4096[5]) == pytest.approx(1.0)
    assert "model's figures only" in lines[0]


def test_bad_argument_is_one_line(cli_here):
    r = cli_here("experiments.bench.lanes", "model=nosuch")
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(err) == 1 and "model=nosuch" in err[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measured_overlap_on_cuda_streams():
    lines = report(
        dict(
            model="switch-base-128",
            hardware="h200",
            lanes=4,
            rows="64,4096",
            device="cuda",
            repeats=5,
        )
    )
    for row in rows_of(lines):
        assert row[-1] in ("graph", "eager") and 0.5 <= float(row[-2]) <= 4.5
