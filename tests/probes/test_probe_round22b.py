"""Round 22b of issue 48: a fresh probe of every command as a new user would type it, and a
failing machine. Each class it found is a test here; each line is made by a real call, in this
process.

- A key that is also a group hydra holds for itself (ConfigStore's `planner_params`,
  conf/command) or, on a command other than experiments.run, any group: hydra read it as that
  group's pick, and `planner_params=5` was an internal error, `planner_params=x` hydra's
  "No match in the defaults list ... use +planner_params=x", `command=5` a list of the
  commands as if one could be picked, and collect's `model=5` "pass one of its names" of a key
  collect does not take; `~planner_params` said "Could not delete ... the defaults list".
- A free mapping given whole with an entry it lacks (`planner_params={sync: true}`) said to add
  `+planner_params=VALUE`, which is the mapping, not the entry.
- bench_accelerate's routing=trace on a model of another shape than the trace's was found in
  moepipe's child, after the bench had said it started it (bench_real refused it up front).
- `hardware=FILE.yaml` (model=, workload= alike) quoted, as a path beyond ASCII must be, or
  with a space, was "not a name in conf/hardware/"; unquoted beyond ASCII it became a config
  name beyond ASCII, refused as unquoted: a file of such a name could not be given at all. A
  sweep of files (`-m hardware=d1/h.yaml,d2/h.yaml`) was "no such file" of the two joined.
- `hydra.run.dir='/x y/é'` (quoted, as a path beyond ASCII must be) was not checked up front
  as the unquoted path is: a file there said "File exists; check the file and the disk". So
  was a quoted pick of a folder in a config folder of the user's (`model='afold'`).
- A sweep with `hydra/launcher=slurm` on a machine without slurm was an internal error
  (submitit's RuntimeError: no srun).
- scripts/gpu_check.sh without CUDA ended in a Python traceback (an assert), and DEVICE=tpu
  ran every stage to its failure.
- A CUDA index past the devices named `device=cuda:N` as the fix whatever the key
  (`executor.device`, `device`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.errors import MoepipeError
from tests.conftest import user_env
from tests.probes.conftest import ROOT, TINY, one_line


@pytest.mark.parametrize(
    ("module", "args", "names"),
    [
        ("experiments.validate", ["planner_params=5"], ["is a mapping", "+planner_params.KEY="]),
        ("experiments.validate", ["planner_params=null"], ["is a mapping"]),
        ("experiments.validate", ["planner_params=x"], ["planner_params=x: planner_params is"]),
        ("experiments.run", ["planner_params=5"], ["planner_params: unknown key", "validate"]),
        ("experiments.run", ["command=validate"], ["command: unknown key; valid: checkpoint"]),
        ("experiments.collect", ["dir=x", "model=5"], ["model: unknown key; valid: dir, out"]),
        ("experiments.collect", ["dir=x", "~planner_params"], ["planner_params: unknown key"]),
        ("experiments.validate", ["~planner_params"], ["empty unless given", "+planner_params."]),
    ],
)
def test_a_key_that_is_a_group_hydra_holds_says_what_the_key_is(
    cli_here: Any, module: str, args: list[str], names: list[str]
) -> None:
    """Said before hydra reads the key as a pick of its own group."""
    one_line(cli_here(module, *args), *names)


def test_a_whole_mappings_missing_entry_names_the_entry_to_add(
    cli_here: Any, tiny_ckpt: Path
) -> None:
    """`planner_params={sync: true}`: the line said `+planner_params=VALUE`, the whole mapping
    again, which the command refuses."""
    args = [f"checkpoint={tiny_ckpt}", "planner_params={sync: true}"]
    one_line(cli_here("experiments.validate", *args), "add one with +planner_params.sync=VALUE")


def test_bench_accelerates_trace_routing_of_another_shape_is_refused_up_front(
    cli_here: Any, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before a child starts, as bench_real refuses it before its checkpoint."""
    from experiments.common import peers

    def no_child(*a: Any, **kw: Any) -> Any:
        raise AssertionError("a child started")

    monkeypatch.setattr(peers, "measure_room", no_child)
    args = [f"checkpoint={tiny_ckpt}", "hardware=tiny", "routing=trace"]
    one_line(cli_here("experiments.bench.accelerate", *args), "routing=trace:", "routing=synthetic")


def test_a_cuda_index_past_the_devices_names_the_key_in_its_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from real.store import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(MoepipeError) as e:
        resolve_device("cuda:3", key="executor.device")
    assert "pass executor.device=cuda:N with N < 1" in str(e.value), e.value


@pytest.mark.parametrize("quote", ["'", ""])
def test_a_group_file_beyond_ascii_or_with_a_space_is_read(
    tmp_path: Path, cli_here: Any, quote: str
) -> None:
    """As a conf/hardware/ name is read: the run writes its result."""
    import shutil

    hw = tmp_path / "my hw é.yaml"
    shutil.copyfile(ROOT / "conf/hardware/tiny.yaml", hw)
    args = [*TINY[:1], f"hardware={quote}{hw}{quote}", *TINY[2:], f"hydra.run.dir={tmp_path}/r"]
    r = cli_here("experiments.run", *args)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r/summary.json").is_file()


@pytest.mark.parametrize("quote", ["", "'"])
def test_a_sweep_of_group_files_reads_each_of_them(tmp_path: Path, quote: str) -> None:
    """Two files of one name in two folders: two configs, each its own file's text (each
    quoted: `'d1/h.yaml','d2/h.yaml'` is no one quoted path)."""
    from experiments.common.conf_files import group_files

    for d in ("d1", "d2"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "h.yaml").write_text(f"name: {d}\n")
    files: dict[str, str] = {}
    q = quote
    arg = f"hardware={q}{tmp_path}/d1/h.yaml{q},{q}{tmp_path}/d2/h.yaml{q}"
    out, added = group_files([arg], ["hardware"], tmp_path / "conf", files)
    names = out[0].partition("=")[2].split(",")
    assert added and len(set(names)) == 2, out
    texts = [(tmp_path / "conf/hardware" / f"{n}.yaml").read_text() for n in names]
    assert texts == ["name: d1\n", "name: d2\n"], texts


def test_a_quoted_run_dir_is_checked_as_an_unquoted_one(tmp_path: Path, capsys: Any) -> None:
    from experiments.common.argv_checks import exit_on_unwritable_dir

    (tmp_path / "a file é").write_text("x")
    with pytest.raises(SystemExit):
        exit_on_unwritable_dir([f"hydra.run.dir='{tmp_path}/a file é'"], ("hydra.run.dir",))
    err = capsys.readouterr().err
    assert "a file é is a file, not a folder" in err and "pass hydra.run.dir=" in err, err


def test_a_quoted_pick_of_a_folder_in_a_users_config_dir_names_the_folder(
    tmp_path: Path,
) -> None:
    from experiments.common.conf_files import check_conf_dirs

    (tmp_path / "model/afold").mkdir(parents=True)
    with pytest.raises(MoepipeError) as e:
        check_conf_dirs([tmp_path], ["model='afold'"], ROOT / "conf")
    assert "afold is a folder; an option of model is a file afold.yaml" in str(e.value), e.value


@pytest.mark.parametrize("pick", ["slurm", "'slurm'"])
def test_a_slurm_sweep_off_a_cluster_says_where_to_run_it(
    monkeypatch: pytest.MonkeyPatch, pick: str
) -> None:
    import shutil

    from experiments.common.argv_checks import missing_launcher

    monkeypatch.setattr(shutil, "which", lambda name: None)
    line = missing_launcher(["-m", "model=tiny", f"hydra/launcher={pick}"]) or ""
    assert "no srun on PATH" in line and "hydra/launcher=submitit_local" in line, line


@pytest.mark.parametrize("device", ["tpu", "cuda"])
def test_gpu_check_refuses_a_device_it_cannot_check_in_one_line(
    tmp_path: Path, device: str
) -> None:
    """Before its folder is made; `cuda` where the machine has none."""
    import subprocess

    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run its stages")
    env = {**user_env(), "DEVICE": device}
    script = str(ROOT / "scripts/gpu_check.sh")
    r = subprocess.run(
        ["bash", script, str(tmp_path / "w")], env=env, capture_output=True, text=True
    )
    one_line(r, "DEVICE=cpu")
    assert not (tmp_path / "w").exists()
