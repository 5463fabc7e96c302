"""Probe round 20d (issue 48): numbers read loosely, and refusals that said no fix.

Classes:
1. A non-integral number where an integer belongs was truncated without a word: a hardware
   YAML's `n_gpus`, `sms`, `comm_sms` and `copy_sms` went through int() (`sms: 2.5` ran as 2,
   `n_gpus: true` as 1, `n_gpus: "2"` as 2, NaN a line on the YAML's layout), and a workload's
   `batch_size: true` passed as 1, and reproduce_klotski's Table 3 column's `paper_column: 0.5`
   stood beside the paper's column 0 (3: past its columns, an IndexError). Each is one line,
   `KEY=VALUE: must be a positive (or non-negative) integer; <what to do>`
   (core.errors.integer_field); 2.0 is refused as the hydra schema refuses it in the same YAML.
2. A refusal that named the field and its value but not what to do: config.json's generic
   field check (`rms_norm_eps: 0`, `routed_scaling_factor: -1`, `qk_nope_head_dim: 0`, a
   missing field) and its RoPE, expert-group and Switch checks, generation_config.json's
   fields, a non-finite number in a YAML the schema checks, the hardware YAML's range checks,
   the workload's routing ranges, every planner's params (`resident_share=1.5 must be in
   [0, 1]`), a training load .npy of the wrong shape, type or values, a model's heads that do
   not divide and dense layers without a width. Each line now ends in its fix.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from core.hardware import HardwareSpec
from core.hf_config import hf_config_to_spec, spec_to_hf_config
from core.hf_config.fields import HFConfig
from core.hf_config.generation import read_generation
from core.hf_config.runtime import hf_runtime
from core.spec import ModelSpec, RoutingConfig, Workload
from experiments.common.app import check_keys
from experiments.common.schema import HardwareSchema
from real.checkpoint import reduced_spec
from tests.probes.conftest import ROOT, raises_one_line

HW = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())


def _hw(path: str, value: Any) -> dict[str, Any]:
    """The tiny hardware YAML with `path` (dotted) set to `value`."""
    d = copy.deepcopy(HW)
    d["gpu"]["sms"] = 80  # so that comm_sms and copy_sms have room below it
    *parents, leaf = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    node[leaf] = value
    return d


# --- 1. a float, a bool, a string, NaN where an integer belongs ---

_NOT_INTEGERS = [2.5, True, "2", math.nan, 2.0]


@pytest.mark.parametrize("value", _NOT_INTEGERS, ids=repr)
@pytest.mark.parametrize("key", ["n_gpus", "gpu.sms", "gpu.comm_sms", "cpu.copy_sms"])
def test_a_hardware_integer_that_is_none_is_one_line(key: str, value: Any) -> None:
    line = raises_one_line(lambda: HardwareSpec.from_dict(_hw(key, value)), f"{key}=")
    assert "integer" in line and "; set" in line, line


@pytest.mark.parametrize("key", ["batch_size", "n_batches", "prompt_len", "gen_len"])
def test_a_workload_size_of_true_is_no_integer(key: str) -> None:
    sizes: dict[str, Any] = dict(batch_size=1, n_batches=1, prompt_len=1, gen_len=1)
    line = raises_one_line(lambda: Workload(**(sizes | {key: True})), f"workload.{key}=True")
    assert "positive integer; pass" in line, line


def test_a_model_count_of_2_5_says_an_integer() -> None:
    spec = reduced_spec("tiny")
    line = raises_one_line(lambda: dataclasses.replace(spec, top_k=2.5), "top_k=2.5")
    assert "must be an integer; set one" in line, line


@pytest.mark.parametrize(
    ("key", "value"),
    [("paper_column", 0.5), ("paper_column", True), ("paper_column", 3), ("n", 2.5), ("n", "15")],
)
def test_a_klotski_table3_column_integer_that_is_none_is_one_line(key: str, value: Any) -> None:
    """reproduce_klotski read a column's paper_column with int(): 0.5 stood beside column 0."""
    from experiments.common.klotski_conf import _check_reproduce

    column = {"model": "tiny", "hardware": "tiny", "n": 15} | {key: value}
    r = {"columns": [column], "steps": {}}
    line = raises_one_line(
        lambda: _check_reproduce("klotski_table3", r), f"reproduce.columns[0].{key}="
    )
    assert "; write" in line, line


# --- 2. every refusal says what to do ---

_DEEPSEEK = spec_to_hf_config(reduced_spec("deepseek-v2-lite"))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("rms_norm_eps", 0),
        ("rope_theta", -1.0),
        ("routed_scaling_factor", 0),
        ("routed_scaling_factor", -1.5),
        ("qk_nope_head_dim", 0),
        ("num_attention_heads", 2.5),
        ("num_experts_per_tok", None),  # absent, with no default
    ],
)
def test_a_config_json_field_out_of_range_says_the_fix(key: str, value: Any) -> None:
    cfg = dict(_DEEPSEEK)
    cfg.pop(key) if value is None else cfg.__setitem__(key, value)
    line = raises_one_line(lambda: hf_config_to_spec(cfg, "m", "ck/config.json"), key)
    assert "as the model's released config.json has it" in line, line


_GROUPS = {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1}
_SWITCH = spec_to_hf_config(reduced_spec("switch-base-128"))


@pytest.mark.parametrize(
    ("base", "fields", "fix"),
    [
        (_DEEPSEEK, {"rope_scaling": {"rope_type": "dynamic", "factor": 0.5}}, "set the model's"),
        (_DEEPSEEK, _GROUPS | {"n_group": 3}, "set n_group"),
        (_DEEPSEEK, _GROUPS | {"topk_group": 99}, "set it <="),
        (_SWITCH, {"num_layers": 1, "encoder_sparse_step": 2}, "set it to 1"),
    ],
)
def test_a_config_json_shape_check_says_the_fix(
    base: dict[str, Any], fields: dict[str, Any], fix: str
) -> None:
    cfg = base | fields

    def read() -> None:  # the spec, then what a run reads beside it (real.checkpoint's order)
        hf_runtime(HFConfig(cfg, "ck/config.json"), hf_config_to_spec(cfg, "m", "ck/config.json"))

    raises_one_line(read, "config.json", fix)


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 2},
        {"no_repeat_ngram_size": "3"},
        {"suppress_tokens": "all"},
        {"bad_words_ids": [[]]},
    ],
)
def test_a_generation_config_field_says_the_fix(tmp_path: Path, fields: dict[str, Any]) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    (key,) = fields
    line = raises_one_line(lambda: read_generation(tmp_path, 100), key)
    assert "; " in line.rsplit(")", 1)[-1], line


def test_a_non_finite_integer_in_a_yaml_says_the_fix() -> None:
    d = _hw("n_gpus", math.nan)
    raises_one_line(lambda: check_keys(HardwareSchema, d, "my.yaml"), "n_gpus", "; pass n_gpus=")


@pytest.mark.parametrize(
    ("key", "value", "fix"),
    [
        ("links.h2d.gbps", 0, "calibrate"),
        ("links.h2d.latency_us", -1, "calibrate"),
        ("gpu.tflops", 0, "calibrate"),
        ("cpu.mem_bw_gbps", 0, "calibrate"),
        ("gpu.overhead_us", -1, "calibrate"),
        ("memory_gb.gpu", 0, "set its size in GB"),
        ("links", {"disk": {"gbps": 1.0}}, "add h2d"),
        ("gpu", {"tflops": 1.0}, "add it"),
        ("processes", {"copy_share": 2.0}, "calibrate"),
        ("processes", {"gate_exchange_us": -1}, "calibrate"),
    ],
)
def test_a_hardware_field_out_of_range_says_the_fix(key: str, value: Any, fix: str) -> None:
    line = raises_one_line(lambda: HardwareSpec.from_dict(_hw(key, value)), fix)
    assert "; " in line, line


@pytest.mark.parametrize(("key", "value"), [("skew", -1.0), ("reuse", 2.0), ("layer_corr", -1)])
def test_a_routing_share_out_of_range_says_the_fix(key: str, value: float) -> None:
    raises_one_line(lambda: RoutingConfig(**{key: value}), f"routing.{key}", "; pass")


def test_a_model_yaml_missing_a_field_says_the_fix(tmp_path: Path) -> None:
    raises_one_line(lambda: ModelSpec.from_dict({"name": "m"}), "missing field", "conf/model/")


@pytest.mark.parametrize(
    ("name", "values"),
    [
        ("fiddler", {"resident_share": 1.5}),
        ("fiddler", {"policy": "fast"}),
        ("eplb", {"window": 0}),
        ("klotski", {"n": -5}),
        ("klotski", {"disk_window": 1.5}),
        ("klotski", {"disk_window": math.nan}),
        ("predictive_replication", {"ema_alpha": 0}),
        ("mixtral_offloading", {"guess_k": -1}),
        ("moe_infinity", {"cache_share": 0.0}),
        ("oracle_replication", {"truth_weight": 2.0}),
    ],
)
def test_a_planner_param_out_of_range_says_the_fix(name: str, values: dict[str, Any]) -> None:
    from planners.registry import make_params

    (key,) = values
    line = raises_one_line(lambda: make_params(name, values), f"planner.params.{key}")
    assert "; pass" in line, line


@pytest.mark.parametrize(
    ("r", "fix"),
    [
        ({"batch_sizes": [1]}, "missing; its table reads it: add it"),
        ({"n": [0], "batch_sizes": [1]}, "[1, 4]"),
    ],
)
def test_a_klotski_reproduce_block_says_the_fix(r: dict[str, Any], fix: str) -> None:
    from experiments.common.klotski_conf import _check_reproduce

    line = raises_one_line(lambda: _check_reproduce("klotski_fig14", r), fix)
    assert "; " in line.rsplit("reproduce.", 1)[-1], line


@pytest.mark.parametrize(
    "array",
    [np.ones((3, 4)), np.ones((2, 4), dtype=np.complex64), np.full((2, 4), np.nan)],
    ids=["shape", "complex", "nan"],
)
def test_a_training_load_file_says_the_fix(tmp_path: Path, array: np.ndarray) -> None:
    from planners.ep.placement import read_load

    np.save(tmp_path / "load.npy", array)
    path = str(tmp_path / "load.npy")
    raises_one_line(lambda: read_load(path, 2, 4, "eplb"), "initial_load", "write it again")


@pytest.mark.parametrize(
    ("fields", "fix"),
    [({"n_heads": 4, "n_kv_heads": 3}, "set n_kv_heads"), ({"dense_ffn_size": 0}, "; set it")],
)
def test_a_model_shape_check_says_the_fix(fields: dict[str, Any], fix: str) -> None:
    spec = reduced_spec("tiny")
    over = fields if "n_heads" in fields else fields | {"moe_layers": spec.moe_layers[:1]}
    raises_one_line(lambda: dataclasses.replace(spec, **over), fix)
