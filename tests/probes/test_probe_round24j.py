"""Round 24j of issue 48: this afternoon's leftovers. Classes:

- error types lost on the way: a wrapper that reworded an error (`named_as`'s own option
  names, validate's `planner_params:`, a hardware file's path, a rank's `rank R:`, calibrate's
  in-run refusal) raised a plain MoepipeError (or a fixed list of kinds), so a config error, a
  shipped planner's bug (an internal error) and a refusal were all one kind to the CLI; a
  GpuEdgeError reworded by replication's `named_as_written` was a TypeError. Now each keeps its
  type and parts (`core.errors.reworded`).
- a warning of a run that worked around a failure quoted the failure's fix: the n-planner's
  "n=2 does not fit memory (...; raise hardware.memory_gb.gpu ...); using n=1", a rerun's
  "...: delete it and run that point again; running again". Now it quotes only the cause
  (`core.errors.without_fix`).
- bench_accelerate's options for its own children (`role`, `host_room_mb`, `acc_batch`,
  `acc_limit_s`) were taken from a user's command line once `role` was given: `role=moepipe
  host_room_mb=500` measured one system at tiers no bench gives it, without a word. Now the bench
  hands them to a child in $MOEPIPE_BENCH_CHILD, and a command line's is refused in one line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.errors import (
    CapacityError,
    ConfigError,
    MoepipeError,
    PlannerBug,
    ScheduleBug,
    capacity_error,
)
from planners.placement import GpuEdgeError

# -- error types kept through every wrapper ---------------------------------------------------

KINDS = {
    "config": lambda: ConfigError("planner.params.n=0: pass 1 or more"),
    "planner_bug": lambda: PlannerBug("planner mine: planner.params.n=9 names layer 9"),
    "schedule_bug": lambda: ScheduleBug("op 3 frees planner.params.n twice"),
    "capacity": lambda: capacity_error("planner.params.n=9 does not fit", ("workload.n",), ()),
    "gpu_edge": lambda: GpuEdgeError("planner.params.n: the GPU is too small", "only"),
}


def _same(got: BaseException, made: BaseException, *said: str) -> None:
    assert type(got) is type(made), (type(got), type(made))
    assert vars(got) == vars(made)
    for words in said:
        assert words in str(got), (words, str(got))


@pytest.mark.parametrize("kind", KINDS)
def test_named_as_keeps_the_errors_type(kind: str) -> None:
    from experiments.bench import real
    from experiments.common.option_names import named_as

    made = KINDS[kind]()
    with pytest.raises(MoepipeError) as info, named_as(real.OWN_NAMES):
        raise made
    _same(info.value, made)
    assert "planner.params.n" not in str(info.value)  # the bench's own name for it


@pytest.mark.parametrize("kind", ["capacity", "gpu_edge"])  # (the others' types were kept)
def test_replications_planner_names_keep_the_errors_type(kind: str) -> None:
    from omegaconf import OmegaConf

    from experiments.common.ep_inputs import named_as_written

    rep = {"routing": "synthetic_olmoe_top1", "case": "g8", "planners": {"eplb": {"n": 3}}}
    made = KINDS[kind]()
    with (
        pytest.raises(MoepipeError) as info,
        named_as_written(OmegaConf.create({"replication": rep}), "eplb"),
    ):
        raise made
    _same(info.value, made, "replication.planners.eplb.n")


@pytest.mark.parametrize("kind", ["config", "planner_bug", "capacity"])
def test_validates_planner_params_keep_the_errors_type(
    kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from experiments import validate

    made = KINDS[kind]()

    def refused(name: str, params: Any) -> Any:
        raise made

    monkeypatch.setattr(validate, "make_planner", refused)
    opts = {"links": "calibrated", "checkpoint": str(tmp_path), "planners": "flexgen"}
    opts |= {"planner_params": {"n": 0}}
    with pytest.raises(MoepipeError) as info:
        validate._setup(opts)
    _same(info.value, made, "planner_params: ")


def test_a_hardware_files_config_error_stays_one() -> None:
    from experiments.common.hardware import hardware_spec

    with pytest.raises(ConfigError, match=r"tiny\.yaml: hardware tiny: memory_gb.disk=0"):
        hardware_spec("tiny", {"name": "tiny", "memory_gb": {"gpu": 1, "disk": 0}})


def test_calibrates_in_run_refusal_stays_a_refusal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """calibrate's in-run runs (at a share of the model) refused: its one line, a refusal."""
    from experiments import calibrate as cal

    spec = SimpleNamespace(name="m", total_bytes=1e6)
    monkeypatch.setattr(cal, "resolve_device", lambda d: d)
    monkeypatch.setattr(cal, "load_checkpoint", lambda ckpt, dtype: (spec, None))
    monkeypatch.setattr(cal, "Model", SimpleNamespace(from_checkpoint=lambda c, s: None))
    monkeypatch.setattr(cal, "_measure", lambda *a: SimpleNamespace(overhead_s=0.0))
    monkeypatch.setattr(cal, "_profile", lambda *a: {"sources": {}})
    monkeypatch.setattr(cal, "_add_p2p", lambda *a: None)

    def refused(*a: Any) -> None:
        raise capacity_error("the working set does not fit", ("workload.batch_size",), ())

    monkeypatch.setattr(cal, "_add_in_run", refused)
    with pytest.raises(CapacityError, match="checkpoint=ck: calibrate's in-run runs of m"):
        cal.calibrate("x", "ck", "cpu", tmp_path, 1)


# -- a warning of a run that worked around a failure names no fix -----------------------------


def test_the_n_planners_warning_quotes_no_fix(caplog: pytest.LogCaptureFixture) -> None:
    from planners.n_planner import smallest_n

    def at(n: int) -> Any:
        if n == 2:
            raise capacity_error("n=2 batches do not fit", ("workload.batch_size",), ("gpu",))
        return None, []

    def at_first(n: int) -> Any:  # n=1 fits and hides nothing: n=2 is tried
        return (None, [[1.0]]) if n == 1 else at(n)

    import planners.n_planner as npl

    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as mp:
        mp.setattr(npl, "failed_at", lambda *a: [0])
        got = smallest_n(at_first, 8, 1, 2, lambda x: x)
    assert got.n == 1
    said = caplog.text
    assert "n=2 does not fit memory (n=2 batches do not fit); using n=1" in said, said
    assert "lower" not in said and "raise" not in said, said


def test_a_reruns_warning_quotes_no_fix(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from experiments.common.run_dir import CODE, code_version, finished

    (tmp_path / "summary.json").write_text(json.dumps({"throughput_tok_s": -1}))
    (tmp_path / "config.yaml").write_text("a: 1\n")
    (tmp_path / CODE).write_text(code_version())
    with caplog.at_level(logging.WARNING):
        assert not finished(tmp_path, "a: 1\n")
    assert "throughput_tok_s is" in caplog.text and "running again" in caplog.text
    assert "delete it" not in caplog.text, caplog.text


# -- a bench's options for its own children are not a user's ----------------------------------


@pytest.mark.parametrize("arg", ["role=moepipe", "role=accelerate", "host_room_mb=100"])
def test_a_childs_option_on_a_command_line_is_refused(
    arg: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from experiments.bench import accelerate

    assert accelerate.main([f"checkpoint={tmp_path}/none", arg]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {arg.split('=')[0]}=") and "\n" not in err, err
    assert "not on a command line; leave it out" in err, err


def test_the_bench_tells_a_child_its_role_in_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """run_side's child: no option of the bench's own on its command line; the same, read back
    by the child (`from_the_bench`), from the environment."""
    from experiments.bench.accelerate import from_the_bench
    from experiments.common import peers
    from experiments.common.schema import BenchAccelerateOptions

    started: list[Any] = []

    def popen(cmd: list[str], env: dict[str, str], **kw: Any) -> Any:
        started.append((cmd, env))
        raise OSError(1, "not started")

    monkeypatch.setattr(peers, "drop_page_cache", lambda *a, **k: None)
    monkeypatch.setattr(peers.subprocess, "Popen", popen)
    opts = {"checkpoint": "ck", "role": None, "host_room_mb": 50, "acc_limit_s": 0.0}
    with pytest.raises(OSError, match="not started"):
        peers.run_side("accelerate", opts, None, acc_batch=4)
    cmd, env = started[0]
    assert cmd[3:] == ["checkpoint='ck'"], cmd
    monkeypatch.setenv(peers.CHILD_ENV, env[peers.CHILD_ENV])
    got = from_the_bench(BenchAccelerateOptions(checkpoint="ck"))
    assert (got.role, got.host_room_mb, got.acc_batch) == ("accelerate", 50, 4)
