"""The replication cases as experiments.run sweeps: what a run gets beside its spec
(experiments.common.ep_inputs.prepare), and a tiny case swept, reported and resumed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from core.errors import ConfigError
from core.hardware import HardwareSpec
from core.spec import ModelSpec, RoutingConfig, Workload
from experiments.common.ep_inputs import esft_split, load_matrix, prepare
from experiments.common.pipeline import RunSpec
from tests.conftest import NEEDS_TRACES, ROOT, SHARED_TRACES
from tests.experiments.conftest import ESFT_ROWS, replication_sweep_args

BASE = OmegaConf.load(ROOT / "conf" / "experiment" / "replication.yaml").replication


def _spec(
    planner: str, model: str = "deepseek-v2-lite", source: str = "trace", **params
) -> RunSpec:
    conf = ROOT / "conf"
    m = ModelSpec.from_dict(yaml.safe_load((conf / "model" / f"{model}.yaml").read_text()))
    hw = HardwareSpec.from_dict(yaml.safe_load((conf / "hardware" / "h200-hgx8.yaml").read_text()))
    rc = RoutingConfig(source=source, trace_dir=str(SHARED_TRACES), layer_corr=0.5, reuse=0.25)
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=1, routing=rc)
    return RunSpec(m, hw, wl, planner, {"n_devices": 2, **params})


def _cfg(routing: str = "esft_heldout", **rep) -> OmegaConf:
    block = OmegaConf.merge(BASE, {"case": "c", "routing": routing, **rep})
    return OmegaConf.create({"replication": block})


@NEEDS_TRACES
def test_runs_get_the_training_files_their_predictor_reads(tmp_path):
    """On held-out ESFT the experiment's predictive (task_mix) gets the per-task loads and the
    prior scenarios' hedge; its `[window]` row gets the hedge and no per-task loads; a row's own
    params win over the experiment's; ep_static gets no replica budget."""
    spec, _ = prepare(_cfg(), _spec("predictive_replication"), tmp_path)
    p = spec.params
    assert (p["predictor"], p["window"], p["prior_weight"]) == ("task_mix", 4, 2)
    assert p["replica_slots"] == 2 and p["n_devices"] == 2
    for key in ("initial_load", "table", "prior_scenarios", "task_load"):
        assert Path(p[key]).parent == tmp_path / "inputs" and Path(p[key]).is_file()
    win, _ = prepare(
        _cfg(params={"predictor": "window"}), _spec("predictive_replication"), tmp_path
    )
    assert win.params["predictor"] == "window" and "task_load" not in win.params
    assert win.params["prior_scenarios"] and win.params["gate"] == "time+copy"
    st, routing = prepare(_cfg(), _spec("ep_static"), tmp_path)
    assert "replica_slots" not in st.params and "initial_load" not in st.params
    assert routing.labels is not None and "esft test" in routing.description


@NEEDS_TRACES
def test_the_split_load_row_packs_from_the_evaluated_splits_own_load(tmp_path):
    rep = {"initial_load": "eval", "params": {"truth_weight": 0.0}}
    spec, _ = prepare(_cfg(**rep), _spec("oracle_replication"), tmp_path)
    ev = np.load(spec.params["initial_load"])
    test_ids, _ = esft_split(str(SHARED_TRACES), 0, "test")
    assert ev.shape == (26, 64) and (ev == load_matrix(test_ids, 64)).all()
    train, _ = prepare(_cfg(), _spec("oracle_replication"), tmp_path / "t")
    assert not (np.load(train.params["initial_load"]) == ev).all()


@NEEDS_TRACES
def test_synthetic_routing_trains_on_its_first_half(tmp_path):
    """synthetic_olmoe_top1: skew fitted to OLMoE at the model's experts; the training tables
    come from a first half drawn with the run's routing, no task loads or hedge."""
    cfg = _cfg("synthetic_olmoe_top1", planners={"predictive_replication": {"predictor": "window"}})
    spec, routing = prepare(
        cfg, _spec("predictive_replication", "switch-base-128", "synthetic"), tmp_path
    )
    with pytest.raises(ConfigError, match="task_mix, which reads each request's task.*=window"):
        prepare(
            _cfg("synthetic_olmoe_top1"),
            _spec("predictive_replication", "switch-base-128", "synthetic"),
            tmp_path,
        )
    assert spec.workload.routing.skew != 1.0 and "first half trains" in routing.description
    assert "task_load" not in spec.params and not spec.params.get("prior_scenarios")
    load = np.load(spec.params["initial_load"])
    assert load.shape[1] == 128 and load.sum() > 0


@pytest.mark.parametrize(
    "rep, planner, match",
    [
        (
            {"params": {"replica_slots": 6}},
            "eplb",
            "eplb sets replica_slots=6.*replication.replica_slots",
        ),
        ({"routing": "esft_heldot"}, "eplb", "replication.routing='esft_heldot' unknown"),
        ({"case": None}, "eplb", "replication.case is not set"),
        ({"split": "fold9"}, "eplb", "replication.split='fold9' unknown"),
        ({}, "flexgen", "planner flexgen, which is not expert-parallel"),
    ],
)
@NEEDS_TRACES
def test_bad_replication_settings_are_one_line(rep, planner, match, tmp_path):
    block = OmegaConf.merge(BASE, {"case": "c", "routing": "esft_heldout"}, rep)
    with pytest.raises(ConfigError, match=match):
        prepare(OmegaConf.create({"replication": block}), _spec(planner), tmp_path)


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
@NEEDS_TRACES
def test_a_case_sweeps_reports_and_resumes(replication_sweep, tmp_path, cli_here):
    """A tiny esft-g8 sweep (the session's): a run dir per row, the report's verdicts over it,
    the sweep run again reuses every run, and a changed setting in the same run dirs runs them
    again."""
    sweep = replication_sweep
    sub = "workload.n_batches=2,workload.prompt_len=8"  # the overrides' own sub-dir
    rows = sorted(p.parent.parent.name for p in sweep.out.glob(f"esft-g8/bs8/*/{sub}/summary.json"))
    assert rows == sorted(ESFT_ROWS.split(","))
    split_load = json.loads(
        (sweep.out / f"esft-g8/bs8/oracle_replication_split_load/{sub}/summary.json").read_text()
    )
    assert split_load["variant"] == "oracle_replication[split_load]"
    rep = sweep.report
    assert rep.returncode == 0, rep.stderr[-3000:]
    assert "esft-g8 bs=8: predictive balancedness" in rep.stdout
    assert "oracle_replication[split_load] (peeks at the routing)" in rep.stdout
    assert (sweep.out / "index.html").exists() and (sweep.out / "results.parquet").exists()
    out = tmp_path / "r"  # a copy: the session's folder stays as its sweeps left it
    shutil.copytree(sweep.out, out)
    one = "hydra.launcher.n_jobs=1"  # in the command's process: no worker to start and import
    # the sweeps again in the test's process (tests.conftest.cli_here): the session's ran as a
    # user's command
    again = cli_here("experiments.run", *replication_sweep_args(out, one))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(rows)} already finished, reused" in again.stderr, again.stderr[-2000:]
    # the same run dir under another split: config.yaml differs, so it runs again. Right
    # after the sweep before: each counts the runs its own jobs marked (`finished_runs`)
    keys = "[experiment,replication_row,workload.batch_size,replication.split]"
    other = cli_here(
        "experiments.run",
        *replication_sweep_args(
            out,
            "replication_row=eplb",
            "replication.split=validation",
            one,
            f"hydra.job.config.override_dirname.exclude_keys={keys}",
        ),
    )
    assert other.returncode == 0 and "already finished" not in other.stderr, other.stderr[-2000:]
    summary = json.loads((out / f"esft-g8/bs8/eplb/{sub}/summary.json").read_text())
    assert "validation" in summary["routing"] and summary["split"] == "validation"


CASES = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("replication_*.yaml"))


def _rows(case: str) -> list[str]:
    """The replication rows `case`'s sweep names."""
    sweep = yaml.safe_load((ROOT / "conf" / "experiment" / f"{case}.yaml").read_text())
    return str(sweep["hydra"]["sweeper"]["params"]["replication_row"]).split(",")


@pytest.mark.parametrize("case", CASES)
def test_every_case_composes_with_each_of_its_rows(case):
    """Each case's sweep names rows that exist, and each row composes into that case's config:
    its planner chosen, the case's devices set, the replication block complete. A `_b32` case
    is its base case at other batch sizes, n_batches and case name (keys no row sets; a row
    sets its planner and replication.label/params): the rows both name compose in the base
    case's test, here the rows of its own (a compose is a quarter second)."""
    from hydra import compose, initialize_config_dir

    import experiments.common.app  # noqa: F401  registers the schemas and help configs

    rows = _rows(case)
    assert rows[:4] == ["ep_static", "eplb", "predictive_replication", "oracle_replication"]
    if case.endswith("_b32"):
        rows = [r for r in rows if r not in _rows(case.removesuffix("_b32"))]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for row in rows:
            cfg = compose("config", [f"experiment={case}", f"replication_row={row}"])
            assert cfg.replication.case and cfg.replication.routing in (
                "esft_heldout",
                "synthetic_olmoe_top1",
            )
            row_cfg = yaml.safe_load(
                (ROOT / "conf" / "replication_row" / f"{row}.yaml").read_text()
            )
            assert cfg.planner.name == row_cfg["defaults"][0]["override /planner"]
            assert cfg.planner.params.n_devices in (4, 8) or row == "ep_static_1lane"
            assert cfg.replication.label == row_cfg["replication"]["label"]
