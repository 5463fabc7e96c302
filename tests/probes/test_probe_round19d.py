"""Probe round 19d (issue 48): the leftovers of rounds 19a-19c, each fixed as a class.

Classes:
1. Two writers of one output file whose folder was not there yet ran unlocked
   (`output_locked`: the lock file needs the folder): the folder is made first, as the write
   would, and taken away again where nothing was written into it.
2. replication and replication_cv said `skipped REL` without the sweep's path, and no count of
   the runs with an older summary.json: one helper and one wording with collect and report.
3. A sharded index naming config.json or itself (or any file no shard is named as) as a
   tensor's file was "not a safetensors file; re-copy the checkpoint": it names a file that is
   not a shard; rewrite the index.
4. An integer option or model field at 0 "must be a positive number": "a positive integer".
5. A stop while a command waits for a run dir's lock another holds: the `.run.lock` there is
   the holder's (it unlinks it as it lets go), left to it.
6. Probed beyond the list: validate_lanes wrote its csv and md one after the other, unlocked
   (a full disk or a stop between them left a new csv beside an earlier md): written together.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from core.args import as_int
from core.errors import MoepipeError
from core.spec import ModelSpec
from experiments.common.dir_lock import LOCK, dir_locked, output_locked
from real.shards import read_header, read_index
from tests.probes.conftest import raises_one_line, tiny_run

# --- 1. two writers of one output file in a folder not there yet ---


def test_two_writers_into_a_folder_not_there_yet_are_kept_apart(tmp_path: Path) -> None:
    out = tmp_path / "new" / "sub" / "out.json"
    with output_locked(out, "out", "routing_stats"):
        raises_one_line(
            lambda: output_locked(out, "out", "routing_stats").__enter__(),
            f"out={out}",
            "another routing_stats is writing this file now",
        )
    assert list(tmp_path.iterdir()) == []  # nothing written: the folders made went again


def test_a_folder_written_into_stays_and_one_that_cannot_be_made_runs_the_write(
    tmp_path: Path,
) -> None:
    out = tmp_path / "new" / "out.json"
    with output_locked(out, "out", "c"):
        out.write_text("{}")
    assert [p.name for p in out.parent.iterdir()] == ["out.json"]
    (tmp_path / "file").write_text("mine\n")
    ran = []
    with output_locked(tmp_path / "file" / "sub" / "o.json", "out", "c"):
        ran.append(1)  # the command's own write then names the folder, in one line
    assert ran and (tmp_path / "file").read_text() == "mine\n"


# --- 2. replication's and replication_cv's skipped lines and count, in collect's words ---


@pytest.fixture(scope="module")
def older(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep of a run as written, one of an older summary.json (no dag_efficiency) and one
    without makespan_s (skipped)."""
    sweep = tmp_path_factory.mktemp("older")
    tiny_run(sweep / "a")
    for name, drop in (("b", "dag_efficiency"), ("c", "makespan_s")):
        shutil.copytree(sweep / "a", sweep / name)
        (sweep / name / "files.sha256").unlink()
        summary = json.loads((sweep / name / "summary.json").read_text())
        del summary[drop]
        (sweep / name / "summary.json").write_text(json.dumps(summary))
    return sweep


def _read_replication(sweep: Path, monkeypatch: Any) -> None:
    from experiments import replication

    monkeypatch.setattr(replication.ep_rows, "rows_of", lambda df, **k: [{"case": "x"}])
    monkeypatch.setattr(replication.ep_rows, "order_rows", lambda rows, *a: rows)
    monkeypatch.setattr(replication, "write_results", lambda df, sweep: None)
    replication.load_rows(sweep, replication.Options(dir=str(sweep)))


def _read_replication_cv(sweep: Path, monkeypatch: Any) -> None:
    from experiments import replication_cv

    monkeypatch.setattr(replication_cv, "fold_rows", lambda rows: {"s": rows})
    monkeypatch.setattr(replication_cv.ep_rows, "rows_of", lambda df, **k: [{"case": "x"}])
    monkeypatch.setattr(replication_cv, "cv_lines", lambda folds: [])
    replication_cv.run(replication_cv.Options(dir=str(sweep)))


@pytest.mark.parametrize("read", [_read_replication, _read_replication_cv])
def test_replications_skipped_lines_and_count_are_collects(
    older: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any, read: Any
) -> None:
    read(older, monkeypatch)
    err = capsys.readouterr().err
    assert f"skipped {older / 'c'}: summary.json has no makespan_s" in err, err
    said = "2 run(s), 1 skipped, 1 with an older summary.json (b/summary.json ...) without"
    assert f"{older}: {said}" in err and "dag_efficiency: kept, those columns empty" in err


# --- 3. an index naming a checkpoint's JSON file as a shard ---


@pytest.mark.parametrize("named", ["config.json", "model.safetensors.index.json"])
def test_an_index_naming_a_json_file_as_a_shard_says_rewrite_it(tmp_path: Path, named: str) -> None:
    index = tmp_path / "model.safetensors.index.json"
    shard = "model-00001-of-00001.safetensors"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": shard, "w": named}}))
    raises_one_line(lambda: read_index(index), str(index), repr(named), "not a shard", "rewrite")


@pytest.mark.parametrize(
    ("name", "fix"),
    [("tokenizer.model", "rewrite the index"), ("model.safetensors", "re-copy the checkpoint")],
)
def test_a_named_file_that_is_no_safetensors_says_what_fixes_it(
    tmp_path: Path, name: str, fix: str
) -> None:
    """A shard's name came from the index: a file of another kind under a name no shard has
    (tokenizer.model) is the index's mistake, which no re-copy fixes."""
    (tmp_path / name).write_bytes(b"PK\x03\x04" + bytes(60))  # a zip, as torch.save's
    raises_one_line(lambda: read_header(tmp_path / name), name, "not a safetensors file", fix)


# --- 4. an integer at 0 is "a positive integer" ---

_COUNTS = ["n_layers", "hidden_size", "expert_ffn_size", "n_experts", "top_k", "n_heads"]


def test_every_integer_model_field_at_0_says_a_positive_integer(tiny_ckpt: Path) -> None:
    spec = ModelSpec.from_hf_config(tiny_ckpt)
    for name in [*_COUNTS, "n_kv_heads", "head_dim", "vocab_size", "dtype_bytes"]:
        with pytest.raises(MoepipeError, match=f"{name}=0: must be a positive integer"):
            dataclasses.replace(spec, **{name: 0})
    with pytest.raises(MoepipeError, match=r"rope_theta=0.0: must be a number in \[1, "):
        dataclasses.replace(spec, rope_theta=0.0)


def test_make_checkpoints_head_dim_0_says_a_positive_integer(tmp_path: Path, cli_here: Any) -> None:
    r = cli_here(
        "experiments.make_checkpoint", "model=mixtral-tiny", "head_dim=0", f"out={tmp_path / 'ck'}"
    )
    assert r.returncode == 2 and "head_dim=0: must be a positive integer" in r.stderr


@pytest.mark.parametrize("value", ["0", "x"])
def test_an_integer_option_at_least_1_says_a_positive_integer(value: str) -> None:
    raises_one_line(lambda: as_int("jobs", value, at_least=1), f"jobs={value}", "positive integer")


# --- 5. a stop while waiting for a run dir's lock another holds ---


def test_a_stop_while_waiting_leaves_the_holders_lock_file_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from experiments.common import dir_lock

    theirs = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # another run's
    fcntl.flock(theirs, fcntl.LOCK_EX)
    flock = fcntl.flock

    def stopped_while_waiting(fd: int, op: int) -> None:
        if op == fcntl.LOCK_EX:  # the blocking wait: a Ctrl-C there
            raise KeyboardInterrupt
        flock(fd, op)

    monkeypatch.setattr(dir_lock.fcntl, "flock", stopped_while_waiting)
    with pytest.raises(KeyboardInterrupt), dir_locked(tmp_path):
        pass
    assert os.stat(tmp_path / LOCK).st_ino == os.fstat(theirs).st_ino  # the holder's, kept
    os.close(theirs)


# --- probed beyond the list: validate_lanes' two tables, written as one ---


def test_validate_lanes_tables_are_both_new_or_both_earlier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure (a full disk) or a stop between validate_lanes.csv and .md left the new csv
    beside the earlier md; two runs into one out= were not kept apart either."""
    import errno
    from types import SimpleNamespace as NS

    import pandas as pd

    from experiments import validate_lanes

    for name in ("validate_lanes.csv", "validate_lanes.md"):
        (tmp_path / name).write_text("earlier\n")

    def full(table: Any) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(validate_lanes, "markdown", full)
    gpu = NS(sm_mem_bw_bytes_per_s=1e9, mem_bw_bytes_per_s=1e9, sms=1)
    stub = NS(name="m", total_bytes=1, gpu=gpu, batch_size=1, n_batches=1, prompt_len=1)
    with pytest.raises(OSError, match="No space"):
        validate_lanes._written(tmp_path, pd.DataFrame({"a": [1]}), stub, stub, stub, 2, 1, "cpu")
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["earlier\n", "earlier\n"]
