"""The benches' `room`: every side in one cgroup limit, moepipe's host tier enlarged by what its
run at the budget tiers left under it. The children are faked here (their peaks chosen), so
the tier sizes, which runs start with which options, and the simulator's tiers are checked
without timing anything."""

from __future__ import annotations

from typing import Any

import pytest

from core.types import Tier
from experiments.bench import accelerate as bench_accelerate
from experiments.bench import real as bench_real
from experiments.common import bench_memory as bm
from experiments.common import peers as pe
from experiments.common.pipeline import resolve_n_batches

MiB = 1 << 20
PROBE = 200 * MiB  # the fake bare child's peak (the runtime allowance)


def test_host_room_is_what_the_budget_run_left_less_the_margin():
    """726 MiB limit, the run at the budget tiers peaked at 462 MiB, 64 MiB margin: 200 MiB.
    A peak 1 byte higher leaves 199 MiB (whole MiB, rounded down); a peak at or above the limit
    less the margin leaves none."""
    assert bm.host_room_bytes(726 * MiB, 462 * MiB, 64 * MiB) == 200 * MiB
    assert bm.host_room_bytes(726 * MiB, 462 * MiB + 1, 64 * MiB) == 199 * MiB
    assert bm.host_room_bytes(726 * MiB, 662 * MiB, 64 * MiB) == 0
    assert bm.host_room_bytes(726 * MiB, 726 * MiB, 0) == 0
    assert bm.host_room_bytes(726 * MiB, 800 * MiB, 64 * MiB) == 0


def test_room_options_keep_the_budget_runs_n_only_with_room():
    """With room, moepipe's options carry host_room_mb and the n of its run at the budget tiers
    (so the two runs differ only in the host tier); without, n is left to the planner."""
    opts = {"n_batches": 15, "klotski_n": 0, "host_room_mb": 9}
    run = {"n_batches": 7, "n_plan": {"n": 7, "n_auto": True}}
    room = bm.Room("cgroup", 100, 50, budget_run=run, host_room_bytes=200 * MiB)
    assert room.options(opts) == {"n_batches": 7, "klotski_n": 7, "host_room_mb": 200}
    assert room.n_plan == {"n": 7, "n_auto": True}
    none = bm.Room("cgroup", 100, 50, budget_run=run)
    assert none.options(opts) == {"n_batches": 15, "klotski_n": 0, "host_room_mb": 0}
    assert none.n_plan == {}


def _opts(ckpt, **over: Any) -> dict[str, Any]:
    d = bench_accelerate.checked(
        bench_accelerate.BenchAccelerateOptions(checkpoint=str(ckpt), hardware="tiny")
    )
    return {**d, **over}


def test_run_spec_grows_moepipes_host_tier_alone(mixtral_tiny):
    """host_room_mb=3 adds 3 MiB to the host tier moepipe (and the simulator) plan; the device
    pool and the disk tier stay."""
    base = pe.run_spec(_opts(mixtral_tiny))[1].memory_bytes
    got = pe.run_spec(_opts(mixtral_tiny, host_room_mb=3))[1].memory_bytes
    assert got[Tier.CPU] == base[Tier.CPU] + 3 * MiB
    assert (got[Tier.GPU], got[Tier.DISK]) == (base[Tier.GPU], base[Tier.DISK])


class FakeCgroup:
    def remove(self) -> None:
        pass


def fake_children(monkeypatch, budget_peak_below_limit: int) -> list[tuple[str, dict, Any]]:
    """Children faked: the probe peaks at PROBE, moepipe's run at the budget tiers at the
    limit less `budget_peak_below_limit` bytes (the room is that less the margin); each
    moepipe child reports the n and RunSpec it would plan from its options. Returns the calls:
    (role, options, the moepipe child's RunSpec or None)."""
    calls: list[tuple[str, dict, Any]] = []
    monkeypatch.setattr(bm.MemoryCgroup, "create", classmethod(lambda cls, *_: FakeCgroup()))

    def run_side(role, opts, limit, **extra):
        if role == "probe":
            calls.append((role, opts, None))
            return {}, PROBE, ""
        if role == "accelerate":
            calls.append((role, {**opts, **extra}, None))
            return {"tok_s": 5.0, "seconds": 2.0, "peak_rss_bytes": MiB}, limit, ""
        spec = resolve_n_batches(pe.run_spec(opts)[0])
        calls.append((role, opts, spec))
        n = spec.workload.n_batches
        got = {
            "tok_s": 10.0 + opts["host_room_mb"],
            "seconds": 1.0,
            "n_batches": n,
            "dag_efficiency": 0.9,
            "tokens": spec.workload.tokens_generated,
            "n_plan": {"n": n, "n_auto": True, "binding": "fake", "inequalities_hold": True},
            "peak_rss_bytes": MiB,
        }
        peak = limit - budget_peak_below_limit if opts["host_room_mb"] == 0 else limit - MiB
        return got, peak, ""

    monkeypatch.setattr(pe, "run_side", run_side)
    return calls


def test_bench_real_simulates_the_tiers_its_moepipe_child_runs(tmp_path, monkeypatch, capsys):
    """bench_real (room=cgroup, the default): moepipe first at the budget tiers, then with the
    host room (the limit less that run's peak less the 64 MiB margin: 5 MiB here) at the same
    n; the simulator's prediction plans exactly the RunSpec of that second child (same host
    tier, device pool, n and params), and the n line says how the planner set n."""
    import experiments.common.pipeline as pipeline

    calls = fake_children(monkeypatch, 64 * MiB + 5 * MiB + 123)
    simulated = []
    real_simulate = pipeline.simulate_run
    monkeypatch.setattr(
        pipeline, "simulate_run", lambda spec: simulated.append(spec) or real_simulate(spec)
    )
    argv = [*TINY, "budget_gb=0.008", f"out_dir={tmp_path}", "n=0"]
    assert bench_real.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    roles = [(role, opts["host_room_mb"]) for role, opts, _ in calls]
    # (the accelerate child ignores host_room_mb: test_accelerates_max_memory_is_the_budget...)
    assert roles == [("probe", 0), ("moepipe", 0), ("moepipe", 5), ("accelerate", 5)]
    budget_run, room_run = calls[1][2], calls[2][2]
    (sim,) = simulated
    assert sim.hardware.memory_bytes == room_run.hardware.memory_bytes
    assert room_run.hardware.memory_bytes[Tier.CPU] == (
        budget_run.hardware.memory_bytes[Tier.CPU] + 5 * MiB
    )
    n = budget_run.workload.n_batches
    assert (sim.workload, sim.params) == (room_run.workload, room_run.params)
    assert sim.workload.n_batches == n and sim.params["n"] == n
    assert any(ln.startswith(f"klotski n={n}: its n-planner's choice") for ln in out)
    assert any(
        ln.startswith("room=cgroup: moepipe's tiers: ") and "+ 5 MB of host room" in ln
        for ln in out
    )
    names = [ln[:40].strip() for ln in out if ln.startswith("moepipe klotski")]
    assert names == [
        f"moepipe klotski (n={n}), host +5 MB",
        f"moepipe klotski (n={n}), budget tiers",
    ]


def test_accelerates_max_memory_is_the_budget_whatever_moepipes_room(mixtral_tiny, monkeypatch):
    """The accelerate child gets the options moepipe's got (host_room_mb included), and still
    asks for the budget's device and host bytes: its page cache takes the cgroup's room."""
    asked = []
    monkeypatch.setattr(
        pe, "run_accelerate", lambda _, dev, host, *a: asked.append((dev, host)) or 1.0
    )
    opts = _opts(mixtral_tiny, n_batches=1, batch_size=1, prompt_len=2, gen_len=1, acc_batch=1)
    hw = pe.run_spec(opts)[1]
    pe.child("accelerate", {**opts, "host_room_mb": 50})
    assert asked == [(hw.memory_bytes[Tier.GPU], hw.memory_bytes[Tier.CPU])]


@pytest.mark.parametrize(
    ("room", "below_limit", "roles", "rows", "ratio"),
    [
        # room, but its run at the budget tiers left less than the margin: that run is the row
        ("cgroup", 10 * MiB, ["probe", "moepipe", "accelerate"], ["moepipe klotski (n=2)"], 2.0),
        ("tiers", 500 * MiB, ["probe", "moepipe", "accelerate"], ["moepipe klotski (n=2)"], 2.0),
        (
            "cgroup",
            64 * MiB + 2 * MiB,
            ["probe", "moepipe", "moepipe", "accelerate"],
            ["moepipe klotski (n=2), host +2 MB", "moepipe klotski (n=2), budget tiers"],
            12 / 5,  # the fake's tok/s: 10 + host_room_mb, accelerate's 5
        ),
    ],
)
def test_which_moepipe_runs_each_room_starts(
    mixtral_tiny, monkeypatch, capsys, room, below_limit, roles, rows, ratio
):
    """bench_accelerate: with room=tiers, or no room left, moepipe runs once at the budget
    tiers; with room, twice, and the run with room is the first row (the ratio's)."""
    calls = fake_children(monkeypatch, below_limit)
    argv = [f"checkpoint={mixtral_tiny}", "hardware=tiny", "n_batches=2", "batch_size=4"]
    argv += [f"room={room}", "gen_len=2", "prompt_len=4", "repeats=1"]
    assert bench_accelerate.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [role for role, _, _ in calls] == [*roles, "accelerate"]  # + batch by batch
    assert [ln[:40].strip() for ln in out if ln.startswith("moepipe klotski")] == rows
    assert out[-1].startswith(f"moepipe / best peer: {ratio:.2f}x")
    tiers = next(ln for ln in out if ln.startswith("room="))
    assert tiers.startswith(f"room={room}: moepipe's tiers: ")
    limit = next(ln for ln in out if ln.startswith("each side in a memory cgroup of "))
    assert f"+ runtime allowance {PROBE / 1e6:.0f}" in limit


@pytest.mark.parametrize("room", ["cgroup", "tiers"])
def test_each_row_is_the_median_of_its_repeats(mixtral_tiny, monkeypatch, capsys, room):
    """repeats=3: every system runs 3 times (moepipe's run at the budget tiers, where no room is
    left, counted as its first), each row is its runs' median (the fake's seconds 3, 1, 2 for
    each system in turn: 2) and shows their tok/s from slowest to fastest."""
    calls = fake_children(monkeypatch, 10 * MiB)
    seconds = iter([3.0, 1.0, 2.0] * 4)
    faked = pe.run_side

    def run_side(role, opts, limit, **extra):
        got, peak, why = faked(role, opts, limit, **extra)
        if role != "probe":
            s = next(seconds)
            got = {**got, "seconds": s, "tok_s": 12.0 / s}
        return got, peak, why

    monkeypatch.setattr(pe, "run_side", run_side)
    argv = [f"checkpoint={mixtral_tiny}", "hardware=tiny", "n_batches=2", "batch_size=4"]
    argv += [f"room={room}", "gen_len=2", "prompt_len=4", "repeats=3"]
    assert bench_accelerate.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert [role for role, _, _ in calls] == ["probe"] + ["moepipe"] * 3 + ["accelerate"] * 6
    table = out[next(i for i, ln in enumerate(out) if ln.startswith("system ")) + 1 : -1]
    assert len(table) == 3
    for ln in table:
        assert ln[40:].split()[1:3] == ["6.00", "2.00"]  # tok/s, seconds: the median run's
        assert ln.endswith("3 runs 4.00-12.00")
    assert out[-1] == "moepipe / best peer: 1.00x (accelerate, 1 generate call)"


@pytest.mark.parametrize(
    ("bench", "arg", "first_words"),
    [
        ("accelerate", "room=page", "error: room='page' unknown; valid: cgroup, tiers"),
        (
            "accelerate",
            "room_margin_mb=-1",
            "error: room_margin_mb=-1: must be an integer in [0, 1048576]",
        ),
        ("accelerate", "host_room_mb=x", "error: host_room_mb=x: must be an integer"),
        ("real", "room=page", "error: room='page' unknown; valid: cgroup, tiers"),
    ],
)
def test_a_bad_room_option_is_one_line(tmp_path, capsys, bench, arg, first_words):
    if bench == "accelerate":
        rc = bench_accelerate.main([f"checkpoint={tmp_path}/none", arg])
    else:
        rc = bench_real.main([*TINY, "budget_gb=0.008", f"out_dir={tmp_path}", arg])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(first_words), err
    assert not any(tmp_path.iterdir())


TINY = ["model=mixtral-tiny", "hardware=tiny", "gen_len=2", "batch_size=2", "prompt_len=4"]
