"""Enumerations shared by every part of moepipe: memory tiers, physical resources, op kinds,
tensor kinds and the well-known logical stream names.

Strings are the enum values, so they read well in YAML, parquet and Chrome traces.
"""

from enum import StrEnum


class Tier(StrEnum):
    """A memory tier that holds weights, KV cache or activations."""

    GPU = "gpu"
    CPU = "cpu"
    DISK = "disk"


class Resource(StrEnum):
    """A physical resource that executes ops one at a time (per device index)."""

    GPU = "gpu"  # GPU compute (one per device)
    CPU = "cpu"  # CPU compute
    H2D = "h2d"  # host -> device link (PCIe)
    D2H = "d2h"  # device -> host link
    DISK = "disk"  # disk -> host reads
    DISK_WRITE = "disk_write"  # host -> disk writes (KV spill)
    P2P = "p2p"  # GPU <-> GPU link (expert parallelism): into the GPU
    P2P_OUT = "p2p_out"  # the same link out of the GPU (full duplex: the all-to-all's sends)
    D2D = "d2d"  # a copy within one GPU's memory (lanes' replicas): its copy path through HBM
    NONE = "none"  # bookkeeping ops (free) that occupy no resource


class OpKind(StrEnum):
    LOAD = "load"  # weight transfer between tiers
    FREE = "free"  # release memory, zero duration
    ATTENTION = "compute-attention"
    GATE = "compute-gate"
    EXPERT = "compute-expert"  # one routed expert over some tokens
    FFN = "compute-ffn"  # dense FFN or shared experts
    HEAD = "compute-head"  # final norm + LM head
    KV_LOAD = "kv-load"
    KV_STORE = "kv-store"
    DISPATCH = "dispatch"  # expert-parallel all-to-all: tokens to devices
    COMBINE = "combine"  # expert-parallel all-to-all: results back
    ALL_REDUCE = "all-reduce"  # tensor-parallel dense work: partial sums summed over the GPUs


COMPUTE_KINDS = frozenset({OpKind.ATTENTION, OpKind.GATE, OpKind.EXPERT, OpKind.FFN, OpKind.HEAD})
# transfers that run as kernels on their GPU's SMs (NCCL's, DeepEP's); replica copies between
# GPUs are modelled as the copy engines' and are not among them (unless `gpu.copy_sms`)
COLLECTIVES = (OpKind.DISPATCH, OpKind.COMBINE, OpKind.ALL_REDUCE)
# a replica copy between GPUs: a LOAD of an expert's weights on either direction of a GPU's link
# (the ops `gpu.copy_sms` makes hold SMs: sim/executor.py, and that gpu_load counts: core/balance)
COPY_LINKS = (Resource.P2P, Resource.P2P_OUT)
TRANSFER_KINDS = frozenset(
    {
        OpKind.LOAD,
        OpKind.KV_LOAD,
        OpKind.KV_STORE,
        OpKind.DISPATCH,
        OpKind.COMBINE,
        OpKind.ALL_REDUCE,
    }
)


class Tensor(StrEnum):
    """What an op moves or reads; lets metrics and the real executor tell loads apart."""

    NONE = "none"
    ATTENTION = "attention"  # q/k/v/o projections + input norm of one layer
    GATE = "gate"  # post-attention norm + router of one MoE layer
    EXPERT = "expert"  # one routed expert of one layer
    FFN = "ffn"  # dense FFN, or the shared experts of an MoE layer
    EMBED = "embed"  # token embedding
    HEAD = "head"  # final norm + LM head
    KV = "kv"
    HIDDEN = "hidden"


class Stream(StrEnum):
    """Well-known logical stream names. Planners may add indexed ones (e.g. ``compute1``)."""

    COMPUTE = "compute"
    CPU_COMPUTE = "cpu_compute"
    WEIGHTS = "weights"  # weight prefetch (host -> device)
    EXPERTS = "experts"  # on-demand expert loads (host -> device)
    DISK = "disk"  # disk -> host reads
    KV_LOAD = "kv_load"
    KV_STORE = "kv_store"
    KV_SPILL = "kv_spill"  # host -> disk
    MEMORY = "memory"  # frees


class Dense(StrEnum):
    """How G GPUs share an expert-parallel run's dense work (attention, shared experts, head)."""

    DATA = "data"  # each GPU runs its share of the batch's sequences
    TENSOR = "tensor"  # every GPU runs every sequence on 1/G of the weights, then an all-reduce


class Dispatch(StrEnum):
    """How a replicated expert's tokens go to its copies."""

    EVEN = "even"  # split evenly over the copies
    BALANCED = "balanced"  # water-filled over the devices holding it (`balanced_split`)


class ReplicaGate(StrEnum):
    """The replica cost gate: which replica copies an expert-parallel planner places."""

    NONE = "none"  # every slot of the budget (EPLB's greedy)
    TIME = "time"  # a copy only while the modelled busiest device finishes sooner
    TIME_COPY = "time+copy"  # ... charged its transfer where it is not already resident


class LaneSharing(StrEnum):
    """How G lanes of one GPU share its SMs."""

    PARTITION = "partition"  # each lane holds its share (green contexts, MPS with SM limits)
    SHARED = "shared"  # plain CUDA streams: a kernel uses the SMs the others leave


class ReplicaPredictor(StrEnum):
    """What `predictive_replication` predicts an iteration's per-expert load from."""

    LAST = "last"  # the previous iteration's
    EMA = "ema"  # an exponential average of past iterations'
    WINDOW = "window"  # the mean of the last `window` iterations'
    LAYER_CORR = "layer_corr"  # the previous layer's, through a layer-to-layer table
    TASK_MIX = "task_mix"  # the coming iteration's request labels' loads


class Activation(StrEnum):
    SWIGLU = "swiglu"
    RELU = "relu"


class RoutingSource(StrEnum):
    AUTO = "auto"  # the real trace when its shape fits the model, else synthetic
    TRACE = "trace"
    SYNTHETIC = "synthetic"
    LIVE = "live"


LINK_OF = {
    (Tier.DISK, Tier.CPU): Resource.DISK,
    (Tier.CPU, Tier.GPU): Resource.H2D,
    (Tier.GPU, Tier.CPU): Resource.D2H,
    (Tier.CPU, Tier.DISK): Resource.DISK_WRITE,
    (Tier.GPU, Tier.GPU): Resource.P2P,
}
"""The physical resource a transfer from one tier to another occupies (and `ALSO_ON`)."""
# other resources a transfer may occupy: a GPU -> GPU copy leaves its source by the link's
# outgoing direction, or stays within one GPU's memory (lanes)
ALSO_ON = {(Tier.GPU, Tier.GPU): (Resource.P2P_OUT, Resource.D2D)}
