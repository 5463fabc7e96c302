"""Probe round 20a (issue 48): the leftovers of round 19, each fixed as a class.

Classes:
1. A run dir made by hand (no files.sha256) whose summary.json records a config field other
   than its config.yaml holds (the planner's `params`, its executor, its hardware) was
   collected: only the workload's sizes were compared. Every field summary.json records from
   the config is, as the run wrote it (a replication run's block params too): collect,
   report and replication skip such a dir, in their one skipped line, naming the field.
2. An FP8 `weight_scale_inv` of 0, a negative, NaN or infinity was accepted (transformers
   would multiply by it): one line naming the tensor, the block and the file, at the open.
3. A stray safetensors file in a checkpoint folder (one the index does not name) counted in the
   checkpoint's change check: rewritten during a run, it failed the run. Only the files the
   checkpoint is read from count (config.json, the index, the weights' files it names).
   Probed beyond: generation_config.json, which a real run reads, counted in neither that
   check nor config.yaml's model-files line (a rewrite reused a finished run of the earlier
   decoding), and a stray file counted in that line.
4. An integer field or option below its bound was said in several wordings (the planners'
   `window=0 must be >= 1`, the workload's `gen_len must be a positive integer, got 0`,
   as_int's `must be >= 1, a positive integer`): one, `KEY=VALUE: must be a positive integer`
   (or a non-negative one), through one helper (core.errors.integer_below); the sweep
   launchers', torchrun's --rdzv_conf and reproduce_klotski's integer options too.
5. A stop (SIGINT, SIGTERM) as a lock's `os.open` returned, before its fd was kept, left a free
   lock file (dir_locked, held_if_free, output_locked): the open is inside the block that
   lets the lock go, and the file a stop left unkept, free, goes.
6. collect's run_dirs walked the sweep four times (an rglob per mark, then one of every entry
   for linked run dirs): one walk, the same run dirs. Probed beyond: a sweep's end counted its
   failed runs with an rglob, a traceback where a folder went mid-walk: os.walk, which skips it.
7. `report metric=has_trace` (true/false) drew 0 and 1: a column of true/false, or of text, is
   no metric, in one line naming what it holds and the runs' metrics.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.errors import MoepipeError
from experiments.common import dir_lock
from experiments.common.dir_lock import LOCK, dir_locked, held_if_free, output_locked
from experiments.common.tables import collect, run_dirs
from tests.probes.conftest import raises_one_line, tiny_run

# --- 1. a hand-made run dir whose summary records a config field its config.yaml does not ---


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run, without its files.sha256: as a run dir put together by hand."""
    run = tiny_run(tmp_path_factory.mktemp("made") / "a")
    (run / "files.sha256").unlink()
    return run


def _edited(made: Path, to: Path, edit: Any) -> Path:
    run = Path(shutil.copytree(made, to / "sweep" / "r"))
    config = yaml.safe_load((run / "config.yaml").read_text())
    edit(config)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda c: c["planner"]["params"].update(sync=False), "planner.params.sync is False"),
        (lambda c: c["planner"]["params"].update(sync=1), "planner.params.sync is 1"),
        (lambda c: c["planner"]["params"].update(extra=3), "planner.params.extra is 3"),
        (lambda c: c["planner"].update(params={}), "has no planner.params.sync"),
        (lambda c: c["hardware"].update(name="other"), "hardware.name is 'other'"),
        (lambda c: c["executor"].update(name="real"), "executor.name is 'real'"),
    ],
)
def test_a_config_field_its_summary_records_otherwise_is_skipped(
    made: Path, tmp_path: Path, edit: Any, said: str
) -> None:
    _edited(made, tmp_path, edit)
    df, problems = collect(tmp_path / "sweep")
    assert df.empty and len(problems) == 1, problems
    assert problems[0].startswith("r: config.yaml") and said in problems[0], problems[0]
    assert "summary.json has" in problems[0] and "not the config it ran" in problems[0]


def test_a_config_that_agrees_with_its_summary_is_collected(made: Path, tmp_path: Path) -> None:
    _edited(made, tmp_path, lambda c: c["planner"]["params"].update(sync=True))
    df, problems = collect(tmp_path / "sweep")
    assert len(df) == 1 and not problems


def test_a_replication_runs_block_params_are_read_as_it_ran(tmp_path: Path) -> None:
    """A replication run's summary holds the params its block set and the tables it wrote
    into its run dir (wherever the sweep was moved since), beside its config's."""
    from experiments.common.tables import config_disagrees

    rep = {"routing": "synthetic", "replica_slots": 3, "planners": {"eplb": {"window": 8}}}
    config = {"planner": {"name": "eplb", "params": {"interval": 4}}, "replication": rep}
    ran = {"interval": 4, "window": 8, "replica_slots": 3}
    ran |= {"initial_load": "/moved/r/inputs/initial_load.npy"}
    assert config_disagrees(config, {"params": ran}) is None
    said = config_disagrees(config, {"params": ran | {"window": 16}})
    assert said and "planner.params.window is 8" in said and "params.window 16" in said


# --- 2. an FP8 block scale that is no finite number > 0 ---


@pytest.mark.parametrize("bad", [0.0, -0.5, float("nan"), float("inf")])
def test_an_fp8_scale_that_is_no_finite_positive_number_is_one_line(
    tmp_path: Path, bad: float
) -> None:
    import torch

    from real.fp8 import attach_scales
    from real.shards import read_header, save_shard

    file = tmp_path / "model.safetensors"
    scale = torch.ones(2, 2)
    scale[1, 0] = bad
    w = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    save_shard({"w.weight": w, "w.weight_scale_inv": scale}, file, {"format": "pt"})
    index = read_header(file)
    raises_one_line(
        lambda: attach_scales(index, list(index), (8, 8)),
        str(file),
        "tensor w.weight_scale_inv holds",
        "block [1, 0]",
        "a finite number > 0",
    )
    scale[1, 0] = 0.25  # a scale as a quantizer writes it
    save_shard({"w.weight": w, "w.weight_scale_inv": scale}, file, {"format": "pt"})
    index = read_header(file)
    assert attach_scales(index, list(index), (8, 8)) == ["w.weight"]


# --- 3. a stray safetensors file is none of the checkpoint's ---


@pytest.mark.parametrize("indexed", [False, True])
def test_a_stray_safetensors_file_rewritten_is_no_change(
    tiny_ckpt: Path, tmp_path: Path, indexed: bool
) -> None:
    from experiments.common.real_run import checkpoint_files, unchanged_since
    from real.shards import INDEX_FILE, read_header

    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    if indexed:  # an index naming the one file
        names = read_header(ck / "model.safetensors")
        wmap = dict.fromkeys(names, "model.safetensors")
        (ck / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    stray = ck / "model-00001-of-00002.safetensors"
    shutil.copyfile(ck / "model.safetensors", stray)
    before = checkpoint_files(ck)
    assert stray.name not in before and "model.safetensors" in before
    stray.write_bytes(b"rewritten")
    unchanged_since(ck, before)  # no change the run read
    os.utime(ck / "config.json")  # a file it reads: its change time moves
    with pytest.raises(MoepipeError, match="config.json: changed while the run read"):
        unchanged_since(ck, before)


# --- 4. one wording for every integer field below its bound ---


def _hardware(**more: Any) -> Any:
    from core.hardware import HardwareSpec
    from tests.probes.conftest import ROOT

    raw = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())
    raw["gpu"] |= more.pop("gpu", {})
    return HardwareSpec.from_dict(raw | more)


def _planner(name: str, **params: Any) -> Any:
    from planners.registry import make_params

    return make_params(name, params)


def _workload(**sizes: int) -> Any:
    from core.spec import Workload

    return Workload(**({"batch_size": 1, "n_batches": 1, "prompt_len": 1, "gen_len": 1} | sizes))


def _routing(hot: Any) -> Any:
    from core.spec import RoutingConfig

    return RoutingConfig(hot_experts=hot, hot_share=0.5)


def _as_int(value: Any, at_least: int) -> Any:
    from core.args import as_int

    return as_int("jobs", value, at_least=at_least)


def _workers(n: int) -> Any:
    from experiments.common.pool import checked_workers

    return checked_workers(n, "jobs")


_INTEGERS = [
    (lambda: _workload(gen_len=0), "workload.gen_len=0", " positive"),
    (lambda: _routing(-3), "workload.routing.hot_experts=-3", " non-negative"),
    (lambda: _hardware(n_gpus=0), "n_gpus=0", " positive"),
    (lambda: _hardware(gpu={"sms": -1}), "gpu.sms=-1", " non-negative"),
    (lambda: _planner("eplb", interval=0), "planner.params.interval=0", " positive"),
    (lambda: _planner("predictive_replication", window=0), "planner.params.window=0", " positive"),
    (lambda: _planner("ep_static", micro_batches=0), "planner.params.micro_batches=0", " positive"),
    (lambda: _planner("eplb", window=0), "planner.params.window=0", " positive"),
    (lambda: _planner("eplb", replicas=-2), "planner.params.replicas=-2", "n integer >= -1"),
    (lambda: _planner("klotski", disk_window=0), "planner.params.disk_window=0", " positive"),
    (lambda: _planner("klotski", hot_k=-1), "planner.params.hot_k=-1", " non-negative"),
    (lambda: _planner("moe_infinity", history=-1), "planner.params.history=-1", " non-negative"),
    (
        lambda: _planner("mixtral_offloading", guess_k=-1),
        "planner.params.guess_k=-1",
        " non-negative",
    ),
    (lambda: _as_int(0, 1), "jobs=0", " positive"),
    (lambda: _as_int(-1, 0), "jobs=-1", " non-negative"),
    (lambda: _workers(0), "jobs=0", " positive"),
]


@pytest.mark.parametrize(("make", "said", "sign"), _INTEGERS, ids=[c[1] for c in _INTEGERS])
def test_an_integer_field_below_its_bound_is_said_in_one_wording(
    make: Any, said: str, sign: str
) -> None:
    """Each integer field of a hardware, workload or planner config and each integer option,
    below its bound: `KEY=VALUE: must be a positive integer` (or a non-negative one), where
    the planners said `>= 1`, the workload `... must be a positive integer, got 0`."""
    line = raises_one_line(make, f"{said}: must be a{sign}")
    assert ">= 0" not in line and ">= 1" not in line, line
    assert line.count("integer") == 1, line


def test_a_launchers_integer_below_its_bound_is_said_in_the_same_words() -> None:
    """joblib's batch_size=0 said `not 'auto' or a whole number >= 1`."""
    from experiments.common.launcher_checks import _check_joblib_limits

    line = raises_one_line(lambda: _check_joblib_limits({"batch_size": 0}), "batch_size=0")
    assert "must be 'auto' or a positive integer" in line and ">= 1" not in line, line


def test_reproduce_klotskis_integer_lists_are_said_in_the_same_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An experiment file's `reproduce.n: [0]` said `a list of whole numbers >= 1`."""
    import experiments.common.klotski_conf as rk

    real = rk.conf_yaml

    def edited(group: str, name: str) -> Any:
        conf = real(group, name)
        conf["reproduce"]["n"] = [0]
        return conf

    monkeypatch.setattr(rk, "conf_yaml", edited)
    line = raises_one_line(lambda: rk.experiment("klotski_fig14"), "reproduce.n=[0]: must be")
    assert "each a positive integer" in line and ">= 1" not in line, line


def test_a_rendezvous_integer_below_its_bound_is_said_in_the_same_words() -> None:
    """torchrun's --rdzv_conf=timeout=0 said `is not a whole number > 0`."""
    from experiments.torchrun import _checked_rdzv_conf

    raises_one_line(
        lambda: _checked_rdzv_conf("timeout=0", "static"), "timeout=0: must be a positive integer"
    )


def test_a_real_runs_model_files_line_versions_the_files_it_reads(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """config.yaml's model-files line (a finished run is reused only for the same line) of a
    real run counts its generation_config.json (a rewrite reused the earlier decoding's
    result), and no stray safetensors file (one copied in ran the run again)."""
    from omegaconf import OmegaConf

    from experiments.common.real_run import checkpoint_files
    from experiments.run import model_files_line

    ck = Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))
    real = OmegaConf.create({"executor": {"name": "real"}, "checkpoint": str(ck), "model": {}})
    before = model_files_line(real)
    shutil.copyfile(ck / "model.safetensors", ck / "model-00001-of-00002.safetensors")
    assert model_files_line(real) == before
    (ck / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert model_files_line(real) != before
    assert "generation_config.json" in checkpoint_files(ck)


# --- 5. a stop as a lock's open returned ---


def _stop_after_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """`os.open` in dir_lock opens, then a stop comes before its fd is kept (once)."""
    real, calls = os.open, []

    def opened_then_stopped(*a: Any) -> int:
        fd = real(*a)
        if not calls:
            calls.append(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(dir_lock.os, "open", opened_then_stopped)


def _enter(cm: Any) -> None:
    with cm:
        pass


@pytest.mark.parametrize(
    ("take", "lock"),
    [
        (lambda d: _enter(dir_locked(d)), LOCK),
        (lambda d: _enter(held_if_free(d)), LOCK),
        (lambda d: _enter(output_locked(d / "out.json", "out", "c")), ".out.json.lock"),
    ],
    ids=["dir_locked", "held_if_free", "output_locked"],
)
def test_a_stop_as_a_locks_open_returned_leaves_no_lock_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, take: Any, lock: str
) -> None:
    d = tmp_path / "run"
    d.mkdir()
    _stop_after_open(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        take(d)
    monkeypatch.undo()
    assert list(d.iterdir()) == [], f"{lock} left"


# --- 6. one walk of the sweep ---


def test_run_dirs_walks_each_folder_once(made: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """A sweep of a run, a nested sweep's run, a linked run dir and a hidden folder (a
    staging's, holding a config.yaml): the same run dirs, each folder listed once."""
    sweep = tmp_path / "sweep"
    shutil.copytree(made, sweep / "a")
    shutil.copytree(made, sweep / "nested" / "b")
    os.symlink(made, sweep / "linked")
    (sweep / ".partial-x").mkdir()
    (sweep / ".partial-x" / "config.yaml").write_text("a: 1\n")
    real, listed = os.scandir, Counter[str]()

    def counted(path: Any = ".") -> Any:
        listed[str(path)] += 1
        return real(path)

    monkeypatch.setattr(os, "scandir", counted)
    found = run_dirs(sweep)
    monkeypatch.undo()
    assert [p.relative_to(sweep).as_posix() for p in found] == ["a", "linked", "nested/b"]
    assert listed and max(listed.values()) == 1, listed


def test_a_sweeps_failed_runs_are_found_while_a_folder_goes_mid_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep's end counted its failed runs with an rglob, which raised FileNotFoundError
    where a folder went mid-walk (a run's staging moved into place, another sweep's run in the
    same dir): its progress count walks as os.walk does, skipping it; so does this."""
    from experiments.common.callbacks import FAILED, failed_runs

    (tmp_path / "gone").mkdir()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / FAILED).write_text("bad input\n")
    real = os.scandir

    def going(path: Any = ".") -> Any:
        if Path(path).name == "gone":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", going)
    assert failed_runs(tmp_path, "token") == []  # none of this sweep's


# --- 7. a metric that is a column of true/false or of text ---


@pytest.mark.parametrize(
    ("metric", "said"),
    [("has_trace", "a column of true/false"), ("model.name", "a column of text")],
)
def test_a_metric_of_no_numbers_is_one_line(metric: str, said: str) -> None:
    import pandas as pd

    from experiments.common.ranking import ReportError, check_request

    one = {"throughput_tok_s": 1.0, "makespan_s": 1.0, "n_batches": 2, "model.name": "tiny"}
    df = pd.DataFrame([one | {"has_trace": True}, one | {"has_trace": False}])
    with pytest.raises(ReportError) as e:
        check_request(df, metric, [])
    line = str(e.value)
    assert "\n" not in line and f"metric {metric!r} is {said}" in line
    assert "the runs' metrics: makespan_s, n_batches, throughput_tok_s" in line
    check_request(df, "n_batches", [])
