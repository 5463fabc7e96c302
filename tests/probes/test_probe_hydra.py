"""Probe class: hydra's and omegaconf's errors (a missing interpolation, bad YAML in a user's
config folder, an override's syntax, a mandatory value left unset) are one line naming the key,
file or override, alone; in a sweep the bad point's line goes to its failed.txt."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import overridden
from tests.probes.conftest import ROOT, TINY, cli, one_line


@pytest.mark.parametrize(
    "fresh, args, names",
    [
        (True, ["workload.batch_size=${nosuch.key}"], ["workload.batch_size", "nosuch.key"]),
        (False, ["workload.batch_size=[1"], ["workload.batch_size=[1", "override"]),
        (False, ["workload.batch_size=???"], ["workload.batch_size"]),
        (False, ["workload.gen_len=${oops:1}"], ["workload.gen_len", "oops"]),
    ],
    ids=["missing interpolation", "override syntax", "mandatory unset", "unknown resolver"],
)
def test_bad_override_is_one_line(
    tmp_path: Path, fresh: bool, args: list[str], names: list[str], cli_here: Any
) -> None:
    """`fresh`: the case runs as a user runs it (a subprocess); the others in this process."""
    run = cli if fresh else cli_here
    where = [f"hydra.{kind}.dir={tmp_path / 'run'}" for kind in ("run", "sweep")]
    r = run("experiments.run", *TINY, *args, *where)
    one_line(r, *names)
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    "fresh, text, names",
    [
        (True, "name: mine\n  batch_size: [1\n", ["mine.yaml:2", "not valid YAML"]),
        (False, "batch_size: 2\nbatch_size: 3\n", ["mine.yaml"]),
        (
            False,
            "batch_size: ${nosuch.key}\nn_batches: 2\nprompt_len: 8\ngen_len: 3\n",
            ["batch_size", "nosuch.key"],
        ),
        (False, "- 1\n- 2\n", ["workload", "not a mapping"]),
    ],
    ids=["bad YAML", "duplicate key", "interpolation in the file", "a list"],
)
def test_bad_yaml_in_a_users_config_dir_is_one_line(
    tmp_path: Path, fresh: bool, text: str, names: list[str], cli_here: Any
) -> None:
    """`fresh`: the case runs as a user runs it (a subprocess); the others in this process."""
    (tmp_path / "conf" / "workload").mkdir(parents=True)
    (tmp_path / "conf" / "workload" / "mine.yaml").write_text(text)
    run = cli if fresh else cli_here
    r = run(
        "experiments.run",
        *overridden(TINY, "workload=mine"),
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_line(r, *names)
    assert not (tmp_path / "run" / "summary.json").exists()


def test_bad_point_of_a_sweep_goes_to_failed_txt(tmp_path: Path, cli_here: Any) -> None:
    """A sweep (the basic launcher: one process) over a good value and an interpolation that
    does not resolve: the good point finishes, the bad one leaves one line in failed.txt."""
    sweep = tmp_path / "sweep"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "hydra/launcher=basic",
        "workload.prompt_len=8,${nosuch.key}",
        f"hydra.sweep.dir={sweep}",
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout, r.stderr
    failed = list(sweep.rglob("failed.txt"))
    assert len(failed) == 1 and "nosuch.key" in failed[0].read_text(), r.stderr
    assert failed[0].read_text().count("\n") == 1
    assert len(list(sweep.rglob("summary.json"))) == 1


@pytest.mark.parametrize(
    "fresh, args, names",
    [
        (True, ["--bogus-flag"], ["--bogus-flag", "unknown flag"]),
        (False, ["--out=x"], ["--out=x", "unknown flag"]),
        (True, ["trace_json=2"], ["trace_json=2", "not a boolean"]),
        (False, ["executor.distributed=5"], ["executor.distributed=5", "not a boolean"]),
        (False, ["-m", "skip_finished=true,3"], ["skip_finished=true,3", "not a boolean"]),
    ],
    ids=["unknown flag", "unknown flag with a value", "number as bool", "nested bool", "sweep"],
)
def test_an_unknown_flag_or_a_number_for_a_boolean_is_one_line(
    tmp_path: Path, fresh: bool, args: list[str], names: list[str], cli_here: Any
) -> None:
    """argparse would print its usage over 8 lines for a flag hydra does not know; omegaconf
    reads any number as true where the schema has a bool. `fresh`: the case runs as a user runs
    it (a subprocess); the others in this process."""
    run = cli if fresh else cli_here
    where = [f"hydra.{kind}.dir={tmp_path / 'run'}" for kind in ("run", "sweep")]
    r = run("experiments.run", *TINY, *args, *where)
    one_line(r, *names)
    assert not (tmp_path / "run").exists()


def _yaml_without(tmp_path: Path, group: str, name: str, key: str) -> Path:
    """conf/<group>/<name>.yaml copied to a file of the user's, `key` (a top-level key, or
    parent.child) left out."""
    import yaml

    d = yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())
    parent, _, child = key.rpartition(".")
    del (d[parent] if parent else d)[child]
    path = tmp_path / f"my-{name}.yaml"
    path.write_text(yaml.safe_dump(d))
    return path


@pytest.mark.parametrize(
    "group, name, key",
    [("hardware", "tiny", "memory_gb.disk"), ("model", "tiny", "top_k")],
)
def test_a_users_file_without_a_required_key_names_it(
    tmp_path: Path, cli_here: Any, group: str, name: str, key: str
) -> None:
    """A user's hardware or model file (group=FILE.yaml) that leaves out a required key: its
    key, 'required', where to set it; before, "could not convert string to float: '???'"."""
    path = _yaml_without(tmp_path, group, name, key)
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, f"{group}.{key}: required and not set", f"{group}.{key}=VALUE")
    assert not (tmp_path / "r").exists()


def test_a_users_model_file_runs_and_a_path_not_yaml_is_named(
    tmp_path: Path, cli_here: Any
) -> None:
    """model=FILE.yaml is read as hardware=FILE.yaml is; a path that is no .yaml (calibrate's
    out=x.txt, a typo) is named whole, not split into hydra's sub-groups."""
    mine = tmp_path / "mine.yaml"
    shutil.copyfile(ROOT / "conf" / "model" / "tiny.yaml", mine)
    args = [a for a in TINY if not a.startswith("model=")]
    r = cli_here("experiments.run", *args, f"model={mine}", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 0 and (tmp_path / "r" / "summary.json").exists(), r.stderr
    txt = tmp_path / "hw.txt"
    txt.write_text("name: x\n")
    r = cli_here("experiments.run", *TINY[:1], f"hardware={txt}", *TINY[2:])
    one_line(r, f"hardware={txt}: not a name in conf/hardware/", "hardware=FILE.yaml")


def test_a_key_twice_in_a_hardware_file_is_refused_by_every_reader(
    tmp_path: Path, cli_here: Any, tiny_ckpt: Path
) -> None:
    """run refused a hardware file with a key given twice (omegaconf); validate and bench.lanes,
    which read it with yaml, took the later value without a word."""
    text = (ROOT / "conf" / "hardware" / "tiny.yaml").read_text()
    dup = tmp_path / "dup.yaml"
    dup.write_text(text + "\nname: again\n")
    for module, args in (
        ("experiments.validate", [f"checkpoint={tiny_ckpt}", f"out={tmp_path / 'v'}"]),
        ("experiments.bench.lanes", ["model=tiny"]),
    ):
        r = cli_here(module, f"hardware={dup}", *args)
        one_line(r, str(dup), "duplicate key 'name'")
    assert not (tmp_path / "v").exists()
    r = cli_here("experiments.calibrate", f"out={tmp_path / 'p.txt'}")
    one_line(r, "out=", "pass out=FILE.yaml")


@pytest.mark.parametrize(
    "override, names",
    [
        ("+hardware.links.p2p={gbps:1}", ["hardware.links.p2p: an override cannot add"]),
        ("+hardware.links.p2p.gbps=1", ["hardware.links.p2p: an override cannot add"]),
        ("+hardware.gpu.time_tables.compute-attention=abc", ["[flops, seconds] pairs"]),
        ("+hardware.gpu.time_tables.nosuch=[[1,2]]", ["'nosuch' is not an op kind", "valid:"]),
        ("+hardware.processes.compute_scale_by_kind.x=2", ["'x' is not an op kind"]),
    ],
)
def test_a_hardware_table_override_of_the_wrong_shape_is_one_line(
    tmp_path: Path, cli_here: Any, override: str, names: list[str]
) -> None:
    """A link, time table or per-kind table given the wrong shape or an unknown op kind: one
    line saying what belongs there (before: "dict is not a subclass of LinkSchema. value: {}",
    "not enough values to unpack", an unknown key with no valid one)."""
    r = cli_here("experiments.run", *TINY, override, f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, *names)


def test_a_users_hardware_file_is_named_in_its_errors(tmp_path: Path, cli_here: Any) -> None:
    """Errors in a hardware=FILE.yaml named the temporary copy hydra read (gone by then)."""
    text = (ROOT / "conf" / "hardware" / "tiny.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text + "\nlinks: [1\n")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text(text.replace("h2d: {", "h2d: 16.8\n  old_h2d: {", 1))
    for path, words in ((bad, "not valid YAML"), (scalar, "where a mapping of gbps")):
        r = cli_here("experiments.run", *TINY[:1], f"hardware={path}", *TINY[2:])
        line = one_line(r, str(path), words)
        assert "moepipe-conf-" not in line


@pytest.mark.parametrize(
    "args, names",
    [
        (["--cfg", "bogus"], ["--cfg bogus", "job, hydra, all"]),
        (["--cfg"], ["--cfg: needs a value"]),
        (["--cfg", "job", "--package", "bogus.pkg"], ["--package bogus.pkg", "top level:"]),
        (["--shell-completion"], ["--shell-completion", "not supported"]),
        (["--experimental-rerun", "/nonexistent.pickle"], ["--experimental-rerun", "overrides"]),
        (["-m", "--cfg", "job", "workload.batch_size=1,2"], ["-m and --cfg", "only one"]),
        (["=5"], ["=5: an override needs a key"]),
        (["hardware=null"], ["hardware=null", "config group", "tiny"]),
        (["executor=null"], ["executor=null", "config group", "sim"]),
        (["-m", "hydra.launcher.n_jobs=0", "workload.batch_size=1,2"], ["n_jobs=0"]),
        (["-m", "hydra.launcher.n_jobs=1000", "workload.batch_size=1,2"], ["n_jobs=1000", "core"]),
        (["hydra.searchpath=[file:///nonexistent/conf]"], ["/nonexistent/conf is not a folder"]),
        (["hydra.searchpath=[pkg://moepipe_nosuch]"], ["not an importable package"]),
        (["+hydra.job.chdri=true"], ["hydra.job.chdri: unknown key", "did you mean 'chdir'"]),
        (["+hydra/job_logging=disabled"], ["pass hydra/job_logging=disabled (no +)"]),
        (["+model=tiny"], ["+model=tiny: model has a value already", "(no +)"]),
        (["-cp", "nosuchconf"], ["-cp nosuchconf: no such folder"]),
        (["--config-dir=/nonexistent"], ["--config-dir /nonexistent: no such folder"]),
        (["experiment="], ["experiment=: no name given", "fig10"]),
        (["hardware.name=ünï"], ["must be quoted: \"hardware.name='ünï'\""]),
        (["-m", "hydra.sweeper.params.workload.gen_len=3,4"], ["sweep on the command line"]),
        (["-m", "hydra.sweeper.params={workload.gen_len: '3,4'}"], ["sweep on the command"]),
        (
            ["-m", "hydra.sweeper.max_batch_size=0", "workload.gen_len=3,4"],
            ["a positive integer, or null"],
        ),
        (
            [
                "-m",
                "hydra/launcher=submitit_local",
                "hydra.launcher.timeout_min=0",
                "workload.seed=1,2",
            ],
            ["hydra.launcher.timeout_min=0: each job would end before it ran"],
        ),
    ],
)
def test_a_hydra_flag_or_override_hydra_fails_on_is_one_line(
    tmp_path: Path, cli_here: Any, args: list[str], names: list[str]
) -> None:
    """Each was argparse's 8 lines of usage, hydra's own line without `error: ` and exit 1, or
    an "internal error" (with a UserWarning for --experimental-rerun); n_jobs=1000 started 1000
    workers on 2 cores. A search path that does not exist was two lines of UserWarning and a
    run without it; `+hydra.job.chdri` ran, the key added unread; `+group=` of a chosen group
    said to write `override` in a YAML file; `-cp` named a module of experiments/common;
    `experiment=` said only "Could not find 'experiment/'"; the basic sweeper's params (null)
    and a max_batch_size of 0 were internal errors (omegaconf's and hydra's assertions); a
    value beyond ASCII, unquoted, hydra's "LexerNoViableAltException" with nothing to do."""
    sweep, run = tmp_path / "s", tmp_path / "r"
    r = cli_here(
        "experiments.run",
        *overridden(TINY, *args),
        f"hydra.sweep.dir={sweep}",
        f"hydra.run.dir={run}",
    )
    one_line(r, *names)
    assert not sweep.exists() and not run.exists()


def test_a_bare_info_flag_prints_hydras_info(cli_here: Any) -> None:
    """`--info` takes an optional value: argparse took the override after it ("invalid choice:
    'hydra.job.name=run'"); alone it is hydra's `--info all`, as documented."""
    r = cli_here("experiments.run", *TINY, "--info")
    assert r.returncode == 0 and "Installed Hydra Plugins" in r.stdout, r.stderr
    r = cli_here("experiments.collect", "--info")
    assert r.returncode == 0 and "Installed Hydra Plugins" in r.stdout, r.stderr


LISTS = [
    ("hardware", "gpu: {tflops: 1.0, mem_bw_gbps: 1000.0, overhead_us: 0}", "gpu: [1, 2]", "gpu"),
    ("hardware", "links:\n", "links: []\nold_links:\n", "links"),
    ("hardware", "h2d: {gbps: 1.0, latency_us: 0}", "h2d: [1.0, 0]", "links.h2d"),
    ("hardware", "sources:", "processes: 5\nsources:", "processes"),  # "its config is a int"
    ("model", "name: tiny", "name: [tiny]", "name"),
]


@pytest.mark.parametrize("group, old, new, key", LISTS, ids=[c[3] for c in LISTS])
def test_a_list_in_a_users_file_where_fields_belong_names_the_key(
    tmp_path: Path, cli_here: Any, group: str, old: str, new: str, key: str
) -> None:
    """`links: []` was "In 'hardware/file_x': ... Cannot merge DictConfig with ListConfig",
    naming neither the key nor the user's file; `gpu: [1, 2]` was "its config is a list" (the
    whole file's), `name: [tiny]` omegaconf's "Cannot convert 'ListConfig' to string"."""
    path = tmp_path / f"{group}.yaml"
    text = (ROOT / "conf" / group / "tiny.yaml").read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    args = [a for a in TINY if not a.startswith(f"{group}=")]
    r = cli_here("experiments.run", *args, f"{group}={path}", f"hydra.run.dir={tmp_path}/r")
    kind = "int 5" if key == "processes" else "list"
    one_line(r, f"{group}.{key}: ", kind, "where", str(path))


def _user_experiment(tmp_path: Path, text: str) -> Path:
    """A user's config folder holding experiment/mine.yaml (`text` after its package line)."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\n" + text)
    return tmp_path / "conf"


@pytest.mark.parametrize(
    "text, names",
    [
        (
            "hydra:\n  sweeper:\n    params:\n      workload.seed: range(0,1000000)\n",
            ["workload.seed=range(0,1000000)", "1,000,000 or more points"],
        ),
        (
            "hydra:\n  launcher:\n    n_jobs: 1000\n",
            ["hydra.launcher.n_jobs=1000 (set in a config file)", "core"],
        ),
    ],
    ids=["sweep of a million points", "n_jobs of a thousand"],
)
def test_a_sweep_or_n_jobs_a_config_file_declares_is_bounded(
    tmp_path: Path, cli_here: Any, text: str, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bounds on a sweep's size and its workers held for the command line only: an
    experiment file sweeping a million seeds enumerated them for minutes before the first ran,
    and its n_jobs: 1000 went to joblib unchecked. The size is checked before a check that
    lists each value (a repeated value's: a million values listed, 1.5 s, before the line)."""
    from experiments.common import overrides

    def listed(*args: Any) -> None:
        raise AssertionError("the sweep's values were listed before its size was checked")

    monkeypatch.setattr(overrides, "refuse_values_twice", listed)
    conf = _user_experiment(tmp_path, text)
    sweep = tmp_path / "s"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        f"hydra.searchpath=[file://{conf}]",
        "experiment=mine",
        "workload.gen_len=3,4",
        f"hydra.sweep.dir={sweep}",
    )
    one_line(r, *names)
    assert not sweep.exists()


def test_a_users_sweep_experiment_needs_m_and_runs_from_config_dir(
    tmp_path: Path, cli_here: Any
) -> None:
    """A sweep experiment in a user's config folder: without -m it ran one default point, as a
    result, where conf/'s are refused; with -m and --config-dir the sweep's check composed
    conf/ alone and refused the experiment as unknown."""
    conf = _user_experiment(tmp_path, "hydra:\n  sweeper:\n    params:\n      workload.seed: 1,2\n")
    for where in ([f"hydra.searchpath=[file://{conf}]"], ["--config-dir", str(conf)]):
        r = cli_here(
            "experiments.run", *TINY, *where, "experiment=mine", f"hydra.run.dir={tmp_path / 'r'}"
        )
        one_line(r, "experiment=mine is a sweep: add -m")
        assert not (tmp_path / "r").exists()
    sweep = tmp_path / "s"
    r = cli_here(
        "experiments.run",
        "-m",
        *TINY,
        "--config-dir",
        str(conf),
        "experiment=mine",
        "hydra/launcher=basic",
        f"hydra.sweep.dir={sweep}",
    )
    assert r.returncode == 0, r.stderr
    assert len(list(sweep.rglob("summary.json"))) == 2


@pytest.mark.parametrize(
    "module, args, names",
    [
        ("experiments.run", [*TINY, "trace_json=${oc.env:MOEPIPE_NOPE}"], ["trace_json: "]),
        ("experiments.run", [*TINY, "hardware.name=${oc.env:MOEPIPE_NOPE}"], ["hardware.name: "]),
        ("experiments.collect", ["dir=${oc.env:MOEPIPE_NOPE}"], ["dir: "]),
        ("experiments.bench.sim", ["repeat=${oc.env:MOEPIPE_NOPE}"], ["repeat: "]),
    ],
    ids=["run, read by get", "run, a folder's name", "collect", "bench.sim"],
)
def test_an_interpolation_that_fails_names_its_key(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], names: list[str]
) -> None:
    """A value whose interpolation fails, read where omegaconf does not say which key it read
    (`cfg.get`), was a line naming no key ("KeyError raised while resolving interpolation"),
    or the key last, as `; full_key: dir`, with nothing to do."""
    run = [f"hydra.run.dir={tmp_path / 'r'}"] if module == "experiments.run" else []
    r = cli_here(module, *args, *run)
    line = one_line(r, *names, "MOEPIPE_NOPE", "fix that value")
    assert line.startswith(f"error: {names[0]}") and "full_key" not in line
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "module, args, names",
    [
        ("experiments.collect", ["dir=${nosuch.key}"], ["dir: ", "nosuch.key"]),
        ("experiments.collect", ["dir=/nonexistent-moepipe"], ["dir=/nonexistent-moepipe"]),
        ("experiments.report", ["dir=${nosuch.key}"], ["dir: ", "nosuch.key"]),
        ("experiments.routing_stats", ["trace_dir=${nosuch.key}"], ["trace_dir: "]),
        ("experiments.run", [*TINY, "hydra.job.name=${nosuch.key}"], ["nosuch.key"]),
        ("experiments.run", [*TINY, "workload.batch_size=-1"], ["workload.batch_size"]),
    ],
    ids=["collect, interpolation", "collect, no folder", "report", "routing_stats", "log", "run"],
)
def test_a_refused_input_leaves_no_run_dir(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], names: list[str]
) -> None:
    """hydra makes the run dir (and the folders above it) before it sets up logging and before
    the command reads its options: a command refusing its input left an empty one behind, and
    experiments.run, which removes its own, the folders above it."""
    r = cli_here(module, *args, f"hydra.run.dir={tmp_path / 'new' / 'r'}")
    one_line(r, *names)
    assert not (tmp_path / "new").exists()


# joblib's pool of fresh workers: the slow suite (.ci/run runs it after the README's command)
@pytest.mark.parametrize("launcher", ["basic", pytest.param("joblib", marks=pytest.mark.slow)])
def test_a_sweep_whose_points_fail_before_they_run_leaves_no_folder(
    tmp_path: Path, cli_here: Any, launcher: str
) -> None:
    """A point's logging config that does not resolve fails its job before the run: the sweep
    stopped with one line, and left its dir (made for it) with the points' empty folders."""
    args = ["-m", *TINY[:3], "planner=flexgen,sequential", f"hydra/launcher={launcher}"]
    sweep = tmp_path / "new" / "s"
    try:
        r = cli_here(
            "experiments.run", *args, "hydra.job.name=${nosuch.key}", f"hydra.sweep.dir={sweep}"
        )
    finally:  # joblib keeps its pool of workers for reuse: not past this test
        pool = sys.modules.get("joblib.externals.loky.reusable_executor")
        executor = getattr(pool, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=True, kill_workers=True)
    assert r.returncode == 2 and r.stderr.splitlines()[-1].startswith("error: "), r.stderr
    assert "nosuch.key" in r.stderr.splitlines()[-1]
    assert not (tmp_path / "new").exists()


def test_an_entry_a_mapping_lacks_says_how_to_add_it(tmp_path: Path, cli_here: Any) -> None:
    """`hardware.gpu.overhead_us_by_kind.load=1` (an op kind, without `+`): "unknown key" alone;
    hydra's own message said to add it with `+`, and `+` adds it."""
    key = "hardware.gpu.overhead_us_by_kind.load"
    r = cli_here("experiments.run", *TINY, f"{key}=1", f"hydra.run.dir={tmp_path / 'r'}")
    one_line(r, f"{key}: unknown key", f"add one with +{key}=VALUE")
    r = cli_here("experiments.run", *TINY, f"+{key}=1", f"hydra.run.dir={tmp_path / 'r'}")
    assert r.returncode == 0, r.stderr


def test_a_relative_config_path_and_hydra_help_with_overrides_work(cli_here: Any) -> None:
    """`-cp conf` (from the repository root) was read against experiments/common/ ("Primary
    config module 'experiments.common.conf' not found"); `--hydra-help` with the run's overrides
    composed them against hydra's own config ("workload: unknown key")."""
    r = cli_here("experiments.run", *TINY, "-cp", "conf", "--cfg", "job")
    assert r.returncode == 0 and "batch_size: 2" in r.stdout, r.stderr
    r = cli_here("experiments.run", "--hydra-help", *TINY)
    assert r.returncode == 0 and "Hydra (" in r.stdout, r.stderr


@pytest.mark.parametrize(
    "override, names",
    [
        ("workload.gen_len=range(5,3)", ["range(5,3): sweeps no value"]),
        ("workload.gen_len=range(3,5,0)", ["range(3,5,0): a range's step is 0"]),
        ("workload.gen_len=interval(3,5)", ["interval(3,5): interval() is for optimizing"]),
        ("planner=glob(nosuch*)", ["glob(nosuch*): sweeps no value"]),
        ("hydra.launcher.backend=nosuch", ["backend=nosuch: not one of joblib's", "loky"]),
        ("hydra.launcher.prefer=nosuch", ["prefer=nosuch: not one of joblib's", "threads"]),
    ],
)
def test_a_sweep_of_no_value_or_a_bad_launcher_hint_is_one_line(
    tmp_path: Path, cli_here: Any, override: str, names: list[str]
) -> None:
    """`range(5,3)` and `range(3,5,0)` were internal errors (StopIteration, ValueError),
    `interval()` hydra's line with nothing to do, a glob "ConfigLoader is not set" whatever it
    matched; joblib ran an unknown backend as its default and failed inside on `prefer`."""
    sweep = tmp_path / "s"
    r = cli_here(
        "experiments.run",
        "-m",
        *overridden(TINY, override),
        "workload.n_batches=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    one_line(r, *names)
    assert not sweep.exists()


def test_a_glob_sweeps_a_groups_names(tmp_path: Path, cli_here: Any) -> None:
    """`planner=glob(klotski_m*)` was "ConfigLoader is not set": the check of the sweep parsed
    it without hydra's config loader, which lists a group's names."""
    sweep = tmp_path / "s"
    args = ["planner=glob(klotski_m*)", "hydra/launcher=basic", f"hydra.sweep.dir={sweep}"]
    r = cli_here("experiments.run", "-m", *TINY[:3], *args)
    assert r.returncode == 0, r.stderr
    assert [p.parent.parent.name for p in sweep.rglob("summary.json")] == [
        "tiny_tiny_klotski_multi_bs2_n2_g3"
    ]


@pytest.mark.parametrize(
    "module, override, names",
    [
        ("experiments.bench.sim", "+planner.params.n=2", ["planner is a str, not a mapping"]),
        ("experiments.bench.sim", "planner.params.n=2", ["planner is a str", "pass planner="]),
        ("experiments.bench.sim", "+repeat.x=2", ["repeat is an int, not a mapping"]),
        ("experiments.trace_json", "~out", ["~out: nothing to delete", "out=VALUE"]),
    ],
)
def test_a_key_under_a_value_is_one_line(
    cli_here: Any, module: str, override: str, names: list[str]
) -> None:
    """`planner.params.n=2` where the command's planner is a name: omegaconf's "Cannot convert
    'dict' to string: '{}'", after `++planner.params.n=2`, an override the user never wrote;
    `~out` of a null out hydra's "Could not delete from config" with nothing to do."""
    one_line(cli_here(module, override), *names)


@pytest.mark.parametrize(
    "flags", [[], ["--help", "-m"], ["--help"]], ids=["run", "help-multirun", "help"]
)
def test_a_comma_in_one_runs_override_says_to_add_m(flags: list[str], cli_here: Any) -> None:
    """`model=tiny,tiny` in one run was hydra's "Ambiguous value" cut to its first fix (a
    list), the sweep (-m) it most likely meant left out; under `--help -m` (help composes one
    run) it was the same line though -m was there. One line offers each fix."""
    r = cli_here("experiments.run", *flags, "model=tiny,tiny")
    one_line(r, "model=tiny,tiny", "add -m", "--help", "key=[a,b]")
