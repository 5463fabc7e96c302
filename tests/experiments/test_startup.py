"""What a simulated run's start-up makes and imports: nothing it does not use."""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from experiments.common import schema
from planners.registry import entry, planner_names
from tests.conftest import user_env
from tests.probes.conftest import TINY, cli


def _imports_of_a_run(run_dir, *args: str) -> set[str]:
    """The modules `python -m experiments.run ARGS` imports (its -X importtime lines), its run
    dir `run_dir`, the run checked to have exited 0."""
    env = {**user_env(), "PYTHONPROFILEIMPORTTIME": "1"}
    r = cli("experiments.run", *args, f"hydra.run.dir={run_dir}", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "experiments.common.run_dir" in imported  # (the import times were read)
    return imported


def test_a_single_run_imports_no_process_pool(tmp_path):
    """A single simulated run, as a user types it, imports neither a process pool nor
    multiprocessing (a sweep's: 5 ms of every run's start-up), and writes its run. (pandas
    imports concurrent.futures' threads itself.)"""
    imported = _imports_of_a_run(tmp_path, *TINY)
    pool = {"multiprocessing", "concurrent.futures.process", "experiments.common.pool"}
    assert not imported & pool
    assert (tmp_path / "summary.json").exists()


def test_a_run_of_a_conf_model_imports_no_hf_config_reader(tmp_path):
    """A simulated run of a model from conf/model, on an expert-parallel planner too (whose
    dense costs read MLA's dims from it for a DeepSeek model), imports no Hugging Face config
    reader (core.hf_config and its rules: 5 ms of every run's start-up), and writes its run."""
    imported = _imports_of_a_run(tmp_path, *TINY[:3], "planner=ep_static")
    assert not {m for m in imported if m.startswith("core.hf_config")}
    assert (tmp_path / "summary.json").exists()


def test_planner_params_are_made_into_configs_when_loaded(monkeypatch):
    """The schemas are stored at import, but each planner's params become an OmegaConf config
    (2 ms each) only when hydra loads them: a run loads its own planner's alone. Loaded, each
    is the config of its Params' schema, loaded twice the same config."""
    made = []
    real = OmegaConf.structured
    monkeypatch.setattr(OmegaConf, "structured", lambda *a, **k: made.append(a) or real(*a, **k))
    cs = ConfigStore.instance()
    saved = dict(cs.repo.get("planner_params", {}))
    try:
        schema.register()
        assert len(made) == 1  # run_schema's
        for name in planner_names():
            node = cs.load(f"planner_params/{name}.yaml").node
            ref = real(schema.params_schema(entry(name).params))
            assert (
                node == ref
                and OmegaConf.get_type(node).__name__ == f"{entry(name).params.__name__}Schema"
            )
            assert cs.load(f"planner_params/{name}.yaml").node == node
        assert len(made) == 1 + len(planner_names())
    finally:
        cs.repo["planner_params"] = saved


def test_a_single_runs_result_is_kept_to_the_commands_end(monkeypatch):
    """A single run started as a command keeps its result (its ops, its trace) to the end,
    where the process's memory goes whole (`cli.leave`), with the collector walking none of it
    (frozen); a sweep's point, or a run in a process that goes on, is freed as it ends."""
    import gc
    from types import SimpleNamespace

    from hydra.types import RunMode

    import experiments
    from experiments import run

    frozen: list[int] = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(1))
    monkeypatch.setattr(run, "_KEPT", [])
    for as_command, mode in ((False, RunMode.RUN), (True, RunMode.MULTIRUN), (True, RunMode.RUN)):
        monkeypatch.setattr(experiments, "AS_COMMAND", as_command)
        config = SimpleNamespace(mode=mode)
        monkeypatch.setattr(run.HydraConfig, "get", staticmethod(lambda c=config: c))
        run.kept_to_exit(f"result of {mode}")
    assert run._KEPT == ["result of RunMode.RUN"] and frozen == [1]
