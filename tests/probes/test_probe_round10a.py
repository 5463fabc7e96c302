"""Probe round 10a (issue 48): a folder in a run file's place, which the reading commands
called missing or "no column(s)", not a folder; bench.real's and validate's errors naming
other commands' options (klotski_n, planner.params.n) for their own; a planner's refusal of a
working set past the GPU made after a minute of building routing, not before; a bad
hydra.callbacks override warned of over many lines and run, or said without its key."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from core.spec import Workload
from core.trace import read_trace
from experiments.common.cli import error_line
from experiments.common.tables import collect
from experiments.trace_json import read_traces
from planners.registry import expert_parallel_names, planner_names
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run

FOLDER = "a folder, where a file belongs"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run(tmp_path_factory.mktemp("round10a") / "run")


@pytest.mark.parametrize("name", ["trace.parquet", "summary.json", "files.sha256", "config.yaml"])
def test_a_folder_in_a_run_files_place_is_said_to_be_one(
    finished_run: Path, tmp_path: Path, name: str
) -> None:
    """trace_json said "no trace.parquet there" and report "no column(s) source, ..." (pyarrow
    reads a folder as an empty dataset) for a trace.parquet that is a folder; collect said
    "not a regular file (a directory)" of summary.json and config.yaml with nothing to do
    about it, and "is not sha256sum's list" of files.sha256."""
    run = Path(shutil.copytree(finished_run, tmp_path / "run"))
    (run / name).unlink()
    (run / name).mkdir()
    if name != "config.yaml":  # trace_json does not read it
        raises_one_line(lambda: read_traces(run), f"{run / name}", FOLDER, "run that run again")
    if name == "trace.parquet":  # collect does not read it; report does
        raises_one_line(lambda: read_trace(run / name), name, FOLDER, "run that run again")
    else:
        _, problems = collect(tmp_path)
        assert len(problems) == 1 and name in problems[0], problems
        assert FOLDER in problems[0] and "run the sweep again" in problems[0]


def test_an_oserror_on_a_folder_says_it_is_one(tmp_path: Path) -> None:
    """open() of a folder: "Is a directory; check the file and the disk"."""
    with pytest.raises(IsADirectoryError) as info:
        open(tmp_path)  # noqa: SIM115 (the error is the point)
    line = error_line(info.value)
    assert line is not None and str(tmp_path) in line and FOLDER in line
    assert "move that folder away" in line


def test_bench_reals_errors_name_its_own_n(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """bench.real's option is n: a child's failure said klotski_n (bench.accelerate's, which its
    children take) and the planner's fit check said planner.params.n (a run's key)."""
    from experiments.bench import real as bench_real
    from experiments.common.peers import side_failed

    def child_failed(opts: Any) -> None:
        why = "n=15 batches does not fit; pick a smaller n (planner.params.n; workload.n_batches)"
        raise side_failed("moepipe klotski", why)

    monkeypatch.setattr(bench_real, "run", child_failed)
    assert bench_real.main(["model=mixtral-tiny", "budget_gb=1"]) == 2
    line = capsys.readouterr().err.strip()
    assert "(n; n)" in line and "klotski_n" not in line and "planner.params" not in line
    monkeypatch.undo()
    args = ["model=mixtral-tiny", "hardware=tiny", "budget_gb=0.008", f"out_dir={tmp_path}"]
    assert bench_real.main([*args, "n=1000"]) == 2  # refused by the planner, before any file
    line = capsys.readouterr().err.strip()
    assert "pick a smaller n (n;" in line and "planner.params" not in line, line


@pytest.mark.parametrize("planner", sorted(set(planner_names()) - set(expert_parallel_names())))
def test_a_working_set_past_the_gpu_is_refused_before_routing_is_built(
    monkeypatch: pytest.MonkeyPatch, planner: str
) -> None:
    """prompt_len=3000000 on the tiny model: routing for it was built (a minute, 5 GB) before
    the planner's placement found the activations larger than the GPU, and the line named no
    field ("use a smaller batch or fewer batches")."""
    from experiments.common import pipeline
    from tests.conftest import hardware_from_conf, model_from_conf

    def built(*_: Any) -> None:
        raise AssertionError("routing built before the plan's own refusal")

    monkeypatch.setattr(pipeline, "load_routing", built)
    wl = Workload(batch_size=2, n_batches=2, prompt_len=3_000_000, gen_len=3)
    spec = pipeline.RunSpec(model_from_conf("tiny"), hardware_from_conf("tiny"), wl, planner)
    raises_one_line(lambda: pipeline.simulate_run(spec), "workload.prompt_len")


CALLBACK_CASES = [
    (["+hydra.callbacks.X.foo=1"], ["hydra.callbacks.X:", "_target_"]),
    (["hydra.callbacks.progress=5"], ["hydra.callbacks.progress:", "_target_"]),
    (["+hydra.callbacks.progress.foo=1"], ["hydra.callbacks.progress.foo", "poll_s"]),
    (["+hydra.callbacks.progress.poll_s=abc"], ["hydra.callbacks.progress.poll_s", "a number"]),
    (["+hydra.callbacks.X._target_=nosuch.Mod"], ["hydra.callbacks.X._target_=nosuch.Mod"]),
    (["+hydra.callbacks.X._target_=builtins.dict"], ["builtins.dict", "Callback"]),
    # an argument the config's callback does not list: not "valid: _target_"
    (["hydra.callbacks.progress.poll_s=3"], ["not set", "+hydra.callbacks.progress.poll_s="]),
    (["hydra.callbacks.progress.pol=3"], ["hydra.callbacks.progress.pol:", "'poll_s'"]),
]


@pytest.mark.parametrize("args, names", CALLBACK_CASES, ids=[c[0][0] for c in CALLBACK_CASES])
def test_a_bad_callback_override_is_one_line_naming_its_key(
    tmp_path: Path, cli_here: Any, args: list[str], names: list[str]
) -> None:
    """A callback of no _target_ (or no class, or not a Callback) was warned of over eight
    lines at each of hydra's events and the run went on, exit 0; an argument its class does not
    take was 'Error in call to target ...; TypeError(...)', naming no key; a value of the wrong
    kind was taken; an argument the config's callback does not list was an unknown key,
    "valid: _target_"."""
    r = cli_here("experiments.run", *TINY, *args, f"hydra.run.dir={tmp_path / 'run'}")
    line = one_line(r, *names)
    assert "HYDRA_FULL_ERROR" not in line
    assert not (tmp_path / "run").exists()


def test_validates_errors_name_its_own_options(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any
) -> None:
    """validate's options are batch_size and planner_params: a planner's refusal said
    workload.batch_size and planner.params.n, a run's keys, which validate does not take."""
    args = [f"checkpoint={tiny_ckpt}", "hardware=tiny", "planners=[klotski]", "repeats=1"]
    args += ["gpu_frac=0.9"]  # one batch fits, n=1000 does not: the fix names n
    r = cli_here("experiments.validate", *args, "+planner_params.n=1000", f"out={tmp_path / 'v'}")
    line = one_line(r, "planner_params.n", "batch_size")
    assert "planner.params" not in line and "workload." not in line


def test_validate_lanes_errors_name_its_own_options(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any
) -> None:
    """validate_lanes's options are lanes and replica_slots: a planner's refusal said
    planner.params.replica_slots, a run's key."""
    args = [f"checkpoint={tiny_ckpt}", "hardware=tiny", "planners=[predictive_replication]"]
    more = ["replica_slots=100", "lanes=2", "device=cpu", "repeats=1", f"out={tmp_path / 'v'}"]
    r = cli_here("experiments.validate_lanes", *args, *more)
    line = one_line(r, "replica_slots=100")
    assert "planner.params" not in line


def test_a_folder_where_an_input_file_belongs_is_not_called_missing(tmp_path: Path) -> None:
    """model=m.yaml, reproduce_klotski's results.csv and a checkpoint shard that are folders
    were "no such file", "no results" and "missing file"."""
    from experiments.reproduce_klotski import read_results
    from real.checkpoint import reduced_spec
    from real.disk import DiskReader

    for name in ("m.yaml", "results.csv", "model.safetensors"):
        (tmp_path / name).mkdir()
    raises_one_line(lambda: reduced_spec(str(tmp_path / "m.yaml")), "m.yaml", FOLDER)
    raises_one_line(lambda: read_results(tmp_path / "results.csv"), "results.csv", FOLDER)
    raises_one_line(lambda: DiskReader(tmp_path / "model.safetensors"), "safetensors", FOLDER)


def test_a_bad_callback_of_a_users_config_dir_is_one_line(tmp_path: Path, cli_here: Any) -> None:
    """An experiment of the user's --config-dir that adds a callback of no class: hydra
    warned at each event and the run went on, exit 0."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\nhydra:\n  callbacks:\n    mine:\n      foo: 1\n"
    )
    args = ["--config-dir", str(tmp_path / "conf"), "experiment=mine", *TINY]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, "hydra.callbacks.mine:", "_target_")


def test_a_kv_cache_past_the_memory_names_the_fields_to_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV cache's refusal said "reduce batch_size, n_batches or the sequence length",
    naming no field of the sequence length."""
    from core.types import Tier
    from experiments.common import pipeline
    from tests.conftest import hardware_from_conf, model_from_conf

    monkeypatch.setattr(pipeline, "ROUTING_CHECK_BYTES", 0)  # checked whatever its size
    monkeypatch.setattr(pipeline, "_available_ram_bytes", lambda: None)  # not the RAM's line
    m, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    room = hw.memory_bytes[Tier.GPU] + hw.memory_bytes[Tier.CPU]
    wl = Workload(
        batch_size=2, n_batches=2, prompt_len=room // (4 * m.kv_bytes_per_token), gen_len=3
    )
    spec = pipeline.RunSpec(m, hw, wl, "flexgen")
    line = raises_one_line(lambda: pipeline.check_kv_fits(spec), "KV cache", "workload.batch_size")
    assert "prompt_len" in line and "gen_len" in line
