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
        "cold=once",
        "repeats=2",
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
    # each row the median of its 2 runs (the slower), the runs' tok/s beside it; the budget-tier
    # run that set moepipe's host room, a row of one run
    for name, r in rows.items():
        if name.endswith("budget tiers"):
            assert len(r) == 6
            continue
        assert r[6:8] == ["2", "runs"]
        low, high = map(float, r[8].split("-"))
        assert low == float(r[1]) <= high
    tok_s = {k: float(r[1]) for k, r in rows.items()}
    assert all(v > 0 for v in tok_s.values())
    assert all(int(r[3]) > 0 for r in rows.values())  # peak RSS MB
    best = max(v for k, v in tok_s.items() if k.startswith("accelerate"))
    last = out[-1]
    assert last.startswith("moepipe / best peer: ")
    ratio = float(last.split(":")[1].split("x")[0])
    assert ratio == pytest.approx(tok_s[ours[0]] / best, rel=0.02)
    assert "cold=once" in out[0] and "8 tokens" in out[0]


def test_room_cgroup_with_cold_pass_is_refused_in_one_line(capsys):
    """moepipe's host tier would keep what accelerate's page cache is dropped of each pass."""
    assert bench_accelerate.main(["checkpoint=nowhere", "cold=pass"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith("error: room=cgroup with cold=pass: ") and "room=tiers" in err
    # with room=tiers the pair is accepted: the run goes on to its next check
    assert bench_accelerate.main(["checkpoint=nowhere", "cold=pass", "room=tiers"]) == 2
    assert "room=" not in capsys.readouterr().err


def test_a_time_limit_stops_the_block_and_restores_the_alarm():
    import signal
    import time

    from experiments.common.peers import _Stopped, _time_limit

    before = signal.getsignal(signal.SIGALRM)
    t0 = time.perf_counter()
    with pytest.raises(_Stopped), _time_limit(0.05):
        while time.perf_counter() - t0 < 5:
            time.sleep(0.001)
    assert time.perf_counter() - t0 < 1
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with _time_limit(0):  # 0: no limit, no alarm
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_stopped_peer_gives_a_lower_bound_on_the_ratio():
    from experiments.common.peers import Row, format_rows

    ours = Row("moepipe klotski (n=4)", 4, 10.0, 160.0, 1, 1)
    stopped = Row("accelerate, 1 generate call", 16, None, None, 1, 1, stopped_s=480.0, tokens=1600)
    slow = Row("accelerate, batch by batch (4 calls)", 4, 2.0, 800.0, 1, 1)
    out = format_rows([ours, stopped, slow])
    # 1600 tokens in more than 480 s: at most 3.33 tok/s, so moepipe is at least 3x it
    assert out[-1] == (
        "moepipe / best peer: >= 3.00x (accelerate, 1 generate call stopped at its time "
        "limit; at most 3.33 tok/s)"
    )
    assert out[2].split()[5:7] == ["<3.33", ">480"]
    assert out[3].split()[-1] == ">=0.60x"  # 2.0 against at most 3.33
    fast = Row("accelerate, batch by batch (4 calls)", 4, 5.0, 320.0, 1, 1)
    assert format_rows([ours, stopped, fast])[-1] == (
        "moepipe / best peer: 2.00x (accelerate, batch by batch (4 calls))"
    )


def test_an_accelerate_child_past_its_limit_is_stopped(mixtral_tiny):
    """The real generate call, stopped by the limit: no tok/s, the limit and the tokens it
    had to make."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from experiments.bench.accelerate import checked
    from experiments.common.peers import child
    from experiments.common.schema import BenchAccelerateOptions

    opts = checked(
        BenchAccelerateOptions(
            checkpoint=str(mixtral_tiny),
            hardware="tiny",
            n_batches=2,
            batch_size=2,
            prompt_len=4,
            gen_len=2,
            cold="false",
            acc_batch=4,
            acc_limit_s=1e-4,
            role="accelerate",
        )
    )
    got = child("accelerate", opts)
    assert got == {"tok_s": None, "seconds": None, "stopped_s": 1e-4, "tokens": 8}
