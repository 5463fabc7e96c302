"""Round 25f's probe classes, this afternoon's rounds' leftovers (issue 48):
- a rank stopped in Python's own start-up printed "Fatal Python error" and a traceback;
- a stop pressed again while the command stops was ignored: a hung clean-up left `kill -9`;
- a sweep stopped in its first seconds left joblib's memmapping folder in /dev/shm;
- a size option past any machine (`shard_mb=1e300`) was taken;
- a comma inside one item of a list option (`runs=[/x/a,b]`) split it with no word;
- validate's per-op-kind table printed a row of `nan` for a skipped planner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import one_line, pasted

_HUGE = [
    ("experiments.make_checkpoint", ["model=tiny", "out=OUT", "shard_mb=1e300"], "shard_mb"),
    ("experiments.calibrate", ["disk_mb=99999999"], "disk_mb"),
    ("experiments.bench.real", ["model=tiny", "budget_gb=1e300"], "budget_gb"),
    ("experiments.bench.real", ["model=tiny", "budget_gb=4", "slack_mb=99999999"], "slack_mb"),
]


@pytest.mark.parametrize(("module", "args", "key"), _HUGE, ids=[c[2] for c in _HUGE])
def test_size_option_past_its_range_names_the_range(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], key: str
) -> None:
    """`make_checkpoint shard_mb=1e300` was taken (one shard planned); a size option's line
    now names its whole range, up to 1 TiB."""
    args = [a.replace("OUT", str(tmp_path / "ck")) for a in args]
    line = one_line(cli_here(module, *args), f"{key}=", "1 TiB")
    assert "in [" in line or "in (0," in line
    assert not (tmp_path / "ck").exists()


class _Ended(BaseException):
    """`os._exit`, in a test: the command ended at once with `args[0]`."""


@pytest.fixture
def ends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The statuses `os._exit` was called with; it raises `_Ended` in place of ending pytest."""
    import os

    ended: list[int] = []

    def exit_now(code: int) -> None:
        ended.append(code)
        raise _Ended(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    return ended


@pytest.mark.parametrize(("again", "grace_s"), [(1, 3.0), (2, 3.0), (1, -1.0)])
def test_a_third_stop_while_stopping_ends_at_once(
    monkeypatch: pytest.MonkeyPatch, capfd: Any, ends: list[int], again: int, grace_s: float
) -> None:
    """A stop while the command stopped was ignored: a clean-up that hung left only `kill -9`.
    The second within the grace is still the same stop; a third, or a second after the grace,
    ends it at once with the first's status (143) and one line of what is left undone."""
    import signal

    from experiments.common import stops

    monkeypatch.setattr(stops, "GRACE_S", grace_s)

    def clean_up_stopped_again() -> None:  # the stops pressed as the clean-up runs
        for _ in range(again):
            stops._stopping(signal.SIGINT, None)

    monkeypatch.setattr(stops, "before_line", clean_up_stopped_again)
    with pytest.raises((SystemExit, _Ended)) as info:
        stops._say_interrupted(stops.Stopped(signal.SIGTERM))
    err = capfd.readouterr().err
    if again == 1 and grace_s > 0:  # the same stop: its line, its status
        assert isinstance(info.value, SystemExit) and info.value.code == 143 and not ends
        assert err.startswith("stopped by SIGTERM;") and "stopped again" not in err
    else:
        assert ends == [143]
        assert err == f"{stops.UNDONE}\n"


def test_a_third_stop_to_the_launcher_ends_it_at_once(
    monkeypatch: pytest.MonkeyPatch, capfd: Any, ends: list[int], tmp_path: Path
) -> None:
    """`experiments.torchrun` took every stop after the first as that one: its ranks' stop
    that hung was left to `kill -9`. The third ends it with the first's status."""
    import signal
    import tempfile

    from torch.distributed.elastic.multiprocessing import api

    from experiments import torchrun
    from experiments.common.stops import UNDONE

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the launch's claim is made
    monkeypatch.setattr(api, "_terminate_process_handler", lambda signum, frame: None)
    monkeypatch.setattr(torchrun, "_SIGNALLED", [])
    torchrun._say_signals_here()
    for _ in range(2):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert not ends
    with pytest.raises(_Ended):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert ends == [143]
    assert capfd.readouterr().err.endswith(f"{UNDONE}\n")


@pytest.mark.parametrize("pieces", [["a,b"], ["a,b,c"], ["a,b", "ok"]])
def test_a_comma_inside_one_item_of_a_list_option_says_to_quote_it(
    cli_here: Any, tmp_path: Path, pieces: list[str]
) -> None:
    """`runs=[/x/a,b]`, `/x/a,b` one folder, was split into `/x/a` and `b` with no word (the
    line named `/x/a`, "no trace.parquet there"). The line names the path and the quoted list
    to pass, in hydra's quotes as every other fix; the quoted list is taken whole."""
    for name in pieces:
        (tmp_path / name).mkdir()
    folders = [str(tmp_path / name) for name in pieces]
    out = f"out={tmp_path / 'o.json'}"
    line = one_line(cli_here("experiments.trace_json", f"runs=[{','.join(folders)}]", out))
    fix = ",".join(f"'{f}'" if "," in f else f for f in folders)
    said = f"{folders[0]} is one path, which hydra splits at its comma into items; quote it: pass "
    assert said in line and pasted(line.partition(said)[2]) == f"runs=[{fix}]", line
    line = one_line(cli_here("experiments.trace_json", f"runs=[{fix}]", out))
    assert f"{folders[0]}: no trace.parquet there" in line  # taken whole


def test_the_fix_for_an_equals_sign_reads_as_the_others(cli_here: Any) -> None:
    """A run dir's `=` is told to pass its list in hydra's quotes, inside the shell's as every
    other fix (round 26c: a fix pasted into a shell as it stands works)."""
    line = one_line(cli_here("experiments.trace_json", "runs=[/nonexistent/w=1,c]"))
    assert line.endswith("must be quoted: \"runs=['/nonexistent/w=1','c']\""), line


@pytest.mark.parametrize("tracker", [False, True], ids=["before-the-tracker", "tracker-running"])
def test_a_stopped_sweep_leaves_no_memmapping_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tracker: bool
) -> None:
    """A `-m` sweep stopped by SIGTERM in its first seconds left joblib's empty memmapping
    folder in /dev/shm (3 stops in 5 at that moment): the stop's clean-up removes this
    process's (named by its pid), in /dev/shm or the temporary folder, and no other's."""
    import os
    import sys
    import tempfile
    import types
    from multiprocessing import util

    from experiments.common import pool

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ours = tmp_path / f"joblib_memmapping_folder_{os.getpid()}_1_a"
    others = tmp_path / "joblib_memmapping_folder_1_1_a"  # pid 1's: not this stop's
    for folder in (ours, others):
        folder.mkdir()
    (ours / "x.pkl").write_bytes(b"")
    name = "joblib.externals.loky.backend.resource_tracker"
    if tracker:
        loky = types.SimpleNamespace(_resource_tracker=types.SimpleNamespace(_stop=lambda: None))
        monkeypatch.setitem(sys.modules, name, loky)
        monkeypatch.setattr(util, "_run_finalizers", lambda minpriority=None: None)
        monkeypatch.setattr(pool, "close_sweep_pool", lambda kill_workers=False: None)
        monkeypatch.setattr(pool, "_kill_workers_left", lambda: None)
    else:
        monkeypatch.delitem(sys.modules, name, raising=False)
    pool.stop_pool_tracker()
    assert not ours.exists() and others.exists()


def test_a_command_started_with_its_stops_blocked_takes_a_held_stop_at_start_up() -> None:
    """A rank still in Python's own start-up when the launcher passed a stop on printed "Fatal
    Python error: init_import_site" and a traceback after the launch's line. Started with
    the stops blocked (as `experiments.torchrun` starts its ranks), a stop held there comes
    once the start-up's handler is set: its one line. The old start-up left them blocked:
    the command ran on, deaf to every stop, and exited 0."""
    import os
    import signal
    import subprocess
    import sys

    from tests.probes.conftest import ROOT, user_env

    def blocked_and_stopped() -> None:  # a stop that lands in Python's start-up, held
        signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGINT)

    r = subprocess.run(
        [sys.executable, "-m", "experiments.trace_json", "--help"],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        preexec_fn=blocked_and_stopped,  # noqa: PLW1509 (the child's own mask, before exec)
        timeout=120,
    )
    assert r.returncode == 130, r.stderr
    assert r.stderr == "interrupted: the command had not started; nothing was written\n"


@pytest.mark.parametrize(("module", "blocked"), [("experiments.run", True), ("mine", False)])
def test_the_launcher_starts_its_ranks_with_their_stops_blocked(
    monkeypatch: pytest.MonkeyPatch, module: str, blocked: bool
) -> None:
    """The launcher's ranks of the project's commands start with Ctrl-C and the stops blocked
    (the command's start-up unblocks them); another program's as torch starts it. The
    launcher's own mask is as it was after."""
    import signal
    import sys

    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    from experiments import torchrun

    masks: list[set[int]] = []

    def popen(self: Any, args: tuple[Any, ...], env: dict[str, str]) -> None:
        masks.append(set(signal.pthread_sigmask(signal.SIG_BLOCK, [])))

    monkeypatch.setattr(subprocess_handler.SubprocessHandler, "_popen", popen)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    torchrun._ranks_start_stops_blocked()
    subprocess_handler.SubprocessHandler._popen(None, (sys.executable, "-u", "-m", module), {})
    stops = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
    assert (stops <= masks[0]) is blocked
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == before


def test_validates_per_op_kind_table_names_a_skipped_planner_not_a_row_of_nan(
    tmp_path: Path,
) -> None:
    """validate.md's per-op-kind table printed a row of `nan` for a planner that was skipped;
    it leaves the row out and names the planner under the table, its reason in the first."""
    from types import SimpleNamespace

    from core.types import Tier
    from experiments.validate import _write_tables

    model = SimpleNamespace(name="tiny", total_bytes=1e6)
    hw = SimpleNamespace(name="hw", memory_bytes={Tier.GPU: 1e9, Tier.CPU: 1e9})
    rows = [
        {"planner": "fiddler", "makespan_s": 1.0, "moe_ms": 2.0},
        {"planner": "klotski", "skipped": "needs more GPU memory"},
    ]
    _write_tables(SimpleNamespace(model=model, hw=hw, out=tmp_path), rows)
    per_kind = (tmp_path / "validate.md").read_text().split("## per-op-kind")[1]
    assert "nan" not in per_kind and "| fiddler" in per_kind
    assert per_kind.endswith("klotski: skipped, so not timed (why: the table above)\n")
