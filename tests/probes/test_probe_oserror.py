"""Probe class: an OSError of any kind (a disk that fills while a run is written, a folder that
cannot be written, a file cut short while it is read) is one line and a non-zero exit, and
leaves nothing that passes for a result: the earlier result stays, a conversion cut short is
not kept."""

from __future__ import annotations

import errno
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import pytest

import real.store as store
from core.errors import ConfigError
from experiments.common.cli import error_line
from real.checkpoint import SINGLE_FILE, load_checkpoint
from tests.conftest import user_env
from tests.probes.conftest import ROOT, TINY, cli, one_line, raises_one_line


def _small_files(limit_bytes: int) -> dict[str, Any]:
    """`cli`'s arguments for a process whose files cannot grow past `limit_bytes` (a write past
    it fails with EFBIG, as on a full disk: Python ignores SIGXFSZ). It writes no bytecode:
    Python's cache writer does not check for a short write, and renamed a .pyc cut at the limit
    into the checkout, which every later import of that module then failed on (EOFError)."""
    limit = (limit_bytes, limit_bytes)
    return {
        "preexec_fn": lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limit),
        "env": {**user_env(), "PYTHONDONTWRITEBYTECODE": "1"},
    }


def test_disk_full_while_writing_a_run_keeps_the_earlier_result(
    tmp_path: Path, cli_here: Any
) -> None:
    """A finished run, then another config into the same dir on a disk that fills while its
    trace is written: one line naming the run dir, exit != 0, and the first run's
    summary.json, config.yaml and trace as they were, with no half-written folder left. (The
    finished run runs in this process; the one whose files are limited, in its own.)"""
    run = tmp_path / "run"
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    assert r.returncode == 0, r.stderr
    before = {f: (run / f).read_bytes() for f in ("summary.json", "config.yaml", "trace.parquet")}
    # files up to 8 kB: hydra's (~4 kB) are written, the trace (trace.parquet, ~12 kB; trace.json,
    # the larger, is written only on demand) is not
    r = cli(
        "experiments.run",
        *TINY[:-1],
        "planner=sequential",
        f"hydra.run.dir={run}",
        **_small_files(8_000),
    )
    one_line(r, str(run), "cannot write")
    assert {f: (run / f).read_bytes() for f in before} == before
    assert not list(run.glob(".partial-*"))


@pytest.mark.parametrize(
    "code, words",
    [
        (errno.ENOSPC, "free space"),
        (errno.EROFS, "folder you can write"),
        (errno.EACCES, "permissions"),
        (errno.EDQUOT, "free space"),
        (errno.EIO, "disk"),
        (errno.EFBIG, "disk"),
        (errno.ENOENT, "path"),
    ],
)
def test_any_oserror_is_one_line_naming_its_file(code: int, words: str) -> None:
    e = OSError(code, os.strerror(code), "/some/run/summary.json")
    line = error_line(e)
    assert line is not None and "\n" not in line
    assert line.startswith("/some/run/summary.json: ") and words in line
    assert error_line(OSError(code, os.strerror(code))) == line.split(": ", 1)[1]


def test_truncated_checkpoint_is_refused_before_a_run(tiny_ckpt: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    f = ck / SINGLE_FILE
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="truncated"):
        load_checkpoint(ck)


@pytest.mark.slow  # several commands end to end; the full-disk case before it stays default
def test_other_commands_on_a_full_disk_are_one_line(tmp_path: Path, cli_here: Any) -> None:
    """collect, report and make_checkpoint on a disk that fills while they write: one line
    naming their output folder each; make_checkpoint leaves no config.json beside its cut
    shard, so the folder is not taken for a checkpoint."""
    sweep = tmp_path / "sweep"
    assert cli_here("experiments.run", *TINY, f"hydra.run.dir={sweep / 'a'}").returncode == 0
    full = _small_files(4_000)
    one_line(
        cli("experiments.collect", f"dir={sweep}", f"out={tmp_path / 'c'}", **full),
        str(tmp_path / "c"),
    )
    one_line(
        cli("experiments.report", f"dir={sweep}", f"out={tmp_path / 'r'}", **full),
        str(tmp_path / "r"),
    )
    ck = tmp_path / "ck"
    one_line(
        cli("experiments.make_checkpoint", "model=mixtral-tiny", f"out={ck}", **full),
        str(ck),
    )
    assert not ck.exists()  # the folder it made goes with its failure
    raises_one_line(lambda: load_checkpoint(ck), str(ck), "no such checkpoint")


def test_checkpoint_truncated_mid_run_is_one_line(tiny_ckpt: Path, tmp_path: Path) -> None:
    """The checkpoint's safetensors file, which the store reads its disk tier from, is cut
    short while a store reads it (another process rewriting it, or a disk fault): the read
    fails as an OSError that the commands print as one line naming the file."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    s = store.TieredStore(ck, 2**30, device="cpu", direct=False)
    try:
        last = max(s.records.values(), key=lambda r: max(x.offset for x in r.reads))
        os.truncate(ck / SINGLE_FILE, min(x.offset for x in last.reads))
        raises_one_line(lambda: s.read_disk(last.unit), str(ck / SINGLE_FILE), "truncated")
    finally:
        s.close()


def test_torchs_allocation_failure_is_the_out_of_memory_line() -> None:
    """torch reports a failed allocation as a RuntimeError on a CPU (and OutOfMemoryError on
    CUDA), not a MemoryError: `bench.host unit_mb=1e12` was an internal error."""
    import torch

    for e in (
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"
        ),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
    ):
        assert (error_line(e) or "").startswith("out of memory"), e
    assert error_line(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback file
    r = cli("experiments.bench.host", "unit_mb=1e12", "device=cpu")
    one_line(r, "unit_mb=")  # refused before it is asked for


def test_a_full_disk_leaves_no_output_file_cut_short(tmp_path: Path, cli_here: Any) -> None:
    """collect, report and trace_json on a disk that fills while they write (files up to 4 kB):
    results.parquet was left cut short at 4 kB, report's first figure and trace.json empty,
    each looking like a result. Now each output file is the earlier one, whole, or none. (The
    run they read runs in this process; the commands whose files are limited, in their own.)"""
    sweep = tmp_path / "sweep"
    assert cli_here("experiments.run", *TINY, f"hydra.run.dir={sweep / 'a'}").returncode == 0
    full = _small_files(4_000)
    earlier = {"results.csv": "earlier,whole\n1,2\n", "index.html": "<p>earlier</p>\n"}
    outs = {"c": tmp_path / "c", "r": tmp_path / "r"}
    for out in outs.values():
        out.mkdir()
        for name, text in earlier.items():
            (out / name).write_text(text)
    for module, args, out in (
        ("experiments.collect", [f"dir={sweep}", f"out={outs['c']}"], outs["c"]),
        ("experiments.report", [f"dir={sweep}", f"out={outs['r']}"], outs["r"]),
        (
            "experiments.trace_json",
            [f"runs=[{sweep / 'a'}]", f"out={tmp_path / 't.json'}"],
            tmp_path,
        ),
    ):
        one_line(cli(module, *args, **full), str(out))
    for out in outs.values():
        left = {p.name: p.read_text() for p in out.iterdir()}
        assert left == earlier, sorted(left)  # no new file cut short, no temporary one
    assert not (tmp_path / "t.json").exists() and not list(tmp_path.glob(".t-*"))


def test_written_whole_keeps_the_earlier_file_when_the_write_fails(tmp_path: Path) -> None:
    from core.args import written_whole

    path = tmp_path / "results.csv"
    path.write_text("earlier\n")
    with pytest.raises(OSError), written_whole(path) as tmp:
        tmp.write_text("new, cut")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "earlier\n" and sorted(tmp_path.iterdir()) == [path]
    with written_whole(path) as tmp:
        tmp.write_text("new\n")
    assert path.read_text() == "new\n" and sorted(tmp_path.iterdir()) == [path]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow  # routing_stats' fit, seconds: .ci/run's slow suite
def test_routing_stats_on_a_full_disk_leaves_no_file_cut_short(tmp_path: Path) -> None:
    """Its JSON is written whole or not at all: a disk that filled while it wrote left 4096
    bytes of invalid JSON."""
    if not (ROOT.parent / "shared" / "traces" / "esft-dsv2lite").is_dir():
        pytest.skip("../shared/traces is absent")
    out = tmp_path / "rs.json"
    one_line(cli("experiments.routing_stats", f"out={out}", **_small_files(1_000)), str(out))
    assert list(tmp_path.iterdir()) == []


def _disk_full_at_hydras_config(cfg: Any, filename: str, output_dir: Path) -> None:
    """hydra's write of a run's .hydra/*.yaml on a full disk: the file begun, then ENOSPC from
    the write, which (unlike open's) names no file."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / filename).write_text("")
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_at_hydras_record_names_the_file_and_leaves_no_run_dir(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk full while hydra wrote .hydra/config.yaml, before the run began: the line named
    no file ("No space left on device"), and the run dir stayed, holding .hydra and an empty
    run.log (in a sweep, each point's). In a sweep's worker the same holds: the worker unpickles
    the progress callback, which names the writes there."""
    import pickle

    import hydra.core.utils as hydra_utils

    from experiments.common.callbacks import SweepProgress

    monkeypatch.setattr(hydra_utils, "_save_config", _disk_full_at_hydras_config)
    run = tmp_path / "run"
    r = cli_here("experiments.run", *TINY, f"hydra.run.dir={run}")
    one_line(r, str(run / ".hydra" / "config.yaml"), "free space")
    assert not run.exists()
    sweep = tmp_path / "s"
    args = ["-m", *TINY, "workload.gen_len=3,4", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", *args)
    last = r.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert r.returncode == 2 and ".hydra/config.yaml: No space left" in last, r.stderr
    assert not [p for p in sweep.iterdir() if p.is_dir()] if sweep.exists() else True
    monkeypatch.setattr(hydra_utils, "_save_config", _disk_full_at_hydras_config)
    pickle.loads(pickle.dumps(SweepProgress()))  # as a launcher's worker gets it
    assert getattr(hydra_utils._save_config, "names_its_file", False)
