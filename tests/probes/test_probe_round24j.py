"""Round 24j of issue 48: this afternoon's leftovers. Classes:

- error types lost on the way: a wrapper that reworded an error (`named_as`'s own option
  names, validate's `planner_params:`, a hardware file's path, a rank's `rank R:`, calibrate's
  in-run refusal) raised a plain MoepipeError (or a fixed list of kinds), so a config error, a
  shipped planner's bug (an internal error) and a refusal were all one kind to the CLI; a
  GpuEdgeError reworded by replication's `named_as_written` was a TypeError. Now each keeps its
  type and parts (`core.errors.reworded`).
"""

from __future__ import annotations

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
