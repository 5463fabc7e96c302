"""Round 25b of issue 48: round 24's named leftovers, one class a test group:

1. a comma in a path-valued option's folder (`hydra.run.dir=/x/a,b`, report's `dir=`, a
   checkpoint, a trace folder, `hydra.sweep.dir` under -m) was told to add -m or pass a list:
   neither helps. Now the line says to quote the path, and the override shown is one value,
   the path; `<` and `>` are named as the other characters hydra refuses unquoted are, a path
   holding both kinds of quote is quoted with its `'` escaped, and a `${` that names nothing
   says how to write it as itself (or, in hydra's own folders, that it cannot be).
2. make_checkpoint's `scale` refused only a value that made every weight subnormal or 0: one
   leaving most of them subnormal (fewer bits of precision) was written with exit 0. Now a
   scale leaving more than 1 in 10 of the narrowest-drawn tensor's weights subnormal is
   refused, naming the range that works; `rms_norm_eps` below float32's smallest normal number
   (0 or subnormal where RMSNorm runs) too, and a RoPE factor past float32's range (inf there:
   no position rotated), in config.json or make_checkpoint's `rope_scaling`.
3. a researcher's planner indexing past its run's experts, layers or batches in its own code
   (an IndexError, KeyError or ValueError raised in its file) was round 24c's internal error
   naming the file and line, a bug to report. Now it is the planner's one line: it planned
   outside its run's model or workload, where, and the counts to index within; its own
   `raise ValueError(...)` is its message, as it wrote it. A shipped planner's stays a bug.
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
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from core.errors import MoepipeError, PlannerBug
from core.hf_config import spec_to_hf_config
from core.spec import Workload
from experiments.common.cli import any_error_line
from experiments.common.overrides import _parsed
from experiments.common.path_values import comma_in_path, literal_dollar
from experiments.common.pipeline import RunSpec, build_schedule
from experiments.common.run_config import config_disagrees
from experiments.make_checkpoint import check_scale, check_usable
from planners import registry
from planners.sequential import Sequential
from real.checkpoint import reduced_spec
from tests.conftest import hardware_from_conf, model_from_conf, random_routing
from tests.probes.conftest import ROOT, one_line, pasted, raises_one_line
from tests.probes.test_probe_round24c import _NoParams

# --- 1. a character of hydra's grammar inside a path-valued option ---

# every command's path-valued options: run and sweep dirs, checkpoints, traces, outputs
PATH_KEYS = [
    "hydra.run.dir",
    "hydra.sweep.dir",
    "dir",
    "out",
    "checkpoint",
    "model.hf_config",
    "workload.routing.trace_dir",
    "src",
]


def _fix_of(line: str, key: str) -> str:
    """The override a line says to pass (a shell's outer quotes off)."""
    fix = pasted(re.split(r"(?:pass|quoted:) ", line)[-1])
    return fix[len(key) + 1 :]


@pytest.mark.parametrize("key", PATH_KEYS)
def test_a_comma_in_one_runs_path_says_to_quote_it(key: str) -> None:
    from experiments.common.overrides import sweep_in_one_run

    said = sweep_in_one_run(Exception(f"Ambiguous value for argument '{key}=/x/a,b'"))
    assert said is not None
    line = str(said)
    assert "a comma in a path must be quoted" in line and "-m" not in line, line
    assert _parsed(f"{key}={_fix_of(line, key)}").value() == "/x/a,b"


def test_paths_one_run_would_sweep_keep_the_sweeps_line() -> None:
    from experiments.common.overrides import sweep_in_one_run

    said = sweep_in_one_run(Exception("Ambiguous value for argument 'checkpoint=/c/a,/c/b'"))
    assert said is not None and "add -m to sweep them" in str(said)


@pytest.mark.parametrize(
    ("key", "value", "quote"),
    [
        ("hydra.sweep.dir", "/x/a,b", True),  # hydra's own folder: one path, never swept
        ("hydra.run.dir", "a,b", True),
        ("checkpoint", "/c/a,b", True),  # its piece `b` is no path
        ("checkpoint", "/c/a,/c/b", False),  # two checkpoints: a sweep
        ("hydra.sweep.subdir", "x,y", False),  # hydra's line: its keys are not swept
        ("workload.seed", "1,2", False),
        ("model.hf_config", "conf/model/tiny.yaml,README.md", False),  # both there: a sweep
    ],
)
def test_a_sweeps_comma_in_one_path_says_to_quote_it(
    key: str, value: str, quote: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # where a relative path is read from
    line = comma_in_path(key, value, sweeping=True)
    assert (line is not None) is quote, line
    if line is not None:
        assert _parsed(f"{key}={_fix_of(str(line), key)}").value() == value


@pytest.mark.parametrize(
    "char", ["=", " ", "'", '"', "'\"", "[", "]", "{", "}", "<", ">", "\\", "$", "~"]
)
@pytest.mark.parametrize("key", ["hydra.run.dir", "dir", "checkpoint"])
def test_a_path_holding_hydras_characters_is_its_path_or_says_how(key: str, char: str) -> None:
    """Taken as the path it is (a space, a backslash, a lone `$`), or one line whose fix is (a
    `~` inside a folder's name is no home folder: no word of one)."""
    path = f"/x/a{char}b"
    try:
        value = _parsed(f"{key}={path}").value()
    except MoepipeError as e:
        line = str(e)
        assert "\n" not in line and "must be quoted" in line and "home" not in line, line
        value = _parsed(f"{key}={_fix_of(line, key)}").value()
    assert value == path


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("dir", "writes it '\\${', quoted: 'dir=\".../a\\${x}\"'"),
        ("hydra.run.dir", "cannot hold '${' as itself"),
        ("workload.seed", None),  # not a path
    ],
)
def test_a_paths_dollar_brace_that_names_nothing_says_how_to_write_it(
    key: str, said: str | None
) -> None:
    added = literal_dollar(key, "Interpolation key 'x' not found")
    assert (said in added) if said else added == "", added
    assert literal_dollar(key, "Key 'x' is not in struct") == ""


def test_a_collects_dir_holding_dollar_brace_is_read_as_written(
    tmp_path: Path, cli_here: Any
) -> None:
    folder = tmp_path / "q${x}"
    folder.mkdir()
    line = one_line(cli_here("experiments.collect", f"dir={folder}"), "Interpolation key 'x'")
    assert "writes it '\\${'" in line, line
    fixed = str(folder).replace("${", "\\${")  # the fix said: the folder read, as it is
    one_line(cli_here("experiments.collect", f"dir='{fixed}'"), f"no finished run under {folder}")


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
    raises_one_line(lambda: check_usable(spec), "rms_norm_eps=", "in [1.18e-38, 1)")


@pytest.mark.parametrize("factor", [1e39, 1e300])
def test_a_rope_factor_float32_cannot_hold_is_refused(factor: float) -> None:
    """A linear factor past float32's range was written (and run): inf in float32, so every
    position's angle was 0 and no token rotated."""
    from experiments.make_checkpoint import check_runs

    spec, scaling = reduced_spec("mixtral-tiny"), {"type": "linear", "factor": factor}
    said = ("rope_scaling.factor=", "must be in [1, 1e6]")
    raises_one_line(lambda: check_runs(spec, False, scaling), *said)


# --- 3. a researcher's planner indexing past its run in its own code ---


class _Slips(Sequential):
    """`sequential`'s plan after a slip of `how`'s, in this file."""

    how = "index"

    def plan(self, ctx: Any, out: Any) -> None:
        m, wl = ctx.model, ctx.workload
        if self.how == "index":
            ([0.0] * m.n_experts)[m.n_experts]
        elif self.how == "key":
            {layer: 0 for layer in range(m.n_layers)}[m.n_layers]
        elif self.how == "value":
            [[0] * m.n_experts for _ in range(wl.n_batches)][wl.n_batches - 1].index(-1)
        elif self.how == "raise":
            raise ValueError("mine: needs 2 GPUs")
        else:  # another file's slip (json's): not where the planner planned
            json.loads("{")
        super().plan(ctx, out)


SLIPS = {
    "index": "planned outside its run's model or workload (IndexError: list index out of range",
    "key": "planned outside its run's model or workload (KeyError: 2, at ",
    "value": "planned outside its run's model or workload (ValueError: -1 is not in list, at ",
    "raise": "planner mine: needs 2 GPUs (ValueError, at ",  # its name once
}


@pytest.fixture(scope="module")
def tiny_spec() -> tuple[RunSpec, Any]:
    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    return RunSpec(model, hw, wl, "mine", {}), random_routing(model, wl)


@pytest.mark.parametrize("how", sorted(SLIPS))
def test_a_researchers_planner_indexing_past_its_run_is_its_line(
    how: str, tiny_spec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = type("Slips", (_Slips,), {"how": how, "__module__": __name__})  # (not abc's)
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    with pytest.raises(PlannerBug) as e:
        build_schedule(*tiny_spec)
    line = any_error_line(e.value)
    assert SLIPS[how] in line and "\n" not in line, line
    assert "tests/probes/test_probe_round25b.py:" in line and " in plan)" in line, line
    assert line.endswith("fix planner mine there"), line
    if how != "raise":
        assert "below ctx.model.n_layers, ctx.model.n_experts, ctx.workload.n_batches" in line


class _ChoosesPast(Sequential):
    def choose_n_batches(self, model: Any, hardware: Any, workload: Any, cost: Any) -> int:
        return [1, 2][model.n_layers]  # a table of n by layer, read past its last


def test_a_researchers_choice_of_n_indexing_past_its_run_is_its_line(
    tiny_spec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common.pipeline import resolve_n_batches

    entry = registry.Entry("mine", _ChoosesPast, _NoParams)
    monkeypatch.setitem(registry._REGISTRY, "mine", entry)
    with pytest.raises(PlannerBug) as e:
        resolve_n_batches(tiny_spec[0])
    line = any_error_line(e.value)
    assert "planner mine planned outside" in line and " in choose_n_batches)" in line, line


@pytest.mark.parametrize("how", ["key", "elsewhere"])
def test_a_slip_not_the_researchers_stays_an_internal_error(
    how: str, tiny_spec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shipped planner's slip is the project's bug to report; one raised in another file
    (json's, here) is not where the planner planned: both keep round 24c's line."""
    cls = type("Slips", (_Slips,), {"how": how, "__module__": __name__})
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    if how == "key":
        monkeypatch.setattr(registry, "project_planners", lambda: frozenset({"mine"}))
    with pytest.raises((KeyError, ValueError)) as e:
        build_schedule(*tiny_spec)
    assert not isinstance(e.value, PlannerBug)


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


def test_a_copy_in_another_projects_checkout_counts_every_file_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An installed copy inside a checkout that tracks none of it (a virtual environment in a
    project's folder): git lists nothing, which is no history of this package's files."""
    import subprocess

    done = subprocess.CompletedProcess([], 0, stdout=b"", stderr=b"")
    monkeypatch.setattr(registry.subprocess, "run", lambda *a, **k: done)
    assert registry._tracked_files.__wrapped__() is None
