"""Probe round 12b (issue 48): a failing machine. A rank of a torchrun launch that dies at any
point is named by the survivor; the rank server is found without multiprocessing's private
attributes; a path's undecodable bytes print back as typed (LC_ALL=C); a PNG of the user's
where a command's plot goes is refused, not overwritten."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.args import PNG_OURS, PNG_START
from tests.conftest import user_env
from tests.probes.conftest import ROOT, SLOW_COMMAND, TINY, one_line


def _parent(rank: int, world: int, init: str, tmp: Path) -> None:
    from experiments.common.dist_run import _as_rank

    _as_rank(rank, tmp, os.getppid)


def test_the_rank_server_is_found_without_multiprocessings_private_pid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server is the ranks' parent; `server_pid` finds it as the command's child running
    multiprocessing's server, whatever multiprocessing keeps privately (it read
    `forkserver._forkserver._forkserver_pid`)."""
    from multiprocessing import forkserver

    from experiments.common.dist_run import _spawn
    from experiments.common.rank_server import server_pid

    server = _spawn(1, _parent, ())
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 1)
    assert server_pid() == server


def _as_c_locale(*args: bytes) -> subprocess.CompletedProcess[bytes]:
    """`python -m args...` under LC_ALL=C without UTF-8 mode: argv's bytes beyond ASCII are
    undecodable, and Python holds them as surrogate escapes."""
    env = dict(user_env(), LC_ALL="C", LANG="C", PYTHONUTF8="0", PYTHONCOERCECLOCALE="0")
    cmd = [os.fsencode(sys.executable), b"-m", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        ([b"experiments.run", *(a.encode() for a in TINY), b"hydra.run.dir=PATH/run"], b"hydra"),
        ([b"experiments.routing_stats", b"out=PATH/s.json"], b"out="),
        ([b"experiments.trace_json", b"runs='PATH/none'"], b"trace.parquet"),
        ([b"experiments.report", b"dir='PATH/none'"], b"dir="),
    ],
    ids=["run-hint", "routing_stats-hint", "trace_json-missing", "report-missing"],
)
def test_a_path_beyond_ascii_prints_back_as_typed_under_the_c_locale(
    tmp_path: Path, args: list[bytes], key: bytes
) -> None:
    """The line naming the path held `\\udcc3\\udca9` for `é` (Python's escapes of bytes the C
    locale cannot decode), which pastes back as another path; it holds the bytes typed."""
    path = os.fsencode(tmp_path) + b"/\xc3\xa9"
    r = _as_c_locale(*(a.replace(b"PATH", path) for a in args))
    assert r.returncode != 0
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(b"error: "), r.stderr
    assert key in lines[0] and path in lines[0], lines[0]
    assert b"\\udc" not in lines[0] and b"Traceback" not in r.stderr


def _their_png(path: Path) -> None:
    """A plot of the user's: a PNG matplotlib drew, not moepipe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    fig.savefig(path)
    plt.close(fig)


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("experiments.replication", "throughput.png"),
        pytest.param(  # throughput.png's case shows the class; 1.7 s: the slow suite
            "experiments.replication", "balance_vs_makespan.png", marks=pytest.mark.slow
        ),
        ("experiments.report", "gantt.png"),
        ("experiments.report", "idle_causes.png"),
    ],
)
def test_a_png_of_the_users_where_a_plot_goes_is_refused(
    tmp_path: Path, cli_here: Any, module: str, name: str
) -> None:
    """Any PNG was taken for the command's own and written over (exit 0, the user's plot
    lost): only one moepipe drew (its text chunk, `PNG_OURS`) is replaced."""
    from tests.probes.conftest import tiny_run

    sweep = tiny_run(tmp_path / "sweep" / "0").parent
    out = tmp_path / "out"
    out.mkdir()
    _their_png(out / name)
    before = (out / name).read_bytes()
    assert before.startswith(PNG_START) and PNG_OURS not in before
    r = cli_here(module, f"dir={sweep}", f"out={out}")
    one_line(r, f"out={out / name}", "did not write")
    assert (out / name).read_bytes() == before


def test_replication_on_a_full_disk_names_out_and_keeps_the_earlier_report(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while replication draws: its PNGs went straight into out= (a plot cut
    short beside the earlier page) and matplotlib's OSError named no file ("No space left on
    device; free space on that disk"). The plots and pages are staged and moved in whole; the
    line names out=."""
    import errno

    from experiments import replication
    from experiments.common import ep_plots

    out = tmp_path / "out"
    out.mkdir()
    page = ep_plots.PAGE_START + b"<p>the earlier report</p>"
    (out / "index.html").write_bytes(page)

    def plot(rows: Any, where: Path, *rest: Any) -> list[Path]:
        (where / "throughput.png").write_bytes(PNG_START + PNG_OURS)  # a first plot, whole
        with open(where / "balancedness_per_batch.png", "wb") as f:  # the next cut short
            f.write(PNG_START)
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(replication, "load_rows", lambda sweep, opts: [])
    monkeypatch.setattr(replication, "report_lines", lambda rows, opts: (["case bs"], {}))
    monkeypatch.setattr(ep_plots, "plot", plot)
    r = cli_here("experiments.replication", f"dir={tmp_path}", f"out={out}")
    one_line(r, f"out={out}: cannot write the report (No space left on device)")
    assert [p.name for p in out.iterdir()] == ["index.html"]
    assert (out / "index.html").read_bytes() == page


def test_validate_refuses_a_png_of_the_users_where_a_timeline_goes(
    tmp_path: Path, cli_here: Any, tiny_ckpt: Path
) -> None:
    """validate's timeline_<planner>.png replaced a user's plot in out= alike; refused before
    any run."""
    out = tmp_path / "out"
    out.mkdir()
    _their_png(out / "timeline_flexgen.png")
    before = (out / "timeline_flexgen.png").read_bytes()
    r = cli_here(
        "experiments.validate",
        f"checkpoint={tiny_ckpt}",
        "hardware=tiny",
        "planners=[flexgen]",
        f"out={out}",
    )
    one_line(r, f"out={out / 'timeline_flexgen.png'}", "did not write")
    assert (out / "timeline_flexgen.png").read_bytes() == before


@pytest.mark.parametrize(
    ("gloo", "said"),
    [
        (
            "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv "
            "operation to complete",
            "rank 1 did not answer within 10 s during the run (hung, stopped or far behind; "
            "executor.rendezvous_timeout_s bounds the wait); rank 0 stopped",
        ),
        (
            "[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41671",
            "rank 1 died or left during the run; rank 0 stopped (gloo: Connection closed by peer "
            "[127.0.0.1]:41671)",
        ),
    ],
    ids=["hung", "died"],
)
def test_a_peer_that_hangs_is_not_said_to_have_died(gloo: str, said: str) -> None:
    """A rank hung (alive, not answering) was "rank 1 died or left", once gloo's wait for it
    timed out: the user looked for a crash. A timeout says the peer did not answer, in how
    long, and which option bounds the wait."""
    import threading

    from real.distributed import Peers

    peers = Peers.__new__(Peers)  # the line needs no process group
    peers.rank, peers.world, peers.gone = 0, 2, None
    peers._cv = threading.Condition()
    assert str(peers.lost(1, RuntimeError(gloo))) == said


def _mounted(where: Path, *options: str) -> None:
    """A 1 MB tmpfs at `where` (root only; the test is skipped where mounting is refused)."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(["size=1m", *options]), "tmpfs", where]
    )
    if r.returncode != 0:
        pytest.skip("mount refused")


@pytest.fixture
def full_disk(tmp_path: Path) -> Any:
    """A folder on a really full disk: a 1 MB tmpfs filled to its last byte, unmounted after."""
    where = tmp_path / "full"
    _mounted(where)
    fd = os.open(where / ".fill", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 65536):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    yield where
    subprocess.run(["umount", "-l", str(where)])


@pytest.fixture
def read_only_disk(tmp_path: Path) -> Any:
    """A folder on a disk mounted read-only (EROFS), unmounted after."""
    where = tmp_path / "ro"
    _mounted(where, "ro")
    yield where
    subprocess.run(["umount", "-l", str(where)])


@pytest.mark.parametrize(
    ("module", "args", "out"),
    [
        ("experiments.collect", ["dir={sweep}", "out={full}/c"], "{full}/c"),
        ("experiments.report", ["dir={sweep}", "out={full}/r"], "out={full}/r"),
        ("experiments.trace_json", ["runs={sweep}/0", "out={full}/t.json"], "out={full}/t.json"),
        pytest.param(
            "experiments.routing_stats",
            ["out={full}/s.json"],
            "out={full}/s.json",
            marks=SLOW_COMMAND,
        ),
        ("experiments.run", [*TINY, "hydra.run.dir={full}/run"], "{full}/run"),
    ],
    ids=["collect", "report", "trace_json", "routing_stats", "run"],
)
def test_a_command_on_a_really_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, cli_here: Any, full_disk: Path, module: str, args: list[str], out: str
) -> None:
    """A full disk (not a faked errno: a filesystem with no byte free) under a command that
    writes: one line naming what it writes, and nothing of it left on that disk."""
    from tests.probes.conftest import tiny_run

    sweep = tiny_run(tmp_path / "sweep" / "0").parent
    fill = {"sweep": str(sweep), "full": str(full_disk)}
    r = cli_here(module, *(a.format(**fill) for a in args))
    one_line(r, out.format(**fill), "No space left on device")
    assert [p.name for p in full_disk.iterdir()] == [".fill"]


def test_a_sweep_on_a_really_full_disk_names_hydras_record(cli_here: Any, full_disk: Path) -> None:
    """hydra's sweeper writes multirun.yaml first; on a full disk its OSError (the file's
    close) named no file: "No space left on device; free space on that disk" alone. The line
    (after the sweep's progress bar, as every sweep's) names the file; no sweep dir is left."""
    r = cli_here("experiments.run", "-m", *TINY, f"hydra.sweep.dir={full_disk}/sweep")
    assert r.returncode == 2 and "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [line for line in r.stderr.replace("\r", "\n").splitlines() if line.strip()]
    assert all(line.startswith("sweep ") for line in lines[:-1]), r.stderr  # the bar
    assert lines[-1].startswith(f"error: {full_disk}/sweep/multirun.yaml: No space left"), lines
    assert [p.name for p in full_disk.iterdir()] == [".fill"]


def test_replication_into_a_folder_it_cannot_write_says_how_to_fix_it(
    tmp_path: Path, cli_here: Any, read_only_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """out= where no folder can be made: replication said only "cannot write the report
    (Read-only file system)" once it had drawn; the others' line names out= and the fix."""
    from experiments import replication

    monkeypatch.setattr(replication, "load_rows", lambda sweep, opts: [])
    monkeypatch.setattr(replication, "report_lines", lambda rows, opts: (["case bs"], {}))
    r = cli_here("experiments.replication", f"dir={tmp_path}", f"out={read_only_disk}/rep")
    one_line(r, f"out={read_only_disk}/rep: cannot create folder", "pass out= a path")


def test_a_ranks_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun starts ranks with `python -u`: stderr is written through, and print's two
    writes (the line, then its newline) let the agent's log line in between: "...(gloo:
    Connection reset by peer)W1206 13:38:09 ... Sending process 23896 closing signal SIGTERM"
    on one line. The launch's line goes out in one write."""
    from experiments.common import launch_line

    writes: list[str] = []

    class Through:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Through())
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launch_line.say_first("error: rank 1 died or left during the run; rank 0 stopped")
    assert writes == ["error: rank 1 died or left during the run; rank 0 stopped\n"]


def test_a_staged_output_that_fails_is_named_where_it_goes(tmp_path: Path) -> None:
    """validate on a full disk named `out/.partial-PID-.../flexgen/sim/...`, a folder the user
    never sees: every command that stages its outputs names the file where it goes, its
    error's type kept."""
    import errno

    from experiments.common.run_dir import staged_outputs

    out = tmp_path / "out"
    with pytest.raises(OSError) as full, staged_outputs(out) as tmp:
        (tmp / "flexgen").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "flexgen" / "a.png"))
    assert full.value.errno == errno.ENOSPC and full.value.filename == str(out / "flexgen/a.png")
    with pytest.raises(FileNotFoundError) as moved, staged_outputs(out) as tmp:
        (tmp / "a").write_text("x")
        os.replace(tmp / "a", tmp / "nowhere" / "b")
    assert (moved.value.filename, moved.value.filename2) == (str(out / "a"), str(out / "nowhere/b"))
    assert ".partial" not in str(moved.value) and not out.exists()


@pytest.mark.parametrize("what", ["file", "fifo", "dangling link"])
def test_a_kept_hydra_record_that_is_no_folder_is_replaced(tmp_path: Path, what: str) -> None:
    """`.hydra/.result` (where a run dir keeps the record of the run whose result it holds) as a
    file: the run's replace of it failed, and failed.txt named the temporary `.kept-PID`."""
    from experiments.common.run_dir import HYDRA, HYDRA_KEPT, keep_hydra_record

    rec = tmp_path / HYDRA
    rec.mkdir()
    (rec / "config.yaml").write_text("a: 1\n")
    kept = rec / HYDRA_KEPT
    {"file": kept.write_text, "fifo": lambda _: os.mkfifo(kept)}.get(
        what, lambda _: kept.symlink_to(tmp_path / "nowhere")
    )("x")
    keep_hydra_record(tmp_path)
    assert kept.is_dir() and (kept / "config.yaml").read_text() == "a: 1\n"
    assert sorted(p.name for p in rec.iterdir()) == sorted(["config.yaml", HYDRA_KEPT])
