"""The real-scale benchmark end to end on a tiny model (checkpoint written, moepipe, the
simulator, the bound, accelerate), and its refusals: a budget below one layer's working set and
a disk without room are one line each, exit 2, nothing written."""

from __future__ import annotations

import errno
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


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_end_to_end_on_a_tiny_model(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    # room=tiers: the disk tier stays active (room=cgroup would give moepipe's host tier room
    # for this whole tiny model; tests/real/test_bench_room.py covers it)
    # peer_limit=0: accelerate's row runs to the end (the limit's stop has its own tests), so
    # its tok/s is a number on a model where moepipe takes a few tens of milliseconds
    argv = [*TINY, "budget_gb=0.008", f"out_dir={tmp_path}", "room=tiers", "peer_limit=0"]
    assert bench_real.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("mixtral-tiny: ") and "disk footprint 1.00" in out[0]
    rows = {
        ln[:40].strip(): ln[40:].split()
        for ln in out
        if ln.startswith(("moepipe k", "accelerate,", "simulator ("))
    }
    # Klotski runs at its n-planner's n, which the bench states, and accelerate gets every
    # sequence of that group in one generate call
    n_line = next(ln for ln in out if ln.startswith("klotski n="))
    n = int(n_line.split("=")[1].split(":")[0])
    assert "its n-planner's choice" in n_line and n > 1
    assert set(rows) == {
        f"moepipe klotski (n={n})",
        "accelerate, 1 generate call",
        "simulator (same schedule)",
    }
    assert int(rows["accelerate, 1 generate call"][0]) == 2 * n  # batch_size 2
    assert next(ln for ln in out if ln.startswith("routing: ")).startswith("routing: synthetic")
    ours, peer = (
        float(rows[f"moepipe klotski (n={n})"][1]),
        float(rows["accelerate, 1 generate call"][1]),
    )
    bound = next(ln for ln in out if ln.strip().startswith("max "))
    bound_s = float(bound.split()[1])
    assert bound_s > 0 and "(disk)" in bound  # disk binds: 43% of the model is read per pass
    i = out.index("physical bound of Klotski's schedule, per resource:")
    per = {ln[:16].strip(): float(ln[16:].split()[0]) for ln in out[i + 1 : out.index(bound)]}
    assert {"disk", "h2d", "gpu compute", "gpu kernels"} <= set(per)
    assert bound_s == max(per.values())  # the kernel line counts toward the bound
    # the peer's time against the same bound: is the resource, or moepipe, what is slow?
    peer_s = rows["accelerate, 1 generate call"][2]
    peer_line = next(ln for ln in out if ln.startswith("best peer / physical bound: "))
    assert peer_line.endswith(f"x (accelerate, 1 generate call, {peer_s} s)")
    assert printed_ratio(peer_line) == ratio_of_printed(float(peer_s), bound_s)
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


def test_a_budget_klotskis_plan_does_not_fit_is_one_line(tmp_path, capsys):
    """A budget above one layer's top-k working set but below what Klotski's placement needs
    (a whole layer's experts in transfer, the dense weights, the activations): one line naming
    budget_gb, exit 2, before any checkpoint is written."""
    assert bench_real.main([*TINY, "budget_gb=0.004", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: budget_gb=0.004: Klotski's plan does not")
    assert not any(tmp_path.iterdir())


def test_a_disk_without_room_is_one_line(tmp_path, capsys, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(1 << 30, (1 << 30) - 4096, 4096))
    assert bench_real.main([*TINY, "budget_gb=0.008", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # sizes to three figures (a small disk's free space read 0.0 GB)
    assert err[-1].startswith(f"error: out_dir={tmp_path}: 4.1e-06 GB free, writing the checkpoint")
    assert not any(tmp_path.iterdir())


def test_a_disk_that_fills_while_writing_is_one_line(tmp_path, capsys, monkeypatch):
    """The disk had room when the bench looked, and filled while it wrote (another process):
    one line naming out_dir, exit 2, and the partial checkpoint removed."""
    real_write = bench_real._write

    def write_then_fill(spec, out):
        real_write(spec, out)  # the shards are there: the error comes after a real write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench_real, "_write", write_then_fill)
    assert bench_real.main([*TINY, "budget_gb=0.008", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: out_dir={tmp_path}: the disk filled up while")
    assert not any(tmp_path.iterdir())


def test_routing_trace_replays_esft_into_the_moepipe_side(tmp_path):
    """A DeepSeek-V2-Lite of the trace's shape (26 MoE layers, 64 experts, top-6) with tiny
    tensors: with routing=trace the bench's moepipe side plans and runs on the ESFT routing
    (its tokens' experts at trace layer i = model layer i + 1), and routing=auto picks it."""
    from core.routing import load_routing
    from core.traces import trace_path
    from core.types import RoutingSource
    from experiments.common import peers as pe
    from real.checkpoint_write import write_checkpoint

    trace_dir = "/work/shared/traces"
    if not trace_path(trace_dir).is_file():
        pytest.skip("no ESFT trace at /work/shared/traces")
    spec = bench_real.reduced_spec(
        "deepseek-v2-lite",
        hidden_size=64,
        n_heads=4,
        expert_ffn_size=16,
        vocab_size=128,
        dense_ffn_size=48,
    )
    assert (len(spec.moe_layers), spec.n_experts, spec.top_k) == (26, 64, 6)
    ckpt = write_checkpoint(spec, tmp_path / "ds", seed=0)
    opts = {
        "checkpoint": str(ckpt),
        "hardware": "tiny",
        "planner": "klotski",
        "gpu_frac": 0.5,
        "cpu_frac": 0.2,
        "batch_size": 2,
        "n_batches": 1,
        "prompt_len": 4,
        "gen_len": 2,
        "klotski_n": 2,
        "trace_dir": trace_dir,
        "executor.dtype": "auto",
    }
    for routing in ("trace", "auto"):
        run, _ = pe.run_spec({**opts, "routing": routing})
        assert run.params == {"n": 2, "attn_batches": 0, "real_activations": True}
        got = load_routing(run.model, run.workload.with_(n_batches=2))
        assert got.description.startswith("trace esft-dsv2lite")
    synthetic, _ = pe.run_spec({**opts, "routing": "synthetic"})
    assert synthetic.workload.routing.source == RoutingSource.SYNTHETIC
    result = pe.child("moepipe", {**opts, "routing": "trace"})
    assert result["n_batches"] == 2 and result["tokens"] == 2 * 2 * 2 and result["seconds"] > 0


@pytest.mark.parametrize(
    ("arg", "first_words"),
    [
        ("routing=live", "error: routing='live' unknown; valid: auto, trace, synthetic"),
        ("n=-1", "error: n="),
        (
            "routing=trace",
            "error: routing=trace: the ESFT trace routes 26 MoE layers of 64 experts, top-6",
        ),
    ],
)
def test_bad_routing_or_n_is_one_line(tmp_path, capsys, arg, first_words):
    """routing=trace on a model of another shape (mixtral-tiny) is refused before anything is
    written, as are an unknown routing source and a negative n."""
    assert bench_real.main([*TINY, "budget_gb=0.008", f"out_dir={tmp_path}", arg]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(first_words), err
    assert not any(tmp_path.iterdir())


def test_linked_cut_reads_the_full_checkpoints_bytes(tmp_path):
    """The calibration's cut of a checkpoint: config.json of its first layers, shards that are
    links to the full checkpoint's (no second copy), and each tensor the same bytes."""
    from real.checkpoint import load_checkpoint
    from real.checkpoint_write import write_checkpoint
    from real.shards import read_tensor

    full = write_checkpoint(bench_real.reduced_spec("mixtral-tiny"), tmp_path / "full", seed=0)
    want = bench_real.reduced_spec("mixtral-tiny", n_layers=1)
    cut = bench_real.linked_cut(full, want, tmp_path / "cut")
    spec, index = load_checkpoint(cut)
    assert (
        spec.n_layers == 1
        and spec.total_bytes == want.total_bytes < load_checkpoint(full)[0].total_bytes
    )
    shards = [p for p in cut.iterdir() if p.suffix == ".safetensors"]
    assert shards and all(p.is_symlink() for p in shards)
    _, whole = load_checkpoint(full)
    assert all((read_tensor(e) == read_tensor(whole[n])).all() for n, e in index.items())
    assert bench_real.linked_cut(full, want, tmp_path / "cut") == cut  # replaced, not refused


def test_disk_tier_holds_at_least_the_model():
    """A profile calibrated on a nearly full disk records a small disk tier; the bench's hardware
    still has room for the model there, since the checkpoint is on that disk already."""
    from experiments.common.hardware import with_model_on_disk

    hw = {"memory_gb": {"gpu": 80, "cpu": 16, "disk": 1.5}, "name": "x"}
    got = with_model_on_disk(hw, 4_000_000_000, 0.5, 0.25)
    assert got["memory_gb"] == {"gpu": 2.0, "cpu": 1.0, "disk": 4.0}
    assert hw["memory_gb"]["disk"] == 1.5  # the profile itself untouched
    roomy = with_model_on_disk({"memory_gb": {"gpu": 1, "cpu": 1, "disk": 9.0}}, 4e9, 0.5, 0.25)
    assert roomy["memory_gb"]["disk"] == 9.0


def test_peers_none_prints_the_moepipe_row(tmp_path, capsys):
    """With no peer the table still holds moepipe's row, and no `best peer` line is printed."""
    argv = [*TINY, "budget_gb=0.008", f"out_dir={tmp_path}", "peers=none", "n=2"]
    assert bench_real.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    row = next(ln for ln in out if ln.startswith("moepipe klotski"))
    assert row.startswith("moepipe klotski (n=2) ") and float(row[40:].split()[1]) > 0
    assert any(ln.startswith("klotski n=2: set by hand") for ln in out)
    assert not any(ln.startswith("moepipe / best peer") for ln in out)
    assert out[-2].startswith("moepipe / physical bound: ")


def test_a_missing_profile_is_calibrated_on_a_linked_cut(tmp_path, monkeypatch):
    """hardware= naming no profile: calibrate runs (here recorded, not run) on a cut of the
    model's first calib_layers layers that links the bench's checkpoint."""
    calls, configs = [], []
    cut = tmp_path / ".calib-cut"

    def calibrate(cmd):
        calls.append(cmd)
        configs.append((cut / "config.json").read_text())  # the cut, as calibrate reads it
        return ""  # it succeeded

    monkeypatch.setattr(bench_real, "_run_child", calibrate)
    ckpt = bench_real.ensure_checkpoint(bench_real.reduced_spec("mixtral-tiny"), tmp_path / "m")
    opts = bench_real.BenchRealOptions(
        model="mixtral-tiny", budget_gb=0.008, hardware="no-such-profile", calib_layers=1
    )
    bench_real._calibrate_if_missing(opts, bench_real.reduced_spec("mixtral-tiny"), ckpt)
    (cmd,) = calls
    assert "hardware.name=no-such-profile" in cmd
    assert f"checkpoint={cut}" in cmd and '"num_hidden_layers": 1' in configs[0]
    assert not cut.exists()  # the profile is written: the cut goes
    calls.clear()
    bench_real._calibrate_if_missing(
        bench_real.BenchRealOptions(model="x", budget_gb=1, hardware="tiny"), None, ckpt
    )
    assert not calls  # a profile that exists is used as it is
