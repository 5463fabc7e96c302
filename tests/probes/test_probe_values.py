"""Probe class: a bad value in a config group (a string, float, bool or huge number where a count
belongs, a scalar where a mapping belongs) is one line naming the key, from the resolved config
(hydra's compose, in-process: the run's own boundary) and from a sweep a user runs. An error
nothing checks still ends in one line, naming the file that holds its traceback."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

import experiments.common.app  # noqa: F401  registers what conf/ composes with (schemas, hydra/help)
from experiments.common.cli import TRACEBACK_ENV, any_error_line
from experiments.common.resolve import run_spec
from tests.conftest import overridden
from tests.probes.conftest import ROOT, TINY, cli, one_line, raises_one_line

CASES = [
    ("model.n_layers=1e12", "n_layers"),
    ("model.n_layers=1000000000", "n_layers"),
    ("model.dense_ffn_size=1000000000000", "dense_ffn_size"),  # unused here, but no model's
    ("model.hidden_size=1000000000000", "hidden_size"),
    ("model.n_layers=2.5", "n_layers"),
    ("model.n_layers='two'", "n_layers"),
    ("model.hidden_size=true", "hidden_size"),
    ("model.hidden_size=0", "hidden_size"),
    ("model.n_experts=-4", "n_experts"),
    ("model.top_k=99", "top_k"),
    ("model.n_kv_heads=3", "n_kv_heads"),
    ("model.activation=gelu", "activation"),
    ("model.rope_theta=abc", "rope_theta"),
    ("+model.moe_layers=[a]", "moe_layers"),
    ("+model.moe_layers=[0,0]", "moe_layers"),
    ("+model.bogus=1", "bogus"),
    ("planner.params=5", "planner.params"),
    ("workload.batch_size=abc", "workload.batch_size"),
    ("workload.batch_size=0", "workload.batch_size"),
    ("workload.seed=-1", "workload.seed"),
    ("workload.routing.skew=abc", "workload.routing.skew"),
    ("workload.routing.reuse=2", "workload.routing.reuse"),
    ("workload.routing.source=magic", "workload.routing.source"),
    ("+workload.bogus=1", "bogus"),
    ("hardware.gpu=5", "gpu"),
    ("hardware.memory_gb=5", "memory_gb"),
    ("hardware.links.h2d.gbps=-1", "links.h2d"),
    ("hardware.links.h2d.gbps=fast", "links.h2d"),
    ("hardware.gpu.tflops=0", "tflops"),
    # numbers no machine has: a slip of units, named instead of simulated
    ("hardware.links.h2d.gbps=1e-300", "links.h2d.gbps=1e-300"),
    ("hardware.links.disk.gbps=1e12", "links.disk.gbps"),
    ("hardware.links.h2d.latency_us=1e9", "links.h2d.latency_us"),
    ("hardware.gpu.tflops=1e-12", "gpu.tflops"),
    ("hardware.cpu.mem_bw_gbps=1e-9", "cpu.mem_bw_gbps"),
    ("hardware.gpu.overhead_us=1e9", "gpu.overhead_us"),
    ("hardware.memory_gb.gpu=1e-12", "memory_gb.gpu"),
    ("hardware.memory_gb.disk=1e15", "memory_gb.disk"),
    ("+hardware.gpu.time_tables.compute-expert=[[1e300,1e-300]]", "compute-expert[0] rate"),
    ("hardware.gpu.sm_mem_bw_gbps=1e300", "gpu.sm_mem_bw_gbps"),
    ("hardware.n_gpus=0", "n_gpus"),
    ("hardware.n_gpus=1000000000", "n_gpus=1e+09"),  # was accepted
    # a number its unit takes past a float's range is named as given ("got inf" before)
    ("hardware.links.h2d.gbps=1e308", "links.h2d.gbps=1e+308"),
    ("hardware.cpu.tflops=1e300", "cpu.tflops=1e+300"),
    ("hardware.gpu.mem_bw_gbps=1e305", "gpu.mem_bw_gbps=1e+305"),
    ("executor.name=gpu", "executor"),
]


@pytest.fixture(scope="module")
def composer():  # noqa: ANN201
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        yield lambda overrides: compose("config", overrides=[*TINY, *overrides])


@pytest.mark.parametrize("override, key", CASES, ids=[c[0] for c in CASES])
def test_bad_value_is_one_line_naming_the_key(composer, override: str, key: str) -> None:  # noqa: ANN001
    raises_one_line(lambda: run_spec(composer([override])), key)


def test_a_count_written_as_a_string_reaches_the_model_as_a_number(composer) -> None:  # noqa: ANN001
    """`model.n_layers='2'`: the schema (experiments/common/schema.py) makes it the int 2 when the
    config composes, so no string count reaches ModelSpec's arithmetic."""
    n_layers = run_spec(composer(["model.n_layers='2'"])).model.n_layers
    assert n_layers == 2 and type(n_layers) is int


@pytest.mark.parametrize("fresh, values", [(True, "1e12,2"), (False, "true,2")])
def test_a_value_the_schema_refuses_stops_a_sweep_before_it_starts(
    tmp_path: Path, fresh: bool, values: str, cli_here: Any
) -> None:
    """A swept value that is not of its key's type (the schema's check, when the sweep's points
    are composed) is one line naming the key before any point runs: nothing is written.
    `fresh`: the case runs as a user runs it (a subprocess); the other in this process."""
    sweep = tmp_path / "sweep"
    r = (cli if fresh else cli_here)(
        "experiments.run",
        "-m",
        *TINY,
        "hydra/launcher=basic",
        f"model.n_layers={values}",
        f"hydra.sweep.dir={sweep}",
    )
    one_line(r, "model.n_layers")
    assert not list(sweep.rglob("summary.json")) and not list(sweep.rglob("failed.txt"))


def test_bad_values_in_a_sweep(tmp_path: Path, cli_here: Any) -> None:
    """One sweep a user runs (the basic launcher: one process): each bad value of the point
    (of its key's type, refused by the run's own checks) is one line in its failed.txt, the good
    point finishes."""
    sweep = tmp_path / "sweep"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "hydra/launcher=basic",
        "model.n_layers=1000000000,0,2",
        f"hydra.sweep.dir={sweep}",
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    failed = [p.read_text() for p in sweep.rglob("failed.txt")]
    assert len(failed) == 2 and all("n_layers" in t and t.count("\n") == 1 for t in failed)
    assert len(list(sweep.rglob("summary.json"))) == 1


def test_an_unchecked_error_is_one_line_with_its_traceback_in_a_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    try:
        {}["missing"]  # noqa: B018 (an error nothing turns into a line)
    except KeyError as e:
        line = any_error_line(e)
    assert "\n" not in line and line.startswith("internal error (KeyError: 'missing'")
    path = Path(line.rsplit(" and ", 1)[1].split(" (its traceback)")[0])
    assert "Traceback" in path.read_text() and "missing" in path.read_text()
    os.unlink(path)
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(KeyError):
        any_error_line(KeyError("x"))


@pytest.mark.parametrize(
    "fresh, module, args, key",
    [
        (True, "experiments.make_checkpoint", ["model=mixtral-tiny", "out="], "out=''"),
        (False, "experiments.collect", ["dir="], "dir=''"),
        (False, "experiments.report", ["dir="], "dir=''"),
        (False, "experiments.routing_stats", ["out="], "out=''"),
        (False, "experiments.convert_traces", ["src=.", "out="], "out=''"),
        (True, "experiments.run", [*TINY, "hydra.run.dir="], "hydra.run.dir=''"),
    ],
    ids=[
        "make_checkpoint out",
        "collect dir",
        "report dir",
        "routing_stats out",
        "convert out",
        "run dir",
    ],
)
def test_an_empty_path_is_refused_not_the_current_folder(
    fresh: bool, module: str, args: list[str], key: str, cli_here: Any
) -> None:
    """Path("") is the current folder: `out=''` wrote a checkpoint into the repository's root
    and `dir=''` collected the repository as a sweep. Nothing is written. `fresh`: the case
    runs as a user runs it (a subprocess); the others in this process, in the same folder."""
    before = sorted(p.name for p in ROOT.iterdir())
    one_line((cli if fresh else cli_here)(module, *args), key, "an empty")
    assert sorted(p.name for p in ROOT.iterdir()) == before


# a value of every config group that a run meets when it plans and simulates (a planner's
# params, the workload, the hardware, the model), each one line naming its key; hot_k,
# disk_speculate, guess_k past the model's experts and prefetch_distance past its layers were cut
# to them without a word
PLANNED = [
    ["planner=klotski", "planner.params.n=-5"],
    ["planner=klotski", "planner.params.n=1000000"],
    ["planner=klotski", "planner.params.hot_k=99"],
    ["planner=klotski", "planner.params.disk_speculate=1000"],
    ["planner=mixtral_offloading", "planner.params.guess_k=1000"],
    ["planner=moe_infinity", "planner.params.prefetch_distance=1000"],
    ["planner=klotski", "planner.params.hot_k=-1"],
    ["planner=klotski", "planner.params.warmup_sequences=-1"],
    ["planner=klotski", "planner.params.warmup_sequences=1000000"],  # a minute and GBs, unasked
    ["planner=klotski", "planner.params.disk_window=0"],
    ["planner=klotski", "planner.params.disk_window=-3"],
    ["planner=klotski", "planner.params.disk_window=1000000000000"],
    ["planner=klotski", "planner.params.attn_batches=1000000000000"],
    ["planner=eplb", "hardware.n_gpus=2", "+planner.params.num_nodes=3"],
    ["planner=flexgen", "workload.routing.hot_share=0.5", "workload.routing.hot_experts=1000"],
    ["planner=ep_static", "hardware.n_gpus=2", "planner.params.lanes=true"]
    + ["planner.params.lane_share=1e-300"],
    ["planner=flexgen", "hardware.memory_gb.gpu=100", "workload.gen_len=3000000"],
    ["planner=ep_static", "hardware.n_gpus=2", "hardware.processes.gate_exchange_us=inf"],
    ["planner=ep_static", "hardware.n_gpus=2", "hardware.gpu.sms=1000000000000"],
    ["planner=flexgen", "hardware.memory_gb.gpu=1e308"],
    ["planner=flexgen", "workload.gen_len=1000000000000"],  # ran until memory ran out
    ["planner=eplb", "hardware.n_gpus=2", "+planner.params.replica_slots=1000000000000"],
    ["planner=klotski", "planner.params.predictor=foo"],
    ["planner=flexgen", "planner.params.sync=maybe"],
    ["planner=flexgen", "+planner.params.bogus=1"],
    ["planner=eplb", "+planner.params.n_devices=0"],
    ["planner=eplb", "+planner.params.n_devices=-1"],
    ["planner=eplb", "+planner.params.interval=0"],
    ["planner=eplb", "+planner.params.interval=-2"],
    ["planner=predictive_replication", "+planner.params.window=0"],
    ["planner=predictive_replication", "+planner.params.gate=foo"],
    ["planner=oracle_replication", "+planner.params.truth=1.5"],
    ["planner=oracle_replication", "+planner.params.truth=-0.5"],
    ["planner=oracle_replication", "+planner.params.truth=nan"],
    ["planner=moe_infinity", "+planner.params.cache_frac=2"],
    ["planner=ep_static", "+planner.params.lanes=0"],
    ["planner=fiddler", "+planner.params.bogus=x"],
    ["planner=mixtral_offloading", "+planner.params.cache_per_layer=-1"],
    ["planner=flexgen", "workload.prompt_len=0"],
    ["planner=flexgen", "workload.gen_len=0"],
    ["planner=flexgen", "workload.n_batches=0"],
    ["planner=flexgen", "workload.gen_len=-1"],
    ["planner=flexgen", "workload.prompt_len=100000000"],
    ["planner=flexgen", "workload.routing.trace_dir=/nonexistent", "workload.routing.source=trace"],
    ["planner=flexgen", "workload.routing.skew=-1"],
    ["planner=flexgen", "workload.routing.layer_corr=2"],
    ["planner=flexgen", "workload.routing.layer_corr=-1"],
    ["planner=flexgen", "workload.routing.reuse=-0.5"],
    ["planner=flexgen", "hardware.memory_gb.gpu=0"],
    ["planner=flexgen", "hardware.memory_gb.cpu=-1"],
    ["planner=flexgen", "hardware.memory_gb.disk=0"],
    ["planner=flexgen", "hardware.gpu.mem_bw_gbps=0"],
    ["planner=flexgen", "hardware.gpu.overhead_us=-5"],
    ["planner=flexgen", "hardware.links.disk.gbps=0"],
    ["planner=flexgen", "hardware.links.disk_write.latency_us=-1"],
    ["planner=flexgen", "hardware.cpu.tflops=0"],
    ["planner=flexgen", "model.dtype_bytes=0"],
    ["planner=flexgen", "model.rms_norm_eps=0"],
    ["planner=flexgen", "model.head_dim=0"],
    ["planner=flexgen", "model.expert_ffn_size=0"],
    ["planner=flexgen", "model.vocab_size=0"],
    ["planner=flexgen", "model.n_heads=0"],
    ["planner=flexgen", "model.shared_ffn_size=-1"],
    ["planner=flexgen", "model.dense_ffn_size=-5"],
    ["planner=flexgen", "model.kv_dim=-1"],
    ["planner=flexgen", "+model.moe_layers=[99]"],
    ["planner=flexgen", "model.top_k=0"],
]


@pytest.mark.parametrize("overrides", PLANNED, ids=[" ".join(o) for o in PLANNED])
def test_a_bad_value_met_while_planning_is_one_line(composer, overrides: list[str]) -> None:  # noqa: ANN001
    from experiments.common.pipeline import simulate_run

    key = overrides[-1].lstrip("+").split("=")[0].split(".")[-1]
    raises_one_line(lambda: simulate_run(run_spec(composer(overrides))), key)


@pytest.mark.parametrize(
    "args",
    [
        ["planner=flexgen", "planner.params.sync=2"],
        ["planner=klotski", "planner.params.hot_prefetch=-1"],
        ["planner=eplb", "+planner.params.n_devices=2", "+planner.params.lanes=5"],
    ],
)
def test_a_number_for_a_boolean_planner_param_is_refused(
    tmp_path: Path, cli_here: Any, args: list[str]
) -> None:
    """omegaconf read any integer as true for a bool planner param (planner.params is a free
    mapping in the schema), and the run went on as if `true` was given."""
    key = args[-1].lstrip("+").split("=")[0]
    r = cli_here("experiments.run", *TINY[:-1], *args, f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, f"{key}=", "not a boolean", f"{key}=true")


def test_a_whole_number_written_as_a_float_is_one() -> None:
    """`disk_mb=1e9` was "must be an integer"; 2.5 still is not, and nan or inf is not finite,
    in the words every other number's check uses (it said "must be an integer")."""
    from core.args import as_int

    assert as_int("disk_mb", 1e9) == as_int("disk_mb", "1e9") == 10**9
    assert as_int("n", 8.0) == as_int("n", " 8 ") == 8
    for bad in (2.5, "2.5", "x", True):
        raises_one_line(lambda bad=bad: as_int("n", bad), "n=", "must be an integer")
    for bad in ("nan", "inf", "-inf", float("inf"), "1e999"):
        raises_one_line(lambda bad=bad: as_int("n", bad), "n must be a finite number, got ")


def test_a_result_beyond_what_collect_reads_is_refused_before_it_is_written() -> None:
    """A run whose makespan came out past collect's cap (1e297 s from a machine of 1e-300 GB/s
    before the hardware ranges) wrote a summary.json that collect and report then refused;
    the run itself now refuses it, naming the metric."""
    from experiments.common.tables import check_result

    raises_one_line(lambda: check_result({"makespan_s": 1.4e297}), "makespan_s", "1.4e+297")
    raises_one_line(lambda: check_result({"busy_s": {"gpu": float("inf")}}), "busy_s.gpu")
    check_result({"makespan_s": 2.0, "busy_s": {"gpu": 1.0}})


def test_a_steep_skew_runs_without_numpy_warnings(tmp_path: Path, cli_here: Any) -> None:
    """A skew of 1000 weighed ranks past rank**1000 > 1e308 as 0 (their limit): numpy's overflow
    warning went to stderr over two lines of a run that succeeded (in this process: `cli_here`
    counts each warning Python would print as a line of stderr). The steepest skew taken now
    is 64 (core.spec_fields.SPANS; round 28c), which runs without one."""
    args = [*TINY, "workload.routing.skew=64", f"hydra.run.dir={tmp_path}/r"]
    r = cli_here("experiments.run", *args)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "module, args, names",
    [
        ("experiments.bench.sim", ["repeat=1000000000000"], ["repeat=", "in [1, 1000]", "days"]),
        ("experiments.bench.host", ["repeats=1000000000000"], ["repeats=", "in [1, 1000]"]),
        ("experiments.bench.host", ["positions=1000000000000"], ["positions=", "memory"]),
        ("experiments.bench.host", ["batch=4096", "positions=1000000"], ["GB cache"]),
        ("experiments.bench.host", ["units=4096", "unit_mb=4096"], ["GB of host buffers"]),
        ("experiments.bench.lanes", ["repeats=1000000000000"], ["repeats=", "in [1, 1000]"]),
        ("experiments.calibrate", ["in_run_s=1e300", "out=/tmp/c.yaml"], ["in_run_s=", "hour"]),
        ("experiments.validate", ["repeats=1000000000000"], ["repeats=", "in [1, 1000]"]),
        ("experiments.validate", ["gen_len=1000000000000"], ["gen_len=", "memory"]),
        ("experiments.validate_lanes", ["repeats=1000000000000"], ["repeats=", "in [1, 1000]"]),
        ("experiments.run", ["-m", "workload.batch_size=range(1,1000000)"], ["range(", "100,000"]),
    ],
)
def test_a_huge_count_is_refused_up_front_with_its_reason(
    tmp_path: Path, cli_here: Any, tiny_ckpt: Path, module: str, args: list[str], names: list[str]
) -> None:
    """Each ran on with no word (hours, or for good) where a typo gave a count of 1e12; now each
    count or duration has an upper bound, said with its reason, before any work starts."""
    extra = {
        "experiments.validate": [f"checkpoint={tiny_ckpt}", f"out={tmp_path / 'v'}"],
        "experiments.validate_lanes": [f"checkpoint={tiny_ckpt}", f"out={tmp_path / 'v'}"],
        "experiments.run": [*TINY, f"hydra.sweep.dir={tmp_path / 'v'}"],
    }.get(module, [])
    r = cli_here(module, *args, *extra)
    one_line(r, *names)
    assert not (tmp_path / "v").exists()


def test_n_devices_0_is_named_as_given_with_the_gpus_it_stands_for(
    tmp_path: Path, cli_here: Any
) -> None:
    """`n_devices=0` (the hardware's GPU count) past the experts was "n_devices=64 must be in
    [1, 4]": a value the user never typed."""
    args = ["planner=eplb", "hardware.n_gpus=64", "planner.params.n_devices=0"]
    r = cli_here("experiments.run", *overridden(TINY, *args), f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, "n_devices=0 (hardware tiny's n_gpus=64)")
