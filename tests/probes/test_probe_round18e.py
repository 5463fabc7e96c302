"""Probe round 18e (issue 48): three small leftovers.

A value the user typed that the run silently ignored: `planner=klotski
workload.n_batches=1000000` ran klotski's own n (`planner.params.n: 0`) and never said the
user's n_batches went unused. One warning line names both fields and the fix; an experiment
file's or the workload conf's own n_batches is not the user's and is not warned of.

A misleading YaRN line: a config.json's `rope_scaling` yarn with `beta_fast: 0` and `beta_slow:
40` said "beta_fast=32 is below ..." where the file says 0: it says `beta_fast=0 (transformers'
default 32)`, and likewise for null and an absent beta.

experiments.bench.real's disk-room check said "the checkpoint needs 0.0812 GB" of a checkpoint
of 0.0139 GB: the rest was a 1% allowance for its headers and 64 MiB left free past it, unsaid.
The line names each part. A checkpoint already at out_dir (another model's) counted as free
room, but it stays until the new one, written beside it, is whole: it no longer counts, and
the line says to remove it where that would make room.

`experiments.prefetch_eval group_seqs=1` over a whole task ran for minutes with nothing shown:
in a terminal a bar on stderr counts its groups (the table on stdout untouched); off a
terminal (a pipe, a log) nothing is added.
"""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from core.hf_config import spec_to_hf_config
from core.spec import ModelSpec
from real.checkpoint import reduced_spec
from tests.probes.conftest import TINY, raises_one_line

KLOTSKI = [*TINY[:3], "planner=klotski"]
UNUSED = "was not used"


def test_a_typed_n_batches_klotski_sizes_away_is_warned_of_once(
    cli_here: Any, tmp_path: Path
) -> None:
    """klotski (n: 0) picks its own n on the tiny model (1): the typed 1000 went unused."""
    r = cli_here(
        "experiments.run", *KLOTSKI, "workload.n_batches=1000", f"hydra.run.dir={tmp_path}"
    )
    assert r.returncode == 0, r.stderr
    said = [x for x in (r.stdout + r.stderr).splitlines() if UNUSED in x]
    assert len(said) == 1, said
    for name in ("workload.n_batches=1000", "planner.params.n=0", "planner.params.n=-1"):
        assert name in said[0]
    assert "drop workload.n_batches" in said[0]


@pytest.mark.parametrize(
    "args",
    [
        [*KLOTSKI],  # the workload conf's own n_batches: not the user's
        [*KLOTSKI, "workload.n_batches=1000", "planner.params.n=-1"],  # it runs the typed n
        [*TINY, "workload.n_batches=2"],  # flexgen keeps the workload's n
    ],
)
def test_no_warning_where_nothing_typed_went_unused(
    cli_here: Any, tmp_path: Path, args: list[str]
) -> None:
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert UNUSED not in r.stdout + r.stderr


@pytest.mark.parametrize("family", ["deepseek-v2-lite", "qwen1.5-moe-a2.7b"])
@pytest.mark.parametrize(
    ("betas", "said"),
    [
        ({"beta_fast": 0, "beta_slow": 40}, "beta_fast=0 (transformers' default 32) is below"),
        ({"beta_fast": None, "beta_slow": 40}, "beta_fast=null (transformers' default 32)"),
        ({"beta_slow": 40}, "beta_fast (absent: transformers' default 32) is below"),
        ({"beta_fast": 0.5, "beta_slow": 0}, "below beta_slow=0 (transformers' default 1)"),
    ],
)
def test_a_yarn_beta_of_0_is_said_as_written(
    tmp_path: Path, family: str, betas: dict[str, Any], said: str
) -> None:
    """Before: "rope_scaling.beta_fast=32 is below beta_slow=40", a 32 the file does not hold."""
    rope = {"rope_type": "yarn", "factor": 4.0, **betas}
    cfg = spec_to_hf_config(reduced_spec(family)) | {"rope_scaling": rope}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    line = raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "rope_scaling.", said)
    assert "swap them" in line


USAGE = namedtuple("USAGE", "total used free")


def test_bench_reals_disk_room_names_each_part(tmp_path: Path, monkeypatch: Any) -> None:
    """mixtral-tiny: 13,914,624 bytes of tensors (0.0139 GB), 1% of that for headers and
    config.json, 64 MiB (0.0671 GB) left free: 0.0812 GB, on a disk with 4 kB free."""
    from experiments.bench import real as bench_real

    monkeypatch.setattr(bench_real.shutil, "disk_usage", lambda _: USAGE(1 << 30, 0, 4096))
    spec = reduced_spec("mixtral-tiny")
    raises_one_line(
        lambda: bench_real.ensure_checkpoint(spec, tmp_path / "ck"),
        "writing the checkpoint needs 0.0812 GB: 0.0139 GB of tensors + 0.000139 GB for its "
        "headers and config.json + 0.0671 GB (64 MiB) left free past it",
    )
    assert not any(tmp_path.iterdir())


def test_bench_reals_old_checkpoint_is_not_counted_as_free_room(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A checkpoint of another model at out_dir stays until the new one is whole: with room
    for the new one only if the old one's bytes count, the bench started and filled the disk.
    Before: it wrote (the check added the old one's size to the free room)."""
    from experiments.bench import real as bench_real
    from real.checkpoint_write import write_checkpoint

    spec, out = reduced_spec("mixtral-tiny"), tmp_path / "ck"
    write_checkpoint(spec, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"rope_theta": 12345.0}))
    need = spec.total_bytes + int(spec.total_bytes * 0.01) + (64 << 20)
    free = need - (1 << 20)  # 1 MiB short: the old checkpoint's 14 MB would cover it
    monkeypatch.setattr(bench_real.shutil, "disk_usage", lambda _: USAGE(1 << 30, 0, free))
    raises_one_line(
        lambda: bench_real.ensure_checkpoint(spec, out),
        f"remove {out} (0.0139 GB, kept until the new checkpoint is whole)",
    )
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 12345.0


@pytest.mark.parametrize("tty", [True, False])
def test_prefetch_eval_shows_its_groups_in_a_terminal_only(tty, monkeypatch):
    """A bar on stderr, a tick per group, where stderr is a terminal; nothing where it is not."""
    import io
    import sys

    import numpy as np

    from experiments.prefetch_eval import evaluate
    from planners.prefetch import ExpertTable

    class Err(io.StringIO):
        def isatty(self) -> bool:
            return tty

    err = Err()
    monkeypatch.setattr(sys, "stderr", err)
    rng = np.random.default_rng(0)
    test = [rng.integers(0, 4, size=(3, 2, 2)) for _ in range(5)]  # [P, L, k] each
    df = evaluate(ExpertTable.empty(2, 4), test, "popularity", 2, 1)
    assert len(df) == 2
    shown = err.getvalue()
    assert ("prefetch_eval popularity" in shown and "/5 " in shown) if tty else shown == "", shown
