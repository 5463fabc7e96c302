"""Round 24f of issue 48: rounds 24a, 24b and 24d's leftovers, one class a test group:

- a refusal a command's own option caused named the hardware file it sized (validate's and
  bench.accelerate's gpu_frac=0.00001: "tiny.yaml: memory_gb.gpu=1.39e-07 ...; check its
  unit"): it names the option and the value that passes;
- warnings held until a plan is accepted: a distributed real run released them only as it
  ended, the bench_* commands held none, and a run failing otherwise than by a refusal
  dropped them (they may explain its error): now a refused run prints only its refusal,
  any other failure prints them before its error, and every command holds them alike;
- klotski's n-planner wrapped its placement's refusal, fixes and all, and added its own
  (bench.real wrapped that again): each capacity line names each helping fix once; the KV
  cache's refusal did not name more memory, which holds it as well as a smaller group does;
- collect and report took a summary.json with neither `routing` nor `routing_fields` (a
  hand-made file) unchecked; and a run of workload.routing.source=auto whose model the trace
  cannot replay, beside a summary of a trace's routing, was skipped naming exclude_tasks: the
  source is named first, as what `auto` is for the model;
- report over runs that differ in two keys, each gen_len's runs of their own model.n_layers,
  labelled its lines by gen_len alone: every key that holds two values is named;
- replication_cv printed `nan%` as the gap closed where it judged none (a gap under 1%, noise,
  or none at all): it prints which.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from core.errors import CapacityError, MoepipeError
from core.types import Tier
from experiments.common.hardware import load_hardware
from experiments.common.pipeline import RunSpec, simulate_run
from tests.conftest import conf, model_from_conf
from tests.probes.conftest import one_line, raises_one_line
from tests.probes.test_probe_round21b import TINY_WL, hardware

_MODEL_BYTES = 13_914_624  # tiny_ckpt's


@pytest.mark.parametrize(
    ("gpu_frac", "cpu_frac", "option", "fix"),
    [
        (1e-5, 0.15, "gpu_frac", "pass gpu_frac at least 7.19e-05"),
        (0.6, 1e-9, "cpu_frac", "pass cpu_frac at least 7.19e-05"),
        (64.0, 1e8, "cpu_frac", "pass cpu_frac at most 7.18e+06"),
    ],
)
def test_a_share_option_too_small_for_a_machine_names_the_option(
    gpu_frac: float, cpu_frac: float, option: str, fix: str
) -> None:
    line = raises_one_line(
        lambda: load_hardware("tiny", _MODEL_BYTES, gpu_frac, cpu_frac), f"{option}=", fix
    )
    assert "tiny.yaml" not in line and "check its unit" not in line, line
    passes = float(fix.rsplit(" ", 1)[1])  # the value it names is itself taken
    shares = {"gpu_frac": gpu_frac, "cpu_frac": cpu_frac, option: passes}
    load_hardware("tiny", _MODEL_BYTES, shares["gpu_frac"], shares["cpu_frac"])


@pytest.mark.parametrize("command", ["experiments.validate", "experiments.bench.accelerate"])
def test_validate_and_bench_accelerate_name_their_gpu_frac(
    tiny_ckpt: Path, tmp_path: Path, cli_here: Any, command: str
) -> None:
    r = cli_here(command, f"checkpoint={tiny_ckpt}", "hardware=tiny", "gpu_frac=0.00001")
    line = one_line(r, "gpu_frac=0.00001", "pass gpu_frac at least")  # as typed (round 27c)
    assert "tiny.yaml" not in line, line


def _cv_fold(st_ms: float, orc_ms: float) -> list[dict[str, Any]]:
    def row(planner: str, ms: float) -> dict[str, Any]:
        return dict(case="c", planner=planner, batch_size=8, balancedness=0.9, makespan_s=ms / 1e3)

    return [
        row("ep_static", st_ms),
        row("eplb", 67.0),
        row("oracle_replication", orc_ms),
        row("predictive_replication", 67.0),
    ]


@pytest.mark.parametrize(
    ("orc_ms", "fold_says", "mean_says"),
    [(65.8, "noise", "noise"), (66.0, "no gap", "no gap"), (None, "no gap", "noise/none")],
)
def test_replication_cv_says_why_it_judged_no_gap(
    orc_ms: float | None, fold_says: str, mean_says: str
) -> None:
    from experiments.replication_cv import cv_lines

    folds = {"fold1": _cv_fold(66.0, orc_ms or 66.0)}
    if orc_ms is None:  # one fold of each
        folds["fold2"] = _cv_fold(66.0, 65.8)
    lines = cv_lines(folds)
    assert not any("nan" in line for line in lines), lines
    fold = next(line for line in lines if line.split()[:2] == ["1", "fold1"])
    mean = next(line for line in lines if line.startswith("mean"))
    assert f" {fold_says} " in fold and f" {mean_says} " in mean, (fold, mean)


_FIXES = ("smaller n", "workload.prompt_len", "workload.batch_size", "hardware.memory_gb.gpu")


@pytest.mark.parametrize("n_batches", [2, 1])
def test_klotskis_group_refusal_names_each_fix_once(n_batches: int) -> None:
    """GPU memory under klotski's working set at prompt_len=4000: the placement's line ("lower
    workload.prompt_len or workload.batch_size (or workload.n_batches), or raise ...") was
    followed by the n-planner's ("pick a smaller n", or at n=1 "lower workload.batch_size or
    the context ..., or use hardware with more memory")."""
    hw = hardware()
    hw = replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: 600_000, Tier.CPU: 100_000})
    wl = TINY_WL.with_(prompt_len=4000, n_batches=n_batches)
    spec = RunSpec(model_from_conf("tiny"), hw, wl, "klotski")
    line = raises_one_line(lambda: simulate_run(spec), f"n={n_batches} batches")
    fixes = line[line.index("KV cache of the group") :].replace("the workload's n_batches", "")
    assert "more memory" not in line and "n_batches" not in fixes, line
    assert [fixes.count(fix) for fix in _FIXES] == [int(n_batches > 1), 1, 1, 1], line


def test_the_kv_caches_refusals_name_more_memory() -> None:
    """The placement's, and the run's before its routing is built: "lower workload.batch_size,
    n_batches, prompt_len or gen_len" alone, though GPU or CPU memory holds the cache too."""
    from experiments.common.pipeline import check_kv_fits
    from planners.placement import klotski_placement

    tiny, hw = model_from_conf("tiny"), hardware()
    hw = replace(hw, memory_bytes={**hw.memory_bytes, Tier.DISK: 10**12})
    more = "raise hardware.memory_gb.gpu or hardware.memory_gb.cpu"
    raises_one_line(lambda: klotski_placement(tiny, hw, 10**5, 10**3, 0, 0, 2), "KV cache", more)
    wl = TINY_WL.with_(prompt_len=10**7)
    line = raises_one_line(lambda: check_kv_fits(RunSpec(tiny, hw, wl, "flexgen")), more)
    assert line.count("workload.batch_size") == 1, line


def test_bench_reals_refusal_names_its_fixes_once(tmp_path: Path, capsys: Any) -> None:
    """ "Klotski's plan does not fit it (...; raise budget_gb, or lower batch_size, prompt_len
    or gen_len); raise budget_gb, or lower batch_size or prompt_len"."""
    from experiments.bench import real as bench_real

    args = ["model=mixtral-tiny", "hardware=tiny", "budget_gb=0.008", f"out_dir={tmp_path}"]
    assert bench_real.main(args) == 2
    line = capsys.readouterr().err.strip()
    assert [line.count(k) for k in ("raise budget_gb", "batch_size", "prompt_len")] == [1, 1, 1]


_HAND_MADE = {"planner": "flexgen", "model": "tiny", "makespan_s": 1.0, "throughput_tok_s": 2.0}


@pytest.mark.parametrize(
    ("summary", "lacks"),
    [
        (_HAND_MADE, "has no routing_fields"),
        (_HAND_MADE | {"status": "infeasible"}, None),  # a point too big: it ran no routing
        (_HAND_MADE | {"routing_fields": {"source": "synthetic"}}, None),
    ],
)
def test_a_summary_that_ran_no_routing_is_skipped_naming_routing_fields(
    summary: dict[str, Any], lacks: str | None
) -> None:
    from experiments.common.tables import summary_lacks

    said = summary_lacks(summary)
    assert said is None if lacks is None else said is not None and said.startswith(lacks), said


@pytest.mark.parametrize(("model", "named"), [("tiny", True), ("deepseek-v2-lite", False)])
def test_an_auto_source_is_named_before_the_trace_fields(model: str, named: bool) -> None:
    """tiny's `auto` is synthetic routing: a summary of the trace's was skipped for its
    exclude_tasks, as if only the tasks were edited."""
    from experiments.common.run_config import config_disagrees

    routing = {"source": "auto", "exclude_tasks": ["law"]}
    config = {"model": conf("model", model), "workload": {"seed": 0, "routing": routing}}
    ran = {"source": "trace", "exclude_tasks": [], "seed": 0}
    line = config_disagrees(config, {"routing": "trace", "routing_fields": ran}) or ""
    source = "workload.routing.source is 'auto' ('synthetic' for its model)"
    assert (source in line and "exclude_tasks" not in line) == named, line
    assert named or "exclude_tasks" in line, line


def test_report_names_every_key_its_lines_differ_in() -> None:
    import pandas as pd

    from experiments.common.ranking import line_groups

    df = pd.DataFrame(
        {
            "system": ["flexgen"] * 4,
            "workload.batch_size": [2, 4, 2, 4],
            "workload.gen_len": [3, 3, 8, 8],
            "model.n_layers": [2, 2, 4, 4],
            "executor.dtype": [None, None, "bf16", "bf16"],  # one value where set: unnamed
            "throughput_tok_s": [1.0, 2.0, 3.0, 4.0],
        }
    )
    labels = [label for label, _ in line_groups(df, "workload.batch_size")]
    assert labels == ["flexgen, gen 3, n_layers 2", "flexgen, gen 8, n_layers 4"]


_NOTE = "probe: a note about the run"


def _noted_then(error: Exception) -> Any:
    def fail(*args: Any, **kw: Any) -> Any:
        import logging

        logging.getLogger("probe").warning(_NOTE)
        raise error

    return fail


def _notes(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.getMessage() == _NOTE for r in caplog.records)


_ERRORS = [(CapacityError("GPU memory too small; raise it"), 0), (MoepipeError("bad"), 1)]


@pytest.mark.parametrize(("error", "said"), [*_ERRORS, (ValueError("a bug"), 1)])
def test_held_warnings_are_said_before_an_error_that_is_no_refusal(
    error: Exception, said: int, caplog: pytest.LogCaptureFixture
) -> None:
    from experiments.common.held_warnings import warnings_held

    with pytest.raises(type(error)), warnings_held():
        _noted_then(error)()
    assert _notes(caplog) == said


def _bench_call(bench: str, monkeypatch: pytest.MonkeyPatch, error: Exception) -> Any:
    """The bench's body, its first check (`first`) replaced by one that warns, then fails with
    `error`."""
    import importlib
    from types import SimpleNamespace

    bench, first = bench.split(".")
    module = importlib.import_module(f"experiments.bench.{bench}")
    monkeypatch.setattr(module, first, _noted_then(error))
    if bench == "accelerate":
        from experiments.common.schema import BenchAccelerateOptions

        return lambda: module._main(BenchAccelerateOptions(checkpoint=""))
    if bench == "real":
        return lambda: module.run(SimpleNamespace())
    return lambda: module.report({"lanes": 2, "repeats": 1, "device": "cpu"})


@pytest.mark.parametrize(
    "bench", ["accelerate.checked", "real._checked", "lanes.as_int", "host.resolve_device"]
)
@pytest.mark.parametrize(("error", "said"), _ERRORS)
def test_the_benches_hold_their_warnings_as_a_run_does(
    bench: str,
    error: Exception,
    said: int,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from experiments.common.held_warnings import warnings_held

    with pytest.raises(type(error)), warnings_held():  # the commands' shared entry's hold
        _bench_call(bench, monkeypatch, error)()
    assert _notes(caplog) == said


def test_a_spawned_distributed_run_says_its_warnings_once_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """They were said as the run ended, after every rank had run."""
    from experiments.common import dist_run, real_run

    said: list[str] = []
    monkeypatch.setattr(dist_run, "launched", lambda: False)
    monkeypatch.setattr(dist_run, "sized_processes", lambda *a: (2, None, None))
    monkeypatch.setattr(dist_run, "_spawn", lambda *a: said.append("ranks ran"))
    monkeypatch.setattr(real_run, "unchanged_since", lambda *a: None)
    run = dist_run.run_distributed(
        "ck", None, "replay", None, 1.0, files={}, on_planned=lambda: said.append("planned")
    )  # type: ignore[arg-type]
    assert said == ["planned", "ranks ran"], (said, run)
