"""The real-scale benchmark end to end on a tiny model (checkpoint written, moepipe, the
simulator, the bound, accelerate), and its refusals: a budget below one layer's working set and
a disk without room are one line each, exit 2, nothing written."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from experiments.bench import real as bench_real

TINY = ["model=mixtral-tiny", "hardware=tiny", "gen_len=2", "batch_size=2", "prompt_len=4"]


def printed_ratio(line: str) -> float:
    """The `R.RRx` of a `moepipe / ...: R.RRx (...)` line."""
    return float(line.split(": ")[1].split("x")[0])


def ratio_of_printed(num: float, den: float):
    """num / den as the bench computes it from the unrounded values, which it prints to 0.01
    each (tok/s, seconds): the ratio lies within what that rounding allows. On the tiny model
    a makespan of ~0.05 s printed to 0.01 s is ±10%, so a relative tolerance cannot hold."""
    lo, hi = (num - 0.005) / (den + 0.005), (num + 0.005) / (den - 0.005)
    return pytest.approx((lo + hi) / 2, abs=(hi - lo) / 2 + 0.005)


def test_end_to_end_on_a_tiny_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    argv = [*TINY, "budget_gb=0.008", f"out_dir={tmp_path}"]
    assert bench_real.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("mixtral-tiny: ") and "disk footprint 1.00" in out[0]
    rows = {
        ln[:40].strip(): ln[40:].split()
        for ln in out
        if ln.startswith(("moepipe k", "accel", "simulator ("))
    }
    assert set(rows) == {
        "moepipe klotski (n=1)",
        "accelerate, 1 generate call",
        "simulator (same schedule)",
    }
    ours, peer = (
        float(rows["moepipe klotski (n=1)"][1]),
        float(rows["accelerate, 1 generate call"][1]),
    )
    bound = next(ln for ln in out if ln.strip().startswith("max "))
    bound_s = float(bound.split()[1])
    assert bound_s > 0 and "(disk)" in bound  # disk binds: 43% of the model is read per pass
    assert out[-3].startswith("moepipe / best peer: ")
    assert out[-3].endswith("x (accelerate, 1 generate call)")
    assert printed_ratio(out[-3]) == ratio_of_printed(ours, peer)
    assert out[-2].startswith("moepipe / physical bound: ")
    made_s = float(out[-2].split("makespan ")[1].split()[0])
    assert printed_ratio(out[-2]) == ratio_of_printed(made_s, bound_s)
    assert out[-1].startswith("simulator error: ")
    assert [p.name for p in tmp_path.iterdir()] == ["mixtral-tiny"]  # no temporary folder left
    # a second run reuses the checkpoint
    assert bench_real.ensure_checkpoint(
        bench_real.reduced_spec("mixtral-tiny"), tmp_path / "mixtral-tiny"
    )
    assert "reusing checkpoint" in capsys.readouterr().err


def test_budget_below_a_layer_is_one_line(tmp_path, capsys):
    assert bench_real.main([*TINY, "budget_gb=0.001", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: budget_gb=0.001: its device pool")
    assert not any(tmp_path.iterdir())


def test_a_disk_without_room_is_one_line(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, (1 << 30) - 4096, 4096))
    assert bench_real.main([*TINY, "budget_gb=0.008", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: out_dir={tmp_path}: 0.0 GB free, the checkpoint needs")
    assert not any(tmp_path.iterdir())
