"""The config schemas: dataclasses registered with hydra's ConfigStore, so that a key the schema
lacks or a value of the wrong type, in an override or in any YAML (a user's own hardware file
too), is refused while hydra composes the config (experiments.common.app turns it into one line).

The YAML layout is the one conf/ uses; core.spec's constructors still check values (positive
sizes, known link names). Planner params schemas are made from the registry's Params classes.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import dataclass, field, fields, make_dataclass
from functools import partial
from typing import Any

from hydra.core.config_store import ConfigNode, ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class MemorySchema:
    gpu: float = MISSING  # GB usable by the model
    cpu: float = MISSING  # GB
    disk: float | None = MISSING  # GB; null: no disk tier (every weight in GPU and CPU memory)


@dataclass
class ComputeSchema:
    tflops: float = MISSING  # dense peak the kernels reach
    mem_bw_gbps: float = MISSING  # memory bandwidth, GB/s
    overhead_us: float = 0.0  # fixed launch cost per op
    overhead_us_by_kind: dict[str, float] = field(default_factory=dict)  # per op kind, replaces it
    time_tables: dict[str, Any] = field(default_factory=dict)  # kind -> [[flops, seconds], ...]
    sms: int = 0  # streaming multiprocessors, 0 = unknown
    sm_mem_bw_gbps: float = 0.0  # memory bandwidth one SM can draw, 0 = mem_bw / sms
    comm_sms: int = 0  # SMs a running collective holds
    copy_sms: int = 0  # SMs a replica copy between GPUs holds on each end


@dataclass
class LinkSchema:
    gbps: float = MISSING  # GB/s
    latency_us: float = 0.0  # per transfer


@dataclass
class ProcessesSchema:
    """What a G-device schedule's ops cost beyond their cost alone when its devices run as
    processes of the machine at once (core.hardware.ProcessesSpec, which experiments.calibrate
    measures)."""

    gate_exchange_us: float = 0.0  # a batch's routing from its gates to every rank
    compute_scale_by_kind: dict[str, float] = field(default_factory=dict)  # time at once / alone
    start_delay_us_by_kind: dict[str, float] = field(default_factory=dict)  # ready -> started
    copy_share: float = 0.0  # of a process's compute, held by a replica copy while it runs


@dataclass
class HardwareSchema:
    name: str = MISSING
    memory_gb: MemorySchema = field(default_factory=MemorySchema)
    gpu: ComputeSchema = field(default_factory=ComputeSchema)
    cpu: ComputeSchema = field(default_factory=ComputeSchema)
    links: dict[str, LinkSchema] = field(default_factory=dict)  # h2d, d2h, disk, disk_write, p2p
    n_gpus: int = 1
    sources: dict[str, str] = field(default_factory=dict)  # where each number comes from
    processes: ProcessesSchema = field(default_factory=ProcessesSchema)


@dataclass
class ModelSchema:
    """core.spec.ModelSpec's fields (moe_layers: null = every layer), or `hf_config`: a Hugging
    Face config.json (or its checkpoint folder) the model is read from instead."""

    name: str = MISSING
    family: str = MISSING
    n_layers: int = MISSING
    hidden_size: int = MISSING
    expert_ffn_size: int = MISSING
    n_experts: int = MISSING
    top_k: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int = MISSING
    head_dim: int = MISSING
    vocab_size: int = MISSING
    moe_layers: list[int] | None = None
    dtype_bytes: int = 2
    activation: str = "swiglu"
    dense_ffn_size: int = 0
    shared_ffn_size: int = 0
    kv_dim: int = 0
    attn_params: int = 0
    qk_head_dim: int = 0
    latent_expand_params: int = 0
    qk_rope_head_dim: int = 0
    q_lora_rank: int = 0
    qkv_bias: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    disk_dtype_bytes: int = 0  # 1: FP8 experts on disk (DeepSeek-V3's release)
    disk_block: list[int] = field(default_factory=lambda: [128, 128])
    hf_config: str | None = None


@dataclass
class RoutingSchema:
    source: str = "synthetic"  # auto | trace | synthetic | live
    trace_dir: str = "../shared/traces"
    tasks: list[str] = field(default_factory=list)
    exclude_tasks: list[str] = field(default_factory=list)
    skew: float = 1.0
    layer_corr: float = 0.5
    reuse: float = 0.25
    hot_experts: int = 0
    hot_share: float = 0.0


@dataclass
class WorkloadSchema:
    batch_size: int = MISSING
    n_batches: int = MISSING
    prompt_len: int = MISSING
    gen_len: int = MISSING
    seed: int = 0
    routing: RoutingSchema = field(default_factory=RoutingSchema)


@dataclass
class DtypeOption:
    """`executor.dtype` of a command that runs a checkpoint (validate, calibrate, the benches):
    what experiments.run's executor.dtype means, checked by the same resolver
    (real.checkpoint.run_dtype, compute_dtype)."""

    dtype: str = "auto"  # compute dtype, float32 | bfloat16 | float16; auto: the saved one


@dataclass
class ExecutorSchema:
    name: str = MISSING  # sim | real
    routing_mode: str | None = None  # real: replay | live
    device: str | None = None  # real: null = cuda if available, else cpu
    dtype: str = "auto"  # real: compute dtype, float32 | bfloat16 | float16; auto: the saved one
    distributed: bool = False  # real: an expert-parallel schedule's G devices as G processes
    rendezvous_timeout_s: float = 120.0  # distributed: how long a rank waits for the others


@dataclass
class PlannerSchema:
    name: str = MISSING  # a registered planner
    params: Any = None  # the planner's own schema (conf/planner/<name>.yaml's defaults)


@dataclass
class ReplicationSchema:
    """A run's `replication` block (conf/experiment/replication*.yaml;
    experiments.common.ep_inputs): with `routing` set, the run reads held-out routing and the
    training tables it prepares."""

    case: str | None = None  # the case the run is of (the report's `case` column)
    routing: str | None = None  # esft_heldout | synthetic_olmoe_top1; null: the workload's own
    split: str = "test"  # ESFT sequences run: test | validation | fold1..fold4
    replica_slots: int = 2  # per device per MoE layer, the same for every replication planner
    initial_load: str = "train"  # train: the training split's load; eval: the evaluated split's
    label: str | None = None  # a variant row's name (e.g. eplb[interval=8]); null: the planner's
    planners: dict[str, Any] = field(default_factory=dict)  # planner -> the experiment's params
    params: dict[str, Any] = field(default_factory=dict)  # the row's own params, which win


@dataclass
class RunSchema:
    """experiments.run's config (conf/config.yaml): one run's five groups and its own keys."""

    model: ModelSchema = field(default_factory=ModelSchema)
    hardware: HardwareSchema = field(default_factory=HardwareSchema)
    workload: WorkloadSchema = field(default_factory=WorkloadSchema)
    planner: PlannerSchema = field(default_factory=PlannerSchema)
    executor: ExecutorSchema = field(default_factory=ExecutorSchema)
    skip_finished: bool = True  # a re-run into a directory with summary.json reuses it
    checkpoint: str | None = None  # executor=real: a Hugging Face checkpoint directory
    # experiments.reproduce_klotski's grid in conf/experiment/klotski_*.yaml (a run ignores it)
    reproduce: dict[str, Any] = field(default_factory=dict)
    trace_json: bool = False  # also write trace.json (else: python -m experiments.trace_json)
    # the replication experiment's block (conf/experiment/replication*.yaml); null elsewhere
    replication: ReplicationSchema | None = None


@dataclass
class BenchAccelerateOptions:
    """experiments.bench.accelerate's options (the module doc says what each does)."""

    checkpoint: str = MISSING  # a Hugging Face checkpoint directory
    hardware: str = "this-machine"  # conf/hardware/<name>.yaml, or a FILE.yaml
    planner: str = "klotski"  # moepipe's planner
    # both systems' compute dtype (transformers' from_pretrained(dtype=...) for accelerate's)
    executor: DtypeOption = field(default_factory=DtypeOption)
    gpu_frac: float = 0.6  # device pool, as a fraction of the model's bytes
    cpu_frac: float = 0.15  # host RAM, as a fraction of the model's bytes
    batch_size: int = 4  # sequences per batch
    n_batches: int = 15  # batches (moepipe's planner may pick fewer per group)
    prompt_len: int = 16  # tokens
    gen_len: int = 4  # tokens generated per sequence
    cold: str = "once"  # once | pass | false: when accelerate's weights leave the page cache
    cgroup: bool = True  # run each system in a memory cgroup where one can be made
    slack_mb: int = 256  # added to the cgroup limit beyond budget + runtime allowance
    # moepipe's tiers: cgroup = the budget's, host tier enlarged by the room the cgroup leaves
    # (limit - its run's peak at the budget tiers - room_margin_mb); tiers = the budget's alone
    room: str = "cgroup"
    room_margin_mb: int = 64  # kept free under the cgroup limit beyond moepipe's measured peak
    host_room_mb: int = 0  # set by the bench (room=cgroup): added to moepipe's host tier, MiB
    role: str | None = None  # set by the bench for its child processes: probe|moepipe|accelerate
    acc_batch: int = 0  # set by the bench for an accelerate child: sequences per generate call
    # accelerate's generation stopped after this many times moepipe's makespan (its row then
    # gives an upper bound on its tok/s); 0 = never stopped
    peer_limit: float = 0.0
    acc_limit_s: float = 0.0  # set by the bench for an accelerate child: its limit in seconds
    klotski_n: int = -1  # moepipe klotski's n: -1 = n_batches, 0 = its n-planner's choice
    # moepipe klotski's attn_batches: 0 = its choice (one attention op over the group at decode
    # where the KV stays on the device), 1 = batch by batch (the paper's loop), k = spans of k
    klotski_attn: int = 0
    routing: str = "synthetic"  # moepipe's routing: synthetic | trace (ESFT replay) | auto
    trace_dir: str = "../shared/traces"  # folder holding esft-dsv2lite/ (routing=trace|auto)
    # runs of each row's system (each from a cold page cache); a row shows their median
    repeats: int = 3


@dataclass
class BenchRealOptions:
    """experiments.bench.real's options (the module doc says what each does)."""

    model: str = MISSING  # conf/model/<name>.yaml
    budget_gb: float = MISSING  # memory for weights: device pool + host RAM
    gen_len: int = 4  # tokens generated per sequence
    out_dir: str = "runs/bench_real"  # where the checkpoint is written (or reused)
    n_layers: int | None = None  # cut the model to its first n_layers (stated in the output)
    batch_size: int = 8  # sequences per batch
    prompt_len: int = 16  # tokens
    hardware: str = "this-machine"  # conf/hardware/<name>.yaml (calibrated when missing)
    peers: str = "best"  # best | all | none: which accelerate rows run
    cold: str = "once"  # once | pass (as in experiments.bench.accelerate)
    slack_mb: int = 256  # added to the cgroup limit beyond budget + runtime allowance
    # each accelerate row stopped after this many times moepipe's makespan (0 = never)
    peer_limit: float = 3.0
    room: str = "cgroup"  # cgroup | tiers: moepipe's tiers (as in experiments.bench.accelerate)
    n: int = 0  # Klotski's batches per group: 0 = its n-planner's choice, k > 0 = k
    routing: str = "auto"  # auto (the ESFT trace where the model has its shape) | trace | synthetic
    trace_dir: str = "../shared/traces"  # folder holding esft-dsv2lite/
    calib_layers: int = 6  # calibrate (where no profile exists) on a cut of this many layers


def params_schema(params: type) -> type:
    """A planner's Params (frozen, primitives) as a schema dataclass of the same fields."""
    hints = typing.get_type_hints(params)
    specs = []
    for f in fields(params):
        default = f.default if f.default is not NO_DEFAULT else MISSING
        specs.append((f.name, hints[f.name], field(default=default)))
    return make_dataclass(f"{params.__name__}Schema", specs)


class _MadeWhenLoaded(ConfigNode):
    """A ConfigStore entry whose config (OmegaConf's of a schema, 2 ms each to make) is made
    when hydra first loads it: a run loads its own planner's params, of a dozen stored. Hydra
    copies the entry and replaces the copy's node (`ConfigStore.load`): the copies share the
    one made."""

    def __init__(self, name: str, group: str, make: Callable[[], type]) -> None:
        self._made: list[DictConfig] = []  # shared by copy.copy's copies
        self._make = make
        super().__init__(name=name, node=None, group=group, package=None, provider=None)

    @property  # type: ignore[override]
    def node(self) -> DictConfig:
        if "_node" in vars(self):  # a copy's own (ConfigStore.load's deep copy)
            return vars(self)["_node"]
        if not self._made:
            self._made.append(OmegaConf.structured(self._make()))
        return self._made[0]

    @node.setter
    def node(self, value: DictConfig | None) -> None:
        if value is not None:
            vars(self)["_node"] = value


def register() -> None:
    """Store every schema in ConfigStore: run_schema (conf/config.yaml's first default) and
    each planner's params (planner_params/<name>, the planner YAMLs' first default), the
    latter made into configs when hydra loads one."""
    from planners.registry import registered

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunSchema)
    group = cs.repo.setdefault("planner_params", {})
    for name, entry in registered().items():
        make = partial(params_schema, entry.params)
        group[f"{name}.yaml"] = _MadeWhenLoaded(f"{name}.yaml", "planner_params", make)


register()
