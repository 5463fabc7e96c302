"""`python -m experiments.run` end to end: the run directory, and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from core.trace import TRACE_COLUMNS
from experiments import run as run_module
from experiments import trace_json
from tests.conftest import ROOT, SHARED_TRACES, command_here, default_signals, overridden

TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.run",
            *overridden(run_dirs(tmp_path), *args),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def run_in(capsys, monkeypatch):
    """`run` in this process (tests.conftest.command_here): the same result, a second or two of
    start-up less per call."""

    def go(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
        argv = overridden(run_dirs(tmp_path), *args)  # a run dir in `args` replaces its own
        return command_here(run_module.main, argv, capsys, monkeypatch)

    return go


def test_run_writes_the_run_directory(tmp_path, run_in):
    """(In this process: the command as a user starts it writes its run dir in the probes, and
    fails in one line in test_bad_input_is_one_line_from_a_fresh_process.)"""
    r = run_in([*TINY, "planner=flexgen"], tmp_path)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run"
    for f in ("config.yaml", "summary.json", "trace.parquet"):
        assert (out / f).exists(), f
    assert not (out / "trace.json").exists()  # on demand: experiments.trace_json
    assert trace_json.main([f"runs={out}"]) == 0
    umask = os.umask(0)
    os.umask(umask)  # the summary, written atomically, is as readable as the other files
    assert (out / "summary.json").stat().st_mode & 0o777 == 0o666 & ~umask
    s = json.loads((out / "summary.json").read_text())
    for key in (
        "planner",
        "executor",
        "model",
        "hardware",
        "batch_size",
        "n_batches",
        "prompt_len",
        "gen_len",
        "tokens_generated",
        "makespan_s",
        "prefill_s",
        "decode_s",
        "throughput_tok_s",
        "busy_s",
        "gpu_bubble_s",
        "lower_bound_s",
        "efficiency",
        "bytes_moved",
        "peak_bytes",
        "ops",
    ):
        assert key in s, key
    assert s["tokens_generated"] == 2 * 2 * 3
    assert s["throughput_tok_s"] == pytest.approx(s["tokens_generated"] / s["makespan_s"])
    trace = pd.read_parquet(out / "trace.parquet")
    assert list(trace.columns) == TRACE_COLUMNS and len(trace) == s["ops"]
    chrome = json.loads((out / "trace.json").read_text())
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"sim"}
    threads = {e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == set(trace["stream"].astype(str))


def test_trace_json_names_a_folder_without_a_trace(tmp_path, capsys):
    """`experiments.trace_json` on a folder no run wrote: one line naming it, exit 2."""
    assert trace_json.main([f"runs={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path) in err and "trace.parquet" in err
    assert trace_json.main([f"runs=[{tmp_path},{tmp_path}/b]"]) == 2  # two runs, no out=
    assert "out=FILE" in capsys.readouterr().err


def test_trace_json_never_writes_over_a_runs_own_files(tmp_path, capsys, run_in):
    """out=RUN/trace.parquet replaced the run's trace with JSON (exit 0), and a later sweep
    reused that run: out is a FILE.json, and not a run's summary."""
    out = tmp_path / "run"
    assert run_in([*TINY, "planner=flexgen"], tmp_path).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for name, why in (("trace.parquet", "pass out=FILE.json"), ("summary.json", "own file")):
        assert trace_json.main([f"runs={out}", f"out={out / name}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and why in err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


def test_sweep_runs_every_planner(tmp_path, run_in):
    # one process (n_jobs=1): joblib's workers would each import the project again
    r = run_in(["-m", *TINY, "planner=sequential,flexgen", "hydra.launcher.n_jobs=1"], tmp_path)
    assert r.returncode == 0, r.stderr
    summaries = sorted((tmp_path / "sweep").rglob("summary.json"))
    assert {json.loads(p.read_text())["planner"] for p in summaries} == {"sequential", "flexgen"}


def test_bad_point_in_a_sweep_fails_alone(tmp_path, run_in):
    """A bad value in one sweep point is that run's one-line error; the other runs finish, and
    the sweep exits 2 naming the failed run. (In the test's process, one job at a time: the
    bad points of a sweep on joblib's worker processes are the probe
    tests/probes/test_probe_hf_config.py::test_one_bad_point_does_not_stop_a_sweep.)"""
    argv = ["-m", *TINY, "planner=flexgen", "workload.batch_size=1,-1,2", "hydra.launcher.n_jobs=1"]
    r = run_in(argv, tmp_path)
    assert r.returncode == 2
    assert len(list((tmp_path / "sweep").rglob("summary.json"))) == 2
    failed = list((tmp_path / "sweep").rglob("failed.txt"))
    assert len(failed) == 1 and "batch_size=-1: must be a positive integer" in failed[0].read_text()
    point = failed[0].parent.relative_to(tmp_path / "sweep")
    assert f"1 run(s) failed ({point};" in r.stderr


def test_an_experiments_own_choices_and_keys_pass_the_schema(tmp_path, run_in):
    """Every experiment's choices and keys compose under the run schema (--cfg job composes
    without running); a mistyped key under an experiment is one line naming the nearest. (The
    klotski_* ones compose and run in test_experiment_configs.py's default cases; these three
    run there in the slow suite only.)"""
    for name in ("compare", "fig10", "fig11"):
        r = run_in(
            [
                "--cfg",
                "job",
                f"experiment={name}",
                "workload.gen_len=2",
                "workload.batch_size=4",
                "executor.name=sim",
            ],
            tmp_path,
        )
        assert r.returncode == 0 and "planner:" in r.stdout, (name, r.stderr)
    r = run_in(["-m", "experiment=compare", "workload.batchsize=8"], tmp_path)
    assert r.returncode == 2
    assert "workload.batchsize: unknown key; did you mean 'batch_size'?" in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["planner=nope"], "planner=nope: no conf/planner/nope.yaml; valid: ep_static,"),
        (
            ["planner=flexgn"],
            "planner=flexgn: no conf/planner/flexgn.yaml; did you mean 'flexgen'?",
        ),
        (["-m", "model=tiny,mixtral-9x7b"], "model=mixtral-9x7b: no conf/model/mixtral-9x7b.yaml"),
        (["hardware.links.h2d.gbps=-1"], "links.h2d.gbps must be positive"),
        (["hardware.memory_gb.gpu=0"], "memory_gb.gpu must be a positive capacity"),
        (["model.top_k=9"], "top_k=9 exceeds n_experts=4"),
        (
            ["model.expert_ffn_size=10000000", "hardware.memory_gb.disk=1"],
            "does not fit in GPU + CPU + disk",
        ),
        (["workload.batch_size=0"], "workload.batch_size=0: must be a positive integer"),
        # a KV cache larger than GPU + CPU memory; a small machine rather than a long prompt,
        # whose routing alone took 13 GB before the check was reached
        (
            [
                "workload.prompt_len=40000",
                "hardware.memory_gb.gpu=0.09",
                "hardware.memory_gb.cpu=0.002",
            ],
            "KV cache",
        ),
        (["+planner.params.bogus=1"], "unknown param(s) bogus; valid: "),
        (["planner.params.sync=maybe"], "planner.params.sync=maybe: not a boolean"),
        (["workload.routing.source=bogus"], "workload.routing.source='bogus' unknown; valid:"),
        (["workload.routing.skew=abc"], "workload.routing.skew=abc: must be a number"),
        (["workload.seed=abc"], "workload.seed=abc: must be an integer"),
        (["workload.routing.tasks=abc"], "workload.routing.tasks: not a list; pass"),
        (["workload.seed=-1"], "workload.seed must be an integer in [0, 2**64)"),
        (["model.n_experts=0"], "model.n_experts=0: must be a positive integer"),
        (["model.n_heads=3"], "n_heads=3 is not a multiple of n_kv_heads=2"),
        (["model.activation=tanh"], "activation='tanh' unknown; valid: swiglu, relu"),
        (["hardware.memory_gb=5"], "hardware.memory_gb=5: a mapping of gpu, cpu, disk belongs"),
        (["hardware.links.h2d=16"], "hardware.links.h2d=16: a mapping of gbps, latency_us"),
        (
            ["hardware.gpu=null"],
            "hardware.gpu=null: takes a value, not null; pass hardware.gpu=VALUE",
        ),
        (["hardware.gpu.tflops=abc"], "hardware.gpu.tflops=abc: must be a number"),
        (
            ["hardware.gpu.overhed_us=50"],
            "hardware.gpu.overhed_us: unknown key; did you mean 'overhead_us'?",
        ),
        (
            ["planner.params.synk=true"],
            "planner.params.synk: unknown key; did you mean 'sync'? valid: sync",
        ),
        (["planner=fiddler", "planner.params.policy=x"], "policy='x' unknown; pass one of"),
        (["experiment=replication", "planner=ep_static"], "replication.case is not set: run one"),
        (["foo=bar"], "foo: unknown key; valid: checkpoint, executor, hardware, model, planner,"),
        (["workload.routing.skw=1"], "workload.routing.skw: unknown key; did you mean 'skew'?"),
        (["executor.routing_mode=live"], "choose executor=real, which has it"),
        # a sweep experiment without -m ran one default point; two swept together, one each
        (["experiment=fig10"], "experiment=fig10 is a sweep: add -m"),
        (["-m", "experiment=compare,fig10"], "own sweep runs only when it is chosen alone"),
        # under an experiment too (hydra printed its screen): its group choices and keys count
        (
            ["-m", "experiment=compare", "workload.batchsize=8"],
            "workload.batchsize: unknown key; did you mean 'batch_size'?",
        ),
    ],
)
def test_bad_input_is_one_clear_line(args, message, tmp_path, run_in):
    r = run_in(overridden([*TINY, "planner=flexgen"], *args), tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # a rejected run leaves no run dir


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.top_k=9"], "top_k=9 exceeds n_experts=4"),  # from the task
        (["foo=bar"], "foo: unknown key; valid: checkpoint,"),  # from hydra's composition
    ],
)
def test_bad_input_is_one_line_from_a_fresh_process(args, message, tmp_path):
    """As `test_bad_input_is_one_clear_line` (which runs the command in this process), through
    `python -m`: nothing else reaches stderr (a warning, a logging handler's line)."""
    r = run(overridden([*TINY, "planner=flexgen"], *args), tmp_path)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


def run_dirs(tmp_path: Path) -> list[str]:
    return [f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={tmp_path}/sweep"]


@pytest.mark.skipif(not SHARED_TRACES.exists(), reason="needs ../shared/traces")
def test_missing_trace_file_is_named(tmp_path, run_in):
    r = run_in(
        [
            "model=deepseek-v2-lite",
            "hardware=h200",
            "workload=tiny",
            "planner=flexgen",
            f"workload.routing.trace_dir={tmp_path}/nowhere",
        ],
        tmp_path,
    )
    assert r.returncode == 2
    assert "nowhere" in r.stderr and "esft_routing.npz" in r.stderr and "Traceback" not in r.stderr


def test_routing_of_the_wrong_shape_is_rejected(tmp_path, run_in):
    r = run_in([*TINY, "planner=flexgen", "workload.routing.source=trace"], tmp_path)
    assert r.returncode == 2
    assert "(26" in r.stderr and "tiny" in r.stderr, r.stderr


def test_model_from_a_hugging_face_config(tmp_path, run_in):
    """A user points at a local checkpoint directory; the spec comes from its config.json."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 256,
                "torch_dtype": "bfloat16",
            }
        )
    )
    r = run_in(
        ["hardware=tiny", "workload=tiny", "planner=flexgen", f"+model.hf_config={ckpt}"], tmp_path
    )
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["model"] == "ckpt"  # named after the checkpoint directory
    assert s["ops"] < 200  # the checkpoint's 2 layers, not the default model's 32


def test_unknown_hf_model_type_is_named(tmp_path, run_in):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    r = run_in([*TINY, "planner=flexgen", f"+model.hf_config={tmp_path}"], tmp_path)
    assert r.returncode == 2
    assert "model_type 'llama' is not supported" in r.stderr


def test_unwritable_run_dir_is_one_line(tmp_path, run_in):
    (tmp_path / "afile").write_text("")
    r = run_in([*TINY, f"hydra.run.dir={tmp_path / 'afile' / 'run'}"], tmp_path)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: hydra.run.dir=") and "is a file, not a folder" in lines[0]


def test_ctrl_c_is_one_line_and_exit_130(capsys):
    """Ctrl-C in a command: one line saying what the command set (`on_interrupt`: that the
    finished runs are kept, for a sweep), exit status 130."""
    from experiments.common.cli import on_interrupt, until_interrupted

    def interrupted() -> None:
        raise KeyboardInterrupt

    on_interrupt("finished runs are kept; run the same command again to resume")
    with pytest.raises(SystemExit) as e:
        until_interrupted(interrupted)
    assert e.value.code == 130
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted: finished runs are kept")
    assert until_interrupted(lambda: 7) == 7


def test_slurm_launcher_without_its_plugin_says_what_to_install():
    import importlib.util
    import shutil

    from experiments.common.cli import missing_launcher

    have = importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    line = missing_launcher(["-m", "hydra/launcher=slurm"])
    if not have:
        assert "pip install hydra-submitit-launcher" in line
    else:  # with its plugin, a machine without slurm is said in its own line
        assert (line is None) if shutil.which("srun") else "no srun on PATH" in line
    assert missing_launcher(["hydra/launcher=joblib"]) is None


def test_replication_override_of_a_missing_key_is_one_line(tmp_path, cli_here):
    """experiments.replication: a misspelt key (hydra: a screen of text, exit 1) is one line
    naming the nearest key there, exit 2; a folder with no runs is one line too."""
    for args, message in (
        (["dirr=x"], "dirr: unknown key; did you mean 'dir'?"),
        ([f"dir={tmp_path}/none"], "no such folder; run the cases first"),
        ([f"dir={tmp_path}"], "no finished replication runs"),
    ):
        r = cli_here("experiments.replication", *args)
        err = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(err) == 1 and message in err[0], r.stderr


def test_run_dirs_and_tables_name_the_model_a_run_runs(tmp_path, monkeypatch):
    """A real run takes its shapes from checkpoint=, and model.hf_config names its own model:
    the run dir (hydra's `${run_model:}`) and collect's model.name say so, not model='s group
    (before, a real run of a tiny checkpoint was filed and reported as mixtral-8x7b)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    import experiments.common.resolve  # noqa: F401  registers ${run_model:}
    from experiments.common.tables import read_run

    ckpt = tmp_path / "my-ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for overrides, name in [
            (["executor=real", f"checkpoint={ckpt}/"], "my-ckpt"),
            ([f"checkpoint={ckpt}"], "mixtral-8x7b"),  # a sim run does not read it
            ([f"+model.hf_config={ckpt / 'config.json'}"], "my-ckpt"),
            ([], "mixtral-8x7b"),
            # a missing folder names itself (it named its parent); the run then fails on it
            (["executor=real", f"checkpoint={tmp_path / 'no-such'}/"], "no-such"),
        ]:
            cfg = compose("config", overrides, return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)  # a run sets it (the group choices)
            assert cfg.hydra.run.dir.endswith(f"_{name}_flexgen"), overrides
            assert cfg.hydra.sweep.subdir.startswith(f"{name}_rtx3090-env1_flexgen_bs16_n15_"), (
                overrides
            )
        monkeypatch.chdir(ckpt)  # checkpoint=. names the folder it is (it fell back to model=)
        cfg = compose("config", ["executor=real", "checkpoint=."], return_hydra_config=True)
        assert cfg.hydra.run.dir.endswith("_my-ckpt_flexgen")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model:\n  name: mixtral-8x7b\n")
    (run_dir / "summary.json").write_text(
        json.dumps(
            {"planner": "p", "model": "my-ckpt", "makespan_s": 1, "throughput_tok_s": 1}
            | {"routing_fields": {"source": "synthetic"}}  # (the routing it ran, as data)
        )
    )
    row, _ = read_run(run_dir)
    assert row is not None and row["model.name"] == "my-ckpt"


@pytest.mark.slow  # end to end, run by .ci/run after the README's command
def test_an_interrupted_sweep_says_how_to_resume_and_resumes(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) in a `-m` sweep under the
    default timestamped folder: one line naming the folder and the `hydra.sweep.dir=` that
    resumes it (it said "run the same command again", which starts a new folder and reuses
    nothing); that command reuses the finished runs and runs the rest."""
    import signal
    import time

    planners = "sequential,layer_prefetch,flexgen,zero_inference,fiddler,moe_infinity,klotski"
    cmd = [sys.executable, "-m", "experiments.run", "-m", *TINY, f"planner={planners}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    # Ctrl-C's default action, as a terminal's foreground job has it: a test run started in the
    # background by a non-interactive shell inherits SIGINT ignored, and the sweep would not stop
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_signals,
    )
    deadline = time.time() + 120
    while not list(tmp_path.glob("multirun/*/*/*/*/summary.json")) and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the sweep ended before it could be interrupted"
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    (sweep,) = {p.parents[2].resolve() for p in tmp_path.glob("multirun/*/*/*/*/summary.json")}
    last = err.strip().splitlines()[-1]
    assert last == (
        f"interrupted: finished runs are kept in {sweep}; to resume, run the same "
        f"command with hydra.sweep.dir={sweep}"
    )
    done = len(list(sweep.rglob("summary.json")))
    r = subprocess.run(
        [*cmd, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (r.stdout + r.stderr).count("already finished") >= done >= 1
    assert len(list(sweep.rglob("summary.json"))) == 7


def test_ctrl_c_s_line_comes_after_what_the_pool_s_resource_tracker_says():
    """joblib's resource tracker (a process of its own, alive until the sweep's process ends)
    warns of a semaphore the interrupted pool left registered; it said so after the line that
    says how to resume (the last line in 1 of 15 interrupted sweeps). Here the leak is made on
    purpose, so the tracker always warns: before the line."""
    code = (
        "from joblib.externals.loky.backend import resource_tracker\n"
        "from experiments.common.cli import until_interrupted\n"
        "resource_tracker.register('/moepipe-test-leak', 'semlock')\n"
        "def main():\n"
        "    raise KeyboardInterrupt\n"
        "until_interrupted(main)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 130, r.stderr
    assert "leaked semlock" in r.stderr  # the tracker did speak
    assert r.stderr.strip().splitlines()[-1].startswith("interrupted: "), r.stderr


@pytest.mark.slow  # two sweeps end to end, 5 s; test_sweep's folder cases stay in the default
def test_a_sweep_point_keeps_its_folder_in_any_order_of_the_values(tmp_path, cli_here):
    """The same points swept in another order reuse their runs (the folders were numbered by
    job: `16,8` after `8,16` swapped them, each ran again and replaced the other's)."""
    args = [*TINY, "planner=flexgen", f"hydra.sweep.dir={tmp_path}/sw", "hydra.launcher.n_jobs=1"]
    first = cli_here("experiments.run", "-m", *args, "workload.prompt_len=8,16")
    assert first.returncode == 0, first.stderr[-2000:]
    again = cli_here("experiments.run", "-m", *args, "workload.prompt_len=16,8")
    assert again.returncode == 0 and "2 already finished, reused" in again.stderr
    assert "another config" not in again.stdout + again.stderr
    assert len(list((tmp_path / "sw").rglob("summary.json"))) == 2


def test_run_dir_names_stay_folder_names():
    """A point's folder from its overrides: as they are when short; a path value (a `/` would
    nest folders) or a name over the file system's limit is cut and ends in a hash of the whole,
    so two long names that share their start stay apart."""
    from experiments.common.resolve import RUN_DIR_CHARS, run_dir_name

    assert (
        run_dir_name("workload.prompt_len=8,workload=tiny") == "workload.prompt_len=8,workload=tiny"
    )
    assert "/" not in run_dir_name("workload.routing.trace_dir=/tmp/t")
    long = ",".join(f"planner.params.p{i}={i}" for i in range(30))
    a, b = run_dir_name(long), run_dir_name(long + "1")
    assert len(a) == len(b) == RUN_DIR_CHARS and a != b


def test_hydra_mode_is_read_without_composing_only_where_nothing_sets_it(tmp_path, run_in):
    """`mode_unset` skips hydra's composition for `hydra.mode` only where no override and no
    config file could set it; `hydra.mode=MULTIRUN` still makes a plain run a sweep."""
    from hydra._internal.hydra import Hydra

    from experiments.common.hydra_errors import CONF_DIR
    from experiments.common.hydra_hooks import mode_unset

    composed = Hydra.get_mode
    with mode_unset(["model=tiny"], [CONF_DIR]):  # "model" is no mode
        assert Hydra.get_mode is not composed
        assert Hydra.get_mode(None, "config", []) is None  # type: ignore[arg-type]
    assert Hydra.get_mode is composed
    for other in (["hydra.mode=MULTIRUN"], ["-cd", "elsewhere"], ["hydra.searchpath=[x]"]):
        with mode_unset(other, [CONF_DIR]):
            assert Hydra.get_mode is composed
    (tmp_path / "mine.yaml").write_text("# @package _global_\nhydra:\n  mode: MULTIRUN\n")
    with mode_unset([], [CONF_DIR, tmp_path]):
        assert Hydra.get_mode is composed
    r = run_in(
        [*TINY, "planner=flexgen", "hydra.mode=MULTIRUN", "hydra.launcher.n_jobs=1"], tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "sweep").rglob("summary.json"))) == 1
    assert not (tmp_path / "run" / "summary.json").exists()
