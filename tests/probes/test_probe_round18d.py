"""Probe round 18d (issue 48): round 18a's and 18b's leftovers.

A result file written whole (`written_whole`: prefetch_eval's table, reproduce_klotski's
results, the figures) on a disk that filled while pandas or matplotlib wrote it raised an
OSError that named no file: it names the file now, and nothing half-written stays.
"""

from __future__ import annotations

import errno

import pytest

from core.args import written_whole


def test_a_whole_write_that_names_no_file_names_its_file(tmp_path):
    """pandas' to_csv on a full disk: ENOSPC with no filename; the earlier file stays whole."""
    out = tmp_path / "results.csv"
    out.write_text("earlier\n")
    with pytest.raises(OSError) as info, written_whole(out) as tmp:
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.filename == str(out)
    assert out.read_text() == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.csv"]
