"""Probe class: input that was accepted without a word. Non-finite activations or logits fail
naming the layer; a routing npz that repeats an expert in one token's top-k is refused; a
summary.json with a metric that is not a finite number is refused by collect and report,
naming the file and key; calibrate's profile name cannot leave conf/hardware; a real run past
config.json's max_position_embeddings warns once."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from core.errors import MoepipeError
from core.spec import Workload
from core.traces import N_EXPERTS, N_LAYERS, TOP_K, TRACE_FILE, TRACE_NAME, load_esft
from experiments import calibrate
from experiments.common.pipeline import RunSpec
from experiments.common.tables import collect
from real.checkpoint import SINGLE_FILE, load_checkpoint
from tests.conftest import NEEDS_TRACES, hardware_from_conf
from tests.probes.conftest import (
    ROOT,
    TINY,
    cli,
    one_line,
    raises_one_line,
    real_args,
    tiny_run,
    trace_args,
)

# ---- non-finite activations -----------------------------------------------------------------


@pytest.mark.parametrize(
    "tensor, value, layer",
    [
        ("model.layers.1.block_sparse_moe.experts.{e}.w2.weight", math.nan, "layer 1 (MoE)"),
        ("model.layers.0.self_attn.o_proj.weight", math.inf, "layer 0 (attention)"),
        ("lm_head.weight", math.nan, "LM head"),
    ],
    ids=["nan expert", "inf attention", "nan head"],
)
def test_non_finite_activations_fail_naming_the_layer(
    tiny_ckpt: Path, tmp_path: Path, tensor: str, value: float, layer: str
) -> None:
    from experiments.common.real_run import real_execute  # torch's model, only here

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck, ignore=shutil.ignore_patterns("offload"))
    weights = load_file(str(ck / SINGLE_FILE))
    for e in range(8) if "{e}" in tensor else [0]:  # every expert: whichever is routed to
        name = tensor.format(e=e)
        if name in weights:
            weights[name][0, 0] = value
    save_file(weights, str(ck / SINGLE_FILE), metadata={"format": "pt"})
    spec, _ = load_checkpoint(ck)
    wl = Workload(batch_size=2, n_batches=1, prompt_len=4, gen_len=2)
    run = RunSpec(spec, hardware_from_conf("tiny"), wl, "sequential", executor="real")
    with pytest.raises(MoepipeError, match="non-finite") as info:
        real_execute(ck, run, device="cpu")
    assert layer in str(info.value) and "\n" not in str(info.value)


# ---- routing npz --------------------------------------------------------------------------


def _npz(folder: Path, ids: np.ndarray) -> Path:
    t = ids.shape[0]
    (folder / TRACE_NAME).mkdir(parents=True, exist_ok=True)
    np.savez(
        folder / TRACE_NAME / TRACE_FILE,
        expert_ids=ids,
        gate_weights=np.full(ids.shape, 1 / TOP_K, np.float32),
        task=np.zeros(t, np.uint8),
        seq_id=np.zeros(t, np.int32),
        pos=np.arange(t, dtype=np.int32),
        task_names=np.array(["intent"]),
    )
    return folder


def test_routing_npz_repeating_an_expert_is_refused(tmp_path: Path, cli_here: Any) -> None:
    rng = np.random.default_rng(0)
    ids = np.stack(
        [np.stack([rng.permutation(N_EXPERTS)[:TOP_K] for _ in range(N_LAYERS)]) for _ in range(40)]
    ).astype(np.uint8)  # [T, L, k], distinct per token
    assert load_esft(_npz(tmp_path / "good", ids)).n_tokens == 40
    ids[17, 3, 4] = ids[17, 3, 1]
    raises_one_line(
        lambda: load_esft(_npz(tmp_path / "bad", ids)),
        TRACE_FILE,
        "token 17",
        "MoE layer 4",
        "repeats an expert",
    )
    # as a user runs it: a simulation that replays this trace
    r = cli_here("experiments.run", *trace_args(tmp_path / "bad", tmp_path / "run"))
    one_line(r, TRACE_FILE, "repeats an expert")
    assert not (tmp_path / "run" / "summary.json").exists()


# ---- summaries -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep folder of one finished tiny run (one subprocess for the module)."""
    root = tmp_path_factory.mktemp("sweep")
    tiny_run(root / "good")
    return root


BAD_METRICS = [
    ("throughput_tok_s", "fast"),
    ("throughput_tok_s", math.nan),
    ("makespan_s", math.inf),
    ("efficiency", None),
    ("gpu_bubble_s", [1.0]),
    ("ops", True),
    ("busy_s", "everything"),
    ("busy_s.gpu", "1.5"),
    ("peak_bytes.gpu", -math.inf),
    ("gpu_idle_causes_s.load expert@h2d", math.nan),
    ("throughput_tok_s", -5.0),
    ("busy_s.h2d", -1e-3),
    ("makespan_s", -1),
    # an int past a float's range (an OverflowError inside), a float past any run's (a figure's
    # axis overflowed: an internal error in report), a name that is not a string
    ("ops", 10**400),
    ("throughput_tok_s", 1.7e308),
    ("bytes_moved.h2d", 1e40),
    ("model", 5),
    ("planner", {"x": 1}),
    ("planner_label", [1]),
    # per-layer metrics report draws: a ValueError inside it (float('a'), int('x'))
    ("plan.prefetch_accuracy_per_layer", ["a", "b"]),
    ("balancedness_per_layer", {"x": 0.5}),
    ("expert_phase_util_per_layer", {"0": "high"}),
]


@pytest.mark.parametrize("key, value", BAD_METRICS, ids=[f"{k}={v!r}"[:40] for k, v in BAD_METRICS])
def test_summary_with_a_bad_metric_is_refused(
    sweep: Path, tmp_path: Path, key: str, value: object
) -> None:
    mine = tmp_path / "sweep"
    shutil.copytree(sweep, mine)
    shutil.copytree(mine / "good", mine / "bad")
    path = mine / "bad" / "summary.json"
    s = json.loads(path.read_text())
    group, _, name = key.partition(".")
    if name:
        s[group][name] = value
    else:
        s[key] = value
    path.write_text(json.dumps(s))  # NaN and Infinity as Python's json writes them
    line = raises_one_line(lambda: collect(mine), str(path), key.partition(".")[0])
    assert "not" in line


@pytest.mark.parametrize("text", ["- a\n- b\n", "", "null\n", "5\n"])
def test_a_config_yaml_that_is_not_a_mapping_is_skipped(
    sweep: Path, tmp_path: Path, text: str
) -> None:
    """A run dir whose config.yaml is a list or empty was a run with no config columns (and
    report failed on it with an internal error)."""
    mine = tmp_path / "sweep"
    shutil.copytree(sweep, mine)
    shutil.copytree(mine / "good", mine / "bad")
    (mine / "bad" / "config.yaml").write_text(text)
    df, problems = collect(mine)
    assert len(df) == 1 and any("not a mapping" in p for p in problems), problems


def test_report_takes_runs_whose_configs_have_other_keys(
    sweep: Path, tmp_path: Path, cli_here: Any
) -> None:
    """A run of other code lacks a config key the others have (NaN in its column): report's
    ranking joined the point's values as strings and failed with an internal error."""
    mine = tmp_path / "sweep"
    shutil.copytree(sweep, mine)
    shutil.copytree(mine / "good", mine / "old")
    (mine / "old" / "config.yaml").write_text("planner: {name: flexgen}\n")
    r = cli_here("experiments.report", f"dir={mine}")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (mine / "report" / "index.html").is_file()


def test_collect_and_report_refuse_a_bad_summary_as_users_run_them(
    sweep: Path, tmp_path: Path, cli_here: Any
) -> None:
    mine = tmp_path / "sweep"
    shutil.copytree(sweep, mine)
    shutil.copytree(mine / "good", mine / "bad")
    path = mine / "bad" / "summary.json"
    path.write_text(
        path.read_text().replace('"throughput_tok_s": ', '"throughput_tok_s": "x", "_": ')
    )
    for module in ("experiments.collect", "experiments.report"):
        r = cli_here(module, f"dir={mine}")
        one_line(r, str(path), "throughput_tok_s")
    assert not (mine / "results.csv").exists() and not (mine / "report").exists()


# ---- calibrate -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../x", "a/b", "/tmp/abs", ".hidden", "", "x y", "..", "a\\b"])
def test_calibrate_profile_name_stays_in_conf_hardware(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted((ROOT / "conf").rglob("*"))
    assert calibrate.main([f"hardware.name={name}", f"disk_dir={tmp_path / 'd'}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: hardware.name="), err
    assert sorted((ROOT / "conf").rglob("*")) == before


def test_calibrate_keeps_a_profile_it_did_not_write(tmp_path: Path, cli_here: Any) -> None:
    """`hardware.name=tiny` named a shipped, hand-written profile: calibrate replaced it with
    this machine's numbers, and every test built on its round numbers changed. Refused before
    any measuring; a profile calibrate wrote (its first line says so) is re-measured."""
    before = (ROOT / "conf/hardware/tiny.yaml").read_bytes()
    r = cli_here("experiments.calibrate", "hardware.name=tiny", f"disk_dir={tmp_path}")
    one_line(r, "tiny.yaml", "out=")
    assert (ROOT / "conf/hardware/tiny.yaml").read_bytes() == before


@pytest.mark.parametrize(
    "fresh, module, args, names",
    [
        pytest.param(
            True, "experiments.prefetch_eval", ["test=[]"], ["test=[]"], marks=NEEDS_TRACES
        ),
        pytest.param(
            False, "experiments.prefetch_eval", ["train=[]"], ["train=[]"], marks=NEEDS_TRACES
        ),
        (False, "experiments.reproduce_klotski", ["only=[]"], ["only=[]"]),
        (
            True,
            "experiments.run",
            [*TINY, "checkpoint=/nonexistent"],
            ["checkpoint", "executor=real"],
        ),
        (False, "experiments.run", [*TINY, "executor.distributed=true"], ["executor.distributed"]),
    ],
    ids=["empty test tasks", "empty train tasks", "no tables", "checkpoint in sim", "dist in sim"],
)
def test_an_option_the_run_would_ignore_or_widen_is_refused(
    tmp_path: Path, fresh: bool, module: str, args: list[str], names: list[str], cli_here: Any
) -> None:
    """An empty task list selected every task, the other side's too (prefetch_eval then tested
    on its training tasks); `only=[]` ended in an internal error; a checkpoint or
    `executor.distributed` given to the simulator was ignored without a word. `fresh`: the case
    runs as a user runs it (a subprocess); the others in this process."""
    out = [f"out={tmp_path / 'o'}"] if "klotski" in module else []
    run = [f"hydra.run.dir={tmp_path / 'run'}"] if module == "experiments.run" else []
    one_line((cli if fresh else cli_here)(module, *args, *out, *run), *names)


# ---- names that name folders -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override, sweep",
    [
        ("model.name=x/../../escaped", False),
        ("hardware.name=../../escaped", True),
        ("model.name=a/b", True),
        ("hardware.name=", False),
    ],
)
def test_a_name_that_is_a_path_is_refused(
    tmp_path: Path, override: str, sweep: bool, cli_here: Any
) -> None:
    """model.name and hardware.name name a run's folder (`${run_model:}`, `${run_hardware:}`):
    one with a `/` or `..` put the run outside its folder, a sweep's point outside the sweep's.
    Refused in one line naming the key, before any folder is made."""
    where = f"hydra.sweep.dir={tmp_path / 'sw'}" if sweep else f"hydra.run.dir={tmp_path / 'r'}"
    before = set(tmp_path.parent.iterdir())
    r = cli_here("experiments.run", *(["-m"] if sweep else []), *TINY, override, where)
    bar = f"sweep {tmp_path / 'sw'}:"  # a sweep's progress bar, drawn before the points resolve
    r.stderr = "\n".join(ln for ln in r.stderr.splitlines() if not ln.startswith(bar))
    one_line(r, override.split("=")[0], "letters, digits")
    assert not any(tmp_path.iterdir()) and set(tmp_path.parent.iterdir()) == before


@pytest.mark.parametrize("planner", ["flexgen", "klotski"])
def test_gpus_for_a_planner_of_one_gpu_are_refused(
    tmp_path: Path, cli_here: Any, planner: str
) -> None:
    """`hardware.n_gpus=4` with an offloading planner ran on one GPU, as if it was not given
    (only the expert-parallel planners read it)."""
    args = [*TINY[:3], f"planner={planner}", "hardware.n_gpus=4", f"hydra.run.dir={tmp_path}/r"]
    one_line(cli_here("experiments.run", *args), "hardware.n_gpus", "ep_static", planner)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "model, override, reads",
    [
        ("tiny", "workload.routing.tasks=[law]", "ESFT trace's"),
        ("tiny", "workload.routing.exclude_tasks=[law]", "ESFT trace's"),
        ("tiny", "workload.routing.trace_dir=/nonexistent", "ESFT trace's"),
        ("deepseek-v2-lite", "workload.routing.skew=5", "synthetic generator's"),
    ],
)
def test_a_routing_knob_the_runs_routing_does_not_read_is_refused(
    tmp_path: Path, cli_here: Any, model: str, override: str, reads: str
) -> None:
    """The trace's tasks on a run of synthetic routing, the generator's skew on one that replays
    the trace: each ran as if it was not given (exit 0, the default's results)."""
    args = [f"model={model}", "hardware=tiny", "workload=tiny", "planner=flexgen", override]
    r = cli_here("experiments.run", *args, f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, override.split("=")[0], reads, "workload.routing.source")
    assert not (tmp_path / "r").exists()


def test_a_rendezvous_timeout_on_a_simulated_run_is_refused(tmp_path: Path, cli_here: Any) -> None:
    """The schema gives every executor the distributed runs' rendezvous timeout (a default),
    so `executor.rendezvous_timeout_s=5` on a simulated run went on without a word."""
    args = [*TINY, "executor.rendezvous_timeout_s=5", f"hydra.run.dir={tmp_path / 'r'}"]
    one_line(cli_here("experiments.run", *args), "executor.rendezvous_timeout_s", "executor=real")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "module, args, names",
    [
        ("experiments.bench.host", ["unit_mb=1e-300"], ["unit_mb=1e-300", "must be >="]),
        ("experiments.validate", ["cpu_frac=1e300"], ["cpu_frac=", "(0, 64]", "share"]),
        ("experiments.validate", ["planners=[flexgen,flexgen]"], ["flexgen given twice"]),
        ("experiments.validate_lanes", ["lanes=9"], ["lanes=9", "experts", "lanes=2 to 8"]),
        ("experiments.validate_lanes", ["planners=[]"], ["planners=[]", "ep_static"]),
        ("experiments.reproduce_klotski", ["only=[table3,table3]"], ["table3 given twice"]),
        ("experiments.replication", ["cases=[bogus]"], ["cases=[bogus]", "esft-g8"]),
        ("experiments.replication", ["cases=[]"], ["cases=[]", "esft-g8"]),
        ("experiments.replication", ["variants=[bogus]"], ["variants=", "eplb[interval=8]"]),
        ("experiments.replication", ["judged_variants=[bogus]"], ["judged_variants=", "bogus"]),
    ],
)
def test_a_value_out_of_range_or_a_bad_list_is_refused(
    tmp_path: Path, cli_here: Any, tiny_ckpt: Path, module: str, args: list[str], names: list[str]
) -> None:
    """Each was an internal ZeroDivisionError, accepted (a fraction of 1e300, an empty list
    writing an empty table, a table run twice, unknown cases ignored with exit 0), or named the
    planner's n_devices rather than the user's lanes= and left an empty out dir."""
    extra = {
        "experiments.validate": [f"checkpoint={tiny_ckpt}", f"out={tmp_path / 'v'}"],
        "experiments.validate_lanes": [f"checkpoint={tiny_ckpt}", f"out={tmp_path / 'v'}"],
        "experiments.reproduce_klotski": ["quick=true", f"out={tmp_path / 'v'}"],
        "experiments.replication": [f"dir={tmp_path}", f"out={tmp_path / 'v'}"],
    }.get(module, [])
    r = cli_here(module, *args, *extra)
    one_line(r, *names)
    assert not (tmp_path / "v").exists()


# ---- context length -----------------------------------------------------------------------


def test_a_real_run_past_max_position_embeddings_warns_once(
    tiny_ckpt: Path, tmp_path: Path, cli_here: Any
) -> None:
    """prompt_len 5000 on a max_position_embeddings 4096 checkpoint ran without a word. It is
    no error (transformers runs it too): one warning naming both numbers. Here 8 positions
    allowed, 6 prompt + 4 generated tokens feed 9."""
    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck, ignore=shutil.ignore_patterns("offload"))
    cfg = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 8}))
    sizes = ["workload.batch_size=2", "workload.n_batches=1", "workload.gen_len=4"]

    def real_run(ck: Path, run: Path, *more: str) -> Any:  # in this process: a second less
        return cli_here("experiments.run", *real_args(ck, run, *more))

    r = real_run(ck, tmp_path / "run", *sizes, "workload.prompt_len=6")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if "max_position_embeddings" in ln]
    assert len(lines) == 1, out
    assert "max_position_embeddings=8" in lines[0] and "9 positions" in lines[0], lines[0]
    r = real_run(ck, tmp_path / "fits", *sizes, "workload.prompt_len=5")
    assert r.returncode == 0, r.stderr
    assert "max_position_embeddings" not in r.stdout + r.stderr


@pytest.mark.parametrize(
    "args, names",
    [
        (["+hydra.launcher.foo=1"], ["hydra.launcher.foo: unknown key", "JoblibLauncher"]),
        (["++hydra.launcher.n_job=1"], ["hydra.launcher.n_job", "did you mean 'n_jobs'"]),
        (["+hydra.sweeper.foo=1"], ["hydra.sweeper.foo: unknown key", "BasicSweeper"]),
        (["hydra/launcher=basic", "+hydra.launcher.n_jobs=2"], ["hydra.launcher.n_jobs"]),
        (["hydra/launcher=submitit_local", "+hydra.launcher.timeout_mn=3"], ["timeout_min"]),
        (["+hydra.job_logging.foo=1"], ["hydra.job_logging.foo: unknown key", "handlers"]),
    ],
)
def test_a_key_hydras_launcher_or_sweeper_lacks_is_refused(
    tmp_path: Path, cli_here: Any, args: list[str], names: list[str]
) -> None:
    """hydra's schema types its launcher and sweeper `Any`: a key added to them was taken, and
    read by nothing (the basic launcher's n_jobs either); so was one of a logging config."""
    r = cli_here("experiments.run", *TINY, *args, f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, *names)
    assert not (tmp_path / "r").exists()


def test_keys_hydra_and_its_launchers_have_are_taken(tmp_path: Path, cli_here: Any) -> None:
    """The keys hydra and the chosen launcher define, and one under a free mapping of hydra's."""
    for args in (
        ["hydra.launcher.n_jobs=1", "hydra.job.chdir=false", "+hydra.job.env_set.MOEPIPE_X=1"],
        ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=3"],
        ["+hydra.job_logging.incremental=false"],
    ):
        r = cli_here("experiments.run", *TINY, *args, f"hydra.run.dir={tmp_path / 'r'}")
        assert r.returncode == 0, (args, r.stderr)
