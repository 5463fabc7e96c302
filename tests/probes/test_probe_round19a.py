"""Probe round 19a (issue 48): the checkpoint boundary, by class.

A real run read its checkpoint's config.json twice: first to check its options and record its
model in config.yaml, then to run it; its check that nothing changed the checkpoint began at the
second read, so a rewrite between the two ran one config.json and recorded another. The state of
the files is taken before the first read now and compared at the run's end, their change time
with it (an edit that keeps the size and puts the modification time back moves it).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from experiments import run as run_module
from tests.probes.conftest import TINY, one_line


@pytest.fixture
def ckpt(tiny_ckpt: Path, tmp_path: Path) -> Path:
    """A copy of the probes' tiny checkpoint, to edit."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ck"))


def _rewrite_config(ckpt: Path, keep_mtime: bool) -> None:
    """config.json given another rope_theta in place, at the same size; with `keep_mtime`, its
    modification time put back (as `touch -r` or a copy that keeps times does)."""
    config = ckpt / "config.json"
    st = config.stat()
    text = config.read_text()
    assert '"rope_theta": 1000000.0' in text
    config.write_text(text.replace('"rope_theta": 1000000.0', '"rope_theta": 2000000.0'))
    if keep_mtime:
        os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns))


# -- a checkpoint rewritten between a run's first read of it and its own load ----------------


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["edited", "mtime-put-back"])
def test_a_rewrite_between_the_runs_two_reads_is_one_line(
    ckpt: Path, tmp_path: Path, keep_mtime: bool, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """config.json rewritten after the run read it to check its options (and record its model)
    but before the run loaded it: the run ran the new file, recorded the old one, exit 0."""
    checked = run_module.check_routing_overrides

    def then_rewritten(cfg: Any, spec: Any) -> None:
        checked(cfg, spec)  # the first read of config.json
        _rewrite_config(ckpt, keep_mtime)

    monkeypatch.setattr(run_module, "check_routing_overrides", then_rewritten)
    run_dir = tmp_path / "run"
    r = cli_here(
        "experiments.run",
        "executor=real",
        f"checkpoint={ckpt}",
        *TINY[1:],
        f"hydra.run.dir={run_dir}",
    )
    one_line(r, str(ckpt / "config.json"), "changed while the run read")
    assert not (run_dir / "summary.json").exists()
