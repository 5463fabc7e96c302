"""Round 24h of issue 48: round 24c's leftovers, a researcher's planner and paths. Classes:

- a researcher's planner that loops over more layers, batches or steps than the run has ended
  in an IndexError located in a shared helper (core/routing.py, reading the routing of a layer
  that is not there), an internal error to report; an expert or a device past the run's was
  blamed on another rule, or taken without a word. Now each op's units are checked against the
  run's (`core.schedule_units`), one line naming the planner, the unit and its valid range.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core import traces
from core.errors import PlannerBug, ScheduleBug
from core.spec import Workload
from core.types import OpKind, Resource
from experiments.common.cli import any_error_line
from experiments.common.pipeline import RunSpec, build_schedule
from planners import registry
from planners.sequential import Sequential
from tests.conftest import hardware_from_conf, model_from_conf, random_routing
from tests.probes.conftest import TINY, one_line, pasted, raises_one_line
from tests.probes.test_probe_round24c import _NoParams


class _Past(Sequential):
    """`sequential`'s plan over one unit more than the run has (`past`)."""

    past = ""

    def plan(self, ctx: Any, out: Any) -> Any:
        model, workload, more = ctx.model, ctx.workload, {}
        if self.past == "layer":
            more = {"n_layers": model.n_layers + 1, "moe_layers": tuple(range(model.n_layers + 1))}
            model = replace(model, **more)
        if self.past in ("batch", "step"):
            key = "n_batches" if self.past == "batch" else "gen_len"
            workload = replace(workload, **{key: getattr(workload, key) + 1})
        super().plan(type(ctx)(model, ctx.hardware, workload, ctx.routing, ctx.cost), out)
        if self.past == "expert":  # tiny's experts are resident: no load names one
            out.add(OpKind.EXPERT, "compute", step=0, layer=0, batch=0, expert=model.n_experts)
        if self.past == "device":
            out.stream("mine", Resource.GPU, 1)


PAST = {  # unit -> what the line says (tiny: 2 layers, 4 experts; 2 batches, 3 steps)
    "layer": "names layer 2, past the run's 2 layers (valid 0..1); plan within ctx.model.n_layers",
    "batch": "names batch 2, past the run's 2 batches (valid 0..1); plan within ctx.workload.",
    "step": "names step 3, past the run's 3 steps (valid 0..2); plan within ctx.workload.n_steps",
    "expert": "names expert 4, past the run's 4 experts (valid 0..3); plan within ctx.model.",
    "device": "stream mine is on device 1, past the run's 1 device (valid 0..0)",
}


@pytest.fixture(scope="module")
def tiny_run() -> tuple[Any, Any, Workload, Any]:
    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    return model, hw, wl, random_routing(model, wl)


@pytest.mark.parametrize("unit", sorted(PAST))
def test_a_unit_past_the_runs_is_one_line_naming_it(
    unit: str, tiny_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, hw, wl, routing = tiny_run
    cls = type(f"Past{unit}", (_Past,), {"past": unit})
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    with pytest.raises(PlannerBug) as e:
        build_schedule(RunSpec(model, hw, wl, "mine", {}), routing)
    line = any_error_line(e.value)
    assert line.startswith("planner mine: ") and PAST[unit] in line, line
    if unit != "layer":
        return
    # one of the project's own planners: a bug to report, not the researcher's line
    monkeypatch.setattr(registry, "project_planners", lambda: frozenset({"mine"}))
    monkeypatch.setenv("MOEPIPE_TRACEBACK", "0")
    with pytest.raises(ScheduleBug) as e:
        build_schedule(RunSpec(model, hw, wl, "mine", {}), routing)
    assert not isinstance(e.value, PlannerBug)
    line = any_error_line(e.value)
    Path(line.rsplit(" and ", 1)[1].split(" ")[0]).unlink()  # its traceback file
    assert "internal error (ScheduleBug: planner mine: op " in line, line


# how a planner file is chosen: on the command line (round 24c's), by a user's experiment file
PICKED_BY = {
    "override": ["planner=mine"],
    "experiment_file": ["experiment=picks"],
}


@pytest.mark.parametrize("how", sorted(PICKED_BY))
def test_a_planner_file_taking_another_planners_params_is_named_however_chosen(
    how: str, tmp_path: Path, cli_here: Any
) -> None:
    """round 24c's check read only `planner=` overrides: an experiment file choosing the same
    file gave hydra's "unknown key; planner.params takes none"."""
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "mine.yaml").write_text(
        "defaults:\n  - /planner_params@params: sequential\n  - _self_\n"
        "name: flexgen\nparams: {sync: false}\n"
    )
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "picks.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /planner: mine\n"
    )
    r = cli_here(
        "experiments.run",
        "--config-dir",
        str(tmp_path),
        *TINY[:3],
        *PICKED_BY[how],
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    line = one_line(r, "planner/mine.yaml", "write `- /planner_params@params: flexgen`")
    assert not (tmp_path / "run" / "summary.json").exists(), line


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout at tmp/checkout with its sibling tmp/shared/traces (empty), run from
    tmp/elsewhere/deeper (whose ../shared/traces is not there)."""
    monkeypatch.setattr(traces, "CHECKOUT", tmp_path / "checkout", raising=False)
    (tmp_path / "checkout").mkdir()
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "elsewhere" / "deeper")
    return tmp_path / "shared" / "traces"


TRACE_FILES = {  # how a command reads the traces folder -> the file it reads there
    "esft": (lambda d: traces.load_esft(d, trace_dir_flag="trace_dir"), traces.trace_path),
    "counts": (
        lambda d: traces.load_counts(d, "olmoe_counts_top1", 64, trace_dir_flag="trace_dir"),
        traces.counts_path,
    ),
}


@pytest.mark.parametrize("kind", sorted(TRACE_FILES))
def test_the_default_traces_folder_is_the_checkouts_from_another_folder(
    kind: str, elsewhere: Path
) -> None:
    """routing_stats, prefetch_eval, a run: `../shared/traces` read from the current folder
    alone failed from any folder but the checkout's, though the checkout's sibling has it."""
    load, path_of = TRACE_FILES[kind]
    # none in either place: one line naming both
    line = raises_one_line(lambda: load("../shared/traces"), "no such file", "trace_dir=")
    assert "from the current folder and from the checkout" in line, line
    assert str(elsewhere.parent.parent / "elsewhere" / "shared" / "traces") in line, line
    assert str(elsewhere) in line, line
    wanted = elsewhere / path_of("x").relative_to(Path.cwd() / "x")
    wanted.parent.mkdir(parents=True)
    wanted.write_bytes(b"")
    assert path_of("../shared/traces") == wanted  # the checkout's, the current folder has none
    # a folder the user gives stays relative to where they run
    assert path_of("../shared/./traces") == Path.cwd().parent / "shared" / wanted.relative_to(
        elsewhere.parent
    )
    line = raises_one_line(lambda: load("../shared/./traces"), "no such file", "trace_dir=")
    assert "from the checkout" not in line, line


# a command that takes run dirs -> its key; a sweep's run dir, its overrides joined by commas
RUN_DIR_KEYS = {
    "trace_json": ("experiments.trace_json", "runs", "no trace.parquet there"),
    "collect": ("experiments.collect", "dir", "no finished run under"),
    "report": ("experiments.report", "dir", "no finished run"),
}


@pytest.mark.parametrize("command", sorted(RUN_DIR_KEYS))
def test_a_sweeps_run_dir_is_taken_unquoted(command: str, tmp_path: Path, cli_here: Any) -> None:
    """`.../prompt_len=8,workload=tiny` (a sweep point's folder) was a parse error, and the
    quoted form shown split it at its comma into two folders."""
    module, key, said = RUN_DIR_KEYS[command]
    run = tmp_path / "bs2" / "workload.prompt_len=8,workload=tiny"
    run.mkdir(parents=True)
    value = f"[{run}]" if key == "runs" else str(run)
    line = one_line(cli_here(module, f"{key}={value}"), said)
    assert "must be quoted" not in line, line
    gone = f"{run}x"  # not there: the form to paste, one folder
    fix = f"['{gone}']" if key == "runs" else f"'{gone}'"
    value = f"[{gone}]" if key == "runs" else gone
    line = one_line(cli_here(module, f"{key}={value}"), "must be quoted: ")
    assert pasted(line.rpartition("must be quoted: ")[2]) == f"{key}={fix}", line
