"""The checks a run makes of its config before anything runs or is written (`run.execute`,
and a sweep's `check_point` before its first point): a key this run would not read, a size
that cannot fit, hydra options that would move its paths."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from core.errors import CapacityError, ConfigError
from core.routing import resolve_source
from core.spec import ModelSpec
from core.types import RoutingSource
from experiments.common import ep_inputs
from experiments.common.app import USER_FILES
from experiments.common.hydra_errors import CONF_DIR
from experiments.common.pipeline import RunSpec, check_kv_fits, sizes_its_group
from experiments.common.resolve import run_spec
from experiments.common.schema import RoutingSchema
from planners.registry import expert_parallel_names, make_params


def check_point(cfg: DictConfig) -> None:
    """A sweep point's config checked as its run checks it first (`execute`), nothing run or
    written: a bad value every point shares is refused before the sweep starts. A point too
    big for the hardware passes: in a sweep it is a result (infeasible), not a failure; one
    whose schedule or routing would not fit this machine's RAM fails, as its run would."""
    check_no_chdir()
    try:
        spec = run_spec(cfg)
        check_routing_overrides(cfg, spec)
        rep = ep_inputs.block(cfg)
        if rep is not None:  # the block's params join the planner's as the run prepares it
            ep_inputs.check_block(rep, spec)
        else:
            make_params(spec.planner, spec.params)
        check_sizes_fit(spec)
    except CapacityError:
        return


def check_sizes_fit(spec: RunSpec) -> None:
    """`sized_run`'s checks of RAM that need no plan: one batch's, then the workload's own
    n_batches where the planner keeps it (one that sizes its group, Klotski's `n: 0`, chooses
    its n as the run starts)."""
    check_kv_fits(replace(spec, workload=spec.workload.with_(n_batches=1)), warn=False)
    if not sizes_its_group(spec):
        check_kv_fits(spec, warn=False)


def check_no_chdir() -> None:
    """Refuse hydra.job.chdir=true: hydra moves the run into its run dir before it starts, so
    every relative path it reads (checkpoint=, the default workload.routing.trace_dir) would be
    looked for there, and a relative checkpoint was called the run dir's own folder."""
    if HydraConfig.initialized() and HydraConfig.get().job.chdir:
        raise ConfigError(
            "hydra.job.chdir=true: the run would read its relative paths (checkpoint=, "
            "workload.routing.trace_dir, ...) from inside its run dir; leave hydra.job.chdir "
            "false (the run dir is hydra.run.dir either way)"
        )


# the executor keys only a real run reads, and what to do instead on a simulated one
REAL_ONLY_KEYS = {
    "executor.rendezvous_timeout_s": "'s distributed runs; choose executor=real "
    "executor.distributed=true, which reads it",
}  # executor.dtype: common.resolve refuses it on a simulated run, from any config file too

# the routing knobs each source reads (core.spec.RoutingConfig)
SYNTHETIC_KNOBS = ("skew", "layer_corr", "reuse", "hot_experts", "hot_share")
TRACE_KNOBS = ("tasks", "exclude_tasks", "trace_dir")


def check_routing_overrides(cfg: DictConfig, spec: RunSpec) -> None:
    """A ConfigError where the user's command line sets a routing knob this run's routing does
    not read (the synthetic generator's skew on a run that replays the ESFT trace, the trace's
    tasks on a synthetic one), a real executor key (rendezvous timeout) on a simulated run,
    hardware.n_gpus for a planner of one GPU, a model for a real run (its checkpoint's is
    run), or a model field beside model.hf_config (its config.json's is simulated): the run
    would go on as if it were not given."""
    if not HydraConfig.initialized():
        return
    overrides = list(HydraConfig.get().overrides.task)
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    check_replication_params(cfg, spec, given)
    if "hardware.n_gpus" in given and spec.planner not in expert_parallel_names():
        raise ConfigError(
            f"hardware.n_gpus: read by the expert-parallel planners only "
            f"({', '.join(expert_parallel_names())}); planner {spec.planner} runs on one GPU: "
            "drop it, or choose one of those"
        )
    model = [o for o in overrides if o.lstrip("+~").split("=")[0].split(".")[0] == "model"]
    if spec.executor == "real" and model:  # config.yaml recorded it, the run another
        raise ConfigError(
            f"{model[0].lstrip('+~')}: a real run takes its model from checkpoint="
            f"{cfg.checkpoint} (its config.json), whatever model says; drop it (to simulate "
            "the checkpoint: executor=sim +model.hf_config=DIR)"
        )
    shaped = [o.lstrip("+~") for o in model if "." in o.split("=")[0]]
    shaped = [o for o in shaped if o.split("=")[0] != "model.hf_config"]
    if spec.executor == "sim" and cfg.model.get("hf_config") and shaped:
        raise ConfigError(
            f"{shaped[0]}: the model's fields come from model.hf_config={cfg.model.hf_config} "
            "(its config.json), whatever model.* says; drop it, or edit that config.json"
        )
    for key in REAL_ONLY_KEYS if spec.executor == "sim" else ():  # (each has a default too)
        if key in given:
            raise ConfigError(f"{key}: a key of the real executor{REAL_ONLY_KEYS[key]}")
    ran, why = run_model(cfg, spec), f"workload.routing.source={spec.workload.routing.source}"
    source = resolve_source(ran, spec.workload.routing.source)
    why = f"{why} for {ran.name}"
    if spec.executor == "real" and cfg.executor.get("routing_mode") == "live":
        source, why = RoutingSource.LIVE, "executor.routing_mode=live: the model's own gates"
    unused = {
        RoutingSource.TRACE: SYNTHETIC_KNOBS,
        RoutingSource.SYNTHETIC: ("tasks", "exclude_tasks")
        + (() if ep_inputs.block(cfg) else ("trace_dir",)),  # a replication case's tables read it
        RoutingSource.LIVE: SYNTHETIC_KNOBS + ("tasks", "exclude_tasks"),
    }.get(source, ())
    in_file, file_knobs = user_workload_knobs()
    for knob in unused:
        key = f"workload.routing.{knob}"
        at = "" if key in given else f" (in {in_file})" if knob in file_knobs else None
        if at is not None:
            reads = "the synthetic generator's" if knob in SYNTHETIC_KNOBS else "the ESFT trace's"
            raise ConfigError(
                f"{key}{at}: {reads} knob, but this run's routing is {source} ({why}); drop it"
                f"{' from that file' if at else ''}, or set workload.routing.source to the "
                "routing it is for"
            )


def check_replication_params(cfg: DictConfig, spec: RunSpec, given: set[str]) -> None:
    """A ConfigError where the command line sets a planner param (`planner.params.window=8`)
    that a replication run takes from its experiment's block instead
    (`replication.planners.eplb.window`, a row's `replication.params`, which win in
    `ep_inputs.prepare`): the run went on with the block's value, its config.yaml recording 8."""
    rep = ep_inputs.block(cfg)
    if rep is None:
        return
    blocks = {
        f"replication.planners.{spec.planner}": (rep.get("planners") or {}).get(spec.planner),
        "replication.params": rep.get("params"),
    }
    for key in sorted(k.split(".", 2)[2] for k in given if k.startswith("planner.params.")):
        for where, block in blocks.items():
            if key in (block or {}):
                raise ConfigError(
                    f"planner.params.{key}: a replication run takes it from {where}.{key} "
                    f"({block[key]}), which wins; pass {where}.{key}=VALUE instead"
                )


def user_workload_knobs() -> tuple[str, set[str]]:
    """The user's own workload file this run composed (workload=FILE.yaml, or one in a
    --config-dir or hydra.searchpath folder) and the routing knobs it sets to other than their
    defaults; ("", set()) for one of conf/workload/, or one whose source is `auto`: its knobs
    are for whichever source that picks."""
    hc = HydraConfig.get()
    name = hc.runtime.choices.get("workload")
    for src in hc.runtime.config_sources:
        path = Path(src.path) / "workload" / f"{name}.yaml"
        if src.schema != "file" or not path.is_file():
            continue
        if path.resolve().is_relative_to(CONF_DIR.resolve()):
            break
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError):  # composed already: read as hydra read it
            break
        routing = data.get("routing") if isinstance(data, dict) else None
        if not isinstance(routing, dict) or routing.get("source", "synthetic") == "auto":
            break  # `auto`: a file, like conf/'s, for whichever source it picks
        shown = USER_FILES.get(str(path), str(path))  # workload=FILE.yaml: FILE, not the copy
        default = RoutingSchema()
        return shown, {k for k, v in routing.items() if getattr(default, k, v) != v}
    return "", set()


def run_model(cfg: DictConfig, spec: RunSpec) -> ModelSpec:
    """The model the run runs: a real run's checkpoint's (its spec holds the config's model)."""
    if spec.executor == "real" and cfg.get("checkpoint"):
        return ModelSpec.from_hf_config(cfg.checkpoint)
    return spec.model
