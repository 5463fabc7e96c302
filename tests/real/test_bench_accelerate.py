"""The peer benchmark: bad input is one line, and (with the `bench` extra) both systems run on a
seeded checkpoint and the ratio is printed."""

from __future__ import annotations

import pytest

from experiments import bench_accelerate


def test_unknown_cold_is_one_line(capsys):
    assert bench_accelerate.main(["checkpoint=nowhere", "cold=sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cold='sometimes' unknown; valid: pass, once, false"]


def test_peer_and_moepipe_run(mixtral_tiny, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    argv = [f"checkpoint={mixtral_tiny}", "hardware=tiny", "n_batches=2", "gen_len=2",
            "batch_size=2", "prompt_len=4", "cold=pass"]  # fmt: skip
    assert bench_accelerate.main(argv) == 0
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ":" in ln}
    theirs = float(lines["accelerate disk offload"].split(":")[1].split()[0])
    ours = float(
        next(v for k, v in lines.items() if k.startswith("moepipe")).split(":")[1].split()[0]
    )
    ratio = float(out.strip().splitlines()[-1].split(":")[1].rstrip("x"))
    assert theirs > 0 and ours > 0
    assert ratio == pytest.approx(ours / theirs, rel=0.02)  # the printed ratio is of the two rows
    assert "cold=pass" in out and "8 tokens" in out
