"""Round 24b of issue 48: last session's leftovers, one class a test group:

- a capacity refusal at the GPU's edge named a smaller workload where the weights alone exceed
  the GPU (the placement had its working set as one number, not its parts), or where the least
  workload leaves no expert cache or no room for expert parallelism's experts: a refusal names
  only fixes that help;
- a real run past its model's context logged that warning, then its plan's refusal (and so did
  a checkpoint's notes, read before the plan, in a run and in validate): a refused run must
  print only its refusal;
- a researcher's own planner whose schedule breaks the IR was an "internal error ... please
  report it": it is theirs to fix, so the line names the planner and the rule; the project's
  own planners' stay a bug to report;
- round 23a's read-back of a trace replay's layer cut against model.moe_layers did nothing where
  the model is a config.json's (model.hf_config, a real run's checkpoint): config.yaml holds
  no layers there, so config.json's are read;
- make_checkpoint wrote what transformers accepts and moepipe's run cannot use: rms_norm_eps=1e308
  (every normalised activation 0), a rope_theta float32 makes 0 or inf, vocab_size=1.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from core.errors import MoepipeError, PlannerBug, ScheduleBug
from core.planner import PlanContext, Planner
from core.schedule import ScheduleBuilder
from core.spec import Workload
from core.types import OpKind, Resource, Tier
from experiments.common.cli import error_line
from experiments.common.pipeline import RunSpec, simulate_run
from planners import planner_names, registry
from planners.registry import Entry, make_planner
from tests.conftest import model_from_conf
from tests.probes.conftest import one_line, raises_one_line, real_args
from tests.probes.test_probe_round21b import TINY_WL, hardware

LEAST_WL = Workload(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)


def _refusal(
    planner: str, memory: dict[Tier, int], workload: Workload = TINY_WL, *names: str, **hw: Any
) -> str:
    """The one line refusing a simulated run of the tiny model with `memory` on hardware=tiny
    (`hw` changed as `hardware` takes them), naming each of `names`."""
    tiny = hardware(**hw)
    tiny = replace(tiny, memory_bytes={**tiny.memory_bytes, **memory})
    spec = RunSpec(model_from_conf("tiny"), tiny, workload, planner)
    return raises_one_line(lambda: simulate_run(spec), *names)


# (planner, GPU bytes, workload): the streamed weights alone, or one expert at the least
# workload, exceed the GPU
@pytest.mark.parametrize(
    ("planner", "gpu", "workload"),
    [
        ("klotski", 10_000, TINY_WL),
        ("flexgen", 10_000, TINY_WL),
        ("moe_infinity", 10_000, TINY_WL),
        ("moe_infinity", 70_000, LEAST_WL),
        ("moe_infinity", 70_000, TINY_WL),  # its working set, where no workload leaves a cache
        ("ep_static", 40_000, TINY_WL),  # its working set, where no workload leaves the experts
        ("mixtral_offloading", 70_000, LEAST_WL),
    ],
)
def test_a_gpu_no_workload_fits_names_no_workload(
    planner: str, gpu: int, workload: Workload
) -> None:
    """klotski at 1e-05 GB: "lower workload.prompt_len or workload.batch_size ..., or raise
    hardware.memory_gb.gpu"; the caches at batch 1: "use a smaller batch"; moe_infinity's
    working set named a smaller workload, whose cache then held no expert."""
    line = _refusal(planner, {Tier.GPU: gpu}, workload, "raise hardware.memory_gb.gpu")
    assert "workload." not in line and "smaller batch" not in line, line


_GPU_BYTES = [5_000, 40_000, 70_000, 100_000, 150_000, 300_000, 500_000, 800_000]


@pytest.mark.slow
@pytest.mark.parametrize("planner", planner_names())
def test_every_planner_names_a_smaller_workload_only_where_one_fits(planner: str) -> None:
    """At each GPU size the least workload (one sequence, one token each way) is refused at,
    TINY_WL's refusal names no smaller workload."""

    def refusal(gpu: int, workload: Workload) -> str | None:
        tiny = hardware()
        tiny = replace(tiny, memory_bytes={**tiny.memory_bytes, Tier.GPU: gpu})
        try:
            simulate_run(RunSpec(model_from_conf("tiny"), tiny, workload, planner))
        except MoepipeError as e:
            return error_line(e)
        return None

    for gpu in _GPU_BYTES:
        if refusal(gpu, LEAST_WL) is not None:
            line = refusal(gpu, TINY_WL) or ""
            assert not any(w in line for w in ("workload.", "smaller batch", "smaller n")), line


def test_a_gpu_a_smaller_workload_fits_still_names_it() -> None:
    line = _refusal("flexgen", {Tier.GPU: 600_000}, TINY_WL.with_(prompt_len=4000))
    assert "lower workload.prompt_len" in line, line


@pytest.mark.parametrize("has_disk", [True, False])
def test_weights_past_every_tier_name_no_smaller_workload(has_disk: bool) -> None:
    """Weights larger than GPU + CPU + disk were told to "add memory or shrink the workload"."""
    total = model_from_conf("tiny").total_bytes
    tiers = {Tier.GPU: total // 4, Tier.CPU: total // 4, Tier.DISK: total // 4 if has_disk else 0}
    disk = {} if has_disk else {"memory_gb.disk": None}
    line = _refusal("flexgen", tiers, TINY_WL, "add memory", **disk)
    assert "shrink the workload" not in line, line


def _edited(ckpt: Path, to: Path, **fields: Any) -> Path:
    """A copy of checkpoint `ckpt` at `to`, its config.json's `fields` set."""
    ckpt = shutil.copytree(ckpt, to)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **fields}))
    return ckpt


@pytest.fixture(scope="module")
def short_context_ckpt(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_ckpt with max_position_embeddings=8: TINY_WL's 8 + 3 tokens run past it."""
    return _edited(tiny_ckpt, tmp_path_factory.mktemp("short") / "ck", max_position_embeddings=8)


@pytest.mark.parametrize(("gpu", "warned"), [(10_000, 0), (None, 1)])
def test_a_run_past_its_context_warns_only_once_its_plan_is_accepted(
    short_context_ckpt: Path, gpu: int | None, warned: int, caplog: pytest.LogCaptureFixture
) -> None:
    from experiments.common.real_run import real_execute

    tiny = hardware()
    if gpu is not None:
        tiny = replace(tiny, memory_bytes={**tiny.memory_bytes, Tier.GPU: gpu})
    spec = RunSpec(model_from_conf("tiny"), tiny, TINY_WL, "flexgen")
    if warned:
        real_execute(short_context_ckpt, spec)
    else:
        raises_one_line(lambda: real_execute(short_context_ckpt, spec), "GPU memory")
    said = [r for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(said) == warned, said


@pytest.mark.parametrize("gpu_gb", [0.00001, None])
def test_a_checkpoints_note_is_said_only_once_its_plan_is_accepted(
    tiny_ckpt: Path, tmp_path: Path, cli_here: Any, gpu_gb: float | None
) -> None:
    """A config.json cutting its weights' layers (num_hidden_layers=1 of 2) logged that note
    as the checkpoint was read, then the plan's refusal (GPU memory)."""
    ckpt = _edited(tiny_ckpt, tmp_path / "ck", num_hidden_layers=1)  # a note once a process
    gpu = [f"hardware.memory_gb.gpu={gpu_gb}"] if gpu_gb else []
    r = cli_here("experiments.run", *real_args(ckpt, tmp_path / "r", *gpu))
    said = (r.stdout + r.stderr).count("num_hidden_layers=1 of the weights' 2 layers")
    if gpu_gb:
        one_line(r, "GPU memory")
    assert said == (0 if gpu_gb else 1), r.stdout + r.stderr


@pytest.mark.parametrize("refused", [True, False])
def test_validates_checkpoint_note_waits_for_an_accepted_real_run(
    tiny_ckpt: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    refused: bool,
) -> None:
    """validate read the checkpoint (its note), then refused: every planner's real run was."""
    from core.errors import CapacityError
    from experiments import validate as v

    def run(ckpt: Path, spec: Any, mode: str, **kw: Any) -> Any:
        if refused:
            raise CapacityError("device pool 1 MB cannot hold one layer's working set (9 MB)")
        kw["on_planned"]()
        raise MoepipeError("stop here: the plan was accepted")

    monkeypatch.setattr(v, "real_execute", run)
    ckpt = _edited(tiny_ckpt, tmp_path / "ck", num_hidden_layers=1)
    opts = dict(v._DEFAULTS, checkpoint=str(ckpt), hardware="tiny", planners="flexgen")
    ends = "every planner was skipped" if refused else "the plan was accepted"
    from experiments.common.held_warnings import warnings_held

    with pytest.raises(MoepipeError, match=ends), warnings_held():  # the shared entry's hold
        v.validate(dict(opts, repeats=1, out=str(tmp_path / "out"), gpu_frac=4, cpu_frac=4))
    said = [r for r in caplog.records if "num_hidden_layers=1 of" in r.getMessage()]
    assert len(said) == (0 if refused else 1), said


@dataclass(frozen=True)
class _NoParams:
    pass


class _DepOnLater:
    """A researcher's planner: flexgen's schedule and one op that depends on a later op."""

    def __init__(self, params: _NoParams) -> None:
        pass

    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        make_planner("flexgen").plan(ctx, out)
        out.add(OpKind.FFN, out.stream("probe", Resource.GPU), deps=(len(out.ops) + 1,))

    choose_n_batches = Planner.choose_n_batches


def test_a_researchers_planner_that_breaks_the_ir_is_told_to_fix_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(registry._REGISTRY, "probe_dep", Entry("probe_dep", _DepOnLater, _NoParams))
    spec = RunSpec(model_from_conf("tiny"), hardware(), TINY_WL, "probe_dep")
    line = raises_one_line(lambda: simulate_run(spec), "planner probe_dep's schedule", "must name")
    assert "fix planner probe_dep" in line and "report" not in line, line


def test_a_shipped_planners_broken_schedule_stays_a_bug_to_report() -> None:
    assert "klotski" in registry.project_planners()
    with pytest.raises(ScheduleBug) as e, registry.own_bugs("klotski"):
        raise ScheduleBug("op 1: deps (0, 2) must name earlier ops")
    assert not isinstance(e.value, PlannerBug) and error_line(e.value) is None


_TRACE = "trace esft-dsv2lite [law] 9 tokens in 4 sequences, start seq 0, wrapped 0x"
_TRACE_FIELDS = {"source": "trace", "trace": "esft-dsv2lite", "tasks": ["law"], "seed": 0}


@pytest.mark.parametrize("key", ["model.hf_config", "checkpoint"])
@pytest.mark.parametrize(("cut", "stale"), [(2, False), (3, True), (None, True)])
def test_a_trace_replays_layer_cut_is_checked_against_config_json(
    tiny_ckpt: Path, key: str, cut: int | None, stale: bool
) -> None:
    """tiny_ckpt's config.json has 2 MoE layers: a summary of the trace's first 3 (or all 26)
    was collected as its run (config.yaml's model.moe_layers: null, or a config group's)."""
    from experiments.common.run_config import config_disagrees

    def config(path: Path) -> dict[str, Any]:  # as config.yaml holds it: moe_layers null
        model = {"moe_layers": [0] if key == "checkpoint" else None}  # model=...: not the run's
        run = {"executor": {"name": "real"}, "checkpoint": str(path)}
        return {
            "model": model | ({"hf_config": str(path)} if key == "model.hf_config" else {}),
            "workload": {"seed": 0, "routing": {"source": "trace"}},
            **(run if key == "checkpoint" else {}),
        }

    said = _TRACE + (f", its first {cut} of 26 MoE layers" if cut else "")
    ran = {"routing": said, "routing_fields": _TRACE_FIELDS | {"moe_layers": cut or 26}}
    line = config_disagrees(config(tiny_ckpt), ran)
    assert (line is not None and "config.json" in line and "2 MoE layers" in line) == stale, line
    assert config_disagrees(config(tiny_ckpt / "gone"), ran) is None  # moved away


@pytest.mark.parametrize(
    ("field", "value", "span"),
    [
        ("rms_norm_eps", 1e-300, "in [1.18e-38, 1)"),
        ("vocab_size", 1, "at least 2"),
    ],
)
def test_make_checkpoint_refuses_a_value_its_run_cannot_use(
    field: str, value: float, span: str
) -> None:
    """Each was written with exit 0: the run generated token 0 at every step. (An rms_norm_eps
    of 1 or more and a rope_theta past 1e12 or below 1 are refused by the spec itself: round
    28c's test_probe_round28c.)"""
    from experiments.make_checkpoint import check_usable
    from real.checkpoint import reduced_spec

    spec = reduced_spec("mixtral-tiny", **{field: value})
    raises_one_line(lambda: check_usable(spec), f"{field}=", f"pass {field} {span}")
    for eps in (0.999, 1.18e-38):
        check_usable(reduced_spec("mixtral-tiny", rms_norm_eps=eps, rope_theta=1e12))


def test_make_checkpoint_writes_nothing_it_refuses(tmp_path: Path, cli_here: Any) -> None:
    out = tmp_path / "ck"
    r = cli_here("experiments.make_checkpoint", "model=mixtral-tiny", f"out={out}", "vocab_size=1")
    one_line(r, "vocab_size=1", "at least 2")
    assert not out.exists()
