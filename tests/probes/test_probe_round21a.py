"""Probe round 21a (issue 48): the leftovers of round 20.

Classes:
1. Two wordings for a value that is not an integer: `as_int`, hydra's type errors and the
   summary checks said "not a whole number", core.errors' integer fields "must be an
   integer". Every line now says "must be an integer" (or the bound's words, "must be a
   positive integer"), and "must be a number" / "must be true or false" for the other kinds.
2. A quoted number in a hardware YAML (`sms: "8"`) ran under experiments.run (omegaconf reads
   it as 8) but was refused by the commands that read the YAML themselves (validate,
   calibrate, the benches), in a line with two fixes (the field's and the file's). Every reader
   now takes it as omegaconf does, and a refused field's line carries its one fix.
3. `executor.dtype=bf16` (fp16, half, fp32) was refused with no did-you-mean: each is now
   the dtype it names, as torch and accelerate name it, and a near miss names the nearest.
4. `executor.distributed=true` with `planner.params.n_devices=1` (or 0 on one GPU) ran one
   rank without a word; it is refused as a planner of one device is, naming n_devices.
5. A sweep of a key no point's result depends on (`-m skip_finished=true,false`, trace_json)
   ran two run dirs of one result; a sweep of hydra's own key (`hydra.job.chdir=true,false`)
   was hydra's line with no fix. Each is refused before the sweep, saying what to do.
6. `hydra.launcher.submitit_folder=<a file>` said "File exists; check the file and the disk"
   once the sweep had started; it is named before the sweep, with "pass a folder".
7. Lines that stated the rule and no fix: `planner.params.replica_slots=-1 must be >= 0`, a
   planner's table that cannot be read, the prefetch predictors', EPLB's argument checks and
   resolve.py's workload wrappers, and the commands' own (reproduce_klotski's
   hardware_overrides, an experiment file's reproduce block, joblib's n_jobs, prefetch_eval's
   bounds, bench.real's n_layers, torchrun's --local-ranks-filter). Each now ends in its fix.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.args import as_int
from core.types import Resource
from experiments.common.app import check_keys
from experiments.common.dist_run import n_processes
from experiments.common.hardware import hardware_spec, read_hardware
from experiments.common.hydra_errors import _wrong_type
from experiments.common.schema import HardwareSchema
from planners.ep.placement import read_npy
from planners.prefetch import Predictor
from real.checkpoint import run_dtype
from tests.probes.conftest import ROOT, TINY, raises_one_line
from tests.real.test_executor import spec_for

TINY_HW = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (lambda: as_int("jobs", "two"), "jobs=two: must be an integer"),
        (lambda: as_int("jobs", "2.5", at_least=1), "jobs=2.5: must be a positive integer"),
        (
            lambda: check_keys(HardwareSchema, {**TINY_HW, "n_gpus": "x"}, "hw.yaml"),
            "n_gpus=x: must be an integer in [1, 100000]",  # its range (round 27c)
        ),
    ],
)
def test_not_an_integer_is_said_in_one_wording(fn, words):
    """`as_int` and hydra's type errors said "not a whole number", integer fields "must be an
    integer": one project, two wordings of one refusal."""
    line = raises_one_line(fn, words)
    assert "whole number" not in line


def test_hydra_type_lines_say_must_be():
    """omegaconf's type error for a number and a bool: "must be", as an integer field's."""
    assert "k=abc: must be a number" in str(
        _wrong_type("Value 'abc' could not be converted to Float", "k", "")
    )
    assert "k=2: must be true or false" in str(
        _wrong_type("Value '2' is not a valid bool (type: str)", "k", "")
    )


def _hw_file(tmp_path: Path, gpu: dict, gbps: object = 1.0) -> str:
    d = {**TINY_HW, "gpu": {**TINY_HW["gpu"], **gpu}}
    d["links"] = {**d["links"], "h2d": {"gbps": gbps, "latency_us": 0}}
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def test_a_quoted_number_in_a_hardware_yaml_is_read_as_a_run_reads_it(tmp_path):
    """`sms: "8"` and `gbps: "16"` ran under experiments.run and were refused by validate's,
    calibrate's and the benches' own read of the same file."""
    name = _hw_file(tmp_path, {"sms": "8"}, gbps="16")
    hw = hardware_spec(name, read_hardware(name))
    assert hw.gpu.sms == 8
    assert hw.links[Resource.H2D].bandwidth_bytes_per_s == 16e9


def test_a_refused_hardware_field_carries_one_fix(tmp_path):
    """`sms: -1` said the field's fix and then the file's "fix it or write it again"."""
    name = _hw_file(tmp_path, {"sms": -1})
    line = raises_one_line(lambda: hardware_spec(name, read_hardware(name)), "gpu.sms=-1")
    assert "write it again" not in line


@pytest.mark.parametrize(
    ("alias", "name"),
    [("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32")],
)
def test_a_dtype_alias_is_the_dtype_it_names(alias, name):
    """`executor.dtype=bf16` (or half, fp16, fp32) was "not a compute dtype", with no
    did-you-mean: torch and accelerate name the dtypes so."""
    assert run_dtype(alias) == name


def test_a_dtype_near_miss_names_the_nearest():
    raises_one_line(lambda: run_dtype("bfloat"), "executor.dtype=bfloat", "'bfloat16'")


@pytest.mark.parametrize("planner", ["ep_static", "eplb"])
def test_a_distributed_run_of_one_device_is_refused(tiny_ckpt, planner):
    """n_devices=1 under executor.distributed=true started one rank, as if distributed."""
    spec = replace(spec_for(tiny_ckpt, planner), params={"n_devices": 1})
    raises_one_line(
        lambda: n_processes(str(tiny_ckpt), spec),
        "planner.params.n_devices=1 with executor.distributed=true",
        "executor.distributed=false",
    )


@pytest.mark.parametrize(
    ("swept", "words"),
    [
        ("skip_finished=true,false", "drop skip_finished from the sweep"),
        ("trace_json=true,false", "drop trace_json from the sweep"),
        ("hydra.job.chdir=true,false", "hydra's own keys cannot be swept"),
        ("hydra.verbose=true,false", "run the sweep once per value"),
        ("hydra/job_logging=default,disabled", "hydra/job_logging=<one value>"),
    ],
)
def test_a_sweep_of_a_key_of_no_result_is_refused(swept, words):
    """`-m skip_finished=true,false` ran two run dirs of one result; a sweep of hydra's own
    key was hydra's "Sweeping over Hydra's configuration is not supported", with no fix."""
    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.overrides import check_sweep

    raises_one_line(lambda: check_sweep(CONF_DIR, "config", [*TINY, swept]), swept, words)


def test_a_submitit_folder_that_is_a_file_is_named_before_the_sweep(tmp_path):
    """`hydra.launcher.submitit_folder=<a file>` said "<file>: File exists; check the file and
    the disk" once the sweep had started, naming no key."""
    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.overrides import check_sweep

    (tmp_path / "f").write_text("")
    launcher = ["hydra/launcher=submitit_local", f"hydra.launcher.submitit_folder={tmp_path}/f"]
    args = [*TINY, "workload.seed=1,2", *launcher]
    raises_one_line(
        lambda: check_sweep(CONF_DIR, "config", args),
        f"hydra.launcher.submitit_folder={tmp_path}/f",
        "a folder",
    )


def _replica_slots_below_0() -> None:
    from types import SimpleNamespace

    from planners.ep.params import EPParams, resolve_layout

    p = EPParams(replica_slots=-1)
    model = SimpleNamespace(n_experts=4)
    resolve_layout(p, SimpleNamespace(model=model, hardware=SimpleNamespace(n_gpus=2, name="h")))


@pytest.mark.parametrize(
    ("fn", "fix"),
    [
        (_replica_slots_below_0, "; pass planner.params.replica_slots=0"),
        (lambda: read_npy("/nonexist.npy", "table", (None,), "a list"), "; check the path"),
        (lambda: Predictor("correlation", None, 1), "; give it one"),
    ],
)
def test_a_planners_own_check_says_the_fix(fn, fix):
    """`replica_slots=-1 must be >= 0`, `table /nonexist: cannot read it` and the prefetch
    predictors' checks stated the rule and no fix."""
    raises_one_line(fn, fix)


@pytest.mark.parametrize(
    "args",
    [((4,), 4, 1, 1, 1), ((2, 4), 4, 1, 1, 8), ((2, 4), 5, 1, 1, 2), ((2, 8), 8, 1, 3, 2)],
)
def test_eplbs_own_checks_say_the_fix(args):
    """EPLB's argument checks said the rule (`num_gpus=8 must be in [1, 4]`) and no fix."""
    from planners.eplb_algo import check_args

    raises_one_line(lambda: check_args(*args), "eplb: ", "; pass")


@pytest.mark.parametrize("where", ["workload", "workload.routing"])
def test_a_workload_key_its_class_refuses_says_the_fix(where):
    """resolve.py's wrappers said `workload: Workload.__init__() got an unexpected keyword
    argument 'nosuch'` and nothing to do."""
    from omegaconf import OmegaConf

    from experiments.common.resolve import workload

    d = yaml.safe_load((ROOT / "conf" / "workload" / "tiny.yaml").read_text())
    (d if where == "workload" else d["routing"])["nosuch"] = 1
    cfg = OmegaConf.create({"workload": d})
    raises_one_line(lambda: workload(cfg), f"{where}: ", "'nosuch'", "; check the key's name")


def _commands_checks() -> list[Any]:
    from experiments.common.klotski_conf import _check_reproduce
    from experiments.common.overrides import check_n_jobs
    from experiments.reproduce_klotski import with_overrides

    return [
        lambda: with_overrides({"gpu": {}}, {"gpu.nosuch": 1}),
        lambda: _check_reproduce("klotski_fig14", [1]),
        lambda: check_n_jobs("hydra.launcher.n_jobs=x", "x"),
    ]


@pytest.mark.parametrize("i", range(3))
def test_a_commands_own_check_says_the_fix(i):
    """reproduce_klotski's `hardware_overrides` key that is no field, an experiment file's
    `reproduce` that is no mapping and joblib's n_jobs stated the rule and no fix."""
    line = raises_one_line(_commands_checks()[i])
    assert any(w in line for w in ("; check", "; write", "; pass", "; fix")), line
