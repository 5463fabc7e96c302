"""Probe class: a number outside its domain that every `< 0` / `> 0` check lets through: NaN
(passes both), inf (passes `> 0`), and values of the right type but no meaning (a family or a
dtype size no model has). Each is one line naming the field, from an override, a hardware YAML
in a user's config dir, and a hardware dict (`HardwareSpec.from_dict`, what calibrate's files
and `hardware=FILE.yaml` go through)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir

import experiments.common.app  # noqa: F401  registers what conf/ composes with (schemas, hydra/help)
from core.hardware import HardwareSpec
from experiments.common.resolve import run_spec
from tests.probes.conftest import ROOT, TINY, one_line, raises_one_line

OVERRIDES = [
    ("workload.routing.skew=nan", "workload.routing.skew"),
    ("workload.routing.layer_corr=nan", "workload.routing.layer_corr"),
    ("workload.routing.skew=inf", "workload.routing.skew"),
    ("hardware.memory_gb.gpu=inf", "memory_gb.gpu"),
    ("hardware.memory_gb.cpu=nan", "memory_gb.cpu"),
    ("hardware.gpu.overhead_us=nan", "gpu.overhead_us"),
    ("hardware.cpu.tflops=inf", "cpu.tflops"),
    ("hardware.gpu.sm_mem_bw_gbps=nan", "sm_mem_bw_gbps"),
    ("hardware.links.h2d.gbps=inf", "links.h2d.gbps"),
    ("hardware.links.disk.latency_us=inf", "links.disk.latency_us"),
    ("hardware.links.d2h.latency_us=nan", "links.d2h.latency_us"),
    ("+hardware.gpu.overhead_us_by_kind={compute-expert:nan}", "overhead_us_by_kind"),
    ("+hardware.gpu.time_tables={compute-expert:[[1,nan]]}", "time_tables.compute-expert"),
    ("model.rms_norm_eps=nan", "rms_norm_eps"),
    ("model.rope_theta=-1", "rope_theta"),
    ("model.rope_theta=inf", "rope_theta"),
    ("model.family=gpt", "family"),
    ("model.dtype_bytes=3", "dtype_bytes"),
    ("executor.rendezvous_timeout_s=nan", "rendezvous_timeout_s"),
    ("executor.rendezvous_timeout_s=-1", "rendezvous_timeout_s"),  # read by distributed runs alone
    ("executor.rendezvous_timeout_s=1e300", "rendezvous_timeout_s"),  # overflowed a C int
    ("executor.rendezvous_timeout_s=0.01", "rendezvous_timeout_s"),  # no rank starts that fast
]


@pytest.fixture(scope="module")
def composer():  # noqa: ANN201
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield lambda overrides: compose("config", overrides=[*TINY, *overrides])


@pytest.mark.parametrize("override, key", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_a_number_outside_its_domain_is_one_line(composer, override: str, key: str) -> None:  # noqa: ANN001
    raises_one_line(lambda: run_spec(composer([override])), key)


def _tiny() -> dict:
    return yaml.safe_load((ROOT / "conf/hardware/tiny.yaml").read_text())


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda d: d["links"]["h2d"].update(gbps=float("nan")), "links.h2d.gbps"),
        (lambda d: d["memory_gb"].update(disk=float("inf")), "memory_gb.disk"),
        (lambda d: d["cpu"].update(mem_bw_gbps=float("inf")), "cpu.mem_bw_gbps"),
        (
            lambda d: d["gpu"].update(time_tables={"compute-attention": [[1.0, float("inf")]]}),
            "time_tables.compute-attention",
        ),
    ],
    ids=["nan link", "inf memory", "inf bandwidth", "inf time table"],
)
def test_a_hardware_dict_with_a_non_finite_number_is_one_line(edit, key: str) -> None:  # noqa: ANN001
    d = copy.deepcopy(_tiny())
    edit(d)
    raises_one_line(lambda: HardwareSpec.from_dict(d), key)


def test_a_nan_in_a_users_hardware_yaml_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """YAML's `.nan` in a hardware file of the user's config dir, as a user writes one."""
    (tmp_path / "conf" / "hardware").mkdir(parents=True)
    text = (
        (ROOT / "conf/hardware/tiny.yaml")
        .read_text()
        .replace("h2d: {gbps: 1.0", "h2d: {gbps: .nan")
    )
    (tmp_path / "conf" / "hardware" / "mine.yaml").write_text(text)
    r = cli_here(
        "experiments.run",
        *[a for a in TINY if not a.startswith("hardware=")],
        "hardware=mine",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_line(r, "links.h2d.gbps")
    assert not (tmp_path / "run" / "summary.json").exists()
