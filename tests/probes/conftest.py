"""The probe suite's helpers: run a command as a user would (a subprocess) and check that a
failure is one line on stderr naming what is at fault, a non-zero exit and no traceback.

Each file is one class of failure (issue 48): malformed HF config.json, malformed safetensors,
OSErrors, hydra/omegaconf errors, input accepted silently, results lost or mixed. Cases of a
class share one subprocess where they can (a sweep over them), and are checked in-process
where the boundary function is the whole story, to keep the suite fast.
"""

from __future__ import annotations

import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from core.errors import MoepipeError
from experiments.common.cli import error_line
from real.checkpoint import reduced_spec
from real.checkpoint_write import write_checkpoint
from tests.conftest import built_once, overridden, user_env

ROOT = Path(__file__).resolve().parents[2]
# routing_stats fits its generator to the ESFT trace (seconds of CPU a run): a test over
# several commands runs its routing_stats member in the slow suite, which .ci/run runs too
SLOW_COMMAND = pytest.mark.slow
TINY = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]


def cli(module: str, *args: str, timeout: float = 300, **popen: Any) -> subprocess.CompletedProcess:
    """`python -m module args...` from the repository root, as a user runs it (in `env`, a
    popen argument, else `user_env()`)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=popen.pop("env", None) or user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def real_args(ckpt: Path, run_dir: Path, *more: str) -> list[str]:
    """`experiments.run`'s arguments of a real run on `ckpt` (tiny hardware and workload,
    flexgen; `more` replace the keys they set) into `run_dir`: `cli_here` runs them in this
    process where the test is not of the process itself (a second of start-up less)."""
    args = ["executor=real", f"checkpoint={ckpt}", *TINY[1:], f"hydra.run.dir={run_dir}"]
    return overridden(args, *more)


def real_run(ckpt: Path, run_dir: Path, *more: str, **kw: Any) -> subprocess.CompletedProcess:
    """A real run (`real_args`) as a user runs it, in a process of its own."""
    return cli("experiments.run", *real_args(ckpt, run_dir, *more), **kw)


def trace_args(trace_dir: Path, run_dir: Path) -> list[str]:
    """`experiments.run`'s arguments of a simulated run of DeepSeek-V2-Lite replaying the ESFT
    trace in `trace_dir` (for `cli_here`, or `trace_run`)."""
    return [
        "model=deepseek-v2-lite",
        *TINY[1:],
        "workload.routing.source=trace",
        f"workload.routing.trace_dir={trace_dir}",
        f"hydra.run.dir={run_dir}",
    ]


def trace_run(trace_dir: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """`trace_args`' run as a user runs it, in a process of its own."""
    return cli("experiments.run", *trace_args(trace_dir, run_dir))


# the test session's temporary root, and the run `tiny_run` copies once it is made there
_SESSION: list[pytest.TempPathFactory] = []
_MADE: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _tiny_run_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    _SESSION[:] = [tmp_path_factory]
    _MADE.clear()


def _made_tiny_run(run_dir: Path) -> None:
    r = cli("experiments.run", *TINY, f"hydra.run.dir={run_dir}")
    assert r.returncode == 0, r.stderr


def tiny_run(run_dir: Path) -> Path:
    """`run_dir` holding a finished tiny simulated run, made as a user runs it (a module's
    fixture makes one and its tests edit copies): one run a test session (both test processes,
    tests.conftest.built_once), copied into `run_dir`."""
    if not _SESSION:  # outside a test session
        _made_tiny_run(run_dir)
        return run_dir
    if not _MADE:  # built_once makes it again for each call in a run without xdist
        made, _ = built_once(_SESSION[0], "tiny_run", lambda f: _made_tiny_run(f / "run"))
        _MADE.append(made / "run")
    shutil.copytree(_MADE[0], run_dir, symlinks=True)
    return run_dir


def one_line(r: subprocess.CompletedProcess, *names: str) -> str:
    """The failed command's single stderr line (after hydra's/our logging, which goes to stdout
    or the run's log), checked: exit status != 0, `error: ` first, each of `names` in it, no
    traceback anywhere."""
    assert r.returncode != 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def pasted(shown: str) -> str:
    """The one argument a shell hands a command for `shown`, a line's fix pasted into it as it
    stands (`shlex.split` is a POSIX shell's parse): `"KEY='/x/a,b'"` is `KEY='/x/a,b'`."""
    words = shlex.split(shown)
    assert len(words) == 1, (shown, words)
    return words[0]


def raises_one_line(fn: Callable[[], Any], *names: str) -> str:
    """`fn()` fails with an error the commands print as one line naming each of `names`."""
    with pytest.raises(Exception) as info:  # noqa: PT011 (any expected error type)
        fn()
    line = error_line(info.value)
    assert line is not None, f"{type(info.value).__name__} would be a traceback: {info.value}"
    assert "\n" not in line
    for name in names:
        assert name in line, (name, line)
    assert isinstance(info.value, MoepipeError | OSError) or line
    return line


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail, instead of hanging the suite, where code under test blocks (opening a FIFO,
    reading /dev/zero): SIGALRM interrupts the blocked call and its handler raises."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small mixtral-family checkpoint (2 layers, width 64)."""
    spec = reduced_spec(
        "mixtral-tiny",
        hidden_size=64,
        n_heads=4,
        n_kv_heads=2,
        expert_ffn_size=32,
        vocab_size=128,
        n_layers=2,
    )
    return write_checkpoint(spec, tmp_path_factory.mktemp("probe") / "ck", seed=0)


def said_by_ranks_1_then_0(
    fn: Callable[[], Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> list[tuple[Any, str]]:
    """(exit code, stderr) of `fn()` run as rank 1 and then rank 0 of a 2-rank launch under
    torchrun's agent (its run id set, the ranks' claim made under `tmp_path`), in-process: the
    signal handlers a rank sets are not pytest's."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the ranks' claim is made
    monkeypatch.setattr(signal, "signal", lambda *a: None)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "probe")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    from tests.conftest import _logging_state, _restore_logging

    said, logs = [], _logging_state()
    try:
        for rank in ("1", "0"):
            monkeypatch.setenv("RANK", rank)
            with pytest.raises(SystemExit) as stop:
                fn()
            said.append((stop.value.code, capsys.readouterr().err))
    finally:  # a run's hydra set its job logging up: its file handler must not outlive the test
        _restore_logging(logs)
    return said
