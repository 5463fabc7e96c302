"""Round 26c's two gaps (issue 48), one class a test group:
1. the warnings rule (held_warnings): a run's warnings print once its inputs are accepted.
   Round 26c made calibrate and reproduce_klotski say theirs then; twelve other commands still
   held theirs until they ended (collect, report, replication, replication_cv, prefetch_eval,
   routing_stats, convert_traces, make_checkpoint, trace_json, validate_lanes, bench.sim,
   torchrun): a long one sat silent on a warning the user could act on. Each says them once
   its last refusal check passed, before its long work; a refused run still says only its
   refusal.
2. int_ranges' table of each int field's working range (the words of a line for a value
   omegaconf refuses by its type) was kept by hand, apart from the checks it speaks for, and
   had drifted: a run's workload sizes have no highest (the line said [1, 1048576]), klotski's
   planner.params.n takes -1, its warmup_sequences and disk_window not 0, bench.accelerate's
   acc_batch and routing_stats' seed had no highest (the line named one). Every field of the
   table is now tried at its ends and just past them against each check that takes it.
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


# --- 2. the int fields' range table is the range each command's own check takes ---


class _Accepted(Exception):
    """Raised by the step after a check: the value got past it."""


def _past(*a: Any, **kw: Any) -> Any:
    raise _Accepted


def _model(name: str) -> Callable[[int], Any]:
    from core.spec import ModelSpec
    from tests.conftest import conf

    def build(v: int) -> Any:
        value: Any = [v, 1] if name == "moe_layers" else v
        return ModelSpec.from_dict(conf("model", "tiny") | {name: value})

    return build


def _gpu(name: str) -> Callable[[int], Any]:
    from core.hardware import HardwareSpec
    from tests.conftest import conf

    def build(v: int) -> Any:
        hw = conf("hardware", "tiny")
        return HardwareSpec.from_dict(hw | {"gpu": dict(hw["gpu"]) | {name: v}})

    return build


def _workload(name: str) -> Callable[[int], Any]:
    from core.spec import Workload

    sizes = {"batch_size": 1, "n_batches": 1, "prompt_len": 1, "gen_len": 1}
    return lambda v: Workload(**(sizes | {name: v}))  # type: ignore[arg-type]


def _params(planner: str, name: str) -> Callable[[int], Any]:
    from planners.registry import make_params

    return lambda v: make_params(planner, {name: v})


def _hot_experts(v: int) -> Any:
    from core.spec import RoutingConfig

    return RoutingConfig(hot_experts=v, hot_share=0.5 if v else 0.0)


def _said(name: str, v: int, code: Any) -> Any:
    """What a check returned; a `_main` that said its line (2): a refusal."""
    if code == 2:
        raise MoepipeError(f"{name}={v}: refused")
    return code


def _units(v: int) -> Any:
    """bench.host's slab slots: checked before the slabs are lent (`check_host_bytes`)."""
    import torch

    from experiments.bench import host
    from experiments.common.app import kv

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "check_host_bytes", _past)
        return host.buffer_lines(kv(host.Options()) | {"units": v}, torch.device("cpu"), None, 1)  # type: ignore[arg-type]


def _host(name: str) -> Any:
    """bench.host's KV cache sizes, checked before its slabs are lent."""
    import torch

    from experiments.bench import host
    from experiments.common.app import kv

    def check(v: int) -> Any:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(host, "check_host_bytes", _past)
            opts = kv(host.Options()) | {name: v}
            return host.kv_lines(opts, torch.device("cpu"), None, 1)  # type: ignore[arg-type]

    return check


def _module_and_owner(module: str, cls: str) -> tuple[Any, Any]:
    """The command's module `experiments.module`, and the module defining its options class
    `cls` (the shared schema's for the benches' `Bench*` classes, else the command's own)."""
    mod = importlib.import_module(f"experiments.{module}")
    if cls.startswith("Bench"):
        return mod, importlib.import_module("experiments.common.schema")
    return mod, mod


def _dict_check(module: str, fn: str, sentinel: str, cls: str = "Options", **given: Any) -> Any:
    """`module.fn(kv(cls(**given)) | {name: v})`, its step after the checks `sentinel`."""

    def field(name: str) -> Callable[[int], Any]:
        def check(v: int) -> Any:
            from experiments.common.app import kv

            mod, owner = _module_and_owner(module, cls)
            opts = kv(getattr(owner, cls)(**given)) | {name: v}
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(*_target(mod, sentinel), _past)
                return _said(name, v, getattr(mod, fn)(opts))

        return check

    return field


def _opts_check(module: str, fn: str, sentinel: str, cls: str, **given: Any) -> Any:
    """`module.fn(cls(**given, name=v))`, for a check that takes the options themselves."""

    def field(name: str) -> Callable[[int], Any]:
        def check(v: int) -> Any:
            mod, owner = _module_and_owner(module, cls)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(*_target(mod, sentinel), _past)
                return _said(name, v, getattr(mod, fn)(getattr(owner, cls)(**(given | {name: v}))))

        return check

    return field


_VALIDATE_LANES = _dict_check("validate_lanes", "report", "load_checkpoint", checkpoint="ck")
_LANES = _dict_check("bench.lanes", "report", "reduced_spec")
_ACCELERATE = _opts_check(
    "bench.accelerate",
    "checked",
    "make_planner",
    "BenchAccelerateOptions",
    checkpoint="ck",
    role="accelerate",  # its child's options too (acc_batch)
    acc_batch=1,
)
_REAL = _opts_check(
    "bench.real", "_checked", "pe.checked_routing", "BenchRealOptions", model="tiny", budget_gb=1
)


def _checks() -> dict[str, list[Callable[[int], Any]]]:
    """Each field name of the table: the checks that take it (a command's, the spec's, a
    planner's params'), each a call that raises where its value is refused."""
    from experiments.common import int_ranges

    checks: dict[str, list[Callable[[int], Any]]] = {}
    for name in int_ranges._NONE_AT_0 & {
        "dense_ffn_size",
        "shared_ffn_size",
        "kv_dim",
        "attn_params",
        "qk_head_dim",
        "latent_expand_params",
        "qk_rope_head_dim",
        "q_lora_rank",
        "disk_dtype_bytes",
        "moe_layers",
    }:
        checks[name] = [_model(name)]
    for name in ("sms", "comm_sms", "copy_sms"):
        checks[name] = [_gpu(name)]
    for name in ("n", "hot_k", "warmup_sequences", "disk_window", "disk_speculate"):
        checks[f"planner.params.{name}"] = [_params("klotski", name)]
    checks["n"] = [_REAL("n")]
    checks["planner.params.guess_k"] = [_params("mixtral_offloading", "guess_k")]
    for name in ("prefetch_distance", "history"):
        checks[f"planner.params.{name}"] = [_params("moe_infinity", name)]
    for name in ("batch_size", "n_batches", "prompt_len", "gen_len", "seed"):
        checks[f"workload.{name}"] = [_workload(name)]
    for name in ("slack_mb", "room_margin_mb", "host_room_mb"):
        checks[name] = [_ACCELERATE(name)]
    checks["slack_mb"].append(_REAL("slack_mb"))
    checks["hot_experts"] = [_hot_experts]
    for name in ("batch_size", "n_batches", "prompt_len", "gen_len"):
        checks[name] = [_ACCELERATE(name)]
        if name != "gen_len":
            checks[name].append(_VALIDATE_LANES(name))
        if name != "n_batches":
            checks[name].append(_REAL(name))
    checks["rows"] = [_LANES("rows")]
    checks["acc_batch"] = [_ACCELERATE("acc_batch")]
    checks["replica_slots"] = [_VALIDATE_LANES("replica_slots")]
    checks["repeats"] = [_VALIDATE_LANES("repeats"), _LANES("repeats"), _ACCELERATE("repeats")]
    checks["repeat"] = [_opts_check("bench.sim", "_main", "bench", "Options")("repeat")]
    checks["disk_mb"] = [_dict_check("calibrate", "_calibrate_main", "as_float")("disk_mb")]
    checks["units"] = [_units]
    for name in ("batch", "kv_heads", "positions", "head_dim"):
        checks[name] = [_host(name)]
    checks["k"] = [_opts_check("prefetch_eval", "_evaluated", "load_esft", "Options")("k")]
    checks["seed"] = [
        _opts_check("routing_stats", "_main", "output_file", "Options")("seed"),
        _opts_check("make_checkpoint", "_write", "as_float", "Options", model="tiny", out="x")(
            "seed"
        ),
    ]
    checks["klotski_n"] = [_ACCELERATE("klotski_n")]
    checks["klotski_attn"] = [_ACCELERATE("klotski_attn")]
    checks["lanes"] = [_VALIDATE_LANES("lanes"), _LANES("lanes")]
    return checks


def _refuses(check: Callable[[int], Any], v: int) -> bool:
    try:
        check(v)
    except _Accepted:
        return False
    except (MoepipeError, ValueError, TypeError):
        return True
    return False


def test_every_int_range_in_the_table_is_its_checks_range(capsys: pytest.CaptureFixture) -> None:
    """Class: the table of int fields' ranges (int_ranges), the words of a line for a value
    omegaconf refuses by its type, was kept by hand, apart from the checks it speaks for. For
    each of its fields, every check that takes it accepts its range's ends and refuses the
    values just past them."""
    from experiments.common import int_ranges

    checks = _checks()
    named = {key.rsplit(".", 1)[-1] for key in checks}
    assert set(int_ranges._RANGES) | int_ranges._NONE_AT_0 <= named
    wrong = []
    for name, takers in checks.items():
        low, high, _ = int_ranges.int_range(name)
        for check in takers:
            ends = [low - 1, low, *([] if high is None else [high, high + 1])]
            said = {v: _refuses(check, v) for v in ends}
            want = {v: v < low or (high is not None and v > high) for v in said}
            if said != want:
                wrong.append((name, getattr(check, "__qualname__", check), said))
    assert not wrong, wrong
