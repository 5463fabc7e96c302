"""Round 14a of issue 48's probe: classes the earlier rounds found and left, each fixed as a
class. Ctrl-backslash (SIGQUIT) stops every command as SIGTERM does (the sweep's and the
distributed run's cases: test_probe_interrupts.py, test_probe_signals.py); executor.dtype in
every command that runs a checkpoint; a tensor-parallel GPU's dense bytes as the real shards
hold them; a key given twice read as the format's owner reads it; a taken MASTER_PORT and the
open-file limit named in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from experiments import TERMINAL_SIGNALS
from experiments.common.dist_run import _as_rank, _spawn
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run
from tests.probes.test_probe_signals import (
    LONG,
    _finished,
    _start,
    _stop_when,
    _whole_and_the_next_run_proceeds,
    stop_line,
)

# --- SIGQUIT (Ctrl-backslash): its default action dumped core, exit 131 and no line ---


def test_sigquit_stops_a_run_as_sigterm_does(tmp_path: Path, cli_here: Any) -> None:
    """Ctrl-backslash (SIGQUIT to the terminal's group) while a run computes: it ended by the
    signal's default action (status -3, a shell's 131) with no line. Now one line naming the
    signal, exit 131, the earlier result whole and the next run into the dir proceeds."""
    run = tmp_path / "run"
    before = _finished(run, cli_here)
    p = _start(run, *LONG)
    code, err = _stop_when(p, run, "computing", signal.SIGQUIT)
    assert code == 131, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err
    assert "did not finish" in stop_line(err, signal.SIGQUIT)
    _whole_and_the_next_run_proceeds(run, before, cli_here)


def test_sigquit_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """SIGQUIT while Python still imports torch and hydra (or, once imports got faster, a
    moment after, as the Ctrl-C and SIGTERM cases allow): one line, exit 131, nothing
    written."""
    run = tmp_path / "run"
    p = _start(run, *LONG)
    time.sleep(0.3)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGQUIT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 131, err
    assert len(err.splitlines()) == 1, err
    stop_line(err, signal.SIGQUIT)
    assert not (run / "summary.json").exists()


def _ignored(rank: int, world: int, init: str, tmp: Path) -> None:
    """A rank that says which of the terminal's signals it ignores."""
    _as_rank(rank, tmp, lambda: [signal.getsignal(s) == signal.SIG_IGN for s in TERMINAL_SIGNALS])


def test_a_rank_leaves_sigquit_to_the_command() -> None:
    """A spawned rank (and the server it forks from) left SIGQUIT at its default: Ctrl-backslash
    dumped each rank's core beside the command's line. It ignores it as it does Ctrl-C."""
    assert _spawn(1, _ignored, ()) == [True, True, True]


# --- executor.dtype in every command that runs a checkpoint ---


@pytest.fixture(scope="module")
def f16_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_ckpt` saved in float16 (its weights cast, config.json's torch_dtype float16)."""
    import torch
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("f16") / "ck"
    shutil.copytree(tiny_ckpt, d)
    for f in d.glob("*.safetensors"):
        weights = {k: v.to(torch.float16) for k, v in load_file(f).items()}
        save_file(weights, f, metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float16"}))
    return d


# each command that runs a checkpoint, with the options that keep it small
DTYPE_COMMANDS = {
    "experiments.run": ["executor=real", *TINY[1:]],
    "experiments.validate": ["hardware=tiny", "planners=[flexgen]", "repeats=1", "n_batches=1"],
    "experiments.validate_lanes": ["hardware=tiny", "planners=[ep_static]", "lanes=2"],
    "experiments.calibrate": ["hardware.name=probe14a"],
    "experiments.bench.accelerate": ["hardware=tiny"],
}


def _dtype_args(module: str, ckpt: Path, out: Path) -> list[str]:
    """`module`'s small arguments on `ckpt`, writing into `out` (bench.accelerate writes no
    file)."""
    where = {"experiments.bench.accelerate": [], "experiments.run": [f"hydra.run.dir={out}"]}
    where = where.get(module, [f"out={out}"])
    return [f"checkpoint={ckpt}", *where, *DTYPE_COMMANDS[module]]


@pytest.mark.parametrize("module", DTYPE_COMMANDS)
@pytest.mark.parametrize("value", ["int8", "fp8", "Auto", "''"])
def test_every_checkpoint_command_refuses_a_bad_dtype_as_run_does(
    module: str, value: str, f16_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """validate, validate_lanes, calibrate and bench.accelerate had no executor.dtype: a key
    they do not know. Each takes it now and refuses what experiments.run refuses, in its
    words, before it runs or writes anything."""
    out = tmp_path / ("out.yaml" if module == "experiments.calibrate" else "out")
    r = cli_here(module, *_dtype_args(module, f16_ckpt, out), f"executor.dtype={value}")
    if module == "experiments.run":  # an empty value was run as auto
        assert not (out / "summary.json").exists()
    if value == "''":  # the commands' line for an empty value, or the dtype's
        one_line(r, "executor.dtype='':")
    else:
        one_line(r, f"executor.dtype={value}: not a compute dtype", "float32, bfloat16, float16")
    assert not out.exists()


def test_validate_runs_float16_weights_in_the_asked_dtype(
    f16_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """experiments.validate with executor.dtype runs float16 weights in that dtype: float32's
    device pool holds twice bfloat16's bytes, in the real run and the simulated one alike, and
    auto runs them in float16, bfloat16's bytes (it refused them, naming an option validate
    did not have)."""
    peaks = {}
    for dtype in ("float32", "bfloat16", "auto"):
        out = tmp_path / dtype
        args = ["hardware=tiny", "planners=[flexgen]", "repeats=1", "n_batches=1"]
        args += ["batch_size=1", "gen_len=2", "prompt_len=4", "links=calibrated", "gpu_frac=2"]
        args += [f"checkpoint={f16_ckpt}", f"out={out}", f"executor.dtype={dtype}"]
        r = cli_here("experiments.validate", *args)
        assert r.returncode == 0, r.stderr
        for side in ("sim", "real"):
            summary = json.loads((out / "flexgen" / side / "summary.json").read_text())
            peaks[dtype, side] = summary["peak_bytes"]["gpu"]
    for side in ("sim", "real"):
        assert peaks["float32", side] == 2 * peaks["bfloat16", side], peaks
        assert peaks["auto", side] == peaks["bfloat16", side], peaks


def test_validate_lanes_and_the_benches_run_float16_weights_in_the_asked_dtype(
    f16_ckpt: Path, tmp_path: Path
) -> None:
    """validate_lanes' runs, bench.accelerate's moepipe side and calibrate's store and
    overhead timings read float16 weights in the asked dtype (they refused them)."""
    import torch

    from experiments.common.peers import run_spec
    from experiments.validate_lanes import report
    from real.calibration import measure_op_overhead, measure_store

    opts = dict(
        checkpoint=str(f16_ckpt), hardware="tiny", gpu_frac=0.6, cpu_frac=0.15, planner="klotski"
    )
    sizes = dict(batch_size=1, n_batches=1, prompt_len=4, gen_len=2)
    spec, _ = run_spec({**opts, **sizes, "executor.dtype": "float32"})
    assert spec.model.dtype_bytes == 4
    cpu = torch.device("cpu")
    assert measure_store(str(f16_ckpt), cpu, budget_s=0.0, dtype="bfloat16")["disk"]
    assert measure_op_overhead(str(f16_ckpt), cpu, n_ops=4, dtype="float32") >= 0
    lanes = dict(checkpoint=str(f16_ckpt), hardware="tiny", planners="ep_static", lanes=2)
    lanes |= dict(replica_slots=1, repeats=1, device="cpu", out=str(tmp_path / "l"))
    lines = report({**lanes, **sizes, "executor.dtype": "bfloat16"})
    assert lines[-1].startswith("wrote ")


# --- dense_share: a tensor-parallel GPU's dense bytes, as the real shards hold them ---

SMALL = dict(hidden_size=64, expert_ffn_size=32, vocab_size=130, n_layers=2)
MOE = dict(n_experts=4, top_k=2)
BIASED = {
    "mixtral-gqa": ("mixtral-tiny", dict(n_heads=4, n_kv_heads=2)),
    "olmoe-attention_bias": ("olmoe-1b-7b", dict(n_heads=8, n_kv_heads=8, attention_bias=True)),
    "qwen3-attention_bias": (  # QK-norm of one head, whole on every GPU
        "qwen3-30b-a3b",
        dict(n_heads=4, n_kv_heads=2, head_dim=32, attention_bias=True),
    ),
    "deepseek-attention_bias-mlp_bias": (
        "deepseek-v2-lite",
        dict(n_heads=4, n_kv_heads=4, attention_bias=True, mlp_bias=True),
    ),
    "deepseek-v3-q_lora_rank": (  # and its router's correction bias, whole on every GPU
        "deepseek-v3",
        dict(n_heads=4, n_kv_heads=4, attention_bias=True, q_lora_rank=16),
    ),
    "deepseek-q_lora_rank": (
        "deepseek-v2-lite",
        dict(n_heads=4, n_kv_heads=4, attention_bias=True, q_lora_rank=16),
    ),
}


def _shard_bytes(spec: Any, units: dict[Any, dict[str, Any]], gpus: int, d: int) -> int:
    """Bytes of the dense weights device d of `gpus` holds in a tensor-parallel run: each unit
    cut as real.tensor_parallel.TensorParallel.shard_of cuts it."""
    from core.shards import shard
    from core.types import Tensor
    from real.model import ffn_shard, head_shard, vocab_shard

    total = 0
    for u, w in units.items():
        if u.kind == Tensor.EXPERT:
            continue
        if u.kind == Tensor.ATTENTION:
            w = head_shard(spec, dict(w), shard(spec.n_heads, gpus, d))
        elif u.kind == Tensor.HEAD:
            w = vocab_shard(dict(w), shard(spec.vocab_size, gpus, d))
        elif u.kind == Tensor.FFN:
            width = (w["wi"] if "wi" in w else w["w1"]).shape[0]
            w = ffn_shard(dict(w), shard(width, gpus, d))
        total += sum(t.numel() * t.element_size() for t in w.values())
    return total


@pytest.mark.parametrize("case", BIASED)
def test_dense_share_is_each_gpus_tensor_parallel_shard_bytes(case: str, tmp_path: Path) -> None:
    """The planner counted a tensor-parallel GPU's dense bytes as 1/G of every attention and
    FFN parameter: the o and down-projection biases (OLMoE's and DeepSeek-V2's attention_bias,
    DeepSeek's mlp_bias), which GPU 0 alone holds, were split over the GPUs, and the norms and
    MLA's q_a projection, which every GPU holds whole, too. It now equals, byte for byte, what
    each of 2, 3 and 4 GPUs holds of a real checkpoint's shards (3: uneven shards)."""
    from functools import partial
    from types import SimpleNamespace

    from planners.common import Emitter
    from planners.ep.dense import dense_share
    from real.checkpoint import load_units, reduced_spec
    from real.checkpoint_write import write_checkpoint

    model, fields = BIASED[case]
    spec = reduced_spec(model, **SMALL, **({} if model == "mixtral-tiny" else MOE), **fields)
    spec, units = load_units(write_checkpoint(spec, tmp_path / "ck", seed=0))
    counts = partial(Emitter._tensor_bytes, SimpleNamespace(model=spec))  # the count, uncached
    runner: Any = SimpleNamespace(ctx=SimpleNamespace(model=spec), em=SimpleNamespace())
    runner.em.tensor_bytes = counts
    for gpus in (2, 3, 4):
        held = [_shard_bytes(spec, units, gpus, d) for d in range(gpus)]
        assert [dense_share(runner, gpus, d) for d in range(gpus)] == held, gpus
        assert held[0] == max(held)


# --- a key given twice: each format's owner decides ---


def _repeat(ckpt: Path, tmp_path: Path, key: str, entry: Any) -> Path:
    """A copy of `ckpt` whose safetensors header gives `key` again, last, as `entry`."""
    from real.checkpoint import SINGLE_FILE

    d = tmp_path / "ck"
    shutil.copytree(ckpt, d)
    f = d / SINGLE_FILE
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    body = raw[8 : 8 + n].decode().rstrip()[:-1] + f", {json.dumps(key)}: {json.dumps(entry)}}}"
    f.write_bytes(len(body.encode()).to_bytes(8, "little") + body.encode() + raw[8 + n :])
    return d


def _header(ckpt: Path) -> dict[str, Any]:
    from real.checkpoint import SINGLE_FILE

    raw = (ckpt / SINGLE_FILE).read_bytes()
    return json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])


def test_a_tensor_named_twice_in_a_header_is_read_as_safetensors_reads_it(
    tiny_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A header naming a tensor twice was refused. safetensors (its format's owner) keeps the
    last entry and loads the file where that entry tiles the data: moepipe does the same,
    saying so in one line, and its weights are the library's."""
    from safetensors.torch import load_file

    from real.checkpoint import SINGLE_FILE, load_checkpoint
    from real.shards import read_tensor

    name = min(k for k in _header(tiny_ckpt) if k != "__metadata__")
    d = _repeat(tiny_ckpt, tmp_path, name, _header(tiny_ckpt)[name])
    with caplog.at_level("WARNING"):
        _, index = load_checkpoint(d)
    said = [r.getMessage() for r in caplog.records if "twice" in r.getMessage()]
    assert said == [
        f"{d / SINGLE_FILE}: safetensors header names tensor {name} twice (1 such); "
        "safetensors takes the last entry, and so does moepipe: rewrite the file with one"
    ]
    assert read_tensor(index[name]).equal(load_file(d / SINGLE_FILE)[name])


@pytest.mark.parametrize("case", ["an entry the last one leaves a gap of", "__metadata__"])
def test_what_safetensors_refuses_given_twice_is_refused_in_one_line(
    case: str, tiny_ckpt: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tensor's first entry whose bytes the last one leaves uncovered, or __metadata__
    given twice: safetensors refuses both ("invalid offset", "duplicate field"), and so does
    moepipe, in one line and no note before it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from real.checkpoint import SINGLE_FILE, load_checkpoint

    h = _header(tiny_ckpt)
    name = max(k for k in h if k != "__metadata__")  # the last tensor's bytes, at the end
    key, entry = ("__metadata__", {"format": "np"}) if case == "__metadata__" else (name, h[name])
    if case != "__metadata__":
        start = entry["data_offsets"][0]
        entry = {**entry, "shape": [0], "data_offsets": [start, start]}  # its bytes: a gap
    d = _repeat(tiny_ckpt, tmp_path, key, entry)
    with pytest.raises(SafetensorError):
        load_file(d / SINGLE_FILE)
    with caplog.at_level("WARNING"):
        raises_one_line(lambda: load_checkpoint(d), str(d / SINGLE_FILE))
    assert not [r for r in caplog.records if "twice" in r.getMessage()]


# --- a distributed run's port and file descriptors ---


def test_a_hand_started_ranks_port_in_use_is_one_line_naming_it(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """Rank 0 of ranks started by hand (RANK, WORLD_SIZE set) whose MASTER_PORT another
    process holds: torch's EADDRINUSE came as "the process group did not form within
    executor.rendezvous_timeout_s", a timeout that never ran. Now the port and the fix."""
    import socket

    from tests.conftest import user_env
    from tests.probes.conftest import real_run

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = user_env() | dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
        env |= dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        args = ["executor.distributed=true", "hardware=h200-hgx8", "planner=eplb"]
        r = real_run(tiny_ckpt, tmp_path / "run", *args, "+planner.params.n_devices=2", env=env)
    line = one_line(r, f"rank 0: MASTER_PORT={port} is in use", "--standalone")
    assert "did not form" not in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("unset", ["MASTER_ADDR", "MASTER_PORT"])
def test_a_hand_started_rank_without_the_masters_address_says_which(
    unset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's own refusal of env:// without MASTER_ADDR or MASTER_PORT, at once, was told as
    a rendezvous timeout; now it names the variable and the ways to start ranks."""
    import torch.distributed as dist

    from experiments.common.launch_line import refused_at_once

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.delenv(unset)
    with pytest.raises(ValueError) as info:  # noqa: PT011 (torch's type)
        dist.init_process_group("gloo", init_method="env://", rank=0, world_size=2)
    said = refused_at_once(0, str(info.value).splitlines()[0])
    assert said is not None and f"{unset} is not" in str(said), info.value
    assert "unset RANK and WORLD_SIZE" in str(said)


# 14 and 20 start two ranks each before they fail: the slow suite
@pytest.mark.parametrize(
    "limit",
    [10, pytest.param(14, marks=pytest.mark.slow), pytest.param(20, marks=pytest.mark.slow)],
)
def test_a_distributed_run_out_of_file_descriptors_names_the_limit(
    limit: int, tiny_ckpt: Path, tmp_path: Path
) -> None:
    """`ulimit -n` too low for the ranks: "Too many open files; check the file and the disk"
    named neither the limit nor a file; at 14 the ranks' server printed its traceback above
    the line that it died; at 20, where the ranks start and lose each other, the line named
    `ulimit -n` but not its value. Now one line naming the limit's value and the fix."""
    import resource

    from tests.probes.conftest import real_run

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

    args = ["executor.distributed=true", "hardware=h200-hgx8", "planner=eplb"]
    run = tmp_path / "run"
    r = real_run(tiny_ckpt, run, *args, "+planner.params.n_devices=2", preexec_fn=low)
    one_line(r, f"ulimit -n {limit}", "run it again")
    assert not run.exists()


def test_an_oserror_out_of_descriptors_names_the_limit() -> None:
    """EMFILE anywhere (a file, a pipe): the limit's value and how to raise it, not 'check the
    file and the disk'."""
    import errno

    from core.files import ulimits
    from experiments.common.cli import error_line

    line = error_line(OSError(errno.EMFILE, "Too many open files"))
    assert line is not None and ulimits("n") in line and "ulimit -n 4096" in line, line


# --- the probe's further cases (real execution, distributed) ---


@pytest.mark.parametrize(
    "value, said",
    [("null", "executor.routing_mode=null; valid"), ("LIVE", "did you mean 'live'?")],
)
def test_a_routing_mode_of_null_or_another_case_is_named_as_given(
    value: str, said: str, tiny_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """executor.routing_mode=null was refused as "executor.routing_mode='None'", a string
    the user never typed; LIVE got no nearest name."""
    run = tmp_path / "run"
    args = ["executor=real", f"checkpoint={tiny_ckpt}", *TINY[1:], f"hydra.run.dir={run}"]
    r = cli_here("experiments.run", *args, f"executor.routing_mode={value}")
    one_line(r, said, "valid: replay, live")
    assert not run.exists()


def test_a_simulated_run_refuses_a_compute_dtype(tmp_path: Path, cli_here: Any) -> None:
    """executor.dtype=bfloat16 with executor=sim ran and wrote a result in the model's own
    dtype_bytes, the option unread, where executor.device and executor.distributed are
    refused there."""
    run = tmp_path / "run"
    r = cli_here("experiments.run", *TINY, "executor.dtype=bfloat16", f"hydra.run.dir={run}")
    one_line(r, "executor.dtype=bfloat16", "model.dtype_bytes", "executor=real")
    assert not run.exists()


@pytest.mark.parametrize("world", ["0", "-2"])
def test_a_launch_of_no_process_is_refused(world: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RANK=0 WORLD_SIZE=0 (or below) ran as if unset: a distributed run started its own
    ranks, the variables unread. They are a launcher's, and malformed: one line."""
    from experiments.common.launch_line import launched

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    raises_one_line(launched, f"WORLD_SIZE={world}", "unset RANK and WORLD_SIZE")


def test_n_devices_left_at_0_is_named_as_the_hardwares_gpus(
    tiny_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """planner.params.n_devices=0 (hardware.n_gpus, 8 here) on a 2-core machine was refused as
    "planner.params.n_devices=8", a value the user never set."""
    run = tmp_path / "run"
    args = ["executor=real", "executor.distributed=true", f"checkpoint={tiny_ckpt}"]
    args += ["hardware=h200-hgx8", "workload=tiny", "planner=eplb", f"hydra.run.dir={run}"]
    r = cli_here("experiments.run", *args, "+planner.params.n_devices=0")
    one_line(r, "planner.params.n_devices=0 (hardware.n_gpus: 8 devices)", "set n_devices lower")
    assert not run.exists()


def test_a_small_checkpoint_on_a_fuller_disk_names_both_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny checkpoint (3.9 MB) on a disk with 0.3 MB free (a small tmpfs) was refused as
    "the checkpoint is 0.0 GB and the disk there has 0.0 GB free": sizes to one decimal of a
    GB, equal and no reason. Both now to three figures."""
    import shutil as sh
    from collections import namedtuple

    from experiments.make_checkpoint import check_room
    from real.checkpoint import reduced_spec

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sh, "disk_usage", lambda _: usage(300_000, 0, 300_000))
    spec = reduced_spec("mixtral-tiny")
    line = raises_one_line(lambda: check_room(spec, tmp_path / "ck"), "0.0003 GB free")
    assert f"{spec.total_bytes / 1e9:.3g} GB" in line and "0.0 GB" not in line


def test_make_checkpoint_refuses_a_runs_folder(tmp_path: Path, cli_here: Any) -> None:
    """make_checkpoint into a finished run's folder wrote config.json and the weights beside
    its summary.json and trace: one folder both a run and a checkpoint, where a run into a
    checkpoint's folder is refused. Refused alike now, the run's files as they were."""
    run = tiny_run(tmp_path / "run")
    before = sorted(p.name for p in run.iterdir())
    r = cli_here("experiments.make_checkpoint", "model=mixtral-tiny", f"out={run}")
    one_line(r, f"out={run}: a run's folder", "pass out= another folder")
    assert sorted(p.name for p in run.iterdir()) == before


def test_a_dotted_key_the_command_takes_itself_is_named(tmp_path: Path, cli_here: Any) -> None:
    """make_checkpoint model=mixtral-tiny model.n_layers=2 (a run's way to resize) was told
    "pass model=VALUE", which cannot resize; make_checkpoint takes n_layers= itself. (A key
    the command lacks is still told to pass model=VALUE.)"""
    args = ["model=mixtral-tiny", f"out={tmp_path / 'ck'}", "model.n_layers=2"]
    one_line(cli_here("experiments.make_checkpoint", *args), "pass n_layers=VALUE")
    assert not (tmp_path / "ck").exists()
    args[-1] = "model.nosuch=2"
    one_line(cli_here("experiments.make_checkpoint", *args), "pass model=VALUE")
