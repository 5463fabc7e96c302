"""Probe round 22a (issue 48): the leftovers of round 21.

Classes:
1. Refusals that named what is wrong and stopped there: a file that cannot be read, the
   synthetic generator's and routing's shape checks, an ESFT dump's line, tar and task count,
   a config.json a family cannot express, disk_dtype_bytes, a planner's integer and
   cache_share bounds, a flag without its value, planner.params not a mapping, the rendezvous
   timeout's range, --rdzv_conf's syntax, a config option that is a folder, a real run's op that
   ran past its stall timeout. Each ends in its fix.
2. A schedule that breaks the IR's own rules (deps, streams, spans, gates, frees) is a
   planner's bug (`ScheduleBug`): the CLI says "internal error ... please report it", where it
   printed the planner's bug as the user's mistake. A schedule a config can fix (an allocation
   over a tier, memory that never frees) stays the user's one line, naming the tier to raise.
3. A hand-made run dir whose summary.json's `routing` (`synthetic skew=2 ... seed=0`) is not
   what config.yaml's workload draws was collected as that config's run; it is skipped.
4. A sweep folder template that reaches a swept key only through another key
   (`hydra.sweep.dir=out/${tag}`, `+tag=${planner.name}`) was not seen as naming it: a sweep
   dir per point ran, and a subdir that does separate the points was refused.
5. A simulated run on `model.hf_config` counted the checkpoint's weight files in config.yaml's
   model-files line, though it reads config.json alone: a rewritten weight file ran a finished
   simulation again. The line counts what the run reads.
6. A sweep of reproduce_klotski's `reproduce.*` (which a run ignores) or of
   executor.rendezvous_timeout_s (a wait, no result) ran runs of one result; it is refused as
   a sweep of skip_finished is.
7. A hardware profile could not say "no disk tier" (`memory_gb.disk` required, `links.disk`
   too). `disk: null` now says it: every planner places the model in GPU and CPU memory, and
   one that does not fit there is refused in one line naming hardware.memory_gb.disk.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.errors import MoepipeError
from core.spec import Workload
from tests.conftest import model_from_conf, random_routing
from tests.probes.conftest import TINY, raises_one_line, tiny_run


def _tar(tmp_path: Path) -> Any:
    from core.trace_convert import convert_esft

    (tmp_path / "dump.tar.gz").write_bytes(b"not a tar")
    return lambda: convert_esft(tmp_path / "dump.tar.gz", tmp_path / "o.npz", 8, 2, 1)


def _line(tmp_path: Path) -> Any:
    from core.trace_convert import convert_esft

    (tmp_path / "d" / "law").mkdir(parents=True)
    (tmp_path / "d" / "law" / "expert_weights_1.txt").write_text("1\t2\t0.5\t0.5\n")
    return lambda: convert_esft(tmp_path / "d", tmp_path / "o.npz", 8, 2, 1)


def _layer_0(tmp_path: Path) -> Any:
    from core.trace_convert import convert_esft

    (tmp_path / "d" / "law").mkdir(parents=True)
    (tmp_path / "d" / "law" / "expert_weights_0.txt").write_text("1\t2\t\t0.5\t0.5\n")
    return lambda: convert_esft(tmp_path / "d", tmp_path / "o.npz", 8, 2, 1)


def _coverage(tmp_path: Path) -> Any:
    model = model_from_conf("tiny")
    r = random_routing(model, Workload(batch_size=1, n_batches=1, prompt_len=2, gen_len=1))
    return lambda: r.check_fits(model, Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3))


def _from_spec(tmp_path: Path) -> Any:
    from core.hf_config.from_spec import spec_to_hf_config

    model = model_from_conf("tiny")
    # (shared experts on a Mixtral, this case before round 28c, are refused by the spec itself)
    return lambda: spec_to_hf_config(replace(model, moe_layers=(1,), dense_ffn_size=64))


def _params(name: str, values: dict[str, Any]) -> Any:
    from planners.registry import make_params

    return lambda tmp_path: lambda: make_params(name, values)


def _synthetic(tmp_path: Path) -> Any:
    from core.spec import RoutingConfig
    from core.synthetic import draw

    return lambda: draw(RoutingConfig(), 1, 1, 1, 2, 3, 0)


def _counts(shape: tuple[int, ...], n_experts: int | None = None) -> Any:
    from core.synthetic import fit_to_counts

    return lambda tmp_path: lambda: fit_to_counts(np.ones(shape), 1, n_experts=n_experts)


def _flag(tmp_path: Path) -> Any:
    from experiments.common.flags import check_flags

    return lambda: check_flags(["--cfg"])


def _stall(tmp_path: Path) -> Any:
    from types import SimpleNamespace

    from real.interpreter import Interpreter

    op = SimpleNamespace(label=lambda: "load expert 0")
    run = SimpleNamespace(ops=[op], stall_timeout_s=1.0)

    def stalled() -> None:
        raise Interpreter._stall(run, [(0, 0.0)], 5.0, 0.0)  # type: ignore[arg-type,misc]

    return stalled


def _hardware_layout(tmp_path: Path) -> Any:
    import yaml

    from core.hardware import HardwareSpec
    from tests.probes.conftest import ROOT

    d = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())
    return lambda: HardwareSpec.from_dict({**d, "memory_gb": "x"})


def _unknown_task(tmp_path: Path) -> Any:
    from types import SimpleNamespace

    from core.traces import select_tokens

    trace = SimpleNamespace(task_names=("law",))
    return lambda: select_tokens(trace, ("nosuch",), ())  # type: ignore[arg-type]


def _torchrun_usage(tmp_path: Path) -> Any:
    from experiments import torchrun

    return lambda: torchrun.main(["--nproc-per-node"])


def _columns(tmp_path: Path) -> Any:
    from experiments.common.klotski_conf import _check_reproduce

    return lambda: _check_reproduce("other", {"columns": 3})


CLASS1 = {
    "tar": (_tar, "re-download it, or pass the dump's folder"),
    "dump_line": (_line, "replace the file with the upstream dump"),
    "layer_numbering": (_layer_0, "rename them so"),
    "routing_coverage": (_coverage, "pass routing that covers them"),
    "from_spec": (_from_spec, "choose a model without them"),
    "synthetic_top_k": (_synthetic, "pass top_k <= n_experts"),
    "counts_shape": (_counts((1,)), "pass each expert's token count"),
    "counts_n_experts": (_counts((3,), 1), "pass n_experts >= 2"),
    "eplb_window": (_params("eplb", {"window": 0}), "pass planner.params.window=1 or more"),
    "klotski_n": (_params("klotski", {"n": -5}), "pass planner.params.n=-1 or more"),
    "cache_share": (_params("moe_infinity", {"cache_share": 0}), "pass a share in it"),
    "flag_value": (_flag, "give it one"),
    "real_run_stalled": (_stall, "check the disk and the other ranks"),
    "hardware_layout": (_hardware_layout, "write it as conf/hardware/'s files have it"),
    "unknown_task": (_unknown_task, "pass names from those"),
    "torchrun_usage": (_torchrun_usage, "run python -m experiments.torchrun --help"),
    "klotski_columns": (_columns, "write it as a list of {model, hardware, n} mappings"),
}


@pytest.mark.parametrize(("make", "fix"), list(CLASS1.values()), ids=list(CLASS1))
def test_a_refusal_ends_in_its_fix(tmp_path: Path, make: Any, fix: str) -> None:
    """Each said what is wrong (`not a readable tar archive (...)`, `top_k=3 exceeds
    n_experts=2`, `cache_share=0 must be in (0, 1]`) and no word of what to do."""
    raises_one_line(make(tmp_path), fix)


def _denied(*a: Any, **kw: Any) -> bytes:
    raise PermissionError(13, "Permission denied")


@pytest.mark.parametrize(
    ("module", "fn", "arg"),
    [
        ("core.hf_config.fields", "read_hf_config", "."),
        ("core.hf_config.generation", "_read_object", "generation_config.json"),
        ("experiments.common.hardware", "read_hardware", None),
    ],
    ids=["config_json", "generation_config", "hardware"],
)
def test_a_file_that_cannot_be_read_says_what_to_do(
    tmp_path: Path, monkeypatch: Any, module: str, fn: str, arg: str | None
) -> None:
    """`config.json: cannot read it (Permission denied)`, and no word of what to do."""
    import importlib

    mod = importlib.import_module(module)
    monkeypatch.setattr(mod, "read_small", _denied)
    where = "tiny" if arg is None else tmp_path / arg
    line = raises_one_line(lambda: getattr(mod, fn)(where), "Permission denied")
    assert line.endswith("check that it is a file you may read"), line


def _schedule(*ops: dict[str, Any]) -> Any:
    from core.schedule import ScheduleBuilder
    from core.types import OpKind, Resource, Tier

    b = ScheduleBuilder({Tier.GPU: 10**9, Tier.CPU: 4 * 10**9, Tier.DISK: 10**11})
    b.stream("weights", Resource.H2D)
    b.stream("compute", Resource.GPU)
    b.add(OpKind.GATE, "compute", step=0, layer=0, batch=0)
    load = dict(src=Tier.CPU, dst=Tier.GPU, nbytes=1, layer=0, alloc_tier=Tier.GPU)
    for op in ops:
        if "alloc_bytes" in op:
            b.add(OpKind.LOAD, "weights", **{**load, **op})
        else:
            b.add(OpKind.FFN, op.pop("stream", "compute"), layer=0, **op)
    return b.build()


PLANNER_BUGS = {
    "dep_on_later": lambda: ({"deps": (0, 2)},),
    "undeclared_stream": lambda: ({"stream": "nosuch"},),
}


@pytest.mark.parametrize("ops", list(PLANNER_BUGS.values()), ids=list(PLANNER_BUGS))
def test_a_planners_bad_schedule_is_an_internal_error(
    tmp_path: Path, monkeypatch: Any, ops: Any
) -> None:
    """`op 1: deps (0, 2) must name earlier ops` was printed as the user's mistake, though no
    config of theirs makes or fixes it."""
    import tempfile

    from core.errors import ScheduleBug
    from core.schedule import validate
    from experiments.common.cli import TRACEBACK_ENV, any_error_line, error_line

    with pytest.raises(ScheduleBug) as e:
        validate(_schedule(*ops()))
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert error_line(e.value) is None
    assert any_error_line(e.value).startswith("internal error (ScheduleBug: op 1")


@pytest.mark.parametrize(
    ("ops", "fix"),
    [
        (({"alloc_bytes": 2 * 10**9},), "raise hardware.memory_gb.gpu"),
        (
            ({"alloc_bytes": 3 * 10**9 // 4}, {"alloc_bytes": 3 * 10**9 // 4}),
            "raise hardware.memory_gb.gpu, or pass planner params that hold less",
        ),
    ],
    ids=["over_the_tier", "never_freed"],
)
def test_a_schedule_a_config_can_fix_names_the_tier(ops: Any, fix: str) -> None:
    """`allocates 2 GB of gpu, only 1 GB is not resident` and `schedule can never finish: ...`
    named the fault and no fix."""
    from core.schedule import validate
    from experiments.common.cli import error_line

    with pytest.raises(MoepipeError) as e:
        validate(_schedule(*ops))
    line = error_line(e.value)
    assert line is not None and fix in line, line


_SYNTH = {"source": "synthetic", "skew": 1.0, "layer_corr": 0.5, "reuse": 0.25, "hot_experts": 0}
# a synthetic run's summary.json routing_fields, as the run of _SYNTH with seed 0 writes them
_RAN = {**_SYNTH, "hot_share": 0.0, "seed": 0}
_TRACE = {"source": "trace", "tasks": ["law"], "exclude_tasks": [], "start_seq": 0, "seed": 0}


@pytest.mark.parametrize(
    ("routing", "ran", "words"),
    [
        ({}, _RAN, None),
        ({"executor": {"name": "real", "routing_mode": "replay"}}, _RAN, None),
        ({"executor": {"name": "real", "routing_mode": "live"}}, {"source": "live"}, None),
        (
            {"skew": 2.0},
            _RAN,
            "workload.routing.skew is 2.0 where the run's summary.json has routing_fields.skew 1",
        ),
        ({}, {**_RAN, "seed": 3}, "workload.seed is 0"),
        ({}, {**_RAN, "hot_experts": 2, "hot_share": 0.5}, "hot_experts is 0"),
        ({"source": "trace"}, _RAN, "workload.routing.source is 'trace'"),
        (
            {"source": "trace", "tasks": ["law"]},
            {**_TRACE, "tasks": ["law", "math"]},
            "workload.routing.tasks is ['law'] where the run's summary.json has routing_fields.",
        ),
        (
            {"source": "trace"},
            {**_TRACE, "start_seq": 3, "seed": 3},
            "workload.seed is 0 where the run's summary.json has routing_fields.seed 3",
        ),
    ],
    ids=["same", "replay", "live", "skew", "seed", "hot", "source", "tasks", "trace_seed"],
)
def test_a_summarys_routing_is_checked_against_the_config(
    routing: dict[str, Any], ran: dict[str, Any], words: str | None
) -> None:
    """A hand-made run dir whose summary.json ran `synthetic skew=2 ...` was collected as the
    run of a config.yaml with `workload.routing.skew: 1.0` (its `routing_fields` since round
    24a: the routing as data)."""
    from experiments.common.run_config import config_disagrees

    executor = routing.pop("executor", {})
    config = {"executor": executor, "workload": {"seed": 0, "routing": {**_SYNTH, **routing}}}
    line = config_disagrees(config, {"routing": "(its text)", "routing_fields": ran})
    assert (line is None) if words is None else (line is not None and words in line), line


def test_a_run_dir_whose_routing_is_not_its_configs_is_skipped(tmp_path: Path) -> None:
    """collect's `skipped` line, as for a planner param the summary records otherwise."""
    import yaml

    from experiments.common.tables import collect

    run = tiny_run(tmp_path / "sweep" / "r")
    (run / "files.sha256").unlink()
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert collect(tmp_path / "sweep")[1] == []
    config["workload"]["routing"]["skew"] = 3.5
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and "workload.routing.skew is 3.5" in problems[0], problems
    assert "not the config it ran" in problems[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["planner=flexgen,klotski", "hydra.sweep.dir=out/${tag}", "+tag=${planner.name}"],
            "names planner (through the keys it interpolates)",
        ),
        (
            ["workload.gen_len=2,3", "hydra.sweep.dir=out/${tag}", "+tag=g${workload.gen_len}"],
            "names workload.gen_len (through",
        ),
        (
            [
                "planner=flexgen,klotski",
                "hydra.sweep.subdir=${hydra.job.override_dirname}_${tag}",
                "+tag=${planner.name}",
                "hydra.job.config.override_dirname.exclude_keys=[planner]",
            ],
            None,
        ),
        (["planner=flexgen,klotski", "hydra.sweep.subdir=${tag}", "+tag=${hydra.job.num}"], None),
    ],
    ids=["dir_group", "dir_key", "subdir_excluded_but_reached", "job_num"],
)
def test_a_sweep_folder_reached_through_an_interpolation_counts(
    args: list[str], words: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first two ran a sweep folder per point, the sweep counting one; the last two were
    refused ("left out of hydra.job.override_dirname", omegaconf's missing hydra.job.num)
    though each point has a folder of its own. The sweep folder's checks alone: the per-point
    check a command registers (`POINT_CHECK`, left set by any in-process command run before)
    is taken away, as a job resolving `${hydra.job.num}` outside hydra's node fails on it."""
    import experiments.run  # noqa: F401 (its help config, which a composed config names)
    from experiments.common import sweep_points
    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.overrides import check_sweep

    monkeypatch.setattr(sweep_points, "POINT_CHECK", [])

    given = [a for a in TINY if not a.startswith("planner=")] + args
    if words is None:
        check_sweep(CONF_DIR, "config", given)
    else:
        raises_one_line(lambda: check_sweep(CONF_DIR, "config", given), words)


def test_a_simulated_runs_model_files_line_counts_config_json_alone(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """A weight file rewritten (or one copied in) beside config.json changed the line, and a
    finished simulation ran again; config.json rewritten changes it."""
    import json
    import shutil

    from omegaconf import OmegaConf

    from experiments.run import model_files_line

    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    sim = OmegaConf.create({"executor": {"name": "sim"}, "model": {"hf_config": str(ck)}})
    before = model_files_line(sim)
    (ck / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes() + b"\0")
    shutil.copyfile(ck / "model.safetensors", ck / "model-00001-of-00002.safetensors")
    assert model_files_line(sim) == before
    config = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(config | {"hidden_size": 128}))
    assert model_files_line(sim) != before


@pytest.mark.parametrize(
    ("swept", "words"),
    [
        ("+reproduce.n=1,2", "reproduce.n is experiments.reproduce_klotski's"),
        ("+reproduce=1,2", "drop reproduce from the sweep"),
        ("executor.rendezvous_timeout_s=60,120", "drop executor.rendezvous_timeout_s from"),
    ],
)
def test_a_sweep_of_a_commands_key_of_no_result_is_refused(swept: str, words: str) -> None:
    """Each ran two run dirs of one result."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.common.sweep_points import refuse_sweeps_of_one_result

    parsed = OverridesParser.create().parse_overrides([swept])
    raises_one_line(lambda: refuse_sweeps_of_one_result(parsed), swept, words)


def _no_disk(cpu_gb: float = 4.0) -> Any:
    import yaml

    from core.hardware import HardwareSpec
    from tests.probes.conftest import ROOT

    d = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())
    d["memory_gb"] |= {"disk": None, "cpu": cpu_gb}
    d["links"] = {k: v for k, v in d["links"].items() if not k.startswith("disk")}
    return HardwareSpec.from_dict(d)


@pytest.mark.parametrize("planner", ["flexgen", "klotski", "fiddler"])
def test_a_machine_without_a_disk_tier_runs_what_fits_in_memory(planner: str) -> None:
    """`memory_gb.disk: null` said "must be a positive capacity, got nothing" (and a profile
    without links.disk "links.disk is missing"), though the model fits in CPU memory."""
    from core.routing import load_routing
    from experiments.common.pipeline import RunSpec, simulate_run, sized_run

    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    spec, made = sized_run(RunSpec(model_from_conf("tiny"), _no_disk(), wl, planner, {}))
    result = simulate_run(spec, load_routing(spec.model, spec.workload), made)
    assert not _no_disk().has_disk and result.summary["makespan_s"] > 0


def test_a_model_past_gpu_and_cpu_without_a_disk_tier_names_the_disk() -> None:
    from core.routing import load_routing
    from experiments.common.pipeline import RunSpec, build_schedule

    wl = Workload(batch_size=1, n_batches=1, prompt_len=2, gen_len=1)
    spec = RunSpec(model_from_conf("mixtral-8x7b"), _no_disk(), wl, "flexgen", {})
    routing = load_routing(spec.model, wl)
    line = raises_one_line(lambda: build_schedule(spec, routing), "no disk tier")
    assert "set hardware.memory_gb.disk" in line, line
