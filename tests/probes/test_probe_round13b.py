"""Probe round 13b (issue 48): a constrained machine, processes, and leftovers. What a writer
killed outright (SIGKILL, the OOM killer) leaves in a folder is hidden from every reader and
removed by the next command there, its outputs set aside put back; a name of the user's quoted
in a line shows even where it is empty; a summary.json's planner `plan` is checked on reading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.files import clear_leftovers, staging_dir, staging_file
from tests.conftest import user_env
from tests.probes.conftest import ROOT, SLOW_COMMAND, TINY, one_line, tiny_run

# `python -c KILL module args...`: the command, SIGKILLed at its (KILL_AT+1)-th rename, the
# moment a staged write's file or folder moves in
KILL = """import os, runpy, sys
left = [int(os.environ["KILL_AT"])]
real = os.replace
def replace(a, b, *k, **kw):
    left[0] -= 1
    if left[0] < 0:
        os.kill(os.getpid(), 9)
    return real(a, b, *k, **kw)
os.replace = replace
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def _killed(at: int, module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(user_env(), KILL_AT=str(at))
    cmd = [sys.executable, "-c", KILL, module, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


OURS = {".hydra", ".result", ".run.lock", ".sweep.json"}  # a folder's hidden names, not staging


def _staged(folder: Path) -> list[str]:
    """Hidden names in `folder` (at any depth) that are no command's record or lock."""
    hidden = (p for p in folder.rglob(".*") if p.name not in OURS)
    return sorted(str(p.relative_to(folder)) for p in hidden)


def _dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    return int(p.stdout)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep dir of one finished tiny run."""
    return tiny_run(tmp_path_factory.mktemp("s13b") / "sweep" / "0").parent


@pytest.mark.parametrize(
    ("module", "args", "at"),
    [
        # report's two points start a fresh process each, 4 s: the slow suite (collect's and
        # run's stay in the default one)
        pytest.param("experiments.report", ["dir=SWEEP", "out=OUT"], 0, marks=SLOW_COMMAND),
        pytest.param("experiments.report", ["dir=SWEEP", "out=OUT"], 6, marks=SLOW_COMMAND),
        ("experiments.collect", ["dir=SWEEP", "out=OUT"], 0),  # results.parquet
        pytest.param("experiments.routing_stats", ["out=OUT/s.json"], 0, marks=SLOW_COMMAND),
        ("experiments.run", [*TINY, "hydra.run.dir=OUT/run"], 0),  # the run's swap
        pytest.param(  # torch and a checkpoint in a fresh process: the slow suite
            "experiments.make_checkpoint", ["model=tiny", "out=OUT/ck"], 0, marks=SLOW_COMMAND
        ),
    ],
    ids=["report-plot", "report-move", "collect", "routing_stats", "run", "make_checkpoint"],
)
def test_a_kill_at_a_staged_write_is_hidden_and_the_next_command_clears_it(
    tmp_path: Path, sweep: Path, module: str, args: list[str], at: int, cli_here: Any
) -> None:
    """A SIGKILL as a staged file or folder moves in left `.partial-PID-HEX` (or a file of
    mkstemp's name, which no later command could tell from a live writer's) until the same
    command ran there again, and a report's earlier outputs set aside (`-earlier`) for good.
    What it leaves is hidden (a dot name), and the next command there removes it, or puts
    back the outputs set aside: every earlier file is there after the kill and the rerun."""
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.replace("SWEEP", str(sweep)).replace("OUT", str(out)) for a in args]
    # the commands before and after the kill in this process: only the killed one needs its own
    assert cli_here(module, *argv).returncode == 0  # an earlier result there
    earlier = sorted(p.name for p in out.iterdir())
    if module == "experiments.run":  # another config: not the result there, reused
        argv.append("workload.n_batches=3")
    r = _killed(at, module, *argv)
    assert r.returncode == -9, r.stderr
    left = _staged(out)
    assert all(name.split("/")[-1].startswith(".") or "/." in name for name in left), left
    r = cli_here(module, *argv)
    assert r.returncode == 0, r.stderr
    assert _staged(out) == [] and sorted(p.name for p in out.iterdir()) == earlier


def test_a_dead_reports_outputs_set_aside_come_back(tmp_path: Path) -> None:
    """A kill between setting a report's earlier outputs aside and moving the new ones in: the
    aside folder stayed for good (`.partial-...-earlier` never matched the cleaner), and the
    earlier index.html was gone from the folder. The next writer puts back each file no new
    one replaced, then removes both folders."""
    pid = _dead_pid()
    (tmp_path / f".partial-{pid}-0badc0de").mkdir()
    (tmp_path / f".partial-{pid}-0badc0de" / "gantt.png").write_text("new")
    aside = tmp_path / f".partial-{pid}-0badc0de-earlier"
    aside.mkdir()
    (aside / "index.html").write_text("earlier")
    (aside / "gantt.png").write_text("earlier")
    (tmp_path / "gantt.png").write_text("moved in")
    staging_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gantt.png", "index.html"]
    assert (tmp_path / "index.html").read_text() == "earlier"
    assert (tmp_path / "gantt.png").read_text() == "moved in"


def test_each_writer_of_one_file_stages_its_own_and_a_dead_ones_goes(tmp_path: Path) -> None:
    """Two calibrate runs writing one hardware profile shared `.NAME.partial`: each renamed
    the other's half-written file over the profile, or failed to find its own. Each writer
    now has its own name (the suffix kept: matplotlib and pandas choose a format by it), and
    a dead writer's file goes with the next writer's."""
    out = tmp_path / "hw.yaml"
    dead = tmp_path / f".hw.partial-{_dead_pid()}-0badc0de.yaml"
    dead.write_text("half")
    live = tmp_path / f".hw.partial-{os.getpid()}-0badc0de.yaml"
    live.write_text("mine")
    a, b = staging_file(out), staging_file(out)
    assert a != b and a.suffix == ".yaml" and a.name.startswith(f".hw.partial-{os.getpid()}-")
    assert not dead.exists() and live.exists()
    clear_leftovers(tmp_path / "absent")  # a folder not there: nothing to do


def test_a_run_set_aside_by_a_kill_is_not_read_as_another_run(sweep: Path, tmp_path: Path) -> None:
    """A kill in a run's swap leaves its earlier result in `.previous/` (summary.json too) and
    its staging folder with config.yaml: collect and report counted each as a run of the
    sweep ("2 run(s), 1 skipped: .partial-... no summary.json"). Hidden folders hold none."""
    from experiments.common.tables import collect

    s = tmp_path / "s"
    run = s / "0"
    run.mkdir(parents=True)
    for f in (sweep / "0").iterdir():
        if f.is_file():
            (run / f.name).write_bytes(f.read_bytes())
    (run / ".previous").mkdir()
    (run / ".previous" / "summary.json").write_bytes((run / "summary.json").read_bytes())
    staged = run / f".partial-{_dead_pid()}-0badc0de"
    staged.mkdir()
    (staged / "config.yaml").write_text("x: 1\n")
    df, skipped = collect(s)
    assert len(df) == 1 and skipped == []
    assert not staged.exists()  # a dead writer's, cleared by the reader
    assert json.loads((run / "summary.json").read_text())


def _with_tensor(ckpt: Path, to: Path, name: str, **entry: Any) -> Path:
    """A copy of `ckpt` whose safetensors file holds one more tensor, `name` (2 float32
    zeros; `entry` replaces fields of its header entry)."""
    import shutil
    import struct

    shutil.copytree(ckpt, to)
    f = to / "model.safetensors"
    data = f.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header[name] = {"dtype": "F32", "shape": [2], "data_offsets": [end, end + 8], **entry}
    text = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :] + b"\0" * 8)
    return to


@pytest.mark.parametrize(
    ("name", "entry", "shown"),
    [
        ("", {}, "tensor '' (1 such)"),
        (" ", {}, "tensor ' ' (1 such)"),
        ("a\nb", {}, "tensor 'a\\nb' (1 such)"),
        ("", {"dtype": "X9"}, "tensor '': unknown safetensors dtype"),
        ("", {"shape": "x"}, "tensor ''"),
    ],
    ids=["empty", "space", "newline", "dtype", "entry"],
)
def test_a_tensor_of_an_empty_or_odd_name_shows_quoted(
    tmp_path: Path, tiny_ckpt: Path, name: str, entry: dict[str, Any], shown: str
) -> None:
    """A tensor named "" was "tensor  (1 such)", one of a space alike, and a newline in a
    name split the line in two: a name that would not read back is quoted."""
    from real.checkpoint import load_units
    from tests.probes.conftest import raises_one_line

    ck = _with_tensor(tiny_ckpt, tmp_path / "ck", name, **entry)
    raises_one_line(lambda: load_units(ck), shown)


@pytest.mark.parametrize(
    ("group", "key", "shown"),
    [("hardware", '""', "hardware.'': unknown key (in "), ("model", '" "', "model.' ': unknown")],
)
def test_a_yaml_files_empty_or_odd_key_shows_quoted(
    tmp_path: Path, cli_here: Any, group: str, key: str, shown: str
) -> None:
    """A hardware YAML's key "" went out as omegaconf's "ConfigKeyError raised while composing
    config:; Key '' not in 'HardwareSchema'", naming no file; a model's key " " as
    "model.. : unknown key"."""
    f = tmp_path / "mine.yaml"
    f.write_text((ROOT / "conf" / group / "tiny.yaml").read_text() + f"{key}: 1\n")
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={f}", f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, shown, str(f))


def test_an_unknown_rope_key_of_an_empty_name_shows_quoted(tmp_path: Path) -> None:
    from core.hf_config import spec_to_hf_config
    from core.spec import ModelSpec
    from real.checkpoint import reduced_spec
    from tests.probes.conftest import raises_one_line

    cfg = spec_to_hf_config(reduced_spec("mixtral-tiny"))
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0, "": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    raises_one_line(lambda: ModelSpec.from_hf_config(tmp_path), "rope_scaling.'' is not a key")


def _plan(s: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return {"plan": s["plan"] | keys}


def _placed(s: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return _plan(s, placement=s["plan"]["placement"] | keys)


@pytest.mark.parametrize(
    ("key", "change"),
    [
        ("plan.n_batches_shared", lambda s: _plan(s, n_batches_shared=float("nan"))),
        ("plan.n_batches_shared", lambda s: _plan(s, n_batches_shared=1.5)),
        ("plan.oracle", lambda s: _plan(s, oracle="yes")),
        ("plan.placement", lambda s: _plan(s, placement=[1])),
        ("plan.placement.working_gb", lambda s: _placed(s, working_gb="x")),
        ("plan.placement.dense", lambda s: _placed(s, dense="gpu0")),
        ("plan.placement.kv_layers", lambda s: _placed(s, kv_layers={"gpu": -1})),
        ("plan.prefetch_accuracy", lambda s: _plan(s, prefetch_accuracy=2.0)),
        ("plan.theirs.a.1", lambda s: _plan(s, theirs={"a": [1, float("inf")]})),
        ("later_metric", lambda s: {"later_metric": float("-inf")}),
        ("plan.oracle", lambda s: {"plan.oracle": True}),
    ],
)
def test_a_plan_key_no_run_writes_is_refused_on_reading(
    tmp_path: Path, sweep: Path, key: str, change: Any
) -> None:
    """The planner's `plan` mapping was read back unchecked by collect, report and a rerun's
    reuse: NaN, a string for a count, a list for the placement, a key taking another's column.
    Each is one line naming the file and the key."""
    from experiments.common.run_dir import finished as reusable
    from experiments.common.tables import collect
    from tests.probes.conftest import raises_one_line
    from tests.probes.test_probe_summary_identities import edited

    mine = tmp_path / "m"
    (mine / "good").mkdir(parents=True)
    for f in (sweep / "0").iterdir():
        if f.is_file() and f.name != "files.sha256":  # checked by its own rules, unhashed
            (mine / "good" / f.name).write_bytes(f.read_bytes())
    mine, path = edited(mine, tmp_path / "e", change)
    raises_one_line(lambda: collect(mine), str(path), f"{key} is", "not a run's")
    assert not reusable(mine / "good", (mine / "good" / "config.yaml").read_text())


def test_keys_a_later_version_may_add_are_read(tmp_path: Path, sweep: Path) -> None:
    """A plan key of a planner this version does not know, and a top-level metric it does not
    know, are kept as columns (docs/commands.md: a later version may add keys)."""
    from experiments.common.tables import collect
    from tests.probes.test_probe_summary_identities import edited

    mine = tmp_path / "m"
    (mine / "good").mkdir(parents=True)
    for f in (sweep / "0").iterdir():
        if f.is_file() and f.name != "files.sha256":
            (mine / "good" / f.name).write_bytes(f.read_bytes())
    mine, _ = edited(mine, tmp_path / "e", lambda s: _plan(s, theirs=[1, None]) | {"later": 3})
    df, skipped = collect(mine)
    assert skipped == [] and df["later"].tolist() == [3] and "plan.theirs" in df


def _private_mounts() -> None:
    """Skip unless this test may mount (root; `unshare -m` gives the command a mount namespace
    of its own, so the machine's /dev/shm and HOME stay as they are)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount in a private namespace")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare -m refused here")


def _in_namespace(script: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["unshare", "-m", "bash", "-c", script],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_sweep_with_dev_shm_full_names_dev_shm(tmp_path: Path) -> None:
    """joblib's pool makes its locks in /dev/shm: a full one was "No space left on device;
    free space on that disk, or write elsewhere" (which disk?) and then joblib's warning of
    serial mode over two more lines. Now one line naming /dev/shm, before any point."""
    _private_mounts()
    sweep = tmp_path / "s"
    r = _in_namespace(
        "mount -t tmpfs -o size=4k tmpfs /dev/shm && exec python -m experiments.run -m "
        + " ".join(TINY)
        + f" workload.batch_size=1,2 hydra.launcher.n_jobs=2 hydra.sweep.dir={sweep}"
    )
    one_line(r, "/dev/shm", "hydra/launcher=basic")
    assert not sweep.exists()


def test_a_report_with_a_read_only_home_says_nothing_of_matplotlibs_cache(
    tmp_path: Path, sweep: Path
) -> None:
    """matplotlib, finding no writable config folder under HOME, printed two lines ("mkdir -p
    failed ...", "Matplotlib created a temporary cache directory ...") on a report that
    succeeded; it works in a temporary folder then, and says so no more."""
    _private_mounts()
    home = tmp_path / "home"
    home.mkdir()
    r = _in_namespace(
        f"mount -t tmpfs -o ro,size=1m tmpfs {home} && HOME={home} MPLCONFIGDIR= exec python -m "
        f"experiments.report dir={sweep} out={tmp_path / 'out'}"
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert (tmp_path / "out" / "index.html").is_file()


@SLOW_COMMAND  # a sweep's pool in a fresh process; round 11b's reader-left sweep stays
def test_a_sweep_with_stdout_closed_runs_and_no_child_writes_into_a_file(tmp_path: Path) -> None:
    """`>&-`: Python leaves sys.stdout None, and joblib flushed it as the sweep started its
    workers ("internal error (AttributeError: 'NoneType' object has no attribute 'flush')");
    the next file opened took descriptor 1, so a child's prints went into it. /dev/null now
    stands in for a closed stream."""
    sweep = tmp_path / "s"
    cmd = f"exec python -m experiments.run -m {' '.join(TINY)} workload.batch_size=1,2 "
    r = _bash(cmd + f"hydra.sweep.dir={sweep} >&-")
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    assert len(list(sweep.rglob("summary.json"))) == 2


def test_a_failure_in_a_deleted_current_folder_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command whose current folder was deleted while it ran failed with "No such file or
    directory; check the path" (which path?), a sweep with "a worker process of the sweep died
    (exit code 1: killed, or out of memory)"."""
    from experiments.common.cli import error_line

    gone = tmp_path / "w"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    line = error_line(FileNotFoundError(2, "No such file or directory"))
    assert line is not None and "the current folder" in line and "cd to a folder" in line
    died = type("TerminatedWorkerError", (Exception,), {})("exit codes: {1}")
    line = error_line(died)
    assert line is not None and "could not start in the current folder" in line


def test_a_file_over_ulimit_f_names_the_limit() -> None:
    import errno

    from experiments.common.cli import error_line

    line = error_line(OSError(errno.EFBIG, "File too large"))
    assert line is not None and "ulimit -f" in line


@pytest.mark.slow  # two ranks in a fresh process: .ci/run's slow suite
def test_a_distributed_run_out_of_descriptors_is_one_line(tmp_path: Path, tiny_ckpt: Path) -> None:
    """Under `ulimit -n 20` each rank's gloo sockets failed and each rank stopped as if the
    other had died first: the command then read rank 0's missing result ("rank0.pkl: No such
    file or directory; check the path"). Every rank losing its peers is said as such."""
    args = ["executor=real", f"checkpoint={tiny_ckpt}", "hardware=h200-hgx8", "workload=tiny"]
    args += ["executor.distributed=true", "planner=eplb", "+planner.params.n_devices=2"]
    cmd = f"ulimit -n 20; exec python -m experiments.run {' '.join(args)} "
    r = _bash(cmd + f"hydra.run.dir={tmp_path / 'r'}")
    line = one_line(r)
    assert "rank0.pkl" not in line
    assert "ulimit -n" in line or "open files" in line, line


def _bash(line: str) -> subprocess.CompletedProcess:
    """`line` run by bash from the checkout, as a user's shell runs it."""
    return subprocess.run(
        ["bash", "-c", line], cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=300
    )
