"""Round 25b of issue 48: round 24's named leftovers, one class a test group:

2. make_checkpoint's `scale` refused only a value that made every weight subnormal or 0: one
   leaving most of them subnormal (fewer bits of precision) was written with exit 0. Now a
   scale leaving more than 1 in 10 of the narrowest-drawn tensor's weights subnormal is
   refused, naming the range that works; `rms_norm_eps` below float32's smallest normal number
   (0 or subnormal where RMSNorm runs) too.
4. the planners whose schedule bug is the project's were a hand-kept list, which a new shipped
   planner had to be added to. Now they are derived: those defined in a file of the planners
   package that git tracks (any file of it in an installed copy).
5. collect (and report, replication) read a real run's checkpoint config.json twice per run dir
   that names it (round 24b's read-back of its MoE layers, and the source `auto` is for it): a
   sweep of many runs on one checkpoint read it as often. Now once per state of the file (its
   size and modification time): an edited file is read again.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from core.hf_config import spec_to_hf_config
from experiments.common.run_config import config_disagrees
from experiments.make_checkpoint import check_scale, check_usable
from planners import registry
from planners.sequential import Sequential
from real.checkpoint import reduced_spec
from tests.probes.conftest import ROOT, raises_one_line
from tests.probes.test_probe_round24c import _NoParams

# --- 2. make_checkpoint's numeric options that lose precision ---


@pytest.mark.parametrize(
    ("model", "scale"),
    [
        ("mixtral-tiny", 1e-36),  # float32: most of w2's weights (std 2.2e-38) subnormal
        ("tiny", 1e-36),  # bfloat16
        ("tiny", 1e300),  # overflow: the same range named
    ],
)
def test_a_scale_leaving_most_weights_subnormal_is_refused_with_its_range(
    model: str, scale: float
) -> None:
    line = raises_one_line(lambda: check_scale(reduced_spec(model), scale), f"scale={scale:g}")
    low, high = map(float, line.rpartition("pass scale in [")[2].rstrip("]").split(", "))
    for edge in (low, 1.0, high):  # the range named works at both ends
        check_scale(reduced_spec(model), edge)


@pytest.mark.parametrize("dtype", [{"float16": True}, {}])
def test_the_default_scale_is_taken_by_a_full_size_model(dtype: dict[str, bool]) -> None:
    """Mixtral-8x7B's w2 (fan-in 14336, 32 layers) draws with std 1e-3: in float16 (smallest
    normal 6.1e-5) 4% of its weights are subnormal at scale 1, as in the real model's."""
    check_scale(reduced_spec("mixtral-8x7b", **dtype), 1.0)


@pytest.mark.parametrize("eps", [1e-300, 1e-40])
def test_an_rms_norm_eps_float32_cannot_hold_is_refused(eps: float) -> None:
    spec = reduced_spec("mixtral-tiny", rms_norm_eps=eps)
    raises_one_line(lambda: check_usable(spec), "rms_norm_eps=", "in [1.18e-38, 3.4e+38]")


# --- 4. the project's planners, derived from where each is defined ---


def test_every_shipped_planner_is_the_projects() -> None:
    shipped = {p.stem for p in (ROOT / "planners").glob("*.py")}
    names = registry.planner_names()
    assert registry.project_planners() == set(names)
    assert {registry.entry(n).factory.__module__.rpartition(".")[2] for n in names} <= shipped


def _researchers(module: str, file: Path) -> type:
    """A planner class defined in module `module`, whose file is `file` (not written)."""
    mod = types.ModuleType(module)
    mod.__file__ = str(file)
    sys.modules[module] = mod
    return type("Mine", (Sequential,), {"__module__": module})


@pytest.mark.parametrize("git", [True, False])
@pytest.mark.parametrize("where", ["own_file", "planners_uncommitted", "test_module"])
def test_a_researchers_planner_is_not_the_projects(
    where: str, git: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the package: theirs; a file added to planners/ and not committed: theirs in a
    git checkout, the project's in an installed copy (which has no history to tell)."""
    files = {
        "own_file": ("mylab.planner", ROOT.parent / "mylab" / "planner.py"),
        "planners_uncommitted": ("planners.mine_probe", ROOT / "planners" / "mine_probe.py"),
    }
    if where == "test_module":
        cls: type = type("Mine", (Sequential,), {})
    else:
        module, file = files[where]
        monkeypatch.setitem(sys.modules, module, None)  # restored, whatever it was
        cls = _researchers(module, file)
    if not git:
        monkeypatch.setattr(registry, "_tracked_files", lambda: None)
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    ours = where == "planners_uncommitted" and not git
    assert ("mine" in registry.project_planners()) is ours
    assert "klotski" in registry.project_planners()


# --- 5. a checkpoint's config.json read once for a sweep's run dirs ---


def test_a_sweep_on_one_checkpoint_reads_its_config_json_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five run dirs of a trace replay on one 2-layer checkpoint, whose summaries say 2 MoE
    layers: read once; config.json then edited to 3 layers (another size and time): read
    again, and each run dir is then stale."""
    import core.hf_config.to_spec as to_spec

    reads: list[Path] = []
    read = to_spec.read_hf_config
    monkeypatch.setattr(to_spec, "read_hf_config", lambda p: reads.append(p) or read(p))
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    write = (ckpt / "config.json").write_text
    write(json.dumps(spec_to_hf_config(reduced_spec("mixtral-tiny", n_layers=2))))
    config = {
        "model": {"moe_layers": [0]},
        "workload": {"seed": 0, "routing": {"source": "trace"}},
        "executor": {"name": "real"},
        "checkpoint": str(ckpt),
    }
    fields = {"source": "trace", "trace": "esft-dsv2lite", "tasks": ["law"], "seed": 0}
    ran = {"routing": "trace esft-dsv2lite", "routing_fields": fields | {"moe_layers": 2}}
    assert [config_disagrees(config, ran) for _ in range(5)] == [None] * 5
    assert len(reads) == 1, reads
    write(json.dumps(spec_to_hf_config(reduced_spec("mixtral-tiny", n_layers=3))))
    os.utime(ckpt / "config.json", ns=(1, 1))  # another time, whatever the clock's grain
    lines: list[Any] = [config_disagrees(config, ran) for _ in range(5)]
    assert len(reads) == 2 and all(line and "has 3 MoE layers" in line for line in lines)
