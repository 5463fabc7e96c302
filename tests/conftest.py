"""Shared fixtures: the round-number `tiny` model/hardware/workload from conf/, and helpers."""

from __future__ import annotations

import copy
import fcntl
import gc
import importlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from core.hardware import HardwareSpec
from core.routing import Routing
from core.spec import ModelSpec, Workload
from experiments.common.torchrun_rank import alive  # noqa: F401 (the tests' too)
from planners.registry import expert_parallel_names

# Where PYTHONDONTWRITEBYTECODE is set (this VM, some CI images), every command a test starts
# compiles the project's modules again: 0.5 s of `experiments.run`'s 1.5 s start-up. Caching
# bytecode is Python's default, so the tests turn it back on for themselves and their children.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Under xdist, torch's default of one OpenMP thread per core in each worker oversubscribes the
# cores, and OpenMP's threads spin waiting for each other: tests/real/test_hf_parity.py and
# test_executor.py took 88.9 s with two workers on the 2-core VM, 25.8 s with one thread each.
# Each worker gets its share of the cores (set before torch is imported; the commands tests
# start inherit it). A thread count the user set is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

# each config text hydra composed (omegaconf's YAML loader), parsed: (type, text) -> its objects
_PARSED: dict[tuple[str, str | bytes], Any] = {}


def _parsed_once(load: Callable[..., Any]) -> Callable[..., Any]:
    """`yaml.load` that parses each text omegaconf's loader reads once a session and hands out
    a copy: a command run in this process (`cli_here`) composes conf/'s same files afresh each
    time, and parsing them was a fifth of a compose (the tiny config's: 0.21 s, 0.17 s with
    this). Parsing is a function of the text, so each result is what parsing it again gives; a
    text that fails parses again each time, with its stream's name, for the error as it was."""

    def load_once(stream: Any, Loader: Any) -> Any:  # noqa: N803 (yaml.load's own name)
        if not hasattr(stream, "read") or "OmegaConfLoader" not in Loader.__qualname__:
            return load(stream, Loader=Loader)
        text = stream.read()
        key = (type(text).__name__, text)
        if key not in _PARSED:
            again = io.StringIO(text) if isinstance(text, str) else io.BytesIO(text)
            again.name = getattr(stream, "name", "<file>")  # type: ignore[misc]
            _PARSED[key] = load(again, Loader=Loader)
        return copy.deepcopy(_PARSED[key])

    return load_once


@pytest.fixture(scope="session", autouse=True)
def _configs_parsed_once() -> Iterator[None]:
    """`_parsed_once` for the test session's in-process commands, and the steps of hydra's
    compose that `tests.compose_cache` keeps."""
    import yaml

    from tests.compose_cache import composing_kept

    with pytest.MonkeyPatch.context() as m, composing_kept():
        m.setattr(yaml, "load", _parsed_once(yaml.load))
        yield


ROOT = Path(__file__).resolve().parents[1]
SHARED_TRACES = ROOT.parent / "shared" / "traces"
# a test that reads the ESFT trace at its default path skips where the checkout has none beside it
NEEDS_TRACES = pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")

# Expert-parallel planners keep every expert resident on its device (replicas add copies); they
# refuse hardware whose GPU memory cannot hold them instead of offloading.
RESIDENT = set(expert_parallel_names())
# GPU memory (GB) of about the dense weights plus 1.5 expert layers of `tiny` (509 KB in all, one
# expert layer 197 KB) and host RAM (0.2 MB) smaller than its experts (393 KB), so a run has to
# stream experts from disk. Offloading planners need different working sets: each runs in at
# least one of the two.
TIGHT_GPU_GB = (0.00045, 0.0006)
TIGHT_CPU_GB = 0.0002


def conf(group: str, name: str) -> dict:
    return yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())


def model_from_conf(name: str) -> ModelSpec:
    return ModelSpec.from_dict(conf("model", name))


def hardware_from_conf(name: str) -> HardwareSpec:
    return HardwareSpec.from_dict(conf("hardware", name))


def random_routing(model: ModelSpec, workload: Workload, seed: int = 0) -> Routing:
    """Uniform random distinct top-k experts per token: a routing independent of core.synthetic."""
    rng = np.random.default_rng(seed)
    shape = (workload.n_sequences, workload.seq_positions, len(model.moe_layers), model.n_experts)
    ids = np.argsort(rng.random(shape), axis=-1)[..., : model.top_k].astype(np.int16)
    weights = np.full(ids.shape, 1.0 / model.top_k, dtype=np.float32)
    return Routing(ids, weights, model.n_experts, f"uniform random seed {seed}")


@pytest.fixture
def tiny_model() -> ModelSpec:
    return model_from_conf("tiny")


@pytest.fixture
def tiny_hw() -> HardwareSpec:
    return hardware_from_conf("tiny")


@pytest.fixture
def tiny_workload() -> Workload:
    return Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)


def pytest_configure(config: pytest.Config) -> None:
    """This test run takes signals as one started from a terminal does (`default_signals`):
    started in a shell's background job it ignores SIGINT, under `nohup` SIGHUP, and the
    in-process probes of Ctrl-C and SIGHUP, and the commands the tests start (which keep an
    ignored signal ignored), would then see no stop."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What a test process holds once it has collected (torch, transformers, hydra, pandas,
    the test modules: 300,000 objects and more) lives to its end: frozen out of the cycle
    collector (`gc.freeze`, as a command does for its imports), so that the collections the
    tests' own garbage sets off do not walk it again each time."""
    gc.collect()
    gc.freeze()


def default_signals() -> None:
    """`preexec_fn` of a command a test signals: Ctrl-C, SIGTERM, SIGHUP and Ctrl-backslash's
    SIGQUIT at their default actions and none blocked, as a command started from a terminal
    has them. The test run's own may differ: under `nohup` SIGHUP is ignored, in a shell's
    background job SIGINT is, code a test ran in this process may have left one ignored (a
    ranks' server's start-up), and a command keeps an ignored signal ignored (as `nohup` asks),
    so a probe that sends it would see no stop."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def overridden(args: Sequence[str], *more: str) -> list[str]:
    """`args` then `more`, less each argument of `args` that sets a key `more` sets too
    (`planner=x` for `planner=y`, `+k=1` or `~k` for `k=2`): a command refuses a key given
    twice, where hydra kept the last. Flags (`-m`) are kept."""

    def key(arg: str) -> str | None:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            return None
        return arg.lstrip("~").partition("=")[0].lstrip("+").strip()

    given = {key(a) for a in more} - {None}
    return [a for a in args if key(a) not in given] + list(more)


def user_env() -> dict[str, str]:
    """The environment a user's command gets in a test: this checkout importable, one thread
    (two test processes share the machine's cores), hydra's traceback switch unset."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    env.pop("MOEPIPE_TRACEBACK", None)
    return env


def started(module: str, *args: str, **popen: Any) -> subprocess.Popen:
    """`python -m module args...` from the repository root as a terminal starts it, for a test
    that signals it: a session (process group) of its own, as a terminal's job has, which
    Ctrl-C or a closed terminal reaches whole, and default signal actions
    (`default_signals`). `popen`: Popen's other arguments (stdout, stderr, text, cwd, env)."""
    popen = {"cwd": ROOT, "env": user_env(), **popen}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        start_new_session=True,
        preexec_fn=default_signals,
        **popen,
    )


def spawned_ranks(command: int) -> list[int]:
    """pids of the ranks a distributed run of the `command` process runs, in start order: the
    children of its forkserver (experiments.common.dist_run), which they fork from."""

    def kids(pid: int) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return sorted(int(k) for k in out.split())

    def cmdline(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        except OSError:  # gone meanwhile
            return ""

    return [r for s in kids(command) if "forkserver" in cmdline(s) for r in kids(s)]


def torchrun_ranks(agent: int) -> dict[int, int]:
    """rank -> pid of a torchrun agent's worker processes (their RANK)."""
    kids = subprocess.run(["pgrep", "-P", str(agent)], capture_output=True, text=True)
    ranks = {}
    for pid in kids.stdout.split():
        try:
            env_vars = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        for kv in env_vars:
            if kv.startswith(b"RANK="):
                ranks[int(kv[5:])] = int(pid)
    return ranks


def catches_sigterm(pid: int) -> bool:
    """Has the process installed a SIGTERM handler (/proc's caught-signals mask)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(x.split()[1], 16) for x in status.splitlines() if x.startswith("SigCgt:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> tuple[Path, Any]:
    """`build(folder)` once per test session: (its folder, what it returned, JSON). A session-
    or module-scoped fixture is built once per pytest-xdist worker, so an expensive one that
    tests on both workers use was built twice; here the first worker to ask builds it under a
    lock in the session's temporary root, the other waits and reads what it left. Tests must
    not change the folder (they work on a copy)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: nothing to share
        folder = tmp_path_factory.mktemp(name)
        return folder, build(folder)
    root = tmp_path_factory.getbasetemp().parent  # this session's, above each worker's
    folder, result = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed in another worker
            folder.mkdir()
            result.write_text(json.dumps(build(folder)))
    return folder, json.loads(result.read_text())


# what Python's default warning filters do not print (outside __main__)
_IGNORED_BY_DEFAULT = (
    DeprecationWarning,
    PendingDeprecationWarning,
    ImportWarning,
    ResourceWarning,
)


def command_here(
    main: Callable[[Sequence[str]], int],
    argv: Sequence[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> subprocess.CompletedProcess[str]:
    """A command's `main(argv)` in this process as its `python -m` runs it (cli.run_command):
    its exit status, stdout and stderr, each warning it gives counted as a line of stderr,
    where Python would print it. A second or two of start-up less than a subprocess; tests of what
    only a fresh process shows (imports, signals) keep the subprocess."""
    from experiments.common import app, cli, hydra_errors, stops

    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # run_command sets it: put back after the test
    monkeypatch.delenv("MOEPIPE_TRACEBACK", raising=False)  # as that one, unset by then
    # what the command sets for this process (Ctrl-C's line, its schema, its --help): its own
    for module, name in (
        (stops, "_ON_INTERRUPT"),
        (stops, "_BEFORE_LINE"),
        (hydra_errors, "ROOT_SCHEMA"),
    ):
        monkeypatch.setattr(module, name, list(getattr(module, name)))
    monkeypatch.setattr(app, "_HELP", dict(app._HELP))
    logs = _logging_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's filters outside pytest
        try:
            code = cli.run_command(lambda: main(list(argv)))
        except SystemExit as e:
            code = e.code
        finally:  # hydra's handlers write to this test's captured streams, closed after it
            _restore_logging(logs)
    shown = [
        f"{w.category.__name__}: {w.message}"
        for w in caught
        if not issubclass(w.category, _IGNORED_BY_DEFAULT)
    ]
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(argv), int(code or 0), out, "\n".join([err, *shown]))


@pytest.fixture
def cli_here(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """`python -m module args...` from the repository root, in this process (`command_here`:
    the module's `main` as `python -m` runs it), for a command whose test needs no process of
    its own: a second or two of interpreter start-up less each."""

    def go(module: str, *args: str) -> subprocess.CompletedProcess[str]:
        from hydra.core.global_hydra import GlobalHydra
        from hydra.core.singleton import Singleton

        main = importlib.import_module(module).main
        monkeypatch.chdir(ROOT)  # where a user (and tests.probes.conftest.cli) runs it
        # a fresh process has no hydra initialized: set aside a module's compose context
        held = Singleton._instances.pop(GlobalHydra, None)
        try:
            return command_here(main, args, capsys, monkeypatch)
        finally:
            if held is not None:
                Singleton._instances[GlobalHydra] = held

    return go


def _logging_state() -> dict[str, tuple[list[logging.Handler], int, bool, bool]]:
    """Every logger's handlers, level, propagate and disabled flags (the root's as "")."""
    loggers = {"": logging.getLogger()}
    loggers.update(
        (name, lg)
        for name, lg in logging.Logger.manager.loggerDict.items()
        if isinstance(lg, logging.Logger)
    )
    return {
        n: (list(lg.handlers), lg.level, lg.propagate, lg.disabled) for n, lg in loggers.items()
    }


def _restore_logging(state: dict[str, tuple[list[logging.Handler], int, bool, bool]]) -> None:
    """Put back `_logging_state`'s loggers as they were; a logger made since loses its handlers.
    Handlers added since are closed (hydra's run.log file handler)."""
    kept = {id(h) for handlers, *_ in state.values() for h in handlers}
    for name, lg in [("", logging.getLogger()), *logging.Logger.manager.loggerDict.items()]:
        if isinstance(lg, logging.Logger):
            for h in lg.handlers:
                if id(h) not in kept:
                    h.close()
            if name not in state:
                lg.handlers.clear()
    for name, (handlers, level, propagate, disabled) in state.items():
        lg = logging.getLogger(name or None)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate, lg.disabled = propagate, disabled


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture(autouse=True)
def _signal_handlers_kept() -> Iterator[None]:
    """A test that leaves a signal's handler changed fails (its teardown errs), and the handler
    is put back: a later test in this process that relies on Ctrl-C's KeyboardInterrupt (or on
    SIGTERM's default action) would otherwise fail for it, far from the cause."""
    before = {s: signal.getsignal(s) for s in _SIGNALS}
    python = sys.executable  # what the processes a test starts run: ignored signals stay so
    yield
    changed = [s for s in _SIGNALS if signal.getsignal(s) != before[s]]
    left = {signal.Signals(s).name: signal.getsignal(s) for s in changed}
    for s in changed:
        signal.signal(s, before[s])
    moved, sys.executable = sys.executable, python
    assert not changed, f"the test left these signals' handlers changed: {left}"
    assert moved == python, f"the test left sys.executable changed: {moved}"
