"""Expert-parallel params and the resolved device layout of one run (`resolve_layout`): what the
replication planners (`ep_static`, `eplb`, `predictive_replication`, `oracle_replication`) are
configured with, checked once."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from core.errors import ConfigError, did_you_mean, integer_below
from core.planner import PlanContext
from core.types import Dense, Dispatch, LaneSharing, ReplicaGate

log = logging.getLogger(__name__)

GATES = tuple(ReplicaGate)
LANE_SHARING = tuple(LaneSharing)


# G devices: past any expert-parallel deployment (hundreds of GPUs). Each device's receive of
# the all-to-all waits on every other's send, G^2 dependencies a layer: 10,000 devices of the
# tiny model ran for minutes in 8 GB and had not finished.
MAX_DEVICES = 2048


@dataclass(frozen=True)
class EPParams:
    n_devices: int = 0  # G compute devices; 0 = hardware.n_gpus
    lanes: bool = False  # True: the G devices are lanes of one GPU (no all-to-all)
    # The share of the GPU's compute rate and memory bandwidth each lane's ops get; 0 = 1/G (a
    # partition of its SMs: the lanes together have one GPU). 1 gives every lane the whole GPU.
    lane_share: float = 0.0
    # How lanes share the GPU: "partition" = each holds its `lane_share` of the SMs (CUDA green
    # contexts, MPS with SM limits); "shared" = plain CUDA streams: every kernel may use any SMs
    # the others leave, up to what its thread blocks fill (processor sharing, sim/executor.py).
    lane_sharing: str = LaneSharing.PARTITION
    replica_slots: int = 2  # extra expert slots per device per MoE layer (the replica budget)
    replicas: int = -1  # redundant copies per layer to place; -1 = at most every slot
    # One grouped-GEMM op per device per layer (simulator only: the real executor runs one op per
    # expert, the default); the replication experiment turns it on.
    grouped_gemm: bool = False
    # Replica cost gate (FasterMoE-style, replication.md §2.2): "none" fills the budget with
    # EPLB's greedy; "time" adds a copy only while it makes the modelled busiest device finish
    # sooner; "time+copy" also charges a copy that is not already resident its transfer time.
    gate: str = ReplicaGate.NONE
    # Dense work (attention, shared experts, dense FFN, head) over G GPUs: "data" = each GPU runs
    # its share of the batch's sequences; "tensor" = every GPU runs every sequence on 1/G of the
    # heads / FFN columns / vocabulary, then an all-reduce (vLLM's TP attention + EP experts).
    # Lanes run dense work on the whole GPU either way.
    dense: str = Dense.DATA
    # How a replicated expert's tokens go to its copies once the gate has routed the batch:
    # "even" = split evenly (the replication paper's rule); "balanced" = water-filled over the
    # devices holding it, given every other expert's tokens, so the busiest device holds as few
    # tokens as the placement allows (`balanced_split`). The replica gate models the same rule.
    dispatch: str = Dispatch.EVEN
    # Two-batch overlap (DeepSeek's and SGLang's TBO; G GPUs): each batch runs as this many
    # micro-batches of its sequences, each with its own gate, all-to-all (dense=tensor: its
    # all-reduces) and experts, so that one's collectives run beside another's compute. They
    # share the batch's placement (one refill). 1 = the whole batch at once.
    micro_batches: int = 1

    def __post_init__(self) -> None:
        # the string options are typed str (configs and schemas give strings); held as enums
        for name, enum in (
            ("gate", ReplicaGate),
            ("dense", Dense),
            ("dispatch", Dispatch),
            ("lane_sharing", LaneSharing),
        ):
            as_enum(self, name, enum, "planner.params.")
        # 0 = 1/n_devices; else at least about one SM of the largest GPUs (1/200 of one)
        if not (self.lane_share == 0.0 or 1e-3 <= self.lane_share <= 1.0):
            raise ConfigError(
                f"planner.params.lane_share={self.lane_share} must be 0 (= 1/n_devices) or in "
                "[0.001, 1] (a lane holds at least one SM); pass lane_share=0 or a share in it"
            )
        if self.n_devices < 0:
            raise ConfigError(
                integer_below("planner.params.n_devices", self.n_devices, 0, "0 = hardware.n_gpus")
                + "; pass planner.params.n_devices=0 or the devices to run on"
            )
        if self.replica_slots < 0:
            raise ConfigError(
                integer_below("planner.params.replica_slots", self.replica_slots, 0)
                + "; pass planner.params.replica_slots=0 (no replicas) or more"
            )
        if self.n_devices > MAX_DEVICES:  # before routing is built for them (0: at the layout)
            raise ConfigError(
                f"planner.params.n_devices={self.n_devices}: more devices than an expert-parallel "
                f"run models (at most {MAX_DEVICES}: the all-to-all's dependencies grow as the "
                "square); lower it"
            )
        if self.replicas < -1:
            raise ConfigError(
                integer_below("planner.params.replicas", self.replicas, -1, "-1: every slot")
                + "; pass planner.params.replicas=-1 or more"
            )
        if self.micro_batches < 1:
            raise ConfigError(
                integer_below(
                    "planner.params.micro_batches", self.micro_batches, 1, "2: two-batch overlap"
                )
                + "; pass planner.params.micro_batches=1 or more"
            )

    def no_gate(self, planner: str) -> None:
        """Planners that place without the replica cost gate refuse one."""
        if self.gate != ReplicaGate.NONE:
            raise ConfigError(
                f"planner.params.gate={str(self.gate)!r}: {planner} has no replica cost gate (the "
                "replication planners do); drop it"
            )


def as_enum(params: object, name: str, enum: type[StrEnum], who: str = "planner ") -> None:
    """Frozen `params`' string option `name` as a member of `enum`, or one ConfigError naming
    it and the valid values (`who` starts the line)."""
    value = getattr(params, name)
    try:
        object.__setattr__(params, name, enum(value))
    except ValueError:
        raise ConfigError(
            f"{who}{name}={value!r} unknown; {did_you_mean(value, enum)}valid: {', '.join(enum)}"
        ) from None


@dataclass(frozen=True)
class Layout:
    """Resolved device layout of one run."""

    n_devices: int  # G
    n_experts: int  # E
    home_slots: int  # ceil(E / G): slots for the experts a device owns
    replica_slots: int  # extra slots per device
    replicas: int  # redundant copies per layer actually placed (<= G * replica_slots)
    lanes: bool
    grouped_gemm: bool = False  # see EPParams
    lane_share: float = 0.0  # see EPParams
    dense: Dense = Dense.DATA  # see EPParams; lanes: data (their dense work runs on the whole GPU)
    lane_sharing: LaneSharing = LaneSharing.PARTITION  # see EPParams
    dispatch: Dispatch = Dispatch.EVEN  # see EPParams
    micro_batches: int = 1  # see EPParams

    @property
    def slots_per_device(self) -> int:
        return self.home_slots + self.replica_slots

    @property
    def shared(self) -> bool:
        """Lanes whose kernels share the GPU's SMs (a processor-sharing pool)."""
        return self.lanes and self.lane_sharing == LaneSharing.SHARED

    @property
    def share(self) -> float:
        """The share of a GPU's compute one device has: a lane holds 1/G of it (shared lanes:
        none fixed, the pool decides)."""
        if not self.lanes or self.shared:
            return 1.0
        return self.lane_share or 1.0 / self.n_devices

    def round_robin(self) -> np.ndarray:
        """[G, K] expert e on device e % G; replica slots empty (-1)."""
        slots = np.full((self.n_devices, self.slots_per_device), -1, dtype=np.int64)
        for e in range(self.n_experts):
            slots[e % self.n_devices, e // self.n_devices] = e
        return slots


@dataclass(frozen=True)
class ReplicaParams(EPParams):
    """Params shared by `predictive_replication` and `oracle_replication`."""

    initial_load: str = ""  # optional .npy [MoE layers, E] load: first homes packed by it
    # Re-pack the homes (EPLB's balanced packing of one copy per expert) from the policy's load
    # every this many iterations, as `eplb` re-places every `interval`; 0 = homes stay fixed.
    rehome_interval: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rehome_interval < 0:
            raise ConfigError(
                integer_below("planner.params.rehome_interval", self.rehome_interval, 0)
                + "; pass planner.params.rehome_interval=0 (homes stay fixed) or more"
            )


def resolve_layout(p: EPParams, ctx: PlanContext) -> Layout:
    g = p.n_devices or ctx.hardware.n_gpus
    e = ctx.model.n_experts
    given = (  # 0: the hardware's GPU count, named as the user wrote it
        f"n_devices={g}"
        if p.n_devices
        else f"n_devices=0 (hardware {ctx.hardware.name}'s n_gpus={g})"
    )
    if not 1 <= g <= e:
        fix = (
            "pass n_devices=1 (one expert: one device holds it)"
            if e == 1
            else f"pass n_devices=1 to {e} (0: the hardware's n_gpus)"
            if g <= e or not p.n_devices  # 0 given: lowering it is no way out
            else "lower n_devices"
        )
        raise ConfigError(
            f"planner.params.{given} must be in [1, {e}] (the model's experts); {fix}"
        )
    if g > MAX_DEVICES:
        raise ConfigError(
            f"planner.params.{given}: more devices than an expert-parallel run models (at most "
            f"{MAX_DEVICES}: the all-to-all's dependencies grow as the square); lower it"
        )
    gpus = ctx.hardware.n_gpus
    if not p.lanes and g > gpus:
        raise ConfigError(
            f"planner.params.n_devices={g} exceeds hardware {ctx.hardware.name}'s n_gpus={gpus}; "
            "use "
            "hardware with more GPUs (hardware.n_gpus), lanes=true for G lanes of one GPU, or "
            "a smaller n_devices"
        )
    if p.replica_slots > e:  # a device holds at most one copy of each expert
        raise ConfigError(
            f"planner.params.replica_slots={p.replica_slots} exceeds the model's {e} experts (a "
            f"device holds one copy of an expert at most); pass planner.params.replica_slots <= {e}"
        )
    replicas = g * p.replica_slots if p.replicas < 0 else p.replicas
    if replicas > g * p.replica_slots:
        raise ConfigError(
            f"planner.params.replicas={replicas} exceeds the {g * p.replica_slots} replica slots "
            f"(n_devices={g} x replica_slots={p.replica_slots}); "
            "raise replica_slots or lower replicas"
        )
    dense = Dense.DATA if p.lanes else Dense(p.dense)
    why = ctx.model.tensor_split_error(g) if dense == Dense.TENSOR else None
    if why:
        raise ConfigError(
            f"planner.params.dense=tensor splits attention heads over n_devices={g}, but model "
            f"{ctx.model.name}'s {why}; use dense=data or another n_devices"
        )
    if p.micro_batches > 1:
        check_micro_batches(p.micro_batches, ctx.workload.batch_size, g, p.lanes, dense)
    return Layout(
        g,
        e,
        -(-e // g),
        p.replica_slots,
        replicas,
        p.lanes,
        p.grouped_gemm,
        p.lane_share,
        dense,
        LaneSharing(p.lane_sharing),
        Dispatch(p.dispatch),
        p.micro_batches,
    )


def check_micro_batches(mb: int, bs: int, g: int, lanes: bool, dense: Dense) -> None:
    """Micro-batches overlap one's collectives (the all-to-all; under tensor-parallel dense
    work, the all-reduces) with another's compute: none on lanes (one GPU's memory), and each
    needs a sequence of every share it splits (data-parallel: each GPU's). One device has no
    collective to overlap: its micro-batches only ran the same work in more, smaller ops."""
    if g == 1 and not lanes:
        raise ConfigError(
            f"planner.params.micro_batches={mb} overlaps one micro-batch's all-to-all or "
            "all-reduce "
            "with another's compute, but n_devices=1 has none; use micro_batches=1, or "
            "n_devices of 2 or more"
        )
    if lanes:
        raise ConfigError(
            f"planner.params.micro_batches={mb} overlaps one micro-batch's all-to-all with "
            "another's "
            "compute, but lanes=true (one GPU's memory) moves no tokens; use micro_batches=1"
        )
    if dense == Dense.TENSOR:
        if bs < mb:
            raise ConfigError(
                f"planner.params.micro_batches={mb} splits a batch's sequences (dense=tensor: "
                "every "
                f"GPU holds all of them), but workload.batch_size={bs} has fewer; lower "
                "micro_batches or raise the batch size"
            )
        return
    if -(-bs // g) < mb:
        raise ConfigError(
            f"planner.params.micro_batches={mb} splits each GPU's share of a batch's sequences, "
            "but "
            f"workload.batch_size={bs} over n_devices={g} gives a GPU at most "
            f"{-(-bs // g)}; lower micro_batches or raise the batch size"
        )


def within_run(params: object, ctx: PlanContext, planner: str, names: tuple[str, ...]) -> None:
    """Warn where a re-placement interval in `params`, changed from its default, is one the run
    never reaches (1e12 for "never", or a sweep's row run at a small size): the run goes on
    without re-placing, as the value says, and its log says so."""
    wl = ctx.workload
    total = wl.n_steps * wl.n_batches  # iterations: (step, batch) pairs; t = 0 never re-places
    defaults = type(params)()
    for name in names:
        value = getattr(params, name)
        if value != getattr(defaults, name) and value >= total:
            log.warning(
                "%s: planner.params.%s=%s is not below the run's %s iterations (steps x "
                "workload.n_batches), so this run never re-places",
                planner,
                name,
                value,
                total,
            )
