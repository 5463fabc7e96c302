"""Turn a resolved hydra config into frozen core objects, once, at the boundary.

Every mistake becomes a `ConfigError` naming the field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from core.args import as_float
from core.errors import ConfigError, did_you_mean
from core.hardware import HardwareSpec
from core.spec import ModelSpec, RoutingConfig, Workload
from experiments.common.pipeline import RunSpec

EXECUTORS = ("sim", "real")


def to_dict(node: Any, key: str = "config") -> dict[str, Any]:
    """A config group's node as a plain dict, resolved; a ConfigError naming `key` when its
    YAML is not a mapping of fields (a list, a scalar)."""
    if isinstance(node, DictConfig):  # a required field left out: its key named, not '???'
        return OmegaConf.to_container(node, resolve=True, throw_on_missing=True)  # type: ignore[return-value]
    if isinstance(node, Mapping):
        return dict(node)
    raise ConfigError(
        f"{key}: its config is a {type(node).__name__}, not a mapping of fields; write it as "
        f"one, as conf/{key}/'s files are"
    )


def model_spec(cfg: DictConfig) -> ModelSpec:
    d = {k: v for k, v in to_dict(cfg.model, "model").items() if v is not None}  # null: derived
    hf = d.pop("hf_config", None)
    if hf:
        return ModelSpec.from_hf_config(hf)  # named after the checkpoint directory
    return ModelSpec.from_dict(d, where=f"model {d.get('name', '?')}")


def name_part(value: Any, key: str) -> str:
    """`value` as a part of a run's folder name; ConfigError naming `key` where it is not a plain
    name (a `/` or `..` would put the run outside its folder, or nest folders)."""
    name = str(value)
    if not re.fullmatch(r"\w[\w.+\-]*", name):
        group = key.partition(".")[0]  # model.name: model=FILE.yaml
        raise ConfigError(
            f"{key}={name!r}: a name is letters, digits, '_', '-', '+' and '.' (it names the "
            f"run's folder); to read a file pass its path as the group, e.g. {group}=FILE.yaml"
        )
    return long_name_refused(name, key, "the run's folder")


NAME_CHARS = 64  # a name that names a folder or file, at most (with the rest: 255 bytes)


def long_name_refused(name: str, key: str, names: str) -> str:
    """`name`, or a ConfigError naming `key` where it is too long for the file system once
    it is part of `names` (the run's folder: File name too long, once the run was set up)."""
    size = len(name.encode())
    if size > NAME_CHARS:
        raise ConfigError(
            f"{key}={name[:24]}...: a name of {size} bytes; it names {names}, so it is at "
            f"most {NAME_CHARS}: pass a shorter {key}"
        )
    return name


def hardware_name(*, _root_: DictConfig) -> str:
    """`${run_hardware:}` in conf/: the hardware's name, for a sweep point's folder."""
    return name_part(_root_.hardware.name, "hardware.name")


OmegaConf.register_new_resolver("run_hardware", hardware_name, replace=True)


def run_model_name(*, _root_: DictConfig) -> str:
    """`${run_model:}` in conf/: the name of the model a run runs, for its directory. A real run
    takes its shapes from `checkpoint=`'s folder, whatever `model=` says; `model.hf_config`'s
    folder names the model it reads; else the model group's name."""
    real = _root_.get("executor", {}).get("name") == "real" and _root_.get("checkpoint")
    path = _root_.checkpoint if real else _root_.model.get("hf_config")
    if not path:
        return name_part(_root_.model.name, "model.name")
    name = str(_root_.model.name)
    # resolved: checkpoint=. names the folder it is; a missing folder (hf_config_file hands it
    # back as it is) names itself, and fails the run later
    given = Path(str(path))
    folder = given.parent if given.is_file() or given.suffix == ".json" else given
    return folder.resolve().name or name


OmegaConf.register_new_resolver("run_model", run_model_name, replace=True)

RUN_DIR_CHARS = 120  # a run dir's name from its overrides, at most (file systems allow 255)


def run_dir_name(overrides: str) -> str:
    """`${run_dir:${hydra.job.override_dirname}}` in conf/: a sweep point's folder from the
    overrides that tell it apart (sorted by hydra, so the same point gets the same folder in
    any order of the sweep's values). A name too long for a folder, or with a `/` (a path
    value) that would nest folders, is cut and ends in a hash of the whole."""
    name = overrides.replace("/", "_")
    if name == overrides and len(name) <= RUN_DIR_CHARS:
        return name
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:12]
    return f"{name[: RUN_DIR_CHARS - 13]}_{digest}"


OmegaConf.register_new_resolver("run_dir", run_dir_name, replace=True)


def workload(cfg: DictConfig) -> Workload:
    d = to_dict(cfg.workload, "workload")
    routing = d.pop("routing", {}) or {}
    try:
        rc = RoutingConfig(**routing)
    except TypeError as e:
        raise ConfigError(
            f"workload.routing: {e}; check the key's name and type (--help lists them)"
        ) from None
    try:
        return Workload(**d, routing=rc)
    except TypeError as e:
        raise ConfigError(
            f"workload: {e}; check the key's name and type (--help lists them)"
        ) from None


def run_spec(cfg: DictConfig) -> RunSpec:
    executor = str(cfg.executor.name)
    if executor not in EXECUTORS:
        raise ConfigError(
            f"executor {executor!r} unknown; {did_you_mean(executor, EXECUTORS)}"
            f"valid: {', '.join(EXECUTORS)}"
        )
    for key in ("routing_mode", "device"):  # the schema has them for real runs alone
        if executor == "sim" and cfg.executor.get(key) is not None:
            raise ConfigError(
                f"executor.{key}: a key of the real executor; choose executor=real, which has it"
            )
    timeout_s = cfg.executor.get("rendezvous_timeout_s")
    if timeout_s is not None:  # checked in every run, not only the distributed ones that read it
        # a rank takes seconds to start (torch's import); past a day the C int of the wait
        # overflows, and a wait that long is a mistake
        t = as_float("executor.rendezvous_timeout_s", timeout_s)  # a number, else its line
        if not 1.0 <= t <= 86400.0:  # one line for either side of the range
            raise ConfigError(
                f"executor.rendezvous_timeout_s={timeout_s}: must be in [1, 86400] seconds (a "
                "rank needs a few seconds to start); set it in that range, e.g. the default 120"
            )
    dtype = cfg.executor.get("dtype")
    if executor == "sim" and dtype not in (None, "auto"):  # the simulator ran on unchanged
        raise ConfigError(
            f"executor.dtype={dtype}: the real executor's compute dtype; the simulator counts "
            "model.dtype_bytes (set that: 4 float32, 2 bfloat16), or choose executor=real"
        )
    if executor == "sim" and cfg.executor.get("distributed"):
        raise ConfigError(
            "executor.distributed=true: the real executor's processes; choose executor=real "
            "(the simulator runs every device in one process)"
        )
    if executor == "sim" and cfg.get("checkpoint"):
        raise ConfigError(
            f"checkpoint={cfg.checkpoint}: read by executor=real only; add executor=real, or "
            "+model.hf_config=DIR to simulate that checkpoint's shapes"
        )
    name_part(cfg.hardware.get("name"), "hardware.name")  # labels that name folders
    if not cfg.model.get("hf_config"):
        name_part(cfg.model.get("name"), "model.name")
    planner = to_dict(cfg.planner, "planner")
    if "name" not in planner:
        raise ConfigError(
            "planner: its config has no name (the registered planner to run); set planner.name"
        )
    if not isinstance(planner.get("params") or {}, Mapping):
        raise ConfigError(
            f"planner.params must be a mapping of param -> value, got {planner['params']!r}; "
            "write it as planner.params.<param>=<value>"
        )
    return RunSpec(
        model=model_spec(cfg),
        hardware=HardwareSpec.from_dict(to_dict(cfg.hardware, "hardware")),
        workload=workload(cfg),
        planner=str(planner["name"]),
        params=dict(planner.get("params") or {}),
        executor=executor,
    )
