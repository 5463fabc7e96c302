"""Round 26c's two gaps (issue 48), one class a test group:
1. the warnings rule (held_warnings): a run's warnings print once its inputs are accepted.
   Round 26c made calibrate and reproduce_klotski say theirs then; twelve other commands still
   held theirs until they ended (collect, report, replication, replication_cv, prefetch_eval,
   routing_stats, convert_traces, make_checkpoint, trace_json, validate_lanes, bench.sim,
   torchrun): a long one sat silent on a warning the user could act on. Each says them once
   its last refusal check passed, before its long work; a refused run still says only its
   refusal.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from core.errors import CapacityError, MoepipeError
from tests.conftest import NEEDS_TRACES, SHARED_TRACES
from tests.probes.conftest import one_line, tiny_run

WARNING = "an input's warning"
REFUSAL = "a refusal of its inputs"

# --- 1. each command says its warnings once its inputs are accepted ---


def _sweep(tmp: Path) -> Path:
    tiny_run(tmp / "sweep" / "r0")
    return tmp / "sweep"


def _stub(value: Any) -> Callable[..., Any]:
    return lambda *a, **kw: value


# module: (where the warning is given: the last step before its inputs are accepted, the
# long work it then starts, what else stands in for inputs the step needs, its arguments)
Case = tuple[str, str, dict[str, Any], Callable[[Path], list[str]]]
_CASES: dict[str, Case] = {
    "collect": ("load_sweep", "write_results", {}, lambda t: [f"dir={_sweep(t)}"]),
    "report": (
        "load_sweep",
        "write_report",
        {},
        lambda t: [f"dir={_sweep(t)}", f"out={t / 'rep'}"],
    ),
    "replication": (
        "report_lines",
        "ep_plots.plot",
        {"load_rows": _stub([]), "report_lines": _stub(([], {}))},
        lambda t: [f"dir={t}", f"out={t / 'rep'}"],
    ),
    "replication_cv": (
        "fold_rows",
        "cv_lines",
        {"fold_rows": _stub({"fold": []})},
        lambda t: [f"dir={t}"],
    ),
    "prefetch_eval": ("load_esft", "evaluate", {}, lambda t: [f"trace_dir={SHARED_TRACES}"]),
    "routing_stats": (
        "mixtral_counts",
        "esft_comparison",
        {},
        lambda t: [f"trace_dir={SHARED_TRACES}", f"out={t / 'stats.json'}"],
    ),
    "convert_traces": (
        "refuse_theirs",
        "convert_esft",
        {},
        lambda t: [f"src={t / 'esft.tar'}", f"out={t / 'esft.npz'}"],
    ),
    "make_checkpoint": (
        "not_a_run_folder",
        "write_checkpoint",
        {},
        lambda t: ["model=mixtral-tiny", f"out={t / 'ck'}"],
    ),
    "trace_json": ("read_traces", "write_chrome", {}, lambda t: [f"runs=[{_sweep(t) / 'r0'}]"]),
    "validate_lanes": (
        "device_hardware",
        "_planner_row",
        {},
        lambda t: [
            f"checkpoint={t / 'ck'}",
            "hardware=tiny",
            "lanes=2",
            "device=cpu",
            f"out={t / 'v'}",
        ],
    ),
    "bench.sim": ("make_planner", "bench", {}, lambda t: ["repeat=1"]),
    "torchrun": (
        "_checked",
        "torch.distributed.run.run",
        {},
        lambda t: ["--nproc-per-node=1", "-m", "experiments.run"],
    ),
}
_TRACES = ("prefetch_eval", "routing_stats")


def _target(module: Any, dotted: str) -> tuple[Any, str]:
    """The object and attribute `dotted` names: in `module`, or a module's (torch's `run`)."""
    head, _, name = dotted.rpartition(".")
    if not head:
        return module, name
    if hasattr(module, head):
        return getattr(module, head), name
    return importlib.import_module(head), name


def _commands() -> list[Any]:
    return [pytest.param(name, marks=NEEDS_TRACES) if name in _TRACES else name for name in _CASES]


def _prepared(
    name: str,
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    *,
    refuse: bool,
) -> tuple[str, list[str], list[str]]:
    """`name`'s module and arguments; its step before acceptance warns (and refuses, where
    `refuse`); its long work is a stand-in that records what was said by then, and stops."""
    module = importlib.import_module(f"experiments.{name}")
    before, work, stubs, args = _CASES[name]
    for attr, value in stubs.items():
        monkeypatch.setattr(*_target(module, attr), value)
    obj, attr = _target(module, before)
    step = getattr(obj, attr)

    def warned(*a: Any, **kw: Any) -> Any:
        logging.getLogger("moepipe.probe").warning(WARNING)
        if refuse:
            raise CapacityError(REFUSAL)
        return step(*a, **kw)

    monkeypatch.setattr(obj, attr, warned)
    said: list[str] = []

    def long_work(*a: Any, **kw: Any) -> Any:
        said.extend(r.getMessage() for r in caplog.records)
        raise MoepipeError("reached its long work")

    monkeypatch.setattr(*_target(module, work), long_work)
    return f"experiments.{name}", args(tmp), said


@pytest.mark.parametrize("name", _commands())
def test_a_commands_warnings_print_before_its_long_work(
    name: str,
    cli_here: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """Class: a command held its warnings until it ended (minutes of work later, or never
    where the work then failed on its own); they print once its inputs are accepted."""
    if name == "validate_lanes":
        tmp_path = _with_checkpoint(tmp_path, request)
    module, args, said = _prepared(name, tmp_path, monkeypatch, caplog, refuse=False)
    r = cli_here(module, *args)
    assert r.returncode != 0 and "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1] == "error: reached its long work", r.stderr
    assert WARNING in said


@pytest.mark.parametrize("name", _commands())
def test_a_refused_commands_warnings_stay_unsaid(
    name: str,
    cli_here: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """The rule's other half: a run refused before its inputs are accepted says only its
    refusal (its warnings, read as if it went on, are dropped)."""
    if name == "validate_lanes":
        tmp_path = _with_checkpoint(tmp_path, request)
    module, args, said = _prepared(name, tmp_path, monkeypatch, caplog, refuse=True)
    r = cli_here(module, *args)
    one_line(r, REFUSAL)
    assert WARNING not in r.stdout + r.stderr
    assert all(rec.getMessage() != WARNING for rec in caplog.records)
    assert not said


def _with_checkpoint(tmp: Path, request: pytest.FixtureRequest) -> Path:
    """`tmp` with `ck`, a link to the session's small checkpoint (validate_lanes reads one)."""
    (tmp / "ck").symlink_to(request.getfixturevalue("tiny_ckpt"))
    return tmp
