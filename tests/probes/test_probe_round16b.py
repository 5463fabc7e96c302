"""Probe round 16b (issue 48): the real, distributed and checkpoint commands. torchrun's own
process ended every failed launch in a traceback (a taken --master_port, Ctrl-C or Ctrl-\\, a
failed rank's ChildFailedError and its table): `python -m experiments.torchrun`, torchrun's
arguments and launcher in the commands' error path, ends in one line, and names torchrun's
refused arguments and a missing script or module before any rank starts. Under torchrun's
agent Ctrl-C's line, and a run's start-up error (composing its config, checking its
arguments), are said once by the first rank to say (rank 0, blocked in a transfer, blamed rank
1 for leaving; each rank printed a start-up error). A Qwen config.json's mlp_only_layers naming
a layer past the model is refused, and a dense layer holding experts no longer blames
DeepseekV2 in every family. An op out of memory no longer logs its traceback above the line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from experiments import torchrun
from experiments.common.cli import until_interrupted
from experiments.common.launch_line import _PREFIX, _start_time, say_first, tempfile_dir
from experiments.common.real_run import real_execute
from real.checkpoint import load_checkpoint, reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.conftest import user_env
from tests.planners.ep_common import tiny_spec
from tests.probes.conftest import ROOT, one_line, raises_one_line, said_by_ranks_1_then_0
from tests.real.conftest import small_overrides

RUN = ["-m", "experiments.run", "executor=real"]


@pytest.fixture
def launcher_env(monkeypatch):
    """torchrun's agent log left as it is (LOGLEVEL set): the test process's logging kept."""
    monkeypatch.setenv("LOGLEVEL", "WARNING")


def test_a_taken_master_port_names_the_port_and_the_fix(launcher_env):
    """torchrun with its --master_port held by another process: torch's DistNetworkError
    traceback from the agent's store, before any rank started."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = ["--nproc_per_node=2", f"--master_port={port}", *RUN]
        raises_one_line(lambda: torchrun.main(argv), f"--master_port={port}", "--standalone")


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--nproc_per_node=abc", *RUN], ["torchrun: ", "nproc_per_node value: abc"]),
        (["--no-such-flag", *RUN], ["torchrun: ", "--no-such-flag"]),
        ([], ["torchrun: ", "training_script"]),
        (["--nproc_per_node=0", *RUN], ["--nproc_per_node=0", "at least 1"]),
        (["--nproc_per_node=-1", *RUN], ["--nproc_per_node=-1", "at least 1"]),
        (["--nnodes=2:1", *RUN], ["torchrun: ", "min_nodes"]),
        (["--nnodes=1:2:3", *RUN], ["--nnodes=1:2:3", "N or MIN:MAX"]),
        (["--nnodes=abc", *RUN], ["--nnodes=abc", "N or MIN:MAX"]),
        (["--standalone", "--nproc_per_node=2", "--max-restarts=-1", *RUN], ["max_restarts"]),
        (["--monitor-interval=0", *RUN], ["--monitor-interval=0", "> 0"]),
        (["--nproc_per_node=2", "nosuch_script.py"], ["nosuch_script.py: no such script"]),
        (["--nproc_per_node=2", "-m", "nosuch_module"], ["-m nosuch_module: no such module"]),
        (["-m", "experiments.nosuch"], ["-m experiments.nosuch: no such module"]),
        (["-m", "nosuch.pkg.mod"], ["-m nosuch.pkg.mod: no such module"]),
    ],
)
def test_torchruns_argument_errors_are_one_line(argv, names, launcher_env):
    """argparse's usage and error (two lines), and torchrun's refusals of its arguments, each a
    traceback: a ValueError for a process count it cannot read, a bare AssertionError for none,
    an AssertionError or RuntimeError for a node range out of order or not MIN:MAX; a script or
    module not found, python's own line from every rank and then torchrun's table."""
    raises_one_line(lambda: torchrun.main(argv), *names)


def _claim_by_rank() -> Path:
    """The claim a rank of this process's launch makes when it says the launch's line."""
    me = os.getpid()
    return Path(tempfile_dir()) / f"{_PREFIX}{me}-{_start_time(me)}-0.said"


@pytest.mark.parametrize(
    ("signum", "code", "said"),
    [
        (signal.SIGINT, 130, "interrupted: the launch did not finish"),
        (signal.SIGQUIT, 131, "stopped by SIGQUIT; the launch did not finish"),
        (signal.SIGTERM, 143, "stopped by SIGTERM; the launch did not finish"),
    ],
)
@pytest.mark.parametrize("rank_said", [False, True])
def test_a_signal_to_the_launch_ends_with_the_interrupt_line(
    signum, code, said, rank_said, monkeypatch, capsys, launcher_env
):
    """Ctrl-C, Ctrl-\\ or a stop: torchrun's agent raised SignalException, a traceback below
    rank 0's line. The launcher says the commands' line where no rank said one, else nothing,
    and exits with the signal's status."""

    def signalled(args):
        if rank_said:
            _claim_by_rank().touch()
        raise SignalException("got signal", sigval=signal.Signals(signum))

    monkeypatch.setattr("torch.distributed.run.run", signalled)
    with pytest.raises(SystemExit) as stop:
        until_interrupted(lambda: torchrun.main(["--nproc_per_node=2", *RUN]))
    assert stop.value.code == code
    err = capsys.readouterr().err
    assert (err == "") if rank_said else err.startswith(said), err
    assert not _claim_by_rank().exists()


def _failure(tmp_path: Path, rank: int, exitcode: int, line: str | None, t: int) -> ProcessFailure:
    error_file = tmp_path / f"error-{rank}.json"
    if line is not None:
        info = {"py_callstack": line, "timestamp": str(t)}
        error_file.write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))
    failure = ProcessFailure(
        local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(error_file)
    )
    failure.timestamp = t
    return failure


@pytest.mark.parametrize(
    ("failures", "names"),
    [
        ({1: (2, "error: rank 1: ck/model.safetensors: truncated", 5)}, ["rank 1: ck/model"]),
        ({0: (-15, None, 6), 1: (2, "error: checkpoint=x: no such folder", 7)}, ["checkpoint=x"]),
        ({0: (-9, None, 5), 1: (-15, None, 6)}, ["rank 0 ended (signal 9, SIGKILL)"]),
        ({1: (1, None, 5)}, ["rank 1 ended (exit status 1) without a line"]),
    ],
)
@pytest.mark.parametrize("redirects", ["0", "3", "1:2"])
def test_a_failed_rank_is_its_one_line_once(
    failures, names, redirects, tmp_path, monkeypatch, capsys, launcher_env
):
    """A failed rank: torchrun's ChildFailedError traceback and table followed the rank's own
    line. The rank's line, from its error file, is the one line: said by the rank on this
    terminal (its claim), or here where no rank said it or its stderr goes to a file."""
    made = {r: _failure(tmp_path, r, *f) for r, f in failures.items()}

    rank_said = any(line for _, line, _ in failures.values())

    def failed(args):
        if rank_said:
            _claim_by_rank().touch()  # the rank said it, on its stderr
        raise ChildFailedError("experiments.run", made)

    monkeypatch.setattr("torch.distributed.run.run", failed)
    argv = ["--nproc_per_node=2", f"--redirects={redirects}", *RUN]
    if rank_said and redirects == "0":  # its stderr is this terminal's
        with pytest.raises(SystemExit) as stop:
            torchrun.main(argv)
        assert stop.value.code == torchrun.FAILED and capsys.readouterr().err == ""
    else:
        raises_one_line(lambda: torchrun.main(argv), *names)
    assert not _claim_by_rank().exists()


def test_under_torchruns_agent_ctrl_c_is_said_by_the_first_rank(tmp_path, monkeypatch, capsys):
    """Ctrl-C reaches every rank; rank 0 alone said it, and rank 0 blocked in a gloo transfer
    (a signal waits for the C++ call) found rank 1 gone first and blamed it ("rank 1 died or
    left while rank 0 waited for it"), the interrupt said nowhere. Under torchrun's agent the
    first rank to say claims the line, whichever it is; the others say nothing."""

    def interrupted():
        raise KeyboardInterrupt

    said = said_by_ranks_1_then_0(
        lambda: until_interrupted(interrupted), tmp_path, monkeypatch, capsys
    )
    assert said[0][1].startswith("interrupted: ") and said[1][1] == "", said
    assert [code for code, _ in said] == [130, 130]
    assert not say_first("error: rank 1 died or left while rank 0 waited for it")


def _qwen3(tmp_path: Path, **fields) -> Path:
    spec = reduced_spec("qwen3-30b-a3b", **small_overrides("qwen3-30b-a3b"))
    ckpt = write_checkpoint(spec, tmp_path / "q3", seed=0)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(cfg | fields))
    return ckpt


@pytest.mark.parametrize("layers", [[3], [0, 99], [2, 7]])
def test_mlp_only_layers_past_the_model_is_refused(layers, tmp_path):
    """mlp_only_layers=[99] of a 3-layer Qwen3-MoE ran without a word (transformers meets no
    such layer): a typo, or the config.json of another model."""
    past = min(i for i in layers if i >= 3)
    raises_one_line(
        lambda: load_checkpoint(_qwen3(tmp_path, mlp_only_layers=layers)),
        "config.json",
        "mlp_only_layers",
        f"layer {past}",
        "num_hidden_layers=3",
    )


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"mlp_only_layers": [0]}, ["decoder_sparse_step and mlp_only_layers", "[0]"]),
        ({"decoder_sparse_step": 2}, ["decoder_sparse_step and mlp_only_layers", "[0, 2]"]),
    ],
)
def test_a_dense_layer_holding_experts_names_the_familys_fields(fields, names, tmp_path):
    """A Qwen config.json that makes a layer holding experts dense was told "(transformers'
    DeepseekV2 ignores moe_layer_freq)", a field and a class of another family."""
    line = raises_one_line(lambda: load_checkpoint(_qwen3(tmp_path, **fields)), *names)
    assert "Deepseek" not in line, line


def _launch(ckpt: Path, run: Path, *more: str) -> list[str]:
    args = ["executor=real", f"checkpoint={ckpt}", "hardware=h200-hgx8", "workload=tiny"]
    args += ["executor.distributed=true", "planner=eplb", "+planner.params.n_devices=2"]
    args += [f"hydra.run.dir={run}", *more]
    head = [sys.executable, "-m", "experiments.torchrun", "--standalone", "--nproc_per_node=2"]
    return [*head, "-m", "experiments.run", *args]


@pytest.mark.slow  # torchrun and two gloo ranks starting
def test_a_launch_whose_ranks_fail_is_one_line(tmp_path):
    """Two ranks meeting a checkpoint that is not there: the rank's line, once, and no
    ChildFailedError traceback or table from torchrun's process."""
    r = subprocess.run(
        _launch(tmp_path / "nosuch", tmp_path / "run"),
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    one_line(r, "nosuch", "no such file")
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # torchrun and two gloo ranks running
def test_ctrl_c_under_the_launcher_is_one_line(tiny_ckpt, tmp_path):
    """Ctrl-C (SIGINT to the terminal's whole group) while two ranks run: rank 0's interrupt
    line and torchrun's SignalException traceback; now the line alone, exit 130, no run dir."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        _launch(tiny_ckpt, run, "workload.gen_len=3000"),
        cwd=ROOT,
        env=user_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / ".hydra").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == [line for line in err.splitlines() if line.strip()]
    (line,) = err.splitlines()
    assert line.startswith("interrupted: "), err
    assert not (run / "summary.json").exists()


def _cannot_allocate(*args, **kw):
    raise RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 10000000000 bytes. Error code 12"
    )


def test_an_op_out_of_memory_is_the_line_without_a_logged_traceback(tiny_ckpt, monkeypatch, caplog):
    """workload.prompt_len=100000 on a small machine: the stream thread that failed logged
    "stream compute failed" with the allocator's traceback (30 lines on the console and in
    run.log) above the one line, "out of memory; ...". The error goes to the main thread, with
    its frames (the traceback file of an unexpected one), and nothing is logged above it."""
    monkeypatch.setattr("real.interpreter.Interpreter._timed", _cannot_allocate)
    caplog.set_level("INFO")
    raises_one_line(lambda: real_execute(tiny_ckpt, tiny_spec("ep_static")), "out of memory")
    assert not [r for r in caplog.records if r.exc_info], caplog.text


@pytest.mark.parametrize(
    "argv",
    [
        ["nosuchkey=1"],  # composing the config (the hydra app's own error path)
        ["hydra.run.dir=/tmp/a=b"],  # the run's argument checks, before hydra
        ["workload=tiny", "workload=tiny"],  # a key given twice
        ["hydra.run.dir=/proc/no/run"],  # a run dir that cannot be made
    ],
)
def test_under_torchruns_agent_a_start_up_error_is_said_once(argv, tmp_path, monkeypatch, capsys):
    """A config error met while the run composes its config (or checks its arguments) was
    printed by every rank without the launch's claim: under torchrun each rank's line, then
    the launcher's "rank 0 ended without a line" (or a rank still starting blamed rank 0).
    It is said once, by the first rank to say, and claimed."""
    from experiments import run

    said = said_by_ranks_1_then_0(lambda: sys.exit(run.main(argv)), tmp_path, monkeypatch, capsys)
    assert said[0][0] == said[1][0] == 2
    assert said[0][1].startswith("error: ") and said[1][1] == "", said
