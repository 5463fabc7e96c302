"""Probe round 11a (issue 48's leftovers): a key given twice on a command line (hydra kept the
last without a word), joblib's temp_folder unchecked, an expert-parallel refusal whose numbers
said the model fit, memory fractions out of range named by one bound, warnings from shared code
naming a run's keys in the benches and validate, and replication's page written over a user's."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from experiments.common.launcher_checks import check_joblib
from experiments.common.option_names import (
    BENCH_OPTIONS,
    VALIDATE_LANES_OPTIONS,
    VALIDATE_OPTIONS,
    named_as,
)
from tests.conftest import overridden
from tests.probes.conftest import TINY, one_line, raises_one_line


@pytest.mark.parametrize(
    ("module", "first", "then", "line"),
    [
        (
            "experiments.run",
            "planner=flexgen",
            "planner=klotski",
            "planner is given twice (flexgen, then klotski)",
        ),
        ("experiments.run", "workload.n_batches=3", "workload.n_batches=4", "(3, then 4)"),
        (
            "experiments.run",
            "+workload.seed=1",
            "workload.seed=2",
            "workload.seed is given twice (1, then 2)",
        ),
        ("experiments.run", "++workload.seed=1", "~workload.seed", "(1, then ~ to delete it)"),
        ("experiments.run", "workload.seed=", "workload.seed=2", "('', then 2)"),
        ("experiments.run", "hydra/launcher=joblib", "hydra/launcher=basic", "hydra/launcher is"),
        ("experiments.run", "hydra.job.name=a", "hydra.job.name=b", "hydra.job.name is given"),
        ("experiments.validate", "batch_size=1", "batch_size=2", "batch_size is given twice"),
        ("experiments.bench.sim", "planner=flexgen", "planner=klotski", "(flexgen, then klotski)"),
        ("experiments.collect", "dir=a", "dir=b", "dir is given twice (a, then b)"),
    ],
)
def test_a_key_given_twice_is_refused(
    tmp_path: Path, cli_here: Any, module: str, first: str, then: str, line: str
) -> None:
    """`planner=flexgen planner=klotski` ran klotski, `workload.n_batches=3 workload.n_batches=4`
    ran n=4: hydra keeps the last value without a word. Each form of a key (`+`, `++`, `~`, a
    group, a hydra key) and every command."""
    base = overridden(TINY, first) if module == "experiments.run" else [first]
    r = cli_here(module, *base, then, f"hydra.run.dir={tmp_path / 'run'}")
    assert one_line(r, line).endswith("give it once")
    assert not (tmp_path / "run").exists()


def test_a_key_given_twice_in_a_sweep_is_refused_before_it_starts(
    tmp_path: Path, cli_here: Any
) -> None:
    """A sweep's list given once is one value; the same key again after it ran the last."""
    sweep = tmp_path / "s"
    args = ["-m", *TINY, "workload.seed=1,2", "workload.seed=3", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", *args)
    one_line(r, "workload.seed is given twice (1,2, then 3)")
    assert not sweep.exists()


def test_flags_and_a_sweeps_list_are_not_a_key_given_twice() -> None:
    from experiments.common.argv_checks import key_given_twice

    argv = ["-m", "workload.seed=1,2", "-cd", "conf", "--cfg", "job", "-i", "x", "planner=a"]
    assert key_given_twice(argv) is None
    assert key_given_twice(["workload.seed=1", "workload.routing.seed=1", "~model.x"]) is None


def _joblib(**launcher: Any) -> Any:
    """A config whose launcher is joblib's, at its defaults but `launcher`."""
    from hydra_plugins.hydra_joblib_launcher.config import JobLibLauncherConf

    base = OmegaConf.to_container(OmegaConf.structured(JobLibLauncherConf))
    return OmegaConf.create({"hydra": {"launcher": {**base, **launcher}}})


def test_a_joblib_temp_folder_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    """temp_folder= a folder that cannot be made ran without a word (joblib makes it only for
    the arrays it shares); a folder that can be made passes, and is not left made."""
    (tmp_path / "afile").write_text("")
    bad = tmp_path / "afile" / "x"
    raises_one_line(
        lambda: check_joblib(_joblib(temp_folder=str(bad))),
        f"hydra.launcher.temp_folder={bad}",
        "cannot create folder",
    )
    check_joblib(_joblib(temp_folder=str(tmp_path / "new" / "t")))
    assert not (tmp_path / "new").exists()


def test_a_sweeps_joblib_temp_folder_is_checked_before_it_starts(
    tmp_path: Path, cli_here: Any
) -> None:
    (tmp_path / "afile").write_text("")
    sweep = tmp_path / "s"
    r = cli_here(
        "experiments.run", "-m", *TINY, "workload.seed=1,2",
        f"hydra.launcher.temp_folder={tmp_path / 'afile' / 'x'}", f"hydra.sweep.dir={sweep}",
    )  # fmt: skip
    one_line(r, "hydra.launcher.temp_folder=", "is a file, not a folder")
    assert not sweep.exists()


def _said_to_fit(line: str) -> bool:
    """Whether an expert-parallel refusal's own numbers say what it holds fits: the fullest
    GPU's bytes within one GPU, or the bytes it needs within all of them."""
    gb = r"([\d.]+(?:e[+-]?\d+)?) GB"
    cap = float(re.search(rf"GPU\(s\) of {gb}", line)[1])  # type: ignore[index]
    held = re.search(rf"the fullest holds {gb}", line)
    if held:
        return float(held[1]) <= cap
    need, room = re.search(rf"\({gb}\) do not fit", line), re.search(rf"\({gb} in all\)", line)
    assert need, line
    return float(need[1]) <= (float(room[1]) if room else cap)  # one GPU: no "in all"


def test_an_expert_parallel_refusal_states_numbers_that_do_not_fit(
    tmp_path: Path, cli_here: Any
) -> None:
    """tiny's experts on lanes of 0.53 MB: "do not fit 1 GPU(s) of 0.00053 GB (the fullest
    holds 0.00051 GB)". The placement also held the activations and the working buffers,
    which the line left out."""
    args = [
        "planner=ep_static", "+planner.params.n_devices=2", "+planner.params.lanes=true",
        "planner.params.replica_slots=0", "hardware.memory_gb.gpu=0.00053",
    ]  # fmt: skip
    r = cli_here("experiments.run", *overridden(TINY, *args), f"hydra.run.dir={tmp_path}/r")
    line = one_line(r, "keeps every expert resident", "hardware.memory_gb.gpu")
    assert not _said_to_fit(line), line


def test_validates_expert_parallel_refusal_at_a_fraction_over_1_adds_up(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any
) -> None:
    """gpu_frac=1.3 with eplb on two lanes: "do not fit 1 GPU(s) of 0.000731 GB (the fullest
    holds 0.000644 GB)", and the fix named was to raise gpu_frac."""
    r = cli_here(
        "experiments.validate", f"checkpoint={tiny_ckpt}", "hardware=tiny", "planners=[eplb]",
        "gpu_frac=1.3", "+planner_params.n_devices=2", "+planner_params.lanes=true",
        "repeats=1", f"out={tmp_path}/v",
    )  # fmt: skip
    line = one_line(r, "keeps every expert resident", "raise gpu_frac")
    assert not _said_to_fit(line), line


@pytest.mark.parametrize(
    ("module", "arg", "bound"),
    [
        ("experiments.validate", "gpu_frac=0", "(0, 64]"),
        ("experiments.validate", "cpu_frac=65", "(0, 64]"),
        ("experiments.bench.accelerate", "gpu_frac=1.3", "(0, 1]"),
        ("experiments.bench.accelerate", "cpu_frac=-0.5", "(0, 1]"),
    ],
)
def test_a_memory_fraction_out_of_range_names_its_range(
    tmp_path: Path, cli_here: Any, module: str, arg: str, bound: str
) -> None:
    """0 said "must be > 0; ... e.g. gpu_frac=1" (past bench.accelerate's own bound), 65 "must
    be <= 64": one bound each. Either side now names the range."""
    r = cli_here(module, f"checkpoint={tmp_path}/none", arg)
    one_line(r, f"{arg.partition('=')[0]}=", f"must be in {bound}", "share of the model")


@pytest.mark.parametrize(
    ("names", "own"),
    [
        (BENCH_OPTIONS, "klotski_n"),
        (VALIDATE_OPTIONS, "planner_params.n"),
        (VALIDATE_LANES_OPTIONS, "n_batches"),
    ],
)
def test_a_warning_from_shared_code_names_the_commands_options(
    names: dict[str, str], own: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The n-planner's warning said "planner.params.n" in bench.accelerate and validate, whose
    options those are not; their refusals already said the commands' own names."""
    with caplog.at_level(logging.INFO), named_as(names):
        logging.getLogger("planners.n_planner").warning(
            "pick a smaller n (%s; %s)", "planner.params.n", "workload.n_batches"
        )
    (message,) = [r.getMessage() for r in caplog.records]
    assert own in message and "workload.n_batches" not in message, message
    logging.getLogger("planners.n_planner").warning("outside: %s", "planner.params.n")
    assert caplog.records[-1].getMessage() == "outside: planner.params.n"


def test_bench_reals_n_planner_warning_names_its_own_options(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """bench.real model=mixtral-tiny at 60% of the model: "n=2 does not fit memory (... raise
    hardware.memory_gb.gpu or hardware.memory_gb.cpu ... (planner.params.n; ...))". The
    warning now quotes only why n=2 does not fit (round 24j): no fix of either's names."""
    from experiments.bench import real
    from experiments.common.schema import BenchRealOptions
    from real.checkpoint import reduced_spec

    spec = reduced_spec("mixtral-tiny")
    opts = BenchRealOptions(model="mixtral-tiny", budget_gb=0.6 * spec.total_bytes / 1e9)
    opts.hardware = "tiny"
    with caplog.at_level(logging.WARNING), named_as(real.OWN_NAMES):
        real._fits(opts, spec, opts.budget_gb * 1e9)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "n-planner" in said and "does not fit" in said and "raise " not in said, said
    assert "hardware." not in said and "planner.params" not in said, said


def test_a_childs_relayed_warning_names_the_benchs_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench.real relayed its accelerate children's warnings as they wrote them: "raise
    gpu_frac or cpu_frac" (bench.accelerate's options) to a bench.real user."""
    from experiments.bench import real
    from experiments.common.peers import relay

    errors: list[str] = []
    with named_as(real.OWN_NAMES):
        relay(io.StringIO("n-planner: raise gpu_frac or cpu_frac (klotski_n)\nerror: x\n"), errors)
    assert capsys.readouterr().err == "n-planner: raise budget_gb (n)\n"
    assert errors == ["x"]


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("index.html", "out"),
        ("report.txt", "out"),
        ("throughput.png", "out"),
        ("results.csv", "dir"),
    ],
)
def test_replication_refuses_report_files_it_did_not_write(
    tmp_path: Path, cli_here: Any, name: str, where: str
) -> None:
    """out= a folder of the user's: its index.html, report.txt and plots were written over
    theirs (exit 0, the files lost). Refused before the sweep's runs are read: no sweep here."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / name).write_text("theirs\n")
    sweep = theirs if where == "dir" else tmp_path / "sweep"
    r = cli_here("experiments.replication", f"dir={sweep}", f"out={theirs}")
    one_line(r, f"{where}={theirs / name}", "did not write")
    assert [p.name for p in theirs.iterdir()] == [name]
    assert (theirs / name).read_text() == "theirs\n"


def test_replication_takes_its_own_page_and_refuses_a_folder_in_a_files_place(
    tmp_path: Path, cli_here: Any
) -> None:
    """Its own files are replaced (the same command again); a folder where a plot goes is
    named before the runs are read."""
    from core.args import PNG_OURS, PNG_START
    from experiments.common.ep_plots import PAGE_START

    out = tmp_path / "out"
    out.mkdir()
    (out / "index.html").write_bytes(PAGE_START + b"<style></style>")
    (out / "report.txt").write_text("case             bs\n")
    (out / "throughput.png").write_bytes(PNG_START + PNG_OURS)
    r = cli_here("experiments.replication", f"dir={tmp_path}/none", f"out={out}")
    one_line(r, f"dir={tmp_path}/none", "no such folder")
    (out / "throughput.png").unlink()
    (out / "throughput.png").mkdir()
    r = cli_here("experiments.replication", f"dir={tmp_path}/none", f"out={out}")
    one_line(r, f"out={out / 'throughput.png'}", "a folder")


def test_a_warning_the_bench_or_a_child_gave_is_not_relayed_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bench.real chose n and warned that n=2 did not fit; then each of its children chose the
    same n and warned again (the line three to five times). A line said once in the bench's
    block, logged by it or relayed from a child, is not relayed again; blank lines and other
    lines are."""
    from experiments.bench import real
    from experiments.common.peers import relay

    warning = "n-planner: n=2 does not fit memory (raise budget_gb)"
    with named_as(real.OWN_NAMES):
        logging.getLogger("planners.n_planner").warning(warning)
        capsys.readouterr()
        for child in ("a", "b"):
            relay(io.StringIO(f"{warning}\n\nchild {child} ran\n{warning}\n"), [])
    assert capsys.readouterr().err == "\nchild a ran\n\nchild b ran\n"
    relay(io.StringIO(f"{warning}\n{warning}\n"), [])  # outside a bench's block: as it came
    assert capsys.readouterr().err == f"{warning}\n{warning}\n"
