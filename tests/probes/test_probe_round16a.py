"""Probe round 16a (issue 48): the simulated commands and their sweeps, by class of failure.

Each test is one class that failed, parametrized over the cases that showed it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import ROOT, TINY, one_line

TWO_POINTS = [*TINY[:-1], "planner=flexgen,sequential"]
# a replication case's declared sweep at one batch size: over its rows, 3 points fewer to check
SMALL_REP = "workload.batch_size=8"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        ([*TWO_POINTS, "workload.gen_len=0"], ["workload.gen_len=0", "a positive integer"]),
        ([*TWO_POINTS, "hardware.memory_gb.gpu=-1"], ["memory_gb.gpu", "positive capacity"]),
        ([*TWO_POINTS, "hardware.links.h2d.gbps=0"], ["links.h2d.gbps", "positive"]),
        ([*TWO_POINTS, "+planner.params.nosuch=1"], ["planner flexgen: unknown param(s) nosuch"]),
        ([*TINY, "workload.batch_size=1,2", "workload.n_batches=0"], ["workload.n_batches"]),
        ([*TINY, "workload.batch_size=1,2", "workload.seed=${oc.env:MOEPIPE_NOPE_16A}"], ["seed"]),
        ([*TWO_POINTS, "hydra/launcher=submitit_local", "workload.gen_len=0"], ["gen_len"]),
        ([*TINY, "workload.gen_len=0"], ["workload.gen_len"]),  # a sweep of one point
        # an experiment's declared sweep (fig11's two keys; compare's one key was its case too)
        (["experiment=fig11", "hardware.links.h2d.gbps=0"], ["links.h2d.gbps"]),
        (
            ["experiment=replication_switch_128", SMALL_REP, "replication.split=validation"],
            ["replication.split=validation", "has none"],
        ),
        (
            ["experiment=replication_esft_g8", SMALL_REP, "replication.split=nosuch"],
            ["replication.split='nosuch' unknown", "fold1"],
        ),
        (
            ["experiment=replication_switch_128_shared", SMALL_REP, "replication.replica_slots=-1"],
            ["replication.replica_slots=-1", "a non-negative integer"],
        ),
        # every point fails, each on its own line: the first point's
        ([*TINY, "workload.gen_len=0,-1"], ["workload.gen_len=0", "a positive integer"]),
        (
            [*TINY[:1], *TINY[2:], "hardware=tiny,h200", "hardware.memory_gb.gpu=-1"],
            ["hardware tiny: memory_gb.gpu"],
        ),
    ],
)
def test_a_bad_value_every_point_shares_is_refused_before_the_sweep(
    cli_here: Any, tmp_path: Path, args: list[str], names: list[str]
) -> None:
    """A bad value the sweep does not sweep failed every point once the sweep had started, one
    line per point under the progress bar, each point's folder left with its failed.txt; it is
    the one line a single run prints, before any point runs or has a folder."""
    sweep = tmp_path / "sweep"
    r = cli_here("experiments.run", "-m", *args, f"hydra.sweep.dir={sweep}")
    one_line(r, *names)
    assert not sweep.exists()


def test_a_point_whose_own_value_is_bad_still_fails_alone(cli_here: Any, tmp_path: Path) -> None:
    """The first point's own swept value is bad (`gen_len=0,2`): the other point runs, the bad
    one's line goes to its failed.txt, and the sweep exits 2 naming it."""
    sweep = tmp_path / "sweep"
    args = [*TINY, "workload.gen_len=0,2", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", "-m", *args)
    assert r.returncode == 2 and "1 run(s) failed" in r.stderr, r.stderr
    (failed,) = sweep.rglob("failed.txt")
    assert "workload.gen_len=0: must be a positive integer" in failed.read_text()
    assert len(list(sweep.rglob("summary.json"))) == 1


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("+hardware.links.h2d.nosuch=1", ["hardware.links.h2d.nosuch", "gbps, latency_us"]),
        ("++hardware.links.disk.gbs=1", ["hardware.links.disk.gbs", "gbps"]),
        ("+hardware.links.d2h.latency=1", ["hardware.links.d2h.latency", "latency_us"]),
    ],
)
def test_a_key_added_under_an_entry_of_a_mapping_of_schemas_is_checked(
    cli_here: Any, tmp_path: Path, override: str, names: list[str]
) -> None:
    """`+hardware.links.h2d.nosuch=1` ran (exit 0), the key added and read by nothing: under
    `links` (a mapping of LinkSchema) any name is an entry, but its keys are LinkSchema's."""
    r = cli_here("experiments.run", *TINY, override, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, *names)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["--config-dir", "hydra.searchpath"])
@pytest.mark.parametrize(
    ("rel", "text", "names"),
    [
        ("model/tiny.yaml", "n_layers: 3\n", ["model/tiny.yaml", "pass model=<that name>"]),
        ("workload/tiny.yaml", "gen_len: 0\n", ["workload/tiny.yaml", "never be read"]),
        ("config.yaml", "workload:\n  gen_len: 0\n", ["config.yaml", "--config-name"]),
    ],
)
def test_a_users_config_the_shipped_conf_has_by_name_is_refused(
    cli_here: Any, tmp_path: Path, where: str, rel: str, text: str, names: list[str]
) -> None:
    """A user's config folder holding conf/'s model/tiny.yaml (or config.yaml), edited: hydra
    reads conf/'s first, and the run went on with the shipped values, exit 0, the user's
    edit unread."""
    conf = tmp_path / "conf"
    shipped = ROOT / "conf" / rel
    (conf / rel).parent.mkdir(parents=True, exist_ok=True)
    (conf / rel).write_text(shipped.read_text() + text)
    given = [f"--config-dir={conf}"] if where == "--config-dir" else [f"{where}=[file://{conf}]"]
    r = cli_here("experiments.run", *TINY, *given, f"hydra.run.dir={tmp_path / 'run'}")
    one_line(r, *names)
    assert not (tmp_path / "run").exists()


def test_a_users_copy_of_a_shipped_config_as_it_is_runs(cli_here: Any, tmp_path: Path) -> None:
    """A copy left as it is changes nothing: it is not refused."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "tiny.yaml").write_text(
        (ROOT / "conf" / "model" / "tiny.yaml").read_text()
    )
    args = [*TINY, f"--config-dir={tmp_path / 'conf'}", f"hydra.run.dir={tmp_path / 'run'}"]
    assert cli_here("experiments.run", *args).returncode == 0


def test_a_sweeps_bar_drops_its_text_once_stderrs_reader_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep piped to a reader that stopped: the bar's write raised BrokenPipeError inside
    tqdm's lock, and the sweep's process, every point finished, waited at its end on that lock
    forever, deaf to Ctrl-C and SIGTERM. The bar's stream drops the text instead."""
    from tqdm import tqdm

    from experiments.common.reader_left import bar_stream

    read, write = os.pipe()
    os.close(read)  # the reader has left
    saved = os.dup(2)
    try:
        os.dup2(write, 2)
        monkeypatch.setattr(sys, "stderr", os.fdopen(2, "w", closefd=False))
        bar = tqdm(total=2, file=bar_stream(), mininterval=0)
        bar.update(1)
        bar.update(1)
        bar.close()  # each raised BrokenPipeError, with sys.stderr as the bar's stream
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(write)


@pytest.mark.parametrize("entry", ["http://x", "s3://bucket/conf", "ftp:///conf"])
def test_a_search_path_of_a_scheme_hydra_has_no_source_for_is_one_line(
    cli_here: Any, tmp_path: Path, entry: str
) -> None:
    """`hydra.searchpath=[http://x]` was an internal error (hydra's ValueError: "No config
    source registered for schema http") with its traceback in a file."""
    run = tmp_path / "run"
    r = cli_here("experiments.run", *TINY, f"hydra.searchpath=[{entry}]", f"hydra.run.dir={run}")
    one_line(r, entry, "file://")
    assert "internal error" not in r.stderr and not run.exists()


# --- a model field beside model.hf_config: the config.json's is simulated ---


@pytest.mark.parametrize("field", ["model.n_layers=1", "+model.top_k=1", "model.name=other"])
def test_a_model_field_beside_hf_config_is_refused(
    field: str, tiny_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """`+model.hf_config=DIR model.n_layers=1` simulated the folder's config.json, all its
    layers, without a word about the field given: now one line naming it, and no run folder."""
    run = tmp_path / "run"
    hf = f"+model.hf_config={tiny_ckpt}"
    r = cli_here("experiments.run", *TINY, hf, field, f"hydra.run.dir={run}")
    line = one_line(r)
    assert r.returncode != 0 and field.lstrip("+") in line and "model.hf_config" in line, line
    assert not run.exists()
    assert cli_here("experiments.run", *TINY, hf, f"hydra.run.dir={run}").returncode == 0
