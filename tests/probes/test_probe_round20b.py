"""Probe round 20b (issue 48): hydra multirun sweeps as a researcher runs them, by class.

Classes:
1. A sweep of two values a key reads as one (`workload.gen_len=2,'2'`, `workload.seed=1,01`,
   `hardware.memory_gb.gpu=1,1.0`, `trace_json=true,yes`) ran one point and reused it as the
   other ("1 run(s) finished (1 already finished, reused)" of two), or ran one config twice
   into two run dirs (a seed averaged with itself): refused as a value swept twice.
2. A `hydra.sweep.dir` naming a value that differs from point to point (a swept key, a swept
   group's `${hydra:runtime.choices.planner}`, `${hydra.job.num}`) gave each point a sweep
   folder of its own; the sweep counted, tabled and reported only the first's, saying one run
   where two ran, exit 0: refused before any point runs.
3. A `hydra.sweep.subdir` naming hydra's runtime values (`x_${hydra:runtime.choices.hardware}`
   over planners) was not resolved per point, and both points wrote one folder ("1 run(s)
   finished" of two): each point's folder is resolved from its composed config.
4. A sweep of thousands of points (`workload.seed=range(0,3000)`) composed a config per value
   before its first point ran (0.2 s each: ten minutes, nothing said); and with a bad value
   every point shares, every value again before the one line. Only the keys that name a
   point's folder are composed per value, and a key's first 32 values tried.
5. A sweep among a sweep's values (`choice(1,choice(2,3))`, `1,choice(2,3)`) said omegaconf's
   "tags: Unexpected type annotation: Set[str]", one inside `sort()`/`shuffle()` hydra's
   "Invalid arguments: (1, ChoiceSweep(...))" or a bare AssertionError, and one in a list or
   dict (`[1,choice(2,3)]`) was passed on as `[1, ChoiceSweep(tags=set(), ...)]`: each is one
   line saying to list the values in one sweep (a list's: to sweep the whole value).
6. A sweep into a run's folder (a single run's `hydra.run.dir`, or one of a sweep's points)
   wrote its points and multirun.yaml beside that run's result, exit 0, and `collect` then
   refused the folder as a run's: refused before any point runs.
7. An ESFT replication case on a model not of the ESFT trace's shape (`-m
   experiment=replication_esft_g4 model=tiny`) started, and each of its 14 points failed on
   the routing's shape, one line each: the case's check (run before the sweep starts) says it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line, raises_one_line

SWEEP = ["-m", *TINY[:-1]]


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("workload.gen_len=2,'2'", "2 and '2' are one workload.gen_len"),
        ("workload.seed=1,01", "1 and 01 are one workload.seed"),
        ("hardware.memory_gb.gpu=1,1.0", "1 and 1.0 are one hardware.memory_gb.gpu"),
        ("trace_json=true,yes", "and yes are one trace_json"),
        ("planner=flexgen,'flexgen'", "flexgen and 'flexgen' are one planner"),
    ],
    ids=["int quoted", "int leading zero", "float", "bool", "a name quoted"],
)
def test_two_values_a_key_reads_as_one_are_refused(override: str, said: str) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from experiments.common.argv_checks import refuse_values_twice

    cfg = OmegaConf.create(
        {
            "workload": {"gen_len": 3, "seed": 0},
            "hardware": {"memory_gb": {"gpu": 24.0}},
            "trace_json": False,
            "planner": {"name": "flexgen"},
        }
    )
    swept = OverridesParser.create().parse_overrides([override])
    raises_one_line(lambda: refuse_values_twice(swept, cfg), override, said, "drop the repeat")


def test_values_a_key_reads_apart_still_sweep() -> None:
    """A string key's `1,01` are two values; `2,3` of an int key are two."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from experiments.common.argv_checks import refuse_values_twice

    cfg = OmegaConf.create({"hardware": {"name": "x"}, "workload": {"gen_len": 3}})
    parsed = OverridesParser.create().parse_overrides(
        ["hardware.name=1,01", "workload.gen_len=2,3"]
    )
    refuse_values_twice(parsed, cfg)


@pytest.mark.parametrize(
    ("sweep", "sweep_dir", "named"),
    [
        ("workload.gen_len=2,3", "g${workload.gen_len}", "names workload.gen_len"),
        ("planner=flexgen,sequential", "${hydra:runtime.choices.planner}", "names planner"),
        ("planner=flexgen,sequential", "${hydra.job.num}", "names hydra.job"),
    ],
    ids=["a swept key", "a swept group's choice", "the job's number"],
)
def test_a_sweep_dir_that_differs_per_point_is_refused(
    tmp_path: Path, cli_here: Any, sweep: str, sweep_dir: str, named: str
) -> None:
    r = cli_here(
        "experiments.run",
        *SWEEP,
        sweep,
        "hydra/launcher=basic",
        f"hydra.sweep.dir={tmp_path}/{sweep_dir}",
    )
    one_line(r, "hydra.sweep.dir=", named, "hydra.sweep.subdir instead")
    assert list(tmp_path.iterdir()) == []


def test_a_subdir_of_hydras_runtime_choice_shared_by_points_is_refused(
    tmp_path: Path, cli_here: Any
) -> None:
    sweep = tmp_path / "s"
    r = cli_here(
        "experiments.run",
        *SWEEP,
        "planner=flexgen,sequential",
        "hydra/launcher=basic",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweep.subdir=x_${hydra:runtime.choices.hardware}",
    )
    one_line(r, "planner=flexgen and planner=sequential would both write x_tiny")
    assert not sweep.exists()


@pytest.fixture
def compositions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many configs a sweep's check composes."""
    import experiments.run  # noqa: F401 (its schema, as the command has it)
    from experiments.common import overrides, sweep_points

    count = [0]
    compose = sweep_points.composed

    def counted(*args: Any) -> Any:
        count[0] += 1
        return compose(*args)

    monkeypatch.setattr(sweep_points, "composed", counted)
    monkeypatch.setattr(overrides, "composed", counted)
    return count


def test_a_sweep_of_thousands_of_points_is_checked_without_composing_each(
    compositions: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from core.errors import MoepipeError
    from experiments.common import sweep_points
    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.overrides import check_sweep

    args = [*TINY, "workload.seed=range(0,3000)"]
    check_sweep(CONF_DIR, "config", args)
    assert compositions[0] < 10

    def bad(cfg: Any) -> None:  # a value every point shares that fails each
        raise MoepipeError("workload.gen_len must be a positive integer, got 0")

    monkeypatch.setattr(sweep_points, "POINT_CHECK", [bad])
    monkeypatch.setattr(sweep_points, "VALUES_TRIED", 3)  # each tried is 0.2 s here
    raises_one_line(lambda: check_sweep(CONF_DIR, "config", args), "workload.gen_len")
    assert compositions[0] < 10 + 3 + 1


def test_a_sweep_whose_first_values_fail_and_last_passes_is_not_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from core.errors import MoepipeError
    from experiments.common import sweep_points
    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.overrides import check_sweep

    def bad_below_2999(cfg: Any) -> None:  # each of its points fails alone but the last
        if cfg.workload.seed < 2999:
            raise MoepipeError(f"workload.seed={cfg.workload.seed}: not this one")

    monkeypatch.setattr(sweep_points, "POINT_CHECK", [bad_below_2999])
    monkeypatch.setattr(sweep_points, "VALUES_TRIED", 3)
    check_sweep(CONF_DIR, "config", [*TINY, "workload.seed=range(0,3000)"])  # not refused


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("choice(1,choice(2,3))", "a sweep among a sweep's values"),
        ("1,choice(2,3)", "a sweep among a sweep's values"),
        ("sort(1,choice(2,3))", "a sweep among a sweep's values"),
        ("shuffle(1,choice(2,3))", "a sweep among a sweep's values"),
        ("choice(1,range(2,4))", "a sweep among a sweep's values"),
        ("[1,choice(2,3)]", "a sweep inside a list or dict"),
    ],
)
def test_a_sweep_nested_in_a_value_is_one_line(
    tmp_path: Path, cli_here: Any, value: str, said: str
) -> None:
    r = cli_here(
        "experiments.run", *SWEEP, f"workload.gen_len={value}", f"hydra.sweep.dir={tmp_path}/s"
    )
    one_line(r, said)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("held", ["summary.json", "files.sha256"])
def test_a_sweep_into_a_runs_folder_is_refused(tmp_path: Path, cli_here: Any, held: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / held).write_text("{}")
    r = cli_here("experiments.run", *SWEEP, "hydra/launcher=basic", f"hydra.sweep.dir={run}")
    one_line(r, f"hydra.sweep.dir={run}: a run's folder (its {held})")
    assert [p.name for p in run.iterdir()] == [held]


def test_an_esft_case_on_a_model_of_another_shape_is_refused_before_it_runs(
    tiny_model: Any,
) -> None:
    from types import SimpleNamespace

    from experiments.common.ep_inputs import check_block

    spec = SimpleNamespace(planner="eplb", params={}, model=tiny_model)
    rep = {"routing": "esft_heldout", "split": "test"}
    raises_one_line(
        lambda: check_block(rep, spec),  # type: ignore[arg-type]
        "replication.routing=esft_heldout",
        "(26, 64, 6); model tiny has (2, 4, 2)",
    )
