"""Probe round 20d (issue 48): numbers read loosely, and refusals that said no fix.

Classes:
1. A non-integral number where an integer belongs was truncated without a word: a hardware
   YAML's `n_gpus`, `sms`, `comm_sms` and `copy_sms` went through int() (`sms: 2.5` ran as 2,
   `n_gpus: true` as 1, `n_gpus: "2"` as 2, NaN a line on the YAML's layout), and a workload's
   `batch_size: true` passed as 1. Each is one line,
   `KEY=VALUE: must be a positive (or non-negative) integer; <what to do>`
   (core.errors.integer_field); 2.0 is refused as the hydra schema refuses it in the same YAML.
2. A refusal that named the field and its value but not what to do: the hardware YAML's range
   checks, the workload's routing ranges. Each line now ends in its fix.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.hardware import HardwareSpec
from core.spec import ModelSpec, RoutingConfig, Workload
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


# --- 2. every refusal says what to do ---


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
