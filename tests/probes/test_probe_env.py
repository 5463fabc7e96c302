"""Environment variables a run reads through its libraries: a value they refuse is one line
naming the variable, not an internal error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.common.cli import error_line
from tests.conftest import user_env
from tests.probes.conftest import ROOT, TINY, one_line, raises_one_line


def test_a_torch_variable_torch_refuses_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_LOGS=bogus (or TORCH_DISTRIBUTED_DEBUG=bogus) made every real run an "internal
    error": torch raises ValueError as it loads. One line names the variable and its value;
    the same error raised by our own code stays a bug's."""
    from torch._logging._internal import _parse_log_settings

    monkeypatch.setenv("TORCH_LOGS", "bogus")
    with pytest.raises(ValueError) as info:
        _parse_log_settings("bogus")  # what `import torch` runs on TORCH_LOGS
    line = error_line(info.value)
    assert line is not None and "\n" not in line
    assert "TORCH_LOGS='bogus'" in line and "unset it" in line
    assert error_line(ValueError("TORCH_LOGS is bad")) is None


def test_a_gloo_interface_that_is_not_there_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GLOO_SOCKET_IFNAME naming no interface failed at once, yet the line said the group did
    not form within the rendezvous timeout and blamed MASTER_ADDR/MASTER_PORT: it names the
    variable and the machine's interfaces."""
    from experiments.common.dist_run import _rank

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "bogus0")
    init = (f"file://{tmp_path / 'rendezvous'}", 0, 1)
    raises_one_line(
        lambda: _rank("unused", None, "replay", None, 5, init),  # type: ignore[arg-type]
        "GLOO_SOCKET_IFNAME='bogus0'",
        "lo",
    )


@pytest.mark.parametrize(
    "name, value",
    [
        ("OMP_NUM_THREADS", "abc"),
        ("OMP_NUM_THREADS", "0"),
        ("OMP_NUM_THREADS", "2,x"),
        ("MKL_NUM_THREADS", "abc"),
        ("OMP_DYNAMIC", "maybe"),
        ("TORCH_SHOW_CPP_STACKTRACES", "abc"),
    ],
)
def test_a_thread_variable_the_libraries_refuse_is_one_line(
    name: str, value: str, tmp_path: Path
) -> None:
    """libgomp and torch read these once, as torch loads: a bad value printed their warning in
    two lines above the run, which went on (MKL_NUM_THREADS=abc: on one thread, without a
    word). The command refuses it before torch loads, naming the variable."""
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env={**user_env(), name: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    one_line(r, f"{name}={value!r}", "unset it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env", [{"OMP_NUM_THREADS": "4,2"}, {"OMP_DYNAMIC": "TRUE"}])
def test_values_the_libraries_take_are_not_refused(env: dict[str, str]) -> None:
    from experiments.common.load_env import bad_variable

    assert bad_variable({**env, "MKL_NUM_THREADS": ""}) is None


@pytest.mark.parametrize(
    "name, value, said",
    [
        ("OMP_WAIT_POLICY", "foo", "Invalid value for environment variable OMP_WAIT_POLICY"),
        ("OMP_PROC_BIND", "foo", "OMP_PROC_BIND"),
        ("OMP_STACKSIZE", "0", "Stack size less than minimum"),
        ("OMP_SCHEDULE", "x", "OMP_SCHEDULE"),
    ],
)
def test_other_openmp_variables_libgomp_refuses_are_one_line(
    name: str, value: str, said: str
) -> None:
    """Beyond the variables checked above, libgomp printed its warning above the run, which
    went on: libgomp itself judges them, loaded alone in a child, and its word is the line."""
    from experiments.common.load_env import openmp_complaint

    line = openmp_complaint({**user_env(), name: value})
    assert line is not None and "\n" not in line
    assert f"{name}={value!r}" in line and said in line and "unset it" in line


def test_an_openmp_variable_that_makes_libgomp_loop_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GOMP_CPU_AFFINITY=x made libgomp loop forever as torch loaded: the command hung at 100%
    CPU before its first line."""
    from experiments.common import load_env

    monkeypatch.setattr(load_env, "LOAD_TIMEOUT_S", 1.0)
    line = load_env.openmp_complaint({**user_env(), "GOMP_CPU_AFFINITY": "x"})
    assert line is not None and "GOMP_CPU_AFFINITY='x'" in line and "did not finish" in line


@pytest.mark.parametrize(
    "env", [{}, {"OMP_WAIT_POLICY": "passive"}, {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}]
)
def test_openmp_variables_libgomp_takes_are_not_refused(env: dict[str, str]) -> None:
    from experiments.common.load_env import openmp_complaint

    assert openmp_complaint({**user_env(), **env}) is None


def test_a_run_with_an_openmp_variable_libgomp_refuses_is_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env={**user_env(), "OMP_WAIT_POLICY": "foo"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    one_line(r, "OMP_WAIT_POLICY='foo'", "libgomp says")
    assert not (tmp_path / "run").exists()
