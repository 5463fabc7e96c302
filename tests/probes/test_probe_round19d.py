"""Probe round 19d (issue 48): the leftovers of rounds 19a-19c, each fixed as a class.

Classes:
1. Two writers of one output file whose folder was not there yet ran unlocked
   (`output_locked`: the lock file needs the folder): the folder is made first, as the write
   would, and taken away again where nothing was written into it.
2. replication and replication_cv said `skipped REL` without the sweep's path, and no count of
   the runs with an older summary.json: one helper and one wording with collect and report.
3. A sharded index naming config.json or itself as a tensor's file was "not a safetensors
   file; re-copy the checkpoint": it names a file that is not a shard; rewrite the index.
4. An integer option or model field at 0 "must be a positive number": "a positive integer".
5. A stop while a command waits for a run dir's lock another holds: the `.run.lock` there is
   the holder's (it unlinks it as it lets go), left to it.
"""

from __future__ import annotations

from pathlib import Path

from experiments.common.dir_lock import output_locked
from tests.probes.conftest import raises_one_line

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
