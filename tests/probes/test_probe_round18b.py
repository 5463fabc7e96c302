"""Probe round 18b (issue 48): the real, distributed and checkpoint commands.

`python -m experiments.torchrun`: two launches of one --rdzv_id at one --rdzv_endpoint ended the
second in an internal error (torch's RendezvousConnectionError once the first's store went);
it is one line naming the id and endpoint. A --rdzv_conf key the chosen backend does not read
(c10d's `timeout`, a typo of join_timeout, static's `rank`) and a TORCHELASTIC_SIGNALS_TO_HANDLE
name that is no signal were accepted without a word (torch logged the latter in the agent's
hidden log): each is one line before any rank starts. Two --standalone launches, and two of one
--master_port (the second's one line: round 16b), are as designed.

A checkpoint run in another dtype than it was saved in (executor.dtype=float32 on bfloat16
weights, bfloat16 on float32): the planners and the simulator counted an expert's disk read at
the compute dtype's bytes, the executor read the saved ones; each disk read is the saved bytes
now (`ModelSpec.disk_dtype_bytes`), as it was for FP8.

Switch in float16 under executor.distributed: transformers decides its clamp over the whole
batch; each rank decided over its own sequences and the split went unsaid. Each rank's flags
are gathered with its results and rank 0 warns as a single process does.

Found probing: under torchrun's 2 ranks a run that is not distributed ran whole on each rank
into one run dir (exit 0), and --run-path with -m failed in the rank unsaid: each is one line.
A SIGTERM to a bench's whole process group made its child calibrate say a second line. A full
disk's write that names no file (matplotlib, pandas) said no folder; validate_lanes wrote its
tables in place. A run on a nearly full disk failed after its result was in place, leaving
summary.json and a staging folder. calibrate replaced a profile it had measured, silently.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from core.types import Resource, Tensor
from experiments import torchrun
from real.checkpoint import load_checkpoint, reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.probes.conftest import raises_one_line

RUN = ["-m", "experiments.run", "executor=real"]


@pytest.fixture
def launcher_env(monkeypatch):
    """torchrun's agent log left as it is (LOGLEVEL set): the test process's logging kept."""
    monkeypatch.setenv("LOGLEVEL", "WARNING")


# --- 1. the torchrun launcher: keys and names nothing reads, two launches of one rendezvous ---


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--rdzv_conf=foo=1"], ["foo is no key", "static", "timeout"]),
        (["--rdzv_conf=rank=1"], ["rank is no key of the static"]),
        (["--standalone", "--rdzv_conf=timeout=60"], ["c10d", "did you mean 'join_timeout'"]),
        (
            ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:1", "--rdzv_conf=join_timout=5"],
            ["join_timout is no key", "did you mean 'join_timeout'"],
        ),
        (["--rdzv_backend=etcd", "--rdzv_conf=store_type=tcp"], ["etcd rendezvous", "cacert"]),
        (["--rdzv_backend=etcd-v2", "--rdzv_conf=cert=x"], ["cert is no key", "ssl_cert"]),
    ],
)
def test_a_rdzv_conf_key_the_backend_ignores_is_one_line(argv, names, launcher_env):
    raises_one_line(lambda: torchrun.main([*argv, *RUN]), "--rdzv_conf=", *names)


@pytest.mark.parametrize("names", ["SIGFOO", "SIGTERM,SIGFOO", "SIGTERM,", "SIGKILL", "SIG_DFL"])
def test_a_signal_to_handle_that_is_no_signal_is_one_line(names, launcher_env, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", names)
    raises_one_line(lambda: torchrun.main(RUN), f"TORCHELASTIC_SIGNALS_TO_HANDLE={names}")


@pytest.mark.parametrize(
    "error", ["RendezvousConnectionError", "RendezvousClosedError", "RendezvousTimeoutError"]
)
def test_a_failed_rendezvous_names_its_id_and_endpoint(error, launcher_env, monkeypatch):
    """A second launch of one --rdzv_id at one --rdzv_endpoint (the first's store gone with
    it): torch's RendezvousConnectionError was an internal error."""
    from torch.distributed.elastic.rendezvous import api

    def failed(args):
        raise getattr(api, error)("The connection to the C10d store has failed.")

    monkeypatch.setattr("torch.distributed.run.run", failed)
    argv = ["--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29533", "--rdzv_id=same", *RUN]
    raises_one_line(lambda: torchrun.main(argv), "--rdzv_id=same", "localhost:29533", "own")


def test_run_path_with_a_module_is_one_line(launcher_env):
    """--run-path with -m: torch's run_path of the module's name failed in the rank with a
    FileNotFoundError only the agent's hidden log held ("rank 0 ended ... without a line")."""
    raises_one_line(lambda: torchrun.main(["--run-path", *RUN]), "--run-path", "-m experiments.run")


@pytest.mark.parametrize(
    "args", [["executor=sim"], ["executor=real", "executor.distributed=false"]]
)
def test_a_run_each_rank_would_run_whole_is_one_line(args, tmp_path, monkeypatch, capsys):
    """Under torchrun's 2 ranks a run that is not distributed ran whole on each rank into one
    run dir (two log lines, the last rank's result kept), exit 0. Now the first rank says one
    line and neither runs."""
    from experiments import run
    from tests.probes.conftest import TINY, said_by_ranks_1_then_0

    out = tmp_path / "r"
    argv = [*TINY, *args, f"hydra.run.dir={out}"]
    said = said_by_ranks_1_then_0(lambda: sys.exit(run.main(argv)), tmp_path, monkeypatch, capsys)
    assert [code for code, _ in said] == [2, 2] and said[1][1] == "", said
    line = said[0][1].strip()
    assert "\n" not in line and "WORLD_SIZE" in line and "executor.distributed=true" in line
    assert not (out / "summary.json").exists()


# --- 2. disk bytes of a run in another dtype than the checkpoint's ---


@pytest.fixture(scope="module")
def saved_in(tmp_path_factory):
    """dtype_bytes -> a small mixtral checkpoint saved in that width (2: bfloat16)."""
    root = tmp_path_factory.mktemp("round18b-dtype")
    made: dict[int, Path] = {}

    def get(width: int) -> Path:
        if width not in made:
            shape = dict(hidden_size=64, n_heads=4, n_kv_heads=2, expert_ffn_size=32, n_layers=2)
            spec = reduced_spec("mixtral-tiny", vocab_size=128, dtype_bytes=width, **shape)
            made[width] = write_checkpoint(spec, root / f"w{width}", seed=0)
        return made[width]

    return get


@pytest.mark.parametrize(
    ("saved", "dtype", "gpu_gb"), [(2, "float32", 5e-4), (4, "bfloat16", 25e-5), (2, None, 25e-5)]
)
def test_disk_reads_count_the_bytes_the_checkpoint_holds(
    saved_in, saved, dtype, gpu_gb, monkeypatch
):
    """klotski streaming experts from disk: each disk read is the expert's bytes as saved (the
    tensors' safetensors byte ranges the store reads), each host->device copy the compute
    dtype's, and the run's disk bytes (validate's disk_bytes) what the store read. Before: a
    bfloat16 checkpoint run in float32 counted 4 bytes a weight on disk."""
    from experiments.common.pipeline import RunSpec
    from experiments.common.real_run import real_execute
    from real.store import TieredStore
    from tests.real.test_executor import WORKLOAD, hardware

    read = []
    real_read = TieredStore._read_into

    def counted(self, rec, buf):
        if rec.unit.kind == Tensor.EXPERT:
            held = rec.staged or rec.tensors  # the saved tensors the reads fill
            read.append(sum(torch.Size(s).numel() * d.itemsize for _, d, s, _ in held))
        return real_read(self, rec, buf)

    monkeypatch.setattr(TieredStore, "_read_into", counted)
    ckpt = saved_in(saved)
    model, index = load_checkpoint(ckpt, dtype)
    expert = model.expert_params
    assert model.expert_disk_bytes == expert * saved
    assert model.expert_bytes == expert * (4 if dtype == "float32" else 2)
    held = [e.nbytes for n, e in index.items() if ".experts.0." in n and "layers.0." in n]
    assert sum(held) == model.expert_disk_bytes  # the byte ranges of one expert's tensors
    disk_bound = RunSpec(model, hardware(gpu_gb, 5e-5), WORKLOAD, "klotski", {})
    result, _ = real_execute(ckpt, disk_bound, dtype=dtype)
    trace = result.trace
    disk = trace[trace["resource"].astype(str) == str(Resource.DISK)]
    h2d = trace[(trace["resource"].astype(str) == str(Resource.H2D)) & (trace["expert"] >= 0)]
    assert len(disk) and set(disk["bytes"]) == {model.expert_disk_bytes}
    assert set(h2d["bytes"]) == {model.expert_bytes}
    assert result.summary["bytes_moved"]["disk"] == sum(read) == len(disk) * expert * saved


def test_a_simulated_spec_in_its_own_dtype_counts_as_before():
    """Without a saved width (a simulation, a run in the saved dtype) the disk holds the
    compute dtype's bytes; a width no checkpoint is saved in is one line."""
    from core.errors import ConfigError

    spec = reduced_spec("mixtral-tiny")
    assert spec.disk_dtype_bytes == 0 and spec.expert_disk_bytes == spec.expert_bytes
    assert dataclasses.replace(spec, disk_dtype_bytes=2).expert_disk_bytes == 2 * spec.expert_params
    with pytest.raises(ConfigError, match="disk_dtype_bytes=8; set 1"):
        dataclasses.replace(spec, disk_dtype_bytes=8)


# --- 3. Switch's float16 clamp, decided over every rank's sequences ---


@pytest.mark.slow
def test_switch_float16_clamp_split_over_ranks_warns(tmp_path, capfd):
    """One batch of 4 sequences on 2 gloo processes: rank 0 holds the 2 whose value stays
    within 1000 of float16's max, rank 1 the 2 that overflow (round 11's checkpoint). A single
    process runs them in one op and clamps as transformers; the ranks decided apart, without a
    word. Now rank 0 warns once, naming the layer and step, as a single process's split does."""
    from core.spec import RoutingConfig, Workload
    from core.types import RoutingSource
    from experiments.common.dist_run import run_distributed
    from experiments.common.pipeline import RunSpec
    from tests.real.test_distributed import TWO_GPUS
    from tests.real.test_hf_parity_round11 import switch_split_ckpt

    ckpt = switch_split_ckpt(tmp_path / "split")
    routing = RoutingConfig(source=RoutingSource.SYNTHETIC)
    wl = Workload(batch_size=4, n_batches=1, prompt_len=6, gen_len=3, routing=routing)
    spec = RunSpec(load_checkpoint(ckpt)[0], TWO_GPUS, wl, "ep_static", {})
    assert run_distributed(str(ckpt), spec, "live", None, 120) is not None
    said = [line for line in capfd.readouterr().err.splitlines() if "overflowed float16" in line]
    assert len(said) == 1 and "layer 0 (FFN) at step 0 " in said[0], said


# --- a bench's child command and a stop sent to the whole group ---


def test_a_bench_child_leaves_every_group_stop_to_the_bench():
    """bench.real's calibrate (and bench.accelerate's systems) ignored only Ctrl-C: SIGTERM to
    the group (a scheduler's, `kill -TERM -PGID`) made the child say "stopped by SIGTERM; the
    command had not started" beside the bench's own line. Each group stop is the bench's now."""
    import subprocess

    from experiments.common.peers import ignore_ctrl_c

    names = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
    code = (
        f"import signal as s; print(all(s.getsignal(getattr(s, n)) is s.SIG_IGN for n in {names}))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=ignore_ctrl_c
    )
    assert r.stdout.strip() == "True", r.stdout


# --- a full disk where the write names no file ---


def test_a_staged_write_that_names_no_file_names_the_output_folder(tmp_path):
    """validate on a disk that filled while matplotlib saved a timeline: its OSError names no
    file, and the line said only "No space left on device; free space ..." (which disk?)."""
    import errno

    from experiments.common.cli import error_line
    from experiments.common.run_dir import staged_outputs

    out = tmp_path / "v"
    with pytest.raises(OSError) as info, staged_outputs(out):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.filename == str(out) and not out.exists()
    assert error_line(info.value).startswith(f"{out}: No space left on device; free space")


def test_an_atomic_write_on_a_full_disk_names_its_file(tmp_path, monkeypatch):
    """atomic_write_text (validate_lanes' tables, a run's JSON files): f.write's OSError on a
    full disk names no file; it names the file now, and leaves neither it nor a half-file."""
    import errno

    from experiments.common import run_dir

    class Full:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_dir, "open", Full, raising=False)
    path = tmp_path / "validate_lanes.csv"
    with pytest.raises(OSError) as info:
        run_dir.atomic_write_text(path, "planner\n")
    assert info.value.filename == str(path) and list(tmp_path.iterdir()) == []


def test_a_full_disk_while_the_hydra_record_is_kept_leaves_no_result(tmp_path, monkeypatch):
    """A run on a nearly full disk: its result was swapped in, then copying hydra's record
    into .hydra/.result failed: the command said it failed (exit 2) and left summary.json,
    trace.parquet and a .hydra/.partial-* folder. The record is staged before the swap now:
    the run fails with nothing of its result left."""
    import errno

    from experiments.common import run_dir

    out = tmp_path / "r"
    (out / run_dir.HYDRA).mkdir(parents=True)
    (out / run_dir.HYDRA / "config.yaml").write_text("a: 1\n")

    def full(src, dst, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    monkeypatch.setattr(run_dir.shutil, "copy2", full)
    with pytest.raises(OSError, match="cannot write the run's files") as info:
        run_dir.replace_run(out, {"x": 1}, lambda tmp: (tmp / "trace.parquet").write_bytes(b"x"))
    assert info.value.filename == str(out)
    left = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert left == [run_dir.HYDRA, f"{run_dir.HYDRA}/config.yaml"], left


def test_calibrate_over_its_own_earlier_profile_says_it_replaced_it(tmp_path, monkeypatch, capsys):
    """calibrate into a name it measured before replaces that profile (one of other sources is
    refused: round 13): it said "wrote" either way; it says it replaced the earlier one."""
    from experiments import calibrate

    links = {"disk": {"gbps": 1.0}, "h2d": {"gbps": 2.0, "latency_us": 5.0}}
    hw = {"sources": {"calibration": "probe"}, "links": links, "gpu": {"tflops": 0.01}}
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: hw)
    out = tmp_path / "p.yaml"
    said = []
    for _ in range(2):
        assert calibrate.main([f"out={out}", f"disk_dir={tmp_path / 'd'}", "disk_mb=1"]) == 0
        said.append(capsys.readouterr().out.strip().splitlines()[-1])
    assert said[0].startswith(f"wrote {out}: "), said
    assert said[1].startswith(f"replaced the earlier profile {out}: "), said


@pytest.mark.parametrize(
    ("held", "own", "refused"),
    [
        ("validate.csv", (), "a validation's folder (its validate.csv)"),  # make_checkpoint's
        ("validate_lanes.csv", ("validate.csv",), "a validation's folder"),  # validate's
        ("summary.json", ("validate.csv",), "a run's folder (its summary.json)"),  # validate's
        ("validate.csv", ("validate.csv",), None),  # validate into its own earlier out
    ],
)
def test_an_out_folder_holding_another_commands_results_is_one_line(tmp_path, held, own, refused):
    """make_checkpoint wrote its weights into a validation's folder, and validate its tables
    and run dirs into a run's, without a word (a run's folder was refused by the other
    commands already)."""
    from core.args import not_a_run_folder

    (tmp_path / held).write_text("x\n")
    if refused is None:
        not_a_run_folder(tmp_path, "out", own)
    else:
        raises_one_line(lambda: not_a_run_folder(tmp_path, "out", own), f"out={tmp_path}", refused)


def test_the_ranks_overflow_flags_merge_into_the_runs():
    """Rank 0 kept a value near float16's max at layer 0's FFN add, rank 1 overflowed there:
    the run's flags hold both (the warning's condition), as one process's ops would."""
    from real.gathered_times import merged_overflow

    rank0 = {(0, 0, 1): [False, True], (0, 1, 0): [False, False]}
    rank1 = {(0, 0, 1): [True, False], (1, 0, 1): [True, False]}
    merged = merged_overflow([rank0, rank1])
    assert merged == {(0, 0, 1): [True, True], (0, 1, 0): [False, False], (1, 0, 1): [True, False]}
    assert merged_overflow([{}, {}]) == {}
