"""The peer benchmark: bad input is one line, and (with the `bench` extra) both systems run on a
seeded checkpoint and the ratio is printed."""

from __future__ import annotations

import pytest

from experiments.bench import accelerate as bench_accelerate


def test_unknown_cold_is_one_line(capsys):
    assert bench_accelerate.main(["checkpoint=nowhere", "cold=sometimes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cold='sometimes' unknown; valid: pass, once, false"]


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_every_row_and_the_ratio_to_the_best_peer(mixtral_tiny, capsys):
    """moepipe, accelerate with every prompt in one generate call, and batch by batch: each
    row's tok/s and memory, and the last line's ratio is moepipe's over the best peer row's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    argv = [
        f"checkpoint={mixtral_tiny}",
        "hardware=tiny",
        "n_batches=2",
        "gen_len=2",
        "batch_size=2",
        "prompt_len=4",
        "cold=pass",
    ]
    assert bench_accelerate.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    table = next(i for i, ln in enumerate(out) if ln.startswith("system "))
    rows = {ln[:40].strip(): ln[40:].split() for ln in out[table + 1 : -1]}
    # room=cgroup (the default) where a cgroup was made: moepipe's host tier + the room its
    # run at the budget tiers left, that run the second row
    room = next((ln for ln in out if ln.startswith("room=cgroup: ")), "+ 0 MB of host room")
    room_mb = int(room.split(" MB of host room")[0].split("+ ")[-1])
    ours = ["moepipe klotski (n=2)"]
    if room_mb:
        ours = [f"{ours[0]}, host +{room_mb} MB", f"{ours[0]}, budget tiers"]
    assert list(rows) == [
        *ours,
        "accelerate, 1 generate call",
        "accelerate, batch by batch (2 calls)",
    ]
    assert [int(r[0]) for r in rows.values()] == [2] * len(ours) + [4, 2]  # sequences per call
    tok_s = {k: float(r[1]) for k, r in rows.items()}
    assert all(v > 0 for v in tok_s.values())
    assert all(int(r[3]) > 0 for r in rows.values())  # peak RSS MB
    best = max(v for k, v in tok_s.items() if k.startswith("accelerate"))
    last = out[-1]
    assert last.startswith("moepipe / best peer: ")
    ratio = float(last.split(":")[1].split("x")[0])
    assert ratio == pytest.approx(tok_s[ours[0]] / best, rel=0.02)
    assert "cold=pass" in out[0] and "8 tokens" in out[0]
