"""Probe round 7 (issue 48): cases of classes the earlier rounds left, each checked on the
boundary that had it: a user's YAML file no YAML parser reads, an output path that is a run's
own result file, an empty path taken for the default, an override into a block the config
leaves null, a knob its partner makes idle, a model a real run ignores, and a bench child's
error said twice."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from core.spec import RoutingConfig
from experiments import reproduce_klotski
from experiments.common import peers
from experiments.common.run_dir import replace_run, staged_outputs
from real.checkpoint import reduced_spec
from tests.conftest import NEEDS_TRACES, ROOT, SHARED_TRACES
from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run's dir in a sweep folder of its own (one subprocess for the module);
    tests work on a copy."""
    return tiny_run(tmp_path_factory.mktemp("round7") / "sweep" / "run")


def copied(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` as tmp_path/sweep/run."""
    return Path(shutil.copytree(run, tmp_path / "sweep" / "run"))


NUL_YAML = "name: mine\nfamily: \x00mixtral\n"  # a control character: yaml's reader refuses it


@pytest.mark.parametrize("group", ["hardware", "model"])
def test_a_yaml_file_with_a_character_yaml_refuses_is_named(
    tmp_path: Path, cli_here: Any, group: str
) -> None:
    """yaml's ReaderError has no mark: the line named neither the file nor its line."""
    path = tmp_path / f"{group}.yaml"
    path.write_text((ROOT / "conf" / group / "tiny.yaml").read_text() + "x: \x00\n")
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path}/r")
    one_line(r, f"{path}:", "not valid YAML", "#x0000")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "text, words",
    [
        (NUL_YAML, ["m.yaml:2", "not valid YAML"]),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", ["m.yaml", "nested too deeply"]),
        ("name: [1\n", ["m.yaml:", "not valid YAML"]),
    ],
    ids=["nul", "nested 5000 deep", "unclosed"],
)
def test_a_model_file_make_checkpoint_reads_is_checked_as_runs_are(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    """make_checkpoint's and bench.real's `model=FILE.yaml` (real.checkpoint.reduced_spec):
    a NUL was an unnamed line, 5000 brackets an internal RecursionError."""
    path = tmp_path / "m.yaml"
    path.write_text(text)
    raises_one_line(lambda: reduced_spec(str(path)), *words)


def test_outputs_staged_into_a_run_dir_leave_its_summary(tmp_path: Path) -> None:
    """Staged outputs moved the folder's summary.json aside with the names they replace, and
    dropped it with them: `report out=RUN_DIR` (or validate's out) deleted the run's result."""
    (tmp_path / "summary.json").write_text("{}")
    with staged_outputs(tmp_path, last="index.html") as tmp:
        (tmp / "index.html").write_text("page")
    assert (tmp_path / "summary.json").read_text() == "{}"
    assert (tmp_path / "index.html").read_text() == "page"


def test_a_report_written_into_a_run_dir_keeps_its_result(
    tmp_path: Path, finished_run: Path, cli_here: Any
) -> None:
    """A report into a run's folder kept the run's result among its own files; it is now
    refused in one line (round 15b: report's page and plots mixed with the run's files), the
    run's files untouched."""
    run = copied(finished_run, tmp_path)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    r = cli_here("experiments.report", f"dir={run.parent}", f"out={run}")
    one_line(r, f"out={run}", "a run's folder")
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before


@pytest.mark.parametrize(
    "module, name",
    [
        ("experiments.routing_stats", "config.yaml"),
        ("experiments.prefetch_eval", "summary.json"),
        ("experiments.calibrate", "files.sha256"),
    ],
)
def test_an_output_over_a_runs_own_file_is_refused(
    tmp_path: Path, finished_run: Path, cli_here: Any, module: str, name: str
) -> None:
    """routing_stats' JSON went over the run's config.yaml, prefetch_eval's CSV over its
    summary.json: the run's result was lost, and the next collect skipped it."""
    run = copied(finished_run, tmp_path)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    r = cli_here(module, f"out={run / name}")
    one_line(r, f"out={run / name}", "a file of the run")
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.collect", ["dir={sweep}", "out="]),
        ("experiments.report", ["dir={sweep}", "out="]),
        ("experiments.calibrate", ["out="]),
        ("experiments.calibrate", ["checkpoint="]),
        ("experiments.validate_lanes", ["out="]),
        ("experiments.trace_json", ["runs=[{run}]", "out="]),
    ],
)
def test_an_empty_value_for_an_option_null_by_default_is_refused(
    tmp_path: Path, finished_run: Path, cli_here: Any, module: str, args: list[str]
) -> None:
    """`out=` ran as if unset: collect wrote into the sweep, calibrate measured the machine
    and wrote conf/hardware/<name>.yaml, validate_lanes ran into runs/."""
    run = copied(finished_run, tmp_path)
    before = sorted(p.name for p in run.parent.rglob("*"))
    r = cli_here(module, *(a.format(sweep=run.parent, run=run) for a in args))
    one_line(r, f"{args[-1].rstrip('=')}=''", "an empty value")
    assert sorted(p.name for p in run.parent.rglob("*")) == before


@pytest.mark.parametrize(
    "override", ["replication.case=x", "+replication.case=x", "+replication={case: x}"]
)
def test_an_override_into_a_block_the_config_leaves_null_is_one_line(
    tmp_path: Path, cli_here: Any, override: str
) -> None:
    """The replication block is null outside its experiments: omegaconf's AssertionError (or
    AttributeError) while hydra applied the override was an "internal error"."""
    r = cli_here("experiments.run", *TINY, override, f"hydra.run.dir={tmp_path}/r")
    one_line(r, "replication is null", "experiment=")
    assert not (tmp_path / "r").exists()


def test_a_hot_share_with_no_hot_experts_is_refused() -> None:
    """hot_share=0.5 alone ran as if unset: the share goes to the hot experts, of which there
    were none (the reverse, hot_experts without a share, was refused already)."""
    raises_one_line(lambda: RoutingConfig(hot_share=0.5), "hot_share=0.5", "hot_experts > 0")
    RoutingConfig(hot_share=0.5, hot_experts=2)  # together they still run


@pytest.mark.parametrize("override", ["model=tiny", "model.top_k=1", "+model.hf_config={ckpt}"])
def test_a_model_given_to_a_real_run_is_refused(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, override: str
) -> None:
    """A real run runs its checkpoint's model: model=tiny was ignored without a word, and the
    run's config.yaml recorded tiny's shapes beside a summary of the checkpoint's."""
    r = cli_here(
        "experiments.run",
        "executor=real",
        f"checkpoint={tiny_ckpt}",
        *TINY[1:],
        override.format(ckpt=tiny_ckpt),
        f"hydra.run.dir={tmp_path}/r",
    )
    one_line(r, override.lstrip("+").split("=")[0], "checkpoint=", "drop it")
    assert not (tmp_path / "r").exists()


def test_a_bench_childs_error_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bench child (moepipe's or accelerate's run) that failed on bad input printed its error
    line, and the bench a second one after it: "moepipe klotski failed (exit status 2); see
    its output above". Its progress still passes through; its error is the bench's one line."""
    child = "import sys; print('progress', file=sys.stderr); sys.exit('error: n=15 does not fit')"
    popen = subprocess.Popen
    monkeypatch.setattr(
        peers.subprocess, "Popen", lambda cmd, **kw: popen([sys.executable, "-c", child], **kw)
    )
    got, _, why = peers.run_side("moepipe", {"checkpoint": str(tmp_path)}, None)
    assert got is None and why == "n=15 does not fit"
    assert capsys.readouterr().err == "progress\n"
    line = str(peers.side_failed("moepipe klotski", why))
    assert line == "moepipe klotski failed: n=15 does not fit"


@NEEDS_TRACES
def test_prefetch_eval_names_a_task_given_twice_or_one_the_trace_lacks(
    tmp_path: Path, cli_here: Any
) -> None:
    """train=[law,law] ran (the table labelled "law,law"); a trace cut to some tasks failed
    on one it lacks with "workload.routing selects no tokens", another command's key."""
    trace = dict(np.load(SHARED_TRACES / "esft-dsv2lite" / "esft_routing.npz"))
    keep = trace["task"] == list(trace["task_names"]).index("intent")
    cut = {k: v[keep] if v.shape[:1] == keep.shape else v for k, v in trace.items()}
    (tmp_path / "esft-dsv2lite").mkdir()
    np.savez(tmp_path / "esft-dsv2lite" / "esft_routing.npz", **cut)
    r = cli_here("experiments.prefetch_eval", "train=[law,law]")
    one_line(r, "train=[law,law]", "given twice")
    r = cli_here("experiments.prefetch_eval", f"trace_dir={tmp_path}", "train=[law]")
    one_line(r, "train=[law]", "no tokens of law", "(intent)")


@pytest.mark.parametrize(
    "arg, words",
    [("rows=[]", ["rows=[]", "at least one"]), ("lanes=100000", ["lanes=100000", "128 experts"])],
)
def test_bench_lanes_refuses_no_rows_or_more_lanes_than_experts(
    cli_here: Any, arg: str, words: list[str]
) -> None:
    """rows=[] said "rows=: not a whole number"; lanes=100000 ran (on CUDA: 100000 streams,
    each with an expert's weights) where validate_lanes bounds lanes by the experts."""
    one_line(cli_here("experiments.bench.lanes", arg, "device=cpu"), *words)


def test_a_checkpoints_weights_are_as_readable_as_its_config(tiny_ckpt: Path) -> None:
    """safetensors' save_file leaves 0600: make_checkpoint's weights (and a real run's
    tokens.safetensors, bench.real's checkpoint) were unreadable to the rest of a shared
    group, beside a config.json they could read."""
    mask = os.umask(0)
    os.umask(mask)
    for f in tiny_ckpt.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f


@pytest.mark.parametrize("module", ["experiments.validate_lanes", "experiments.bench.lanes"])
def test_a_value_a_users_hardware_file_holds_is_named_with_the_file(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, module: str
) -> None:
    """validate_lanes' and bench.lanes' hardware=FILE.yaml with a value HardwareSpec refuses
    said "hardware tiny: links.h2d.gbps must be positive" naming no file (validate and
    bench.accelerate named it)."""
    hw = tmp_path / "hw.yaml"
    hw.write_text(
        (ROOT / "conf" / "hardware" / "tiny.yaml").read_text().replace("1.0, lat", "-1, lat")
    )
    ckpt = [f"checkpoint={tiny_ckpt}"] if module.endswith("validate_lanes") else []
    r = cli_here(module, *ckpt, f"hardware={hw}", "device=cpu")
    one_line(r, str(hw), "links.h2d.gbps")


def _full_disk(*args: Any, **kw: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_run_that_could_not_be_written_leaves_no_folder_made_for_it(tmp_path: Path) -> None:
    """reproduce_klotski's run dirs (replace_run) on a full disk: the run dir, and the runs/
    folder made for it, were left empty beside the one-line error."""
    with pytest.raises(OSError, match="cannot write the run's files"):
        replace_run(tmp_path / "out" / "runs" / "r", {"makespan_s": 1.0}, _full_disk)
    assert list(tmp_path.iterdir()) == []


def test_reproduce_klotski_on_a_full_disk_keeps_its_earlier_results_whole(
    tmp_path: Path, cli_here: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """results.csv was written in place: a full disk left it cut short, and report_only=true
    then read the cut file as the results. A command whose runs all failed left its out
    folder, empty."""
    monkeypatch.setattr(reproduce_klotski, "run_resumable", _full_disk)
    r = cli_here("experiments.reproduce_klotski", "only=[auto_n]", f"out={tmp_path / 'rk'}")
    one_line(r, "No space left")
    assert not (tmp_path / "rk").exists()

    (tmp_path / "rk").mkdir()
    (tmp_path / "rk" / "results.csv").write_text("table\nauto_n\n")
    monkeypatch.setattr(reproduce_klotski, "run_resumable", lambda *a: ([{"planner": "x"}], 1))
    monkeypatch.setattr(reproduce_klotski, "report", lambda df: "the report")

    def cut_short(df: pd.DataFrame, path: Any = None, **kw: Any) -> str | None:
        if path is None:  # the rows printed instead
            return "planner\nx\n"
        Path(path).write_text("plan")
        return _full_disk()

    monkeypatch.setattr(pd.DataFrame, "to_csv", cut_short)
    r = cli_here("experiments.reproduce_klotski", "only=[auto_n]", f"out={tmp_path / 'rk'}")
    one_line(r, "cannot write the results")
    assert (tmp_path / "rk" / "results.csv").read_text() == "table\nauto_n\n"
    assert sorted(p.name for p in (tmp_path / "rk").iterdir()) == ["results.csv"]


@pytest.mark.parametrize(
    "module, args",
    [
        ("experiments.routing_stats", ["out={new}/a/rs.json", "trace_dir={tmp}/none"]),
        ("experiments.prefetch_eval", ["out={new}/pe.csv", "trace_dir={tmp}/none"]),
        ("experiments.calibrate", ["out={new}/profile.txt"]),
        ("experiments.calibrate", ["out={tmp}/p.yaml", "disk_dir={new}/d", "disk_mb=99999999"]),
        ("experiments.convert_traces", ["src={tmp}/none", "out={new}/x.npz"]),
    ],
    ids=["routing_stats", "prefetch_eval", "calibrate out", "calibrate disk_dir", "convert"],
)
def test_a_refused_command_leaves_no_folder_its_output_check_made(
    tmp_path: Path, cli_here: Any, module: str, args: list[str]
) -> None:
    """The output checks make an output's folder before the long work (to know it can be
    written); a check or a read after them that failed left those folders, empty."""
    new = tmp_path / "new"
    r = cli_here(module, *(a.format(new=new, tmp=tmp_path) for a in args))
    one_line(r)
    assert not new.exists()


def test_a_users_workload_file_runs_and_a_planner_file_is_named_as_unsupported(
    tmp_path: Path, cli_here: Any
) -> None:
    """workload=FILE.yaml was refused as "not a name in conf/workload/ (a file is taken where
    it ends in .yaml)", which it did: now it runs, as model= and hardware= files do; a planner
    file (its params need their schema) is refused saying so."""
    wl = tmp_path / "wl.yaml"
    wl.write_text((ROOT / "conf" / "workload" / "tiny.yaml").read_text())
    args = [a for a in TINY if not a.startswith("workload=")]
    r = cli_here("experiments.run", *args, f"workload={wl}", f"hydra.run.dir={tmp_path}/r")
    assert r.returncode == 0 and (tmp_path / "r" / "summary.json").exists(), r.stderr
    wl.write_text("batch_size: 0\nn_batches: 1\nprompt_len: 1\ngen_len: 1\n")
    r = cli_here("experiments.run", *args, f"workload={wl}", f"hydra.run.dir={tmp_path}/s")
    one_line(r, "workload.batch_size")
    pl = tmp_path / "pl.yaml"
    pl.write_text("name: flexgen\n")
    args = [a for a in TINY if not a.startswith("planner=")]
    r = cli_here("experiments.run", *args, f"planner={pl}", f"hydra.run.dir={tmp_path}/t")
    one_line(r, f"planner={pl}", "takes names only")


@pytest.mark.parametrize("theirs", ["weights", "config only"])
def test_make_checkpoint_refuses_to_replace_a_checkpoint_it_did_not_write(
    tmp_path: Path, tiny_ckpt: Path, cli_here: Any, theirs: str
) -> None:
    """out= a downloaded model's folder deleted its config.json and model-*.safetensors and
    wrote random weights in their place; a checkpoint make_checkpoint wrote is still
    replaced (a second run into the same out=)."""
    out = tmp_path / "theirs"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "mixtral"}')
    if theirs == "weights":
        from safetensors.numpy import save_file

        save_file({"w": np.zeros(2, np.float32)}, str(out / "model.safetensors"))
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    r = cli_here("experiments.make_checkpoint", "model=tiny", f"out={out}")
    one_line(r, f"out={out}", "without make_checkpoint's mark")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    ours = copied(tiny_ckpt, tmp_path)  # written by write_checkpoint: marked
    r = cli_here("experiments.make_checkpoint", "model=tiny", f"out={ours}")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "module, arg, words",
    [
        ("experiments.routing_stats", "out={tmp}/config.yaml", ["written as JSON"]),
        ("experiments.prefetch_eval", "out={tmp}/table.json", ["written as CSV"]),
        ("experiments.calibrate", "out={tmp}/config.yaml", ["calibrate did not write"]),
    ],
)
def test_an_output_over_a_file_of_another_kind_is_refused(
    tmp_path: Path, cli_here: Any, module: str, arg: str, words: list[str]
) -> None:
    """routing_stats out=conf/config.yaml wrote its JSON over the project's config; calibrate
    out=FILE.yaml replaced any YAML file (the check of a profile it did not write covered
    hardware.name's default path only)."""
    for name in ("config.yaml", "table.json"):
        (tmp_path / name).write_text("mine: 1\n")
    r = cli_here(module, arg.format(tmp=tmp_path))
    one_line(r, *words)
    assert all((tmp_path / n).read_text() == "mine: 1\n" for n in ("config.yaml", "table.json"))


def test_trace_json_refuses_a_run_twice_or_another_runs_folder(
    tmp_path: Path, finished_run: Path, cli_here: Any
) -> None:
    """runs=[A,A] wrote A's processes twice into one file; out=B/trace.json wrote A's trace
    into run B's folder, where B's own trace.json belongs."""
    a = copied(finished_run, tmp_path)
    b = Path(shutil.copytree(a, tmp_path / "sweep" / "b"))
    r = cli_here("experiments.trace_json", f"runs=[{a},{a}]", f"out={tmp_path}/t.json")
    one_line(r, "given twice")
    r = cli_here("experiments.trace_json", f"runs=[{a}]", f"out={b}/trace.json")
    one_line(r, f"out={b}/trace.json", "another run")
    assert not (b / "trace.json").exists() and not (tmp_path / "t.json").exists()
