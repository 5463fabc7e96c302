"""Probe round 23a (issue 48): round 22's leftovers.

Classes:
1. `~KEY` where KEY is one of a command's own options with a default (a run's `~trace_json`,
   validate's `~gen_len`, report's `~metric`): hydra deleted it and the command ran on the
   default without a word. Refused in one line naming the default and `KEY=VALUE`.
2. A run dir with failed.txt beside summary.json (a finished run's folder whose later run, of
   another config, failed and kept the earlier result) was collected as finished, though the
   sweep's end line named the point as failed (and counted it as finished and reused too).
   collect and report skip it, naming both files and how to collect the earlier result, and
   the sweep's count of finished runs leaves it out.
3. A sweep of `replication.case` or `replication.label`, which only name a run (the replication
   report's case column, its variant row), ran two run dirs of one result: refused before it
   starts, like round 22a's sweep of `reproduce.*`, saying what to sweep instead (the case's
   experiment file, the row's file, which set the name with the settings it names).
4. A run of millions of ops (`validate gen_len=100000`) logged that it needs minutes and GB
   (twice: one batch's, then the group's) and was then refused for GPU memory: the planner's
   placement is now checked first, and a run that passes every check says it once.
5. A trace replay's summary text was read back against its config for tasks and start sequence,
   not its layer cut (`, its first L of 26 MoE layers`): a run dir whose config.yaml has other
   model.moe_layers is skipped too.
6. Fixes that did not help: a one-expert model's n_devices refusal said "pass n_devices=1 to
   1"; klotski's refusal of a CPU below one expert (the disk reads' staging) said "pick a
   smaller n", which no n changes. It says the tier's own fix where the least workload (one
   batch of one sequence) is refused too.
7. The `-m` versus `hydra.run.dir` lines printed a quoted folder with its quotes (round 22b
   read it unquoted in the folder check): they name the folder as the run reads it, and their
   fix is an override that parses back to it (quoted only where hydra needs it); a quoted
   `hydra.job.name='abc'` was refused as not a name.
8. A live eplb run refused mid-plan at a GPU its replay fits: its replica staging follows the
   loads the gates give as it runs, so docs/commands.md says why no bound is checked up front
   (no test: nothing changed in code).
"""

from __future__ import annotations

import importlib
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import raises_one_line, tiny_run


@pytest.mark.parametrize(
    ("schema", "key", "default"),
    [
        ("experiments.common.schema:RunSchema", k, d)
        for k, d in [("trace_json", "false"), ("skip_finished", "true"), ("reproduce", "{}")]
    ]
    + [
        ("experiments.validate:Options", "gen_len", "4"),
        ("experiments.report:Options", "metric", "throughput_tok_s"),
    ],
)
def test_deleting_an_option_is_refused_naming_its_default(
    schema: str, key: str, default: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common import hydra_errors
    from experiments.common.overrides import check_hydra_overrides

    module, _, name = schema.partition(":")
    root = getattr(importlib.import_module(module), name)
    monkeypatch.setattr(hydra_errors, "ROOT_SCHEMA", [root])
    for deleted in (f"~{key}", f"~{key}={default}"):
        line = raises_one_line(partial(check_hydra_overrides, [deleted], hydra_errors.CONF_DIR))
        assert line.startswith(f"{deleted}: an option cannot be deleted"), line
        assert f"its default, {default})" in line and f"pass {key}=VALUE" in line, line


@pytest.mark.parametrize("deleted", ["~model", "~checkpoint", "~workload.seed"])
def test_deleting_a_group_or_a_null_option_is_left_to_hydras_line(
    deleted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common import hydra_errors
    from experiments.common.overrides import check_hydra_overrides
    from experiments.common.schema import RunSchema

    monkeypatch.setattr(hydra_errors, "ROOT_SCHEMA", [RunSchema])
    check_hydra_overrides([deleted], hydra_errors.CONF_DIR)  # hydra's own one line follows


def test_a_finished_run_dir_with_failed_txt_is_skipped_naming_both(tmp_path: Path) -> None:
    from experiments.common.callbacks import failed_runs, finished_runs, mark_run
    from experiments.common.tables import collect

    run = tiny_run(tmp_path / "sweep" / "point")
    mark_run(run, "sweep23a")  # the sweep's end line counts it
    assert len(collect(tmp_path / "sweep")[0]) == 1
    assert finished_runs(tmp_path / "sweep", "sweep23a") == (1, 1)
    (run / "failed.txt").write_text("planner.params.n=-5: must be ...; pass n >= 0\n")
    assert finished_runs(tmp_path / "sweep", "sweep23a") == (0, 0)
    assert failed_runs(tmp_path / "sweep", "sweep23a") == ["point"]
    rows, (skipped,) = collect(tmp_path / "sweep")
    assert rows.empty
    assert skipped.startswith("point: failed: planner.params.n=-5"), skipped
    assert "summary.json beside failed.txt is an earlier run's" in skipped, skipped
    assert "delete failed.txt to collect that one" in skipped and "\n" not in skipped


@pytest.mark.parametrize(
    ("swept", "instead"),
    [
        ("replication.case=a,b", "sweep experiment=replication_A,replication_B instead"),
        ("+replication.label=x,y", "sweep replication_row=A,B instead"),
    ],
)
def test_a_sweep_of_a_replication_name_is_refused(swept: str, instead: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from experiments.common.sweep_points import refuse_sweeps_of_one_result

    parsed = OverridesParser.create().parse_overrides([swept])
    key = swept.lstrip("+").partition("=")[0]
    line = raises_one_line(lambda: refuse_sweeps_of_one_result(parsed), swept, instead)
    assert f"{key} only names a run" in line and f"drop {key} from the sweep" in line, line


@pytest.mark.parametrize(("gpu_gb", "warned"), [(0.001, 0), (None, 1)])
def test_a_long_run_is_said_once_and_only_where_it_is_not_refused(
    gpu_gb: float | None,
    warned: int,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import yaml

    from core.errors import CapacityError
    from core.hardware import HardwareSpec
    from core.spec import Workload
    from experiments.common import pipeline
    from tests.conftest import model_from_conf
    from tests.probes.conftest import ROOT

    monkeypatch.setattr(pipeline, "_available_ram_bytes", lambda: 10**15)
    d = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())
    d["memory_gb"]["gpu"] = gpu_gb or d["memory_gb"]["gpu"]
    hw = HardwareSpec.from_dict(d)
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=100000)
    spec = pipeline.RunSpec(model_from_conf("tiny"), hw, wl, "flexgen", {})
    if warned:
        pipeline.sized_run(spec)
    else:
        with pytest.raises(CapacityError, match="GPU memory"):
            pipeline.sized_run(spec)
    said = [r.getMessage() for r in caplog.records if "minutes to simulate" in r.getMessage()]
    assert len(said) == warned, said


# a trace replay's summary.json routing_fields (round 24a: the routing as data)
_TRACE = {"source": "trace", "tasks": ["law"], "exclude_tasks": [], "seed": 0}


@pytest.mark.parametrize(
    ("n_moe", "cut", "words"),
    [
        (26, 26, None),
        (3, 3, None),
        (None, 3, None),  # a config.json's model
        (4, 3, "len(model.moe_layers) is 4 where the run's summary.json has routing_fields."),
        (3, 26, "len(model.moe_layers) is 3 where the run's summary.json has routing_fields."),
    ],
)
def test_a_trace_replays_layer_cut_is_checked_against_the_config(
    n_moe: int | None, cut: int, words: str | None
) -> None:
    from experiments.common.run_config import config_disagrees

    model = {} if n_moe is None else {"moe_layers": list(range(1, n_moe + 1))}
    config = {"model": model, "workload": {"seed": 0, "routing": {"source": "trace"}}}
    line = config_disagrees(
        config, {"routing": "", "routing_fields": {**_TRACE, "moe_layers": cut}}
    )
    assert (line is None) if words is None else (line is not None and words in line), line


def _hardware(cpu_bytes: int = 10**9, n_gpus: int = 1, gpu_bytes: int = 10**7) -> Any:
    from core.hardware import HardwareSpec

    return HardwareSpec.from_dict(
        dict(
            name="probe23a",
            memory_gb=dict(gpu=gpu_bytes / 1e9, cpu=cpu_bytes / 1e9, disk=1.0),
            gpu=dict(tflops=0.05, mem_bw_gbps=10),
            cpu=dict(tflops=0.02, mem_bw_gbps=5),
            links=dict(h2d=dict(gbps=5), d2h=dict(gbps=5), disk=dict(gbps=1)),
            n_gpus=n_gpus,
        )
    )


_WL = dict(batch_size=2, n_batches=2, prompt_len=6, gen_len=3)


def test_klotski_on_a_cpu_below_one_expert_says_the_tiers_fix_alone() -> None:
    from core.spec import Workload
    from experiments.common.pipeline import RunSpec, simulate_run
    from tests.conftest import model_from_conf

    spec = RunSpec(
        model_from_conf("tiny"), _hardware(1000, gpu_bytes=400_000), Workload(**_WL), "klotski"
    )
    line = raises_one_line(lambda: simulate_run(spec), "staging area", "add CPU memory")
    assert "smaller n" not in line and line.endswith("add CPU memory"), line


@pytest.mark.parametrize("n_devices", [0, 2])
def test_a_one_expert_models_n_devices_says_pass_1(n_devices: int) -> None:
    from dataclasses import replace

    from core.spec import Workload
    from experiments.common.pipeline import RunSpec, simulate_run
    from tests.conftest import model_from_conf

    model = replace(model_from_conf("tiny"), n_experts=1, top_k=1)
    wl, hw = Workload(**_WL), _hardware(n_gpus=2)
    spec = RunSpec(model, hw, wl, "ep_static", {"n_devices": n_devices})
    line = raises_one_line(lambda: simulate_run(spec), f"n_devices={n_devices}")
    assert line.endswith("pass n_devices=1 (one expert: one device holds it)"), line


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["-m", "hydra.run.dir='/tmp/r'"],
            "hydra.run.dir=/tmp/r: a single run's folder, which a sweep (-m) does not use; "
            "pass hydra.sweep.dir=/tmp/r",
        ),
        (
            ["-m", "hydra.run.dir='/tmp/a b'"],
            "hydra.run.dir='/tmp/a b': a single run's folder, which a sweep (-m) does not use; "
            "pass \"hydra.sweep.dir='/tmp/a b'\"",
        ),
        (
            ['hydra.sweep.dir="/tmp/é"'],
            "hydra.sweep.dir=/tmp/é: a sweep's folder, which a single run (no -m) does not use; "
            "pass \"hydra.run.dir='/tmp/é'\", or add -m",
        ),
        (["hydra.job.name='abc'"], None),  # the name abc: it was refused as not one
    ],
)
def test_a_misplaced_run_dir_is_named_as_the_run_reads_it(
    args: list[str], line: str | None
) -> None:
    from experiments.run import misplaced_output

    assert misplaced_output(args) == line
