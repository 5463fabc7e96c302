"""Round 25d (issue 48): the docs run as written. A newcomer's probe ran every command and
snippet the README and docs/ show (tests/test_docs_run.py keeps the snippets in step); this
file holds what the runs found in the code.

Classes:
1. A sweep of hardware or model files of one `name:` (`-m hardware=a.yaml,b.yaml`, b a copy of
   a with one number changed) wrote both points into one folder, named by that name: the
   second replaced the first's result, and the sweep said "1 run(s) finished" of two points.
   The folder check took `${run_hardware:}` for a name that tells points apart, as it does for
   conf/'s configs; a config of the user's (a file, a config dir's) is now composed point by
   point, and two of one folder refused before any point runs, naming the files as typed.
   So is a sweep of conf/'s hardware under one `hardware.name=` (each point's folder took it).
2. A torchrun launch of the documented distributed run left, beside rank 0's run dir, a folder
   of rank 1's own (`runs/<date>/16-53-04_ckpt_eplb/`: .hydra and an empty run.log) where the
   ranks' `${now:%H-%M-%S}` fell a second apart. A rank past 0 now takes it away as it ends.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import ROOT, one_line


@pytest.mark.parametrize("form", ["files", "renamed"])
def test_a_sweep_of_two_hardware_of_one_name_is_refused(
    tmp_path: Path, cli_here: Any, form: str
) -> None:
    text = (ROOT / "conf" / "hardware" / "tiny.yaml").read_text()
    (tmp_path / "a.yaml").write_text(text)
    (tmp_path / "b.yaml").write_text(text.replace("gpu: 1.0,", "gpu: 2.0,"))
    args = ["-m", "model=tiny", "workload=tiny", "planner=flexgen", f"hydra.sweep.dir={tmp_path}/s"]
    if form == "files":
        swept = [f"hardware={tmp_path}/a.yaml,{tmp_path}/b.yaml"]
        names = f"hardware={tmp_path}/a.yaml and hardware={tmp_path}/b.yaml"
    else:
        swept, names = ["hardware=tiny,h200", "hardware.name=same"], "tiny_same_flexgen"
    one_line(cli_here("experiments.run", *args, *swept), names, "a name of its own")
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_torchrun_rank_past_0_leaves_no_folder_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str
) -> None:
    """Rank 1 of a launch resolved the run dir's `${now:%H-%M-%S}` a second after rank 0 and
    left that folder, holding its .hydra and an empty run.log, beside rank 0's run. Now it
    takes it away as it ends; a folder a run holds the lock of (rank 0's, the same second)
    stays, and so does rank 0's own."""
    from experiments.common import run_dir
    from experiments.common.dir_lock import LOCK

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    runs = tmp_path / "runs"
    own, locked = runs / "16-53-04_ckpt_eplb", runs / "16-53-03_ckpt_eplb"
    with run_dir.run_dirs_made() as made:
        for out in (own, locked):
            made.append((out, runs, frozenset()))  # as hydra's run_job lists it
            (out / ".hydra").mkdir(parents=True)
            (out / "run.log").write_text("")
        (locked / LOCK).write_text("")
    assert own.exists() == (rank == "0") and locked.exists()
