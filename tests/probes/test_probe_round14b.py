"""Probe round 14b (issue 48): the simulated and analysis commands (run, its sweeps, collect,
report, trace_json, convert_traces, routing_stats, prefetch_eval, replication_cv,
reproduce_klotski, bench.sim, bench.host). What this round found: a real executor's key
accepted without a word on a simulated run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, one_line, raises_one_line, tiny_run


@pytest.mark.parametrize("value", ["float16", "bfloat16", "bogus"])
def test_a_real_executors_dtype_on_a_simulated_run_is_refused(
    cli_here: Any, tmp_path: Path, value: str
) -> None:
    """`executor.dtype=float16` on a simulated run went on without a word (exit 0): the
    simulator reads model.dtype_bytes, never the real executor's compute dtype, while its
    siblings (device, routing_mode, rendezvous_timeout_s) were refused."""
    run = tmp_path / "r"
    r = cli_here("experiments.run", *TINY, f"executor.dtype={value}", f"hydra.run.dir={run}")
    one_line(r, "executor.dtype", "model.dtype_bytes", "executor=real")
    assert not (run / "summary.json").exists()


@pytest.mark.parametrize(
    ("module", "args", "names"),
    [
        ("experiments.trace_json", ["runs=[[RUN]]"], ["runs=", "not a value"]),
        ("experiments.trace_json", ["runs=[RUN,{a:1}]", "out=OUT.json"], ["runs=", "not a value"]),
        ("experiments.reproduce_klotski", ["only=[[table3]]", "out=OUT"], ["only=", "not a value"]),
        ("experiments.prefetch_eval", ["train=[[law]]"], ["train=", "not a value"]),
    ],
)
def test_a_list_or_mapping_inside_a_list_option_is_refused(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], names: list[str]
) -> None:
    """`trace_json runs=[[RUN]]` was an internal error (TypeError: expected str, not list),
    `reproduce_klotski only=[[table3]]` a name "['table3']": a nested item of a list option
    of names went in as a name."""
    args = [a.replace("RUN", str(tmp_path)).replace("OUT", str(tmp_path / "o")) for a in args]
    one_line(cli_here(module, *args), *names)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("value", ["[[law]]", "[law,[intent]]", "[{a: 1}]"])
@pytest.mark.parametrize("key", ["tasks", "exclude_tasks"])
def test_a_nested_task_of_a_trace_run_is_refused(key: str, value: str) -> None:
    """`workload.routing.tasks=[[law]]` on a run replaying the trace was an internal error
    (TypeError: unhashable type: 'list')."""
    from omegaconf import OmegaConf

    from core.spec import RoutingConfig

    tasks = OmegaConf.to_object(OmegaConf.create(f"v: {value}"))["v"]  # as hydra parses it
    raises_one_line(lambda: RoutingConfig(source="trace", **{key: tasks}), key, "task's name")


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.prefetch_eval", ["train=[law,null]"], "train[1]=null"),
        ("experiments.report", ["dir=DIR", "columns=[null]"], "columns[0]=null"),
        (
            "experiments.run",
            [*TINY, "model.moe_layers=[null]", "hydra.run.dir=DIR"],
            "moe_layers[0]",
        ),
        (
            "experiments.run",
            [*TINY, "workload.routing.tasks=[null]", "hydra.run.dir=DIR"],
            "tasks[0]",
        ),
    ],
)
def test_a_null_item_of_a_list_is_named_with_a_fix(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], key: str
) -> None:
    """`train=[null]` said "train=None: a mapping of  belongs there; set its fields, e.g.
    train.=VALUE": a list's null item read as a mapping of no fields."""
    args = [a.replace("DIR", str(tmp_path / "d")) for a in args]
    one_line(cli_here(module, *args), key, "takes no null", "drop it")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("hardware.memory_gb=[1]", ["a list where a mapping of gpu, cpu, disk", "memory_gb.gpu="]),
        ("hardware.links.h2d=[1,2]", ["mapping of gbps, latency_us", "links.h2d.gbps="]),
        ("workload.routing=[a]", ["workload.routing.source="]),
        ("hardware.gpu.overhead_us_by_kind=[1]", ["+hardware.gpu.overhead_us_by_kind.NAME="]),
        ("hardware.sources=[a]", ["a list where a mapping", "+hardware.sources.NAME="]),
    ],
)
def test_a_list_where_a_mapping_belongs_is_named_with_a_fix(
    cli_here: Any, tmp_path: Path, override: str, names: list[str]
) -> None:
    """`hardware.memory_gb=[1]` said "Cannot merge DictConfig with ListConfig", omegaconf's
    words, with nothing to do about it."""
    run = tmp_path / "r"
    one_line(cli_here("experiments.run", *TINY, override, f"hydra.run.dir={run}"), *names)
    assert not run.exists()


@pytest.mark.parametrize(
    ("arg", "shown"),
    [("quick=true", "quick=true"), ("jobs=1", "jobs=1"), ("only=[table3]", "only=[table3]")],
)
def test_reproduce_klotski_report_only_refuses_what_it_would_not_read(
    cli_here: Any, tmp_path: Path, arg: str, shown: str
) -> None:
    """`report_only=true only=[table3]` re-printed the whole report without a word: the runs'
    options (only, quick, jobs) are not read when nothing runs."""
    r = cli_here("experiments.reproduce_klotski", "report_only=true", f"out={tmp_path}", arg)
    one_line(r, shown, "report_only=true runs nothing", "results.csv")


@pytest.fixture(scope="module")
def broken_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep dir of one tiny run whose summary.json is a JSON list: no run to read."""
    run = tiny_run(tmp_path_factory.mktemp("s14b") / "sweep" / "0")
    (run / "summary.json").write_text("[1, 2]\n")
    return run.parent


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("experiments.replication_cv", ["no finished held-out ESFT runs", "skipped: "]),
        ("experiments.replication", ["no finished replication runs", "skipped: "]),
        ("experiments.collect", ["no finished run under"]),
    ],
)
def test_a_sweep_of_skipped_runs_fails_in_one_line(
    cli_here: Any, broken_sweep: Path, module: str, names: list[str]
) -> None:
    """replication_cv and replication printed a `skipped DIR: ...` line per unreadable run,
    then their error: two lines or more, where collect said it in one."""
    r = cli_here(module, f"dir={broken_sweep}")
    one_line(r, *names, "summary.json unreadable (a JSON list")


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: p.write_text("mine\n"), "is a file, not a folder"),
        (lambda p: p.symlink_to(p.parent / "gone"), "which does not exist"),
    ],
    ids=["file", "dangling-link"],
)
def test_a_file_where_a_run_folder_goes_is_named(tmp_path: Path, make: Any, words: str) -> None:
    """A file or a dangling link at one of reproduce_klotski's <out>/runs/<run> folders said
    "<run>: File exists; check the file and the disk" after the runs before it."""
    from experiments.common.run_dir import replace_run

    run = tmp_path / "runs" / "flexgen_0"
    run.parent.mkdir()
    make(run)
    raises_one_line(lambda: replace_run(run, {"x": 1}, lambda tmp: None), str(run), words)
    assert run.is_symlink() or run.read_text() == "mine\n"  # what was there, kept


@pytest.mark.parametrize(
    ("module", "args", "key"),
    [
        ("experiments.collect", ["dir=[a,b]"], "dir"),
        ("experiments.trace_json", ["runs=RUN", "out=[a]"], "out"),
        ("experiments.bench.host", ["device=[cpu]"], "device"),
        (
            "experiments.run",
            [*TINY, "workload.routing.source=[trace]", "hydra.run.dir=RUN"],
            "workload.routing.source",
        ),
        ("experiments.run", [*TINY, "model.name={a: 1}", "hydra.run.dir=RUN"], "model.name"),
    ],
)
def test_a_list_or_mapping_where_a_string_belongs_says_what_to_pass(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], key: str
) -> None:
    """`dir=[a,b]` said omegaconf's "Cannot convert 'list' to string: '['a', 'b']'"."""
    args = [a.replace("RUN", str(tmp_path / "r")) for a in args]
    line = one_line(cli_here(module, *args), f"{key}: a ", "where a string belongs", f"pass {key}=")
    assert "Cannot convert" not in line


def test_ops_past_the_ram_of_one_batch_name_no_n_batches(
    cli_here: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gen_len=5000000 n_batches=50 said "gen_len=5000000 x n_batches=1 ...; lower gen_len or
    n_batches": the n of the one batch checked first, not the user's, and a way out that is
    none (this machine's RAM set to 8 GB, below one batch's need)."""
    monkeypatch.setattr("experiments.common.pipeline._available_ram_bytes", lambda: 8 * 10**9)
    run = tmp_path / "r"
    more = ["workload.gen_len=5000000", "workload.n_batches=50", f"hydra.run.dir={run}"]
    line = one_line(cli_here("experiments.run", *TINY, *more), "x one batch", "lower gen_len")
    assert "n_batches" not in line and not run.exists()


@pytest.mark.parametrize("theirs", [b"my notes\n", b"PK\x03\x04-\x00 another.npy"])
def test_convert_traces_keeps_a_file_it_did_not_write_at_out(
    cli_here: Any, tmp_path: Path, theirs: bytes
) -> None:
    """convert_traces replaced whatever file was at out= (a user's notes, another npz) without
    a word, where routing_stats, prefetch_eval and collect refuse a file they did not write;
    the source is not even read first."""
    out = tmp_path / "mine.npz"
    out.write_bytes(theirs)
    r = cli_here("experiments.convert_traces", f"src={tmp_path / 'nowhere'}", f"out={out}")
    one_line(r, f"out={out}", "did not write (it would be lost)")
    assert out.read_bytes() == theirs


@pytest.fixture(scope="module")
def good_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep dir of one finished tiny run (tests write their outputs elsewhere)."""
    return tiny_run(tmp_path_factory.mktemp("s14b") / "sweep" / "0").parent


@pytest.mark.parametrize(
    ("module", "key"),
    [
        ("experiments.collect", "out"),
        ("experiments.report", "out"),
        ("experiments.replication", "dir"),
    ],
)
def test_a_users_results_parquet_is_not_replaced(
    cli_here: Any, good_sweep: Path, tmp_path: Path, module: str, key: str
) -> None:
    """A results.parquet of the user's in out= was replaced by collect, report and replication
    without a word; only results.csv was checked for being theirs."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "results.parquet").write_text("my notes\n")
    args = [f"dir={good_sweep}", f"out={folder}"] if key == "out" else [f"dir={folder}"]
    one_line(cli_here(module, *args), "results.parquet", "did not write (it would be lost)")
    assert (folder / "results.parquet").read_text() == "my notes\n"


@pytest.mark.parametrize(
    ("module", "args", "name"),
    [
        ("experiments.trace_json", ["runs=RUN"], "t.json"),
        ("experiments.prefetch_eval", ["test=[intent]"], "t.csv"),
        ("experiments.convert_traces", ["src=RUN"], "t.npz"),
    ],
)
def test_a_fifo_at_out_is_not_replaced(
    cli_here: Any, tmp_path: Path, module: str, args: list[str], name: str
) -> None:
    """A FIFO at out= (a reader of the user's on the other end) was replaced by a regular file
    and the command exited 0: the file's rename went over it."""
    import os
    import stat

    out = tmp_path / name
    os.mkfifo(out)
    args = [a.replace("RUN", str(tmp_path / "nowhere")) for a in args]
    one_line(cli_here(module, *args, f"out={out}"), f"out={out}", "a FIFO", "a file path")
    assert stat.S_ISFIFO(out.lstat().st_mode)


def test_an_output_through_a_link_replaces_the_file_it_names(
    cli_here: Any, good_sweep: Path, tmp_path: Path
) -> None:
    """out=LINK.json (a link to the user's trace.json elsewhere) put a new regular file where
    the link was and left the file it names as it was, exit 0: the output went somewhere the
    user does not look, and their link was gone."""
    target, link = tmp_path / "kept" / "trace.json", tmp_path / "link.json"
    run = good_sweep / "0"
    assert cli_here("experiments.trace_json", f"runs={run}", f"out={target}").returncode == 0
    target.write_text(target.read_text() + "\n" * 3)  # still its own, told apart
    link.symlink_to(target)
    assert cli_here("experiments.trace_json", f"runs={run}", f"out={link}").returncode == 0
    assert link.is_symlink() and not target.read_text().endswith("\n" * 3)


@pytest.mark.parametrize(
    ("param", "block"),
    [("window=8", "replication.planners.eplb.window (4)"), ("interval=3", "eplb.interval (2)")],
)
def test_a_planner_param_the_replication_block_sets_is_refused(
    cli_here: Any, tmp_path: Path, param: str, block: str
) -> None:
    """`planner.params.window=8` on a replication case ran with the block's window 4 (it wins
    in ep_inputs.prepare) while the run's config.yaml recorded 8, without a word. Every point
    of this sweep of one would fail on it: refused before it runs (round 16a)."""
    args = ["-m", "experiment=replication_esft_g8", "workload.batch_size=8"]
    args += ["workload.n_batches=2", "workload.prompt_len=8", "replication_row=eplb"]
    args += [f"planner.params.{param}", f"hydra.sweep.dir={tmp_path}", "hydra.launcher.n_jobs=1"]
    r = cli_here("experiments.run", *args)
    key = param.split("=")[0]
    one_line(r, f"planner.params.{key}: a replication run takes it from", block)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
