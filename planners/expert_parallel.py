"""Expert-parallel execution shared by the replication planners (`ep_static`, `eplb`,
`predictive_replication`, `oracle_replication`): they differ only in which experts each device
holds for each (batch, layer): a `SlotPolicy`.

Setting: G compute devices, either G GPUs (`gpu`, `gpu:1`, ...; device d's NVLink is `p2p:d`
into it and `p2p_out:d` out of it, full duplex, each direction's transfers sharing its
bandwidth: a simulator pool) or G concurrent lanes on one GPU (`lanes=True`:
no dispatch/combine traffic; lane d runs on `lane{d}`, by default a partition of 1/G of the
GPU's SMs and memory bandwidth, so the lanes together have one GPU's capacity: `lane_share`; or,
`lane_sharing="shared"`, as plain CUDA streams whose kernels share the SMs, each up to what its
thread blocks fill: a simulator pool, which the replica gate weighs with `pool_makespan_s`).
Every device holds `slots_per_device` expert copies per MoE layer; all weights stay resident. Dense work (attention, gate, shared experts,
head) is data-parallel over the G GPUs, each running (and gating) its contiguous share of the
batch's sequences, or tensor-parallel (`dense`: every GPU runs every token on 1/G of the weights,
partial sums all-reduced); on lanes it runs as whole-GPU kernels on `compute`, between the lanes'
expert phases. At each MoE layer the tokens are dispatched to the devices holding their experts
(the pairs of each GPU's sequences leave by its `p2p_out:d`, the pairs it computes arrive by
its `p2p:d`, as `core.dispatch.traffic` counts them; tensor-parallel: every GPU has them), a
replicated expert's tokens split evenly over its copies (`dispatch="balanced"`: over the devices
holding it so that the busiest holds the fewest tokens, `balanced_split`), and results are
combined back (all-reduced), so a layer lasts as long as its busiest device.
A device's expert work in a layer is ONE grouped-GEMM op (`grouped_gemm=True`, how vLLM/SGLang's
fused MoE and DeepEP + DeepGEMM run it): roofline of its total tokens x expert flops and the bytes
of the distinct experts it touches, plus one launch overhead; `grouped_gemm=False` emits one op
per (device, expert) as an eager per-expert loop does (docs/replication-model.md).
A copy whose expert changes is refilled from a device holding it (`copy_moves`: into `p2p:d`
and out of the source's `p2p_out`; on lanes within the GPU's memory, `d2d`) after the slot's
previous user is done and once the policy's information exists: behind earlier layers, not on
the critical path unless it is late. Iteration t = (step, batch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from core.cost import TILE, CostModel, gemm_blocks, pool_makespan_s
from core.dispatch import (  # noqa: F401  (re-exported: planners' and tests' names)
    DENSE,
    DISPATCH,
    balanced_split,
    copies_sent,
    copy_moves,
    micro_batch_rows,
    micro_batch_seqs,
    source_counts,
    split_tokens,
    times_held,
    traffic,
    water_fill_level,
    whole_tokens,
)
from core.errors import CapacityError, ConfigError
from core.planner import PlanContext
from core.routing import GateView
from core.schedule import ScheduleBuilder
from core.spec import ModelSpec
from core.types import OpKind, Resource, Stream, Tensor, Tier
from planners.common import Emitter, standard_placement

GATES = ("none", "time", "time+copy")
LANE_SHARING = ("partition", "shared")
POOL = "gpu-sms"  # the shared lanes' pool: one GPU's SMs


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
    lane_sharing: str = "partition"
    replica_slots: int = 2  # extra expert slots per device per MoE layer (the replica budget)
    replicas: int = -1  # redundant copies per layer to place; -1 = at most every slot
    # One grouped-GEMM op per device per layer (simulator only: the real executor runs one op per
    # expert, the default); the replication experiment turns it on.
    grouped_gemm: bool = False
    # Replica cost gate (FasterMoE-style, replication.md §2.2): "none" fills the budget with
    # EPLB's greedy; "time" adds a copy only while it makes the modelled busiest device finish
    # sooner; "time+copy" also charges a copy that is not already resident its transfer time.
    gate: str = "none"
    # Dense work (attention, shared experts, dense FFN, head) over G GPUs: "data" = each GPU runs
    # its share of the batch's sequences; "tensor" = every GPU runs every sequence on 1/G of the
    # heads / FFN columns / vocabulary, then an all-reduce (vLLM's TP attention + EP experts).
    # Lanes run dense work on the whole GPU either way.
    dense: str = "data"
    # How a replicated expert's tokens go to its copies once the gate has routed the batch:
    # "even" = split evenly (the replication paper's rule); "balanced" = water-filled over the
    # devices holding it, given every other expert's tokens, so the busiest device holds as few
    # tokens as the placement allows (`balanced_split`). The replica gate models the same rule.
    dispatch: str = "even"
    # Two-batch overlap (DeepSeek's and SGLang's TBO; G GPUs with data-parallel dense work): each
    # batch runs as this many micro-batches of its sequences, each with its own gate, all-to-all
    # and experts, so that one's dispatch and combine run beside another's compute. They share
    # the batch's placement (one refill). 1 = the whole batch at once.
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ConfigError(f"planner gate={self.gate!r} unknown; valid: {', '.join(GATES)}")
        if self.dense not in DENSE:
            raise ConfigError(f"planner dense={self.dense!r} unknown; valid: {', '.join(DENSE)}")
        if self.dispatch not in DISPATCH:
            raise ConfigError(
                f"planner dispatch={self.dispatch!r} unknown; valid: {', '.join(DISPATCH)}"
            )
        if self.lane_sharing not in LANE_SHARING:
            raise ConfigError(
                f"planner lane_sharing={self.lane_sharing!r} unknown; valid: "
                f"{', '.join(LANE_SHARING)}"
            )
        if not 0.0 <= self.lane_share <= 1.0:
            raise ConfigError(
                f"planner lane_share={self.lane_share} must be in [0, 1] (0 = 1/n_devices)"
            )
        if self.replicas < -1:
            raise ConfigError(
                f"planner replicas={self.replicas} must be >= 0, or -1 (at most every slot)"
            )
        if self.micro_batches < 1:
            raise ConfigError(
                f"planner micro_batches={self.micro_batches} must be >= 1 (2: two-batch overlap)"
            )

    def no_gate(self, planner: str) -> None:
        """Planners that place without the replica cost gate refuse one."""
        if self.gate != "none":
            raise ConfigError(
                f"planner gate={self.gate!r}: {planner} has no replica cost gate (the "
                "replication planners do); drop it"
            )


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
    dense: str = "data"  # see EPParams; lanes: "data" (their dense work runs on the whole GPU)
    lane_sharing: str = "partition"  # see EPParams
    dispatch: str = "even"  # see EPParams
    micro_batches: int = 1  # see EPParams

    @property
    def slots_per_device(self) -> int:
        return self.home_slots + self.replica_slots

    @property
    def shared(self) -> bool:
        """Lanes whose kernels share the GPU's SMs (a processor-sharing pool)."""
        return self.lanes and self.lane_sharing == "shared"

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
            raise ConfigError(f"planner rehome_interval={self.rehome_interval} must be >= 0")


class Replicator:
    """Homes and replicas of one layer after another for a replication policy: homes re-placed
    every `rehome_interval` iterations (re-packed from scratch, or under a gate also by
    `swap_homes`, when that pays), replicas by `replicate_onto` with the params' gate; keeps
    what is resident so the "time+copy" gate charges only new copies."""

    def __init__(
        self, p: ReplicaParams, layout: Layout, timer: ExpertTime, homes: list[np.ndarray]
    ) -> None:
        self.p, self.layout, self.timer, self.homes = p, layout, timer, homes
        self.resident: dict[int, np.ndarray] = {}

    @classmethod
    def for_run(
        cls, p: ReplicaParams, ctx: PlanContext, layout: Layout, who: str
    ) -> tuple[Replicator, np.ndarray | None]:
        """The run's replicator, homes packed from `p.initial_load` (else round-robin), and that
        load [MoE layers, E] (None without one); `who` names the planner in errors."""
        n_layers, e = len(ctx.model.moe_layers), ctx.model.n_experts
        init = read_load(p.initial_load, n_layers, e, who) if p.initial_load else None
        homes = [home_slots(layout, None if init is None else init[m]) for m in range(n_layers)]
        return cls(p, layout, ExpertTime.of(ctx, layout), homes), init

    def rehome_due(self, t: int) -> bool:
        return self.p.rehome_interval > 0 and t > 0 and t % self.p.rehome_interval == 0

    def place(
        self,
        moe: int,
        load: np.ndarray,
        home_load: np.ndarray | None = None,
        scenarios: np.ndarray | None = None,
    ) -> np.ndarray:
        """[G, K] for predicted load [E]; re-packs homes by `home_load` [E] when given. With
        `scenarios` [S, E] the gate judges placements on them (`replicate_onto`)."""
        old = self.resident.get(moe)
        slots = self._with_replicas(moe, load, self.homes[moe], scenarios)
        if old is None and self.p.gate != "none":
            # The first placement is preloaded with the model, so its copies cost no transfer:
            # fill every replica slot when that is modelled no slower than the gate's choice;
            # copies that cost nothing hedge against the prediction (a prior) being wrong.
            full = replicate_onto(load, self.layout, self.homes[moe])
            if self.timer.span(full, load, scenarios) <= self.timer.span(slots, load, scenarios):
                slots = full
        if home_load is not None and home_load.sum() > 0:
            # EPLB's packing from scratch, and under a gate also a few swaps from where the homes
            # are: a full re-pack moves nearly every home, and its copies seldom pay
            options = [home_slots(self.layout, home_load)]
            if self.p.gate != "none" and old is not None:
                options.append(swap_homes(self.homes[moe], home_load, self.layout))
            for homes in options:
                moved = self._with_replicas(moe, load, homes, scenarios)
                if (
                    self.p.gate == "none"
                    or old is None
                    or self._pays(moved, slots, old, load, scenarios)
                ):
                    self.homes[moe], slots = homes, moved
        self.resident[moe] = slots
        return slots

    def _with_replicas(
        self, moe: int, load: np.ndarray, homes: np.ndarray, scenarios: np.ndarray | None
    ) -> np.ndarray:
        return replicate_onto(load, self.layout, homes, gate=self.p.gate, timer=self.timer,
                              resident=self.resident.get(moe), scenarios=scenarios)  # fmt: skip

    def _pays(
        self,
        new: np.ndarray,
        keep: np.ndarray,
        old: np.ndarray,
        load: np.ndarray,
        scenarios: np.ndarray | None = None,
    ) -> bool:
        """The gate applied to re-homing: the busiest device of `new` finishes sooner than with
        `keep`, each charged the time its copies from `old` run late ("time+copy"; `keep`'s
        re-chosen replicas may need copies too, and a move that needs fewer was refused); or as
        soon, and the busiest device alone (its copies aside) as soon too, holding fewer
        predicted tokens (`_fewer_peak_tokens`). Late copies can make the two totals tie
        whatever the spans (each total is then its copy queue): there the shorter span wins."""
        s_new, s_keep = (self.timer.span(s, load, scenarios) for s in (new, keep))
        t_new, t_keep = s_new, s_keep
        if self.p.gate == "time+copy":
            t_new += self.timer.late_copy_s(self.timer.queue(new, old), s_new)
            t_keep += self.timer.late_copy_s(self.timer.queue(keep, old), s_keep)
        if not math.isclose(t_new, t_keep, rel_tol=1e-9):
            return t_new < t_keep
        if not math.isclose(s_new, s_keep, rel_tol=1e-9):
            return s_new < s_keep
        return self._fewer_peak_tokens(new, keep, load)

    def _fewer_peak_tokens(self, new: np.ndarray, keep: np.ndarray, load: np.ndarray) -> bool:
        """A move the gate finds no slower is taken when it balances the tokens (`new`'s busiest
        device holds fewer of `load`'s than `keep`'s). Memory-bound layers tie: each device
        reads all its experts' weights however the tokens fall, so a re-homing never pays in
        time there; a balanced placement is what a batch hotter than predicted runs fastest on.
        Its copies run as late as keeping's by the gate's model (mostly not at all: they hide
        behind the other layers); the simulator runs them on the links beside the all-to-all,
        which they slow a little (docs/replication-model.md, "Ties go to balance"). With
        `scenarios` the tie is on their mean time, the tokens those of `load`."""
        peak = [predicted_tokens(s, load, self.p.dispatch).sum(1).max() for s in (new, keep)]
        return bool(peak[0] < peak[1])


def resolve_layout(p: EPParams, ctx: PlanContext) -> Layout:
    g = p.n_devices or ctx.hardware.n_gpus
    e = ctx.model.n_experts
    if not 1 <= g <= e:
        raise ConfigError(
            f"planner n_devices={g} must be in [1, {e}] (the model's experts); lower n_devices"
        )
    gpus = ctx.hardware.n_gpus
    if not p.lanes and g > gpus:
        raise ConfigError(
            f"planner n_devices={g} exceeds hardware {ctx.hardware.name}'s n_gpus={gpus}; use "
            "hardware with more GPUs (hardware.n_gpus), lanes=true for G lanes of one GPU, or "
            "a smaller n_devices"
        )
    if p.replica_slots < 0:
        raise ConfigError(f"planner replica_slots={p.replica_slots} must be >= 0")
    replicas = g * p.replica_slots if p.replicas < 0 else p.replicas
    if replicas > g * p.replica_slots:
        raise ConfigError(
            f"planner replicas={replicas} exceeds the {g * p.replica_slots} replica slots "
            f"(n_devices={g} x replica_slots={p.replica_slots}); raise replica_slots or lower replicas"
        )
    dense = "data" if p.lanes else p.dense
    why = ctx.model.tensor_split_error(g) if dense == "tensor" else None
    if why:
        raise ConfigError(
            f"planner dense=tensor splits attention heads over n_devices={g}, but model "
            f"{ctx.model.name}'s {why}; use dense=data or another n_devices"
        )
    if p.micro_batches > 1:
        mb, bs = p.micro_batches, ctx.workload.batch_size
        where = ("lanes=true (one GPU's memory)" if p.lanes
                 else "dense=tensor (every GPU holds every token)" if dense == "tensor" else "")  # fmt: skip
        if where:
            raise ConfigError(
                f"planner micro_batches={mb} overlaps one micro-batch's all-to-all with "
                f"another's compute, but {where} moves no tokens; use micro_batches=1"
            )
        if -(-bs // g) < mb:
            raise ConfigError(
                f"planner micro_batches={mb} splits each GPU's share of a batch's sequences, but "
                f"workload.batch_size={bs} over n_devices={g} gives a GPU at most "
                f"{-(-bs // g)}; lower micro_batches or raise the batch size"
            )
    return Layout(g, e, -(-e // g), p.replica_slots, replicas, p.lanes, p.grouped_gemm,
                  p.lane_share, dense, p.lane_sharing, p.dispatch, p.micro_batches)  # fmt: skip


def expert_width(m: ModelSpec, rows: Iterable[int]) -> int:
    """Thread blocks of a device's expert op (one expert's tokens, or each expert's of a grouped
    GEMM): those of its up-projection GEMM (SwiGLU's gate and up fused: (matrices - 1) x F
    columns) and of its down-projection (H columns), averaged by the weight bytes each reads."""
    return max(1, round(_mean_blocks(m, gemm_blocks(rows, TILE))))  # rows -> output row tiles


def expert_widths(m: ModelSpec, rows: np.ndarray) -> np.ndarray:
    """`expert_width` of many one-expert ops at once, each of `rows` [N] (> 0) tokens."""
    tiles = -(-rows.astype(np.int64) // TILE)
    return np.maximum(1, np.round(_mean_blocks(m, tiles))).astype(np.int64)


def _mean_blocks(m: ModelSpec, row_tiles: Any) -> Any:
    """`expert_width` before rounding, for ops of `row_tiles` output row tiles (an int, or an
    array of them): each GEMM's blocks are its row tiles times its column tiles."""
    k = m.ffn_matrices - 1
    up, down = (
        row_tiles * -(-(k * m.expert_ffn_size) // TILE),
        row_tiles * -(-m.hidden_size // TILE),
    )
    return (k * up + down) / (k + 1)


class SlotPolicy(Protocol):
    """Decides each device's expert copies; sees routing only through `observe` (causal)."""

    def place(self, t: int, moe: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """[G, K] expert ids (-1 empty) for iteration t, MoE layer `moe`, and the ops whose
        routing the decision used (the copies it triggers wait for them)."""
        ...

    def observe(self, t: int, moe: int, view: GateView, gates: tuple[int, ...]) -> None:
        """Iteration t's routing at MoE layer `moe`, revealed once all of its gate ops (one per
        device that gates a share of the batch) have run."""
        ...


class PredictionError:
    """How far a policy's placements were planned from the truth: per (iteration, MoE layer), the
    total-variation distance (half the L1 distance of the shares) between the load the placement
    was planned from and the iteration's true load, revealed by its gates. 0 for the oracle."""

    def __init__(self) -> None:
        self.planned: dict[tuple[int, int], np.ndarray] = {}
        self.tv: list[float] = []

    def planned_from(self, t: int, moe: int, load: np.ndarray) -> None:
        self.planned[(t, moe)] = np.asarray(load, dtype=np.float64)

    def observed(self, t: int, moe: int, counts: Any) -> None:
        load, true = self.planned.pop((t, moe)), np.asarray(counts, dtype=np.float64)
        if load.sum() > 0 and true.sum() > 0:
            self.tv.append(0.5 * float(np.abs(load / load.sum() - true / true.sum()).sum()))

    def mean(self) -> float | None:
        return float(np.mean(self.tv)) if self.tv else None


def read_npy(path: str, label: str, shape: tuple[int | None, ...], need: str) -> np.ndarray:
    """A .npy array of loads or counts whose shape matches `shape` (None: any length >= 1 on that
    axis), finite and >= 0 (all 0 is a table with no pairs yet: a one-MoE-layer model's
    transitions), or one ConfigError naming `label` (the param), the file
    and what is wrong (`need`: the shape the model needs)."""
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{label} {path}: cannot read a .npy array ({e})") from None
    fits = arr.ndim == len(shape) and all(
        n == want if want is not None else n >= 1 for n, want in zip(arr.shape, shape, strict=True)
    )
    if not fits:
        raise ConfigError(f"{label} {path}: shape {arr.shape}, the model needs {need}")
    try:
        out = arr.astype(np.float64)
    except (TypeError, ValueError):
        raise ConfigError(f"{label} {path}: dtype {arr.dtype}, not numbers") from None
    if not np.isfinite(out).all() or (out < 0).any():
        raise ConfigError(
            f"{label} {path}: loads must be finite counts >= 0 "
            f"(min {np.nanmin(out) if not np.isnan(out).all() else 'nan'}, "
            f"{int(np.isnan(out).sum())} NaN)"
        )
    return out


def read_load(path: str, n_layers: int, n_experts: int, who: str) -> np.ndarray:
    """A .npy [MoE layers, experts] load matrix (e.g. token counts of a training split)."""
    return read_npy(path, f"{who} initial_load", (n_layers, n_experts),
                    f"[{n_layers} MoE layers, {n_experts} experts]")  # fmt: skip


def swap_homes(homes: np.ndarray, load: np.ndarray, layout: Layout) -> np.ndarray:
    """Homes [G, K] (replica slots emptied) re-balanced under load [E] by swapping two homes
    between devices, each device in at most one swap (so each receives at most one copy): the
    busiest device not yet swapped takes the swap that lowers the larger of the pair's loads the
    most, until no swap lowers it."""
    h = layout.home_slots
    out = homes.copy()
    out[:, h:] = -1
    dev = np.array([load[row[row >= 0]].sum() for row in out])  # [G] home load
    free = [int(d) for d in np.argsort(-dev, kind="stable")]  # devices not yet swapped
    while len(free) >= 2:
        b = free.pop(0)
        best: tuple[float, int, int, int, float] | None = None
        for i in np.flatnonzero(out[b, :h] >= 0):
            for d in free:
                for j in np.flatnonzero(out[d, :h] >= 0):
                    delta = load[out[b, i]] - load[out[d, j]]
                    pair = max(dev[b] - delta, dev[d] + delta)
                    if delta > 0 and pair < dev[b] and (best is None or pair < best[0]):
                        best = (pair, int(i), d, int(j), delta)
        if best is None:
            continue
        _, si, sd, sj, delta = best
        out[b, si], out[sd, sj] = out[sd, sj], out[b, si]
        dev[b], dev[sd] = dev[b] - delta, dev[sd] + delta
        free.remove(sd)
        free.sort(key=lambda x: -dev[x])
    return out


def home_slots(layout: Layout, load: np.ndarray | None) -> np.ndarray:
    """[G, K] homes: round-robin, or with a load [E] EPLB's balanced packing of one copy per
    expert (needs G | E); replica slots empty."""
    from planners.eplb_algo import balanced_packing

    if load is None or layout.n_experts % layout.n_devices:
        return layout.round_robin()
    pack, rank = balanced_packing(np.asarray(load, dtype=np.float64)[None], layout.n_devices)
    slots = np.full((layout.n_devices, layout.slots_per_device), -1, dtype=np.int64)
    slots[pack[0], rank[0]] = np.arange(layout.n_experts)
    return slots


@dataclass(frozen=True)
class ExpertTime:
    """The simulator's time for one device's expert work in one layer: `core.cost`'s duration of
    the op(s) `EPRunner.moe_layer` emits for it, so the replica gate and the simulation agree."""

    cost: CostModel
    expert_params_flops: float  # flops of one token through one expert
    expert_bytes: int  # weight bytes of one expert
    grouped: bool  # one grouped-GEMM op (else one op per expert)
    copy_s: float  # one replica copy on the device link (lanes: within the GPU's memory)
    share: float = 1.0  # of the GPU each device gets: 1/G for lanes (`Layout.share`)
    # lanes sharing the GPU's SMs (`Layout.shared`): the model, for its kernels' widths
    pool_model: ModelSpec | None = None
    dispatch: str = "even"  # how a replicated expert's tokens split (`EPParams.dispatch`)
    one_link: bool = False  # lanes: every lane's copies queue on the one GPU's copy path
    # micro-batches a layer's expert work runs as (`EPParams.micro_batches`): each its own op(s),
    # with its share of every expert's tokens, reading the experts' weights again
    micro: int = 1
    # the share of a GPU's SMs a replica copy holds while it runs (`gpu.copy_sms`; G GPUs): the
    # compute beside it runs that much slower, hidden copy or not
    copy_sm_share: float = 0.0

    @classmethod
    def of(cls, ctx: PlanContext, layout: Layout) -> ExpertTime:
        cost, m = CostModel(ctx.hardware), ctx.model
        copy_s = cost.transfer_s(Resource.D2D if layout.lanes else Resource.P2P, m.expert_bytes)
        return cls(cost, m.expert_flops(1), m.expert_bytes, layout.grouped_gemm, copy_s,
                   layout.share, m if layout.shared else None, layout.dispatch,
                   layout.lanes, layout.micro_batches,
                   0.0 if layout.lanes else ctx.hardware.gpu.copy_share)  # fmt: skip

    def queue(self, slots: np.ndarray, resident: np.ndarray) -> int:
        """The copies `slots` needs over `resident` on the longest copy queue: on lanes all of
        them on the one GPU's (`new_copies`); on G GPUs per direction of each GPU's link, the
        copies into it or out of it (from the source `copy_moves` picks), the longer."""
        into = new_copies(slots, resident, self.one_link)
        if self.one_link or not into:
            return into
        return max(into, int(copies_sent(resident, slots).max()))

    def late_copy_s(self, queue: int, layer_s: float) -> float:
        """What the longest queue of `queue` copies (`queue`) adds to a layer: copies run behind
        earlier layers on the device's link, which the all-to-all mostly leaves free while
        experts compute (a GPU's results may start coming back during its own expert phase), so
        in steady state each layer's copies get the link for about one expert phase (`layer_s`,
        the busiest device's modelled time); only the excess is late. Where copies hold SMs
        (`copy_sm_share`: NCCL's p2p kernels) each also slows the compute it runs beside, hidden
        or not, by that share of its time."""
        busy = queue * self.copy_s
        return max(0.0, busy - layer_s) + busy * self.copy_sm_share

    def span(self, slots: np.ndarray, load: np.ndarray, scenarios: np.ndarray | None) -> float:
        """The layer's modelled expert time with slots [G, K]: the busiest device's time under
        load [E], or with `scenarios` [S, E] its mean over them (an expectation over loads the
        prediction may turn out to be)."""
        if scenarios is None:
            return self._span(slots, load)
        return float(np.mean([self._span(slots, s) for s in scenarios]))

    def _span(self, slots: np.ndarray, load: np.ndarray) -> float:
        """The busiest device's time; on lanes that share the SMs the phase as the simulator's
        pool runs it (`pool_makespan_s`: the lanes' ops side by side, each at most its cap)."""
        if self.pool_model is None:
            return float(self.device_times(slots, load).max())
        tokens = predicted_tokens(slots, load, self.dispatch)
        return pool_makespan_s([self.pool_ops(row) for row in tokens])

    def device_times(self, slots: np.ndarray, load: np.ndarray) -> np.ndarray:
        """[G] each device's modelled time (`device_s`) for slots [G, K] if load [E] splits
        over the copies by `dispatch`."""
        tokens = predicted_tokens(slots, load, self.dispatch)
        if self.pool_model is not None:
            return np.array([self.device_s(row) for row in tokens])
        return self._own_times(tokens)

    def _own_times(self, tokens: np.ndarray) -> np.ndarray:
        """[G] `device_s` of devices that do not share the SMs, for tokens [G, E], all at once
        (the gate's inner loop): each row's sums run along it (so a row alone gives the same).
        As `micro` micro-batches: that many times the ops over 1/micro of each expert's tokens
        (how a predicted load would split; the real split is each micro-batch's routing)."""
        busy, m = tokens > 0, self.micro
        if self.grouped:  # one op per device with tokens: all its tokens, every expert it reads
            n = busy.sum(1)
            flops = self.expert_params_flops * np.where(busy, tokens, 0.0).sum(1) / m
            t = self.cost.compute_vec(Resource.GPU, OpKind.EXPERT, flops,
                                      n * float(self.expert_bytes), self.share)  # fmt: skip
            return np.where(n > 0, m * t, 0.0)
        t = self.cost.compute_vec(Resource.GPU, OpKind.EXPERT,
                                  (self.expert_params_flops * tokens / m).ravel(),
                                  np.full(tokens.size, float(self.expert_bytes)), self.share)  # fmt: skip
        return np.where(busy, m * t.reshape(tokens.shape), 0.0).sum(1)

    def _ops(self, tokens: np.ndarray) -> list[tuple[float, float, list[float]]]:
        """The expert ops of a device computing tokens [E]: (flops, bytes, rows per expert)."""
        busy = tokens[tokens > 0]
        if self.grouped:
            f = self.expert_params_flops * busy.sum()
            return [(f, len(busy) * self.expert_bytes, list(busy))] if len(busy) else []
        return [(self.expert_params_flops * n, self.expert_bytes, [n]) for n in busy]

    def pool_ops(self, tokens: np.ndarray) -> list[tuple[float, float, float]]:
        """A lane's expert ops on a shared GPU: (overhead, work at the whole GPU, cap) each."""
        assert self.pool_model is not None
        over, out = self.cost.overhead_s(Resource.GPU, OpKind.EXPERT), []
        if not self.grouped:  # one op per expert: all of them at once
            busy = tokens[tokens > 0]
            fl = self.expert_params_flops * busy
            by = np.full(len(busy), float(self.expert_bytes))
            works = self.cost.compute_vec(Resource.GPU, OpKind.EXPERT, fl, by, 1.0) - over
            caps = self.cost.cap_vec(
                Resource.GPU, fl, by, expert_widths(self.pool_model, np.ceil(busy))
            )
            return [(over, w, c) for w, c in zip(works.tolist(), caps.tolist(), strict=True)]
        for f, b, rows in self._ops(tokens):
            width = expert_width(self.pool_model, np.ceil(rows))
            work = self.cost.compute_s(Resource.GPU, OpKind.EXPERT, f, b) - over
            out.append((over, work, self.cost.cap(Resource.GPU, f, b, width)))
        return out

    def device_s(self, tokens: np.ndarray) -> float:
        """tokens [E] (may be fractional: predicted) this device computes per expert. On lanes
        that share the SMs: each op's launch plus its work at the share its width can fill, as
        if the lane had the GPU to itself."""
        if self.pool_model is not None:
            return sum(over + work / cap for over, work, cap in self.pool_ops(tokens))
        return float(self._own_times(np.asarray(tokens, dtype=np.float64)[None])[0])


def new_copies(slots: np.ndarray, resident: np.ndarray, one_queue: bool = False) -> int:
    """The longest per-device queue of copies that `slots` [G, K] needs over `resident` [G, K]:
    per device, the experts it holds and did not hold before (each empty slot is -1; a second
    slot of an expert the device holds already shares its weights: no copy, as in the real
    run's `copy_moves`); `one_queue` (lanes): all devices' copies in one queue."""
    e = int(max(slots.max(initial=-1), resident.max(initial=-1))) + 1
    more = (times_held(slots, e) > 0) & (times_held(resident, e) == 0)
    per = more.sum(1)
    return int(per.sum() if one_queue else per.max(initial=0))


def predicted_tokens(slots: np.ndarray, load: np.ndarray, dispatch: str = "even") -> np.ndarray:
    """[G, E] tokens per device and expert if each expert's load [E] splits (fractionally) over its
    copies in slots [G, K]: evenly, or by `balanced_split` (dispatch="balanced")."""
    if dispatch == "balanced":
        return balanced_split(slots, load)
    g, e = slots.shape[0], len(load)
    dev = np.repeat(np.arange(g), slots.shape[1])
    ids = slots.ravel()
    keep = ids >= 0
    copies = np.bincount(ids[keep], minlength=e)  # [E]
    out = np.zeros((g, e))
    np.add.at(out, (dev[keep], ids[keep]), load[ids[keep]] / np.maximum(copies[ids[keep]], 1))
    return out


def replicate_onto(
    load: np.ndarray,
    layout: Layout,
    homes: np.ndarray | None = None,
    *,
    gate: str = "none",
    timer: ExpertTime | None = None,
    resident: np.ndarray | None = None,
    scenarios: np.ndarray | None = None,
) -> np.ndarray:
    """[G, K] slots: homes (default round-robin) plus replica copies. load [E] predicted tokens.

    gate "none": `layout.replicas` copies given to the largest per-copy load (EPLB's greedy), each
    on the lightest device with a free slot (preferring one without that expert).
    gate "time" / "time+copy" (after FasterMoE's shadowing rule, replication.md §2.2): copies
    added one at a time in the same greedy order, each onto the modelled least busy device
    (`timer`) with a free slot that lacks it; the prefix whose busiest device finishes first is
    kept, for "time+copy" charged the copies not already in `resident` [G, K] that cannot hide
    behind the other layers (`ExpertTime.late_copy_s`). A copy adds the expert's weight bytes to
    the grouped GEMM's roofline, so in memory-bound layers replication can lose and the gate
    declines it. Either way `polish` then improves the replica slots (kept under a gate only if
    modelled faster). With `scenarios` [S, E] (loads the prediction may turn out to be, e.g. other
    splits' loads) the gate compares placements by their mean busiest-device time over
    the scenarios (`ExpertTime.span`) instead of under `load` alone; the greedy order stays `load`'s.
    """
    slots = layout.round_robin() if homes is None else homes.copy()
    load = np.asarray(load, dtype=np.float64)
    if gate != "none":
        assert timer is not None, "a gated replication needs the cost model"
        return _gated(load, layout, slots, gate, timer, resident, scenarios)
    from planners.eplb_algo import replicate_experts

    g, e = layout.n_devices, layout.n_experts
    cnt = replicate_experts(load[None], e + layout.replicas)[2][0]  # [E] copies per expert
    per_copy = load / cnt
    dev_load = np.array([per_copy[row[row >= 0]].sum() for row in slots])  # [G]
    free = np.full(g, layout.home_slots)  # next free slot index per device
    extra = [ex for ex in np.argsort(-per_copy, kind="stable") for _ in range(cnt[ex] - 1)]
    for ex in extra:
        open_ = np.flatnonzero(free < layout.slots_per_device)
        fresh = [d for d in open_ if ex not in slots[d]]
        cand = np.array(fresh) if fresh else open_
        d = int(cand[np.argmin(dev_load[cand])])
        slots[d, free[d]] = ex
        free[d] += 1
        dev_load[d] += per_copy[ex]
    return polish(slots, load, layout)


def _gated(
    load: np.ndarray,
    layout: Layout,
    slots: np.ndarray,
    gate: str,
    timer: ExpertTime,
    resident: np.ndarray | None,
    scenarios: np.ndarray | None = None,
) -> np.ndarray:
    """Replicas added one at a time in EPLB's greedy order (the expert with the largest per-copy
    load next), each on the modelled least busy device with a free slot that lacks it; of all
    these prefixes, the one whose busiest device finishes first (charged, for "time+copy", the
    longest per-device queue of copies not already resident; lanes: all lanes' copies as one
    queue) is kept. Looking at every prefix
    rather than stopping at the first copy that does not pay lets a copy that only pays together
    with the next one (a hot expert split three ways) be taken."""

    def cost(trial: np.ndarray) -> float:
        span = timer.span(trial, load, scenarios)
        if gate != "time+copy" or resident is None:
            return span
        return span + timer.late_copy_s(timer.queue(trial, resident), span)

    free = np.full(layout.n_devices, layout.home_slots)
    copies = np.bincount(slots[slots >= 0], minlength=layout.n_experts)
    times = timer.device_times(slots, load)  # [G]
    best, best_cost = slots, cost(slots)
    for _ in range(layout.replicas):
        order = np.argsort(-(load / np.maximum(copies, 1)), kind="stable")
        pick = None
        for ex in order[: layout.n_experts]:
            if load[ex] <= 0:
                break
            cand = [d for d in range(layout.n_devices)
                    if free[d] < layout.slots_per_device and ex not in slots[d]]  # fmt: skip
            if cand:
                pick = int(ex), min(cand, key=lambda c: (times[c], c))
                break
        if pick is None:
            break
        ex, d = pick
        slots = slots.copy()
        slots[d, free[d]] = ex
        free[d] += 1
        copies[ex] += 1
        times = timer.device_times(slots, load)
        c = cost(slots)
        if c < best_cost:
            best, best_cost = slots, c
    polished = polish(best, load, layout)
    return polished if cost(polished) < best_cost else best


def polish(slots: np.ndarray, load: np.ndarray, layout: Layout, rounds: int = 64) -> np.ndarray:
    """Local search over the replica slots (homes stay): refill a replica slot (or fill a free one,
    within the `replicas` budget) with an expert of the busiest device, or empty one of its
    replicas, while that lowers (max device tokens, sum of squares) under the even split.

    The greedy that fills the slots places copies one at a time and can leave the busiest device
    with a better move; this takes the best single-slot move until none helps (at most
    `rounds`; of equally good moves the first in the order they are listed)."""
    g, e, h = layout.n_devices, layout.n_experts, layout.home_slots
    member = np.zeros((g, e))
    for d in range(g):
        np.add.at(member[d], slots[d][slots[d] >= 0], 1.0)

    def scores(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # m [T, G, E] -> max, sum sq [T]
        # each trial's matrix @ vector as one product of the stack: the same gemv per trial
        dev = np.matmul(m, (load / np.maximum(m.sum(1), 1.0))[:, :, None])[:, :, 0]
        return dev.max(1), (dev**2).sum(1)

    slots = slots.copy()
    now_max, now_sq = (float(v[0]) for v in scores(member[None]))
    # replicas placed; a free slot is filled only while this is below the budget
    filled = int((slots[:, h:] >= 0).sum())
    for _ in range(rounds):
        busiest = int(np.argmax(member @ (load / np.maximum(member.sum(0), 1.0))))
        moves: list[tuple[int, int, int]] = []  # (expert put in or -1, device, slot)
        for x in np.flatnonzero((member[busiest] > 0) & (load > 0)):
            for d in range(g):
                if member[d, x]:
                    continue
                for j in range(h, layout.slots_per_device):
                    y = int(slots[d, j])
                    if y < 0 and filled >= layout.replicas:
                        break
                    moves.append((int(x), d, j))
                    if y < 0:
                        break  # free slots of one device are interchangeable
        # or empty one of the busiest device's replicas
        moves += [(-1, busiest, j) for j in range(h, layout.slots_per_device)
                  if slots[busiest, j] >= 0]  # fmt: skip
        if not moves:
            break
        trials = np.repeat(member[None], len(moves), axis=0)
        t_idx = np.arange(len(moves))
        put, dev, slot = (np.array(c) for c in zip(*moves, strict=True))
        out = slots[dev, slot]
        trials[t_idx[out >= 0], dev[out >= 0], out[out >= 0]] -= 1
        trials[t_idx[put >= 0], dev[put >= 0], put[put >= 0]] += 1
        mx, sq = scores(trials)
        better = (mx < now_max) | ((mx == now_max) & (sq < now_sq))
        if not better.any():
            break
        cand = np.flatnonzero(better)
        best = cand[np.lexsort((cand, sq[cand], mx[cand]))[0]]
        now_max, now_sq = float(mx[best]), float(sq[best])
        pick, d, j = moves[best]
        if slots[d, j] >= 0:
            member[d, slots[d, j]] -= 1
            filled -= 1
        if pick >= 0:
            member[d, pick] += 1
            filled += 1
        slots[d, j] = pick
    return slots


@dataclass
class EPRunner:
    """Emits a whole run for one policy. `plan` is the planner's body."""

    ctx: PlanContext
    out: ScheduleBuilder
    layout: Layout
    resident: dict[int, np.ndarray] = field(default_factory=dict)  # moe -> [G, K] slots now filled
    layer_done: dict[int, tuple[int, ...]] = field(
        default_factory=dict
    )  # moe -> ops ending its last use
    n_copies: int = 0  # replica copies emitted
    # iteration -> [G] experts each device gains (over all MoE layers): each is held beside the
    # copy it replaces until that one is sent, as real/distributed.py holds them
    gained: dict[int, np.ndarray] = field(default_factory=dict)
    room: int = 0  # bytes a GPU has beside its resident weights, KV and replica slots
    # [G] pairs of each GPU's own tokens it sent to another GPU's experts (the all-to-all; what
    # real/distributed.py counts as `pairs_sent`)
    sent: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        m, lay, b = self.ctx.model, self.layout, self.out
        hw, wl = self.ctx.hardware, self.ctx.workload
        self.sent = np.zeros(lay.n_devices, dtype=np.int64)
        cap = hw.memory_bytes[Tier.GPU]  # one GPU's
        gpus = 1 if lay.lanes else lay.n_devices
        # The schedule's gpu tier is the G GPUs together: each holds its copy of the dense
        # weights, its share of the experts, its replica slots, its sequences' KV (every
        # batch's: an expert-parallel run keeps them all) and activations (one batch's: batches
        # run one after another); checked per GPU below
        both = replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: gpus * cap})
        b.capacity_bytes[Tier.GPU] = gpus * cap
        self.em = Emitter(
            self.ctx,
            b,
            standard_placement(
                replace(self.ctx, hardware=both), kv_sequences=wl.n_sequences,
                layers_in_flight=0, act_sequences=wl.batch_size,
            ),
        )  # fmt: skip
        expert_layer = len(m.moe_layers) * m.expert_bytes  # one expert slot on every MoE layer
        experts = m.n_experts * expert_layer
        dense_w = m.total_bytes - experts
        p = self.em.placement
        kv = p.kv_bytes_per_layer * p.kv.count(Tier.GPU)  # every batch's KV on the GPUs
        act = max(0, b.resident_bytes[Tier.GPU] - dense_w - experts - kv)  # one batch's
        tp = lay.dense == "tensor" and not lay.lanes
        dense_gpu = self.dense_share(gpus) if tp else dense_w  # one GPU's dense weights
        # the fullest GPU: data parallel, GPU 0 (the most sequences); tensor parallel, every GPU
        # holds its kv heads of every sequence (MLA: the whole latent)
        kv_share = (
            (1 if m.kv_dim else 1 / min(gpus, m.n_kv_heads))
            if tp
            else -(-wl.batch_size // gpus) / wl.batch_size
        )
        act_share = 1 if tp else -(-wl.batch_size // gpus) / wl.batch_size  # TP: every token
        held = dense_gpu + -(-m.n_experts // gpus) * expert_layer + kv * kv_share + act * act_share
        if any(t != Tier.GPU for t in self.em.placement.experts) or held > cap:
            raise CapacityError(
                f"expert parallelism keeps every expert resident, but {m.name}'s experts "
                f"({experts / 1e9:.3g} GB) with its dense weights and KV cache do not fit "
                f"{gpus} GPU(s) of {cap / 1e9:.3g} GB (the fullest holds {held / 1e9:.3g} GB); "
                "use hardware with more GPU memory, more GPUs, or a smaller model"
            )
        b.reserve(Tier.GPU, int(max(0, gpus * dense_gpu - dense_w)))  # the other GPUs' dense copies
        replica_bytes = lay.n_devices * lay.replica_slots * expert_layer
        per_gpu = lay.n_devices if lay.lanes else 1  # devices whose slots one GPU holds
        if held + per_gpu * lay.replica_slots * expert_layer > cap:
            fit = max(0, int((cap - held) // (per_gpu * expert_layer)))
            raise CapacityError(
                f"planner replica_slots={lay.replica_slots}: "
                f"{per_gpu * lay.replica_slots * expert_layer / 1e9:.3g} GB of replicas a GPU on top of "
                f"{held / 1e9:.3g} GB already resident exceed its {cap / 1e9:.3g} GB; lower "
                f"replica_slots (at most {fit} fit)"
            )
        b.reserve(Tier.GPU, replica_bytes)
        self.room = int(cap - held - per_gpu * lay.replica_slots * expert_layer)
        if lay.lanes:  # lane d: 1/G of the GPU (lane_share); dense work on all of it (em.compute)
            pool = POOL if lay.shared else ""  # or all of them share its SMs
            self.compute = [b.stream(f"lane{d}", Resource.GPU, d, lay.share, pool)
                            for d in range(lay.n_devices)]  # fmt: skip
            if pool:
                b.join_pool(self.em.compute, pool)
        else:
            self.compute = [self.em.compute] + [
                b.stream(f"{Stream.COMPUTE}{d}", Resource.GPU, d) for d in range(1, lay.n_devices)
            ]

        def link(name: str, res: Resource, d: int) -> str:
            """A stream on one direction of GPU d's link. The link's streams form a pool: their
            transfers run at once, sharing its bandwidth, as the real run's copies (on a process
            group of their own, whose NCCL kernels run beside the all-to-all's) share it. The
            real run's collectives, on the default group, run in program order among
            themselves; here one batch's combine may overlap the next one's dispatch."""
            return b.stream(name, res, d, pool=f"{res}:{d}")

        # replica copies on each GPU's link; lanes: copies within the one GPU's memory, every
        # lane's on its one copy path (`d2d`: half its HBM bandwidth, a read and a write a byte)
        self.copies = (
            [b.stream("replicas", Resource.D2D, 0)] * lay.n_devices if lay.lanes
            else [link(f"replicas{d}", Resource.P2P, d) for d in range(lay.n_devices)]
        )  # fmt: skip
        # the all-to-all: tokens and results in (`p2p:d`), and out (`p2p_out:d`); none on lanes
        # (one GPU's memory) or with tensor-parallel dense work (every GPU holds every token)
        a2a = range(0 if lay.lanes or lay.dense == "tensor" else lay.n_devices)
        self.dispatch = [link(f"dispatch{d}", Resource.P2P, d) for d in a2a]
        self.combine = [link(f"combine{d}", Resource.P2P, d) for d in a2a]
        self.sends = [link(f"send{d}", Resource.P2P_OUT, d) for d in a2a]
        # a replica copy leaves its source GPU by the same outgoing direction (not on lanes)
        self.copies_out = [link(f"replicas_out{d}", Resource.P2P_OUT, d)
                           for d in range(0 if lay.lanes else lay.n_devices)]  # fmt: skip
        self.reduce = (
            [link(f"allreduce{d}", Resource.P2P, d) for d in range(lay.n_devices)]
            if lay.dense == "tensor" else []
        )  # fmt: skip
        b.meta["ep"] = dict(
            n_devices=lay.n_devices, lanes=lay.lanes, lane_share=lay.share if lay.lanes else None,
            replica_slots=lay.replica_slots, replicas=lay.replicas,
            slots_per_device=lay.slots_per_device, replica_gb=round(replica_bytes / 1e9, 3),
            grouped_gemm=lay.grouped_gemm, dense=None if lay.lanes else lay.dense,
            lane_sharing=lay.lane_sharing if lay.lanes else None, dispatch=lay.dispatch,
            micro_batches=lay.micro_batches,
            # replica copies between GPUs hold SMs (NCCL's p2p kernels): gpu_load counts them
            copy_kernels=bool(self.ctx.hardware.gpu.copy_share) and not lay.lanes,
        )  # fmt: skip

    def dense_share(self, gpus: int) -> float:
        """Bytes of the dense weights one GPU holds under tensor-parallel dense work, as `dense`
        cuts them: 1/G of the heads, FFN columns and vocabulary; MLA's kv_a projection, the
        routers and the embeddings whole; a GQA kv head on G / n_kv_heads GPUs where the GPUs
        outnumber them."""
        m, d = self.ctx.model, self.ctx.model.dtype_bytes
        whole = m.hidden_size * m.kv_dim * d if m.kv_dim else 0
        kv_w = 0 if m.kv_dim else 2 * m.hidden_size * m.n_kv_heads * m.head_dim * d
        attn = (m.attn_bytes - whole - kv_w) / gpus + whole + kv_w / min(gpus, m.n_kv_heads)
        layers = sum(
            attn + self.em.tensor_bytes(Tensor.FFN, layer) / gpus
            + (m.gate_bytes if m.is_moe(layer) else 0)
            for layer in range(m.n_layers)
        )  # fmt: skip
        return layers + m.embed_bytes + m.head_bytes / gpus

    def plan(self, policy: SlotPolicy) -> None:
        m, wl = self.ctx.model, self.ctx.workload
        last: tuple[int, ...] = ()
        lasts: list[tuple[int, ...]] = [()] * self.layout.micro_batches
        t = 0
        for step in range(wl.n_steps):
            for batch in range(wl.n_batches):
                if self.layout.micro_batches > 1:
                    lasts = self.overlapped(policy, t, step, batch, lasts)
                    t += 1
                    continue
                for layer in range(m.n_layers):
                    attn = self.dense(OpKind.ATTENTION, step, layer, batch, last)
                    if m.is_moe(layer):
                        last = self.moe_layer(policy, t, step, layer, batch, attn)
                    else:
                        last = tuple(self.dense(OpKind.FFN, step, layer, batch, attn)) or tuple(
                            attn
                        )
                last = tuple(self.dense(OpKind.HEAD, step, -1, batch, last))
                t += 1
        self.out.meta["ep"]["copies"] = self.n_copies
        self.out.meta["ep"]["pairs_sent"] = self.sent.tolist()
        self.reserve_staging()

    def overlapped(
        self, policy: SlotPolicy, t: int, step: int, batch: int, lasts: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        """Iteration t as micro-batches (two-batch overlap): each layer emits every micro-batch's
        dense work and gate in turn, then each one's all-to-all and experts, so a GPU's compute
        stream runs micro-batch 1's attention while micro-batch 0's tokens travel, and 0's next
        attention while 1's results come back. Micro-batch i waits only for its own previous
        layer (`lasts[i]`, from the previous batch's head at layer 0). Returns each one's head."""
        m, micro = self.ctx.model, range(self.layout.micro_batches)
        for layer in range(m.n_layers):
            if m.is_moe(layer):
                lasts = self.moe_layer_micro(policy, t, step, layer, batch, lasts)
                continue
            nxt = []
            for i in micro:
                attn = self.dense(OpKind.ATTENTION, step, layer, batch, lasts[i], micro=i)
                ffn = self.dense(OpKind.FFN, step, layer, batch, attn, micro=i)
                nxt.append(tuple(ffn or attn))
            lasts = nxt
        return [tuple(self.dense(OpKind.HEAD, step, -1, batch, lasts[i], micro=i)) for i in micro]

    def reserve_staging(self) -> None:
        """GPU memory for the experts replica moves bring in while the ones they replace are
        still held (until sent: an iteration's copies of every MoE layer travel at once): the
        most any iteration brings to one GPU (on lanes, to the lanes together), reserved for the
        run on each GPU; CapacityError where that exceeds a GPU's room."""
        if not self.gained:
            return
        per_iter = np.array(list(self.gained.values()))  # [iterations, G]
        eb = self.ctx.model.expert_bytes
        if self.layout.lanes:  # one GPU holds every lane's
            most = int(per_iter.sum(1).max())
            per_gpu, total = most * eb, most * eb
        else:
            each = per_iter.max(0)  # [G] the most each GPU gains in one iteration
            per_gpu, total = int(each.max()) * eb, int(each.sum()) * eb
        if per_gpu > self.room:
            raise CapacityError(
                f"planner replica_slots={self.layout.replica_slots}: replica moves bring up to "
                f"{per_gpu // eb} experts ({per_gpu / 1e9:.3g} GB) to one GPU in one iteration, "
                f"each held beside the copy it replaces until that is sent, beyond its "
                f"{max(self.room, 0) / 1e9:.3g} GB free; lower replica_slots, or re-home less "
                "often (rehome_interval)"
            )
        self.out.reserve(Tier.GPU, total)
        self.out.meta["ep"]["staging_bytes"] = per_gpu

    def seqs(self, d: int, micro: int = -1) -> int:
        """The sequences of a batch GPU `d` runs dense work (and the gate) on: its share of them
        (data-parallel, the first `batch % G` GPUs one more), or all of them (tensor-parallel).
        Of micro-batch `micro`: that part of its share (`micro_batch_seqs`: each GPU splits its
        own sequences, so a sequence stays on its GPU and the all-to-all moves the same pairs as
        the whole batch's)."""
        if self.layout.dense == "tensor":
            return self.ctx.workload.batch_size
        s0, s1 = self.micro_seqs(d, micro)
        return s1 - s0

    def micro_seqs(self, d: int, micro: int) -> tuple[int, int]:
        lay = self.layout
        return micro_batch_seqs(self.ctx.workload.batch_size, lay.n_devices, lay.micro_batches,
                                d, micro)  # fmt: skip

    def micro_rows(self, micro: int, per: int) -> np.ndarray:
        """The rows of the batch's routing (`GateView.ids`, `per` tokens a sequence) that
        micro-batch `micro` holds, GPU by GPU."""
        lay = self.layout
        return micro_batch_rows(self.ctx.workload.batch_size, lay.n_devices, lay.micro_batches,
                                micro, per)  # fmt: skip

    def dense(
        self,
        kind: OpKind,
        step: int,
        layer: int,
        batch: int,
        deps: tuple[int, ...] | list[int],
        reduce: bool = True,
        micro: int = -1,
    ) -> list[int]:
        """Dense work of one layer. Data-parallel: device d runs attention / FFN / head for its share
        of the batch's sequences, reading its own copy of the weights; on lanes, one whole-GPU op
        over the batch. Tensor-parallel: every device runs every sequence on 1/G of the weights
        (heads, FFN columns, vocabulary), then the partial sums are all-reduced (`reduce`; the
        head's logits all-gathered). Returns the ops the next work waits for (one per device)."""
        m, wl, lay = self.ctx.model, self.ctx.workload, self.layout
        per_seq = wl.step_tokens(step)
        tp = lay.dense == "tensor"
        ranks = 1 if lay.lanes else lay.n_devices
        part = lay.n_devices if tp else 1  # each op's share of the weights and flops: 1 / part
        # a GPU's KV share under tensor parallelism: its KV heads (MLA's latent: all of it), one
        # of n_kv_heads where the GPUs outnumber them (each kv head held by G / n_kv_heads GPUs)
        kv_part = 1 if not tp or m.kv_dim else min(lay.n_devices, m.n_kv_heads)
        # MLA's kv_a projection makes the latent every head reads: each GPU runs all of it
        whole = m.hidden_size * m.kv_dim if tp and m.kv_dim else 0  # params
        # GQA's k and v projections: each GPU holds and runs its kv heads' rows (1 / kv_part)
        kv_w = 2 * m.hidden_size * m.n_kv_heads * m.head_dim if tp and not m.kv_dim else 0
        ops = []
        for d in range(ranks):
            seqs = wl.batch_size if lay.lanes else self.seqs(d, micro)
            if not seqs:
                continue
            tokens = seqs * per_seq
            if kind == OpKind.ATTENTION:
                ctx_len = (wl.prompt_len + 1) / 2 if step == 0 else wl.step_context(step)
                w_flops, kv_flops = 2 * tokens * whole, 2 * tokens * kv_w
                flops = (
                    m.attention_flops(tokens, int(ctx_len), sequences=seqs) - w_flops - kv_flops
                ) / part
                flops += w_flops + kv_flops / kv_part
                kv = seqs * wl.step_context(step) * m.kv_bytes_per_token / kv_part
                w_bytes, kv_bytes = whole * m.dtype_bytes, kv_w * m.dtype_bytes
                touch = (m.attn_bytes - w_bytes - kv_bytes) / part + w_bytes + kv_bytes / kv_part
                touch, tensor = touch + kv, Tensor.ATTENTION
            elif kind == OpKind.FFN:
                touch, tensor = self.em.tensor_bytes(Tensor.FFN, layer) / part, Tensor.FFN
                if not touch:
                    return []
                flops = m.ffn_flops(tokens, layer) / part
            else:
                tokens, flops = seqs, m.head_flops(seqs) / part
                touch, tensor = m.head_bytes / part, Tensor.HEAD
            stream = self.em.compute if lay.lanes else self.compute[d]
            ops.append(self.out.add(kind, stream, deps, step=step, layer=layer, batch=batch, micro=micro,
                                    tensor=tensor, tokens=tokens, flops=flops, touch_bytes=touch))  # fmt: skip
        if not tp or not reduce:
            return ops
        tokens = wl.batch_size * per_seq
        if kind == OpKind.ATTENTION and m.qk_norm:
            # QK-norm's statistics (a float32 sum of squares of q and of k per token), summed
            # over the GPUs inside attention; charged after it, the same work on the path
            ops = self.all_reduce(ops, tokens * 2 * 4, step, layer, batch, tokens)
        if kind == OpKind.HEAD:  # gather every GPU's slice of the vocabulary (float32 logits)
            return self.all_reduce(ops, wl.batch_size * m.vocab_size * 4, step, layer, batch,
                                   tokens=wl.batch_size, gather_only=True)  # fmt: skip
        return self.all_reduce(
            ops, tokens * m.hidden_size * m.dtype_bytes, step, layer, batch, tokens
        )

    def all_reduce(
        self,
        parts: list[int],
        nbytes: int,
        step: int,
        layer: int,
        batch: int,
        tokens: int,
        gather_only: bool = False,
    ) -> list[int]:
        """Sum (or, `gather_only`, concatenate) `nbytes` held by every GPU once `parts` are done:
        a reduce-scatter and an all-gather through the NVSwitch, each GPU sending (G-1)/G of the
        bytes in each (NCCL's bandwidth-optimal volume; one link latency per phase). Returns the
        all-gather op of each GPU."""
        g = self.layout.n_devices
        if g == 1:
            return parts
        sent = nbytes * (g - 1) // g
        after: list[int] = list(parts)
        for _ in range(1 if gather_only else 2):
            after = [self.out.add(OpKind.ALL_REDUCE, self.reduce[d], tuple(after), step=step, layer=layer,
                                  batch=batch, tensor=Tensor.HIDDEN, tokens=tokens, nbytes=sent)
                     for d in range(g)]  # fmt: skip
        return after

    def refill(
        self, moe: int, slots: np.ndarray, after: tuple[int, ...], step: int, layer: int, t: int
    ) -> list[tuple[int, ...]]:
        """Copy ops bringing each device's slots to `slots`; returns per device the ops to wait for."""
        m = self.ctx.model
        old = self.resident.get(moe)
        if old is None:  # the first placement is loaded before the run, like the home experts
            assert not after, f"MoE layer {moe}'s first placement used routing ops {after}"
            self.resident[moe] = slots.copy()
            return [() for _ in range(self.layout.n_devices)]
        g = self.layout.n_devices
        waits: list[list[int]] = [[] for _ in range(g)]
        deps = (*after, *self.layer_done.get(moe, ()))
        # experts each device holds and did not (a second slot of one it holds shares its
        # weights), each from the source the real run sends it from (`copy_moves`): into the
        # destination's link and, on G GPUs, out of the source's; lanes copy within the GPU
        for e, src, dst in copy_moves(old.tolist(), slots.tolist()):
            common = dict(step=step, layer=layer, expert=e, tensor=Tensor.EXPERT,
                          nbytes=m.expert_bytes, src=Tier.GPU, dst=Tier.GPU)  # fmt: skip
            waits[dst].append(self.out.add(OpKind.LOAD, self.copies[dst], deps, **common))
            if self.copies_out:
                waits[dst].append(self.out.add(OpKind.LOAD, self.copies_out[src], deps, **common))
            self.n_copies += 1
            self.gained.setdefault(t, np.zeros(g, np.int64))[dst] += 1
        self.resident[moe] = slots.copy()
        return [tuple(w) for w in waits]

    def moe_layer(
        self, policy: SlotPolicy, t: int, step: int, layer: int, batch: int, attn: list[int]
    ) -> tuple[int, ...]:
        m, lay = self.ctx.model, self.layout
        moe = m.moe_index(layer)
        slots, copy_waits = self.placed(policy, t, step, layer, batch)
        # The router: on lanes one whole-GPU op (as attention); on GPUs each gates the sequences
        # it holds (every sequence under tensor parallelism), after its own attention. The
        # batch's routing is known once every part has run.
        if lay.lanes:
            gate, view = self.em.gate(step, layer, batch, tuple(attn), last_batch=True)
            gates: tuple[int, ...] = (gate,)
        else:
            parts = [(self.compute[d], self.seqs(d), (op,)) for d, op in enumerate(attn)]
            gates, view = self.em.gate_parts(step, layer, batch, parts)
        policy.observe(t, moe, view, gates)
        # Shared experts, before the routed ones: on lanes a whole-GPU op the lanes wait for; on
        # GPUs each runs its share while the all-to-all brings the routed tokens (the overlap of
        # vLLM's SharedFusedMoE and SGLang's DeepEP path)
        tp = lay.dense == "tensor"  # every GPU holds every token: no all-to-all, one all-reduce
        shared = self.dense(OpKind.FFN, step, layer, batch, gates, reduce=not tp)
        start = shared[-1] if lay.lanes and shared else None
        ends = self.routed(slots, view, gates, copy_waits, start, step, layer, batch)
        if tp:  # routed and shared partial sums, summed over the GPUs at once
            n_tok = self.ctx.workload.batch_size * self.ctx.workload.step_tokens(step)
            act_bytes = m.hidden_size * m.dtype_bytes
            shared = self.all_reduce([*gates, *ends, *shared], n_tok * act_bytes, step, layer, batch,
                                     n_tok)  # fmt: skip
        done = (*gates, *ends, *shared)
        self.mark_done(moe, done, copy_waits)
        return done

    def moe_layer_micro(
        self, policy: SlotPolicy, t: int, step: int, layer: int, batch: int,
        lasts: list[tuple[int, ...]],
    ) -> list[tuple[int, ...]]:  # fmt: skip
        """An MoE layer of iteration t as micro-batches (`overlapped`): one placement and refill
        for the batch; each micro-batch's attention, gate and shared experts in turn, then each
        one's all-to-all and experts, moving its tokens as soon as its own gate has run. The
        policy observes the whole batch once its last micro-batch is gated. Returns the ops
        each micro-batch's next layer waits for."""
        moe, per = self.ctx.model.moe_index(layer), self.ctx.workload.step_tokens(step)
        slots, copy_waits = self.placed(policy, t, step, layer, batch)
        gated, whole = [], None
        for i in range(self.layout.micro_batches):
            attn = self.dense(OpKind.ATTENTION, step, layer, batch, lasts[i], micro=i)
            parts = [(self.compute[d], self.seqs(d, i), (op,)) for d, op in enumerate(attn)]
            gates, view, last = self.em.gate_micro(step, layer, batch, parts, i,
                                                   self.layout.micro_batches,
                                                   self.micro_rows(i, per))  # fmt: skip
            whole = last or whole
            gated.append((gates, view, self.dense(OpKind.FFN, step, layer, batch, gates, micro=i)))
        assert whole is not None
        policy.observe(t, moe, whole, tuple(g for gates, _, _ in gated for g in gates))
        done = [
            (*gates, *self.routed(slots, view, gates, copy_waits, None, step, layer, batch, i),
             *shared)
            for i, (gates, view, shared) in enumerate(gated)
        ]  # fmt: skip
        self.mark_done(moe, tuple(op for d in done for op in d), copy_waits)
        return done

    def mark_done(self, moe: int, done: tuple[int, ...], copy_waits: list[tuple[int, ...]]) -> None:
        """A slot of MoE layer `moe` is refilled only after this iteration's ops of the layer
        (every micro-batch's) and the copies that filled it are done."""
        self.layer_done[moe] = done + tuple(op for w in copy_waits for op in w)

    def placed(
        self, policy: SlotPolicy, t: int, step: int, layer: int, batch: int
    ) -> tuple[np.ndarray, list[tuple[int, ...]]]:
        """The policy's placement for iteration t at this MoE layer, and per device the copy ops
        bringing it in."""
        moe = self.ctx.model.moe_index(layer)
        slots, used = policy.place(t, moe)
        assert slots.shape == (self.layout.n_devices, self.layout.slots_per_device), slots.shape
        copy_waits = self.refill(moe, slots, used, step, layer, t)
        # The placement itself, for executors that hold real experts per device (real/distributed.py).
        self.out.meta.setdefault("ep_slots", {})[(step, batch, moe)] = slots.tolist()
        return slots, copy_waits

    def routed(
        self,
        slots: np.ndarray,
        view: GateView,
        gates: tuple[int, ...],
        copy_waits: list[tuple[int, ...]],
        start: int | None,
        step: int,
        layer: int,
        batch: int,
        micro: int = -1,
    ) -> list[int]:
        """The routed experts of a batch (or of micro-batch `micro`, whose routing `view` is)
        under `slots`: the all-to-all's dispatch, each device's expert work and the combine.
        Returns the ops ending them."""
        m, lay, b = self.ctx.model, self.layout, self.out
        tokens = split_tokens(
            slots, np.asarray(view.counts, dtype=np.int64), lay.dispatch
        )  # [G, E]
        act_bytes = m.hidden_size * m.dtype_bytes
        ends: list[int] = []
        common = dict(step=step, layer=layer, batch=batch, micro=micro)
        # all-to-all (G GPUs, data-parallel dense work): each GPU sends the pairs of its own
        # sequences' tokens to the GPUs computing them, out of its link (`p2p_out:d`), while it
        # receives the pairs it computes into it (`p2p:d`), the two directions at once; a GPU's
        # experts wait for its receive and for the sends of every GPU sending to it. The combine
        # sends the results back the same way, once the experts that computed them are done.
        g = lay.n_devices
        moved = np.zeros((g, g), dtype=np.int64)
        if not lay.lanes and lay.dense != "tensor":
            rows = [self.seqs(d, micro) * self.ctx.workload.step_tokens(step) for d in range(g)]
            moved = traffic(tokens, source_counts(view.ids, rows, m.n_experts))  # [src, dst]
        home = np.diag(moved)
        out_, in_ = moved.sum(1) - home, moved.sum(0) - home  # [G] pairs sent, received
        self.sent += out_

        def move(kind: OpKind, stream: str, deps: Iterable[int | None], n: int) -> int | None:
            return b.add(kind, stream, tuple(deps), tokens=n, nbytes=n * act_bytes,
                         tensor=Tensor.HIDDEN, **common) if n else None  # fmt: skip

        a2a = bool(self.sends)  # G GPUs, dense work data-parallel (else no token moves)
        sends = [move(OpKind.DISPATCH, self.sends[d], gates, int(out_[d])) if a2a else None
                 for d in range(g)]  # fmt: skip
        recvs = [move(OpKind.DISPATCH, self.dispatch[d], gates, int(in_[d])) if a2a else None
                 for d in range(g)]  # fmt: skip
        experts: list[int | None] = []
        for d in range(g):
            n_d = int(tokens[d].sum())
            waits = (recvs[d], *(sends[s] for s in range(g) if s != d and moved[s, d]))
            prev: int | None = start
            busy = np.flatnonzero(tokens[d])
            if lay.grouped_gemm and len(busy):  # one grouped GEMM over the device's experts
                width = expert_width(m, tokens[d, busy]) if lay.shared else 0
                prev = b.add(
                    OpKind.EXPERT, self.compute[d], (prev, *waits, *gates, *copy_waits[d]), tensor=Tensor.EXPERT,
                    tokens=n_d, flops=m.expert_flops(n_d), touch_bytes=len(busy) * m.expert_bytes,
                    width=width, **common,
                )  # fmt: skip
            for e in [] if lay.grouped_gemm else busy:
                n = int(tokens[d, e])
                prev = b.add(
                    OpKind.EXPERT, self.compute[d], (prev, *waits, *gates, *copy_waits[d]), expert=int(e), tensor=Tensor.EXPERT,
                    tokens=n, flops=m.expert_flops(n), touch_bytes=m.expert_bytes,
                    width=expert_width(m, [n]) if lay.shared else 0, **common,
                )  # fmt: skip
            experts.append(prev if prev != start else None)
        for d in range(g):
            # d sends back the results it computed for others, and receives its own tokens'
            # results once the GPUs computing them are done
            back = came = None
            if a2a:
                back = move(OpKind.COMBINE, self.sends[d], (experts[d],), int(in_[d]))
                came = move(OpKind.COMBINE, self.combine[d],
                            (experts[x] for x in range(g) if x != d and moved[d, x]), int(out_[d]))  # fmt: skip
            ends.extend(op for op in (experts[d], back, came) if op is not None)
        return ends
