"""`EPRunner`: emits a whole expert-parallel run for one `SlotPolicy`: dense work (data- or
tensor-parallel), gates, the all-to-all, each device's expert work, replica copies and the
memory they need."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from core.dispatch import copy_moves, source_counts, split_tokens, traffic
from core.ep_layout import EPLayout
from core.errors import CapacityError, gb_apart
from core.planner import PlanContext
from core.routing import GateView
from core.schedule import ScheduleBuilder
from core.shown import gb
from core.types import Dense, OpKind, Resource, Stream, Tensor, Tier
from planners.common import Emitter, standard_placement
from planners.ep.cost import expert_width
from planners.ep.dense import all_reduce, dense, dense_share
from planners.ep.params import Layout
from planners.ep.resident import activation_bytes, not_resident, resident_edge

POOL = "gpu-sms"  # the shared lanes' pool: one GPU's SMs


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
        lay, cap = self.layout, self.ctx.hardware.memory_bytes[Tier.GPU]  # one GPU's
        gpus = 1 if lay.lanes else lay.n_devices
        self.sent = np.zeros(lay.n_devices, dtype=np.int64)
        self.em = self._emitter(gpus, cap)
        held = self._check_resident(gpus, cap)
        replica_bytes = self._reserve_replicas(held, cap)
        self._make_streams()
        self._record_layout(replica_bytes)

    def _emitter(self, gpus: int, cap: int) -> Emitter:
        """The schedule's gpu tier is the G GPUs together: each holds its copy of the dense
        weights, its share of the experts, its replica slots, its sequences' KV (every batch's:
        an expert-parallel run keeps them all) and activations (one batch's: batches run one
        after another); checked per GPU by `_check_resident`."""
        hw, wl, b = self.ctx.hardware, self.ctx.workload, self.out
        both = replace(hw, memory_bytes={**hw.memory_bytes, Tier.GPU: gpus * cap})
        b.capacity_bytes[Tier.GPU] = gpus * cap
        with resident_edge(self.ctx.model, gpus, cap):
            return Emitter(
                self.ctx,
                b,
                standard_placement(
                    replace(self.ctx, hardware=both),
                    kv_sequences=wl.n_sequences,
                    layers_in_flight=0,
                    act_sequences=wl.batch_size,
                ),
            )

    def _check_resident(self, gpus: int, cap: int) -> float:
        """Bytes the fullest GPU holds (dense weights, its experts, KV and activations);
        CapacityError where they exceed a GPU; reserves the other GPUs' dense copies."""
        m, lay, b = self.ctx.model, self.layout, self.out
        wl = self.ctx.workload
        expert_layer = len(m.moe_layers) * m.expert_bytes  # one expert slot on every MoE layer
        experts = m.n_experts * expert_layer
        dense_w = m.total_bytes - experts
        p = self.em.placement
        kv = p.kv_bytes_per_layer * p.kv.count(Tier.GPU)  # every batch's KV on the GPUs
        act = activation_bytes(m, p, b.resident_bytes[Tier.GPU])  # one batch's
        tp = lay.dense == Dense.TENSOR and not lay.lanes
        # the fullest GPU's dense weights (tensor parallel: GPU 0's shards, the output biases)
        shares = [dense_share(self, gpus, d) for d in range(gpus)] if tp else [dense_w] * gpus
        dense_gpu = shares[0]
        # the fullest GPU: data parallel, GPU 0 (the most sequences); tensor parallel, every GPU
        # holds its kv heads of every sequence (MLA: the whole latent)
        kv_share = (
            (1 if m.kv_dim else 1 / min(gpus, m.n_kv_heads))
            if tp
            else -(-wl.batch_size // gpus) / wl.batch_size
        )
        act_share = 1 if tp else -(-wl.batch_size // gpus) / wl.batch_size  # TP: every token
        held = dense_gpu + -(-m.n_experts // gpus) * expert_layer + kv * kv_share + act * act_share
        if any(t != Tier.GPU for t in p.experts) or held > cap:
            raise not_resident(m, p, gpus, cap, held, act)
        b.reserve(Tier.GPU, int(max(0, sum(shares) - dense_w)))  # the other GPUs' dense copies
        return held

    def _reserve_replicas(self, held: float, cap: int) -> int:
        """Reserves every device's replica slots (CapacityError where a GPU's do not fit beside
        `held`), sets `room`; returns the replica slots' bytes over all devices."""
        m, lay = self.ctx.model, self.layout
        expert_layer = len(m.moe_layers) * m.expert_bytes  # one expert slot on every MoE layer
        replica_bytes = lay.n_devices * lay.replica_slots * expert_layer
        per_gpu = lay.n_devices if lay.lanes else 1  # devices whose slots one GPU holds
        if held + per_gpu * lay.replica_slots * expert_layer > cap:
            fit = max(0, int((cap - held) // (per_gpu * expert_layer)))
            slots = per_gpu * lay.replica_slots * expert_layer
            adds, holds, has, _ = gb_apart(slots, int(held), cap, int(held) + slots)
            raise CapacityError(
                f"planner.params.replica_slots={lay.replica_slots}: {adds} GB of replicas a GPU "
                f"on top of {holds} GB already resident exceed its {has} GB; "
                f"lower replica_slots (at most {fit} fit) or raise hardware.memory_gb.gpu"
            )
        self.out.reserve(Tier.GPU, replica_bytes)
        self.room = int(cap - held - per_gpu * lay.replica_slots * expert_layer)
        return replica_bytes

    def _make_streams(self) -> None:
        """Each device's compute stream, and the link streams of replica copies, the all-to-all
        and the all-reduce."""
        lay, b = self.layout, self.out
        if lay.lanes:  # lane d: 1/G of the GPU (lane_share); dense work on all of it (em.compute)
            pool = POOL if lay.shared else ""  # or all of them share its SMs
            self.compute = [
                b.stream(f"lane{d}", Resource.GPU, d, lay.share, pool) for d in range(lay.n_devices)
            ]
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
            [b.stream("replicas", Resource.D2D, 0)] * lay.n_devices
            if lay.lanes
            else [link(f"replicas{d}", Resource.P2P, d) for d in range(lay.n_devices)]
        )
        # the all-to-all: tokens and results in (`p2p:d`), and out (`p2p_out:d`); none on lanes
        # (one GPU's memory) or with tensor-parallel dense work (every GPU holds every token)
        a2a = range(0 if lay.lanes or lay.dense == Dense.TENSOR else lay.n_devices)
        self.dispatch = [link(f"dispatch{d}", Resource.P2P, d) for d in a2a]
        self.combine = [link(f"combine{d}", Resource.P2P, d) for d in a2a]
        self.sends = [link(f"send{d}", Resource.P2P_OUT, d) for d in a2a]
        # a replica copy leaves its source GPU by the same outgoing direction (not on lanes)
        self.copies_out = [
            link(f"replicas_out{d}", Resource.P2P_OUT, d)
            for d in range(0 if lay.lanes else lay.n_devices)
        ]
        self.reduce = (
            [link(f"allreduce{d}", Resource.P2P, d) for d in range(lay.n_devices)]
            if lay.dense == Dense.TENSOR
            else []
        )

    def _record_layout(self, replica_bytes: int) -> None:
        """The run's layout on the schedule (`Schedule.ep`; summary.json's `plan.ep`)."""
        lay = self.layout
        self.out.ep = EPLayout(
            n_devices=lay.n_devices,
            lanes=lay.lanes,
            lane_share=lay.share if lay.lanes else None,
            replica_slots=lay.replica_slots,
            replicas=lay.replicas,
            slots_per_device=lay.slots_per_device,
            replica_gb=gb(replica_bytes),
            grouped_gemm=lay.grouped_gemm,
            dense=None if lay.lanes else lay.dense,
            lane_sharing=lay.lane_sharing if lay.lanes else None,
            dispatch=lay.dispatch,
            micro_batches=lay.micro_batches,
            # replica copies between GPUs hold SMs (NCCL's p2p kernels): gpu_load counts them
            copy_kernels=bool(self.ctx.hardware.gpu.copy_share) and not lay.lanes,
        )

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
                    attn = dense(self, OpKind.ATTENTION, step, layer, batch, last)
                    if m.is_moe(layer):
                        last = self.moe_layer(policy, t, step, layer, batch, attn)
                    else:
                        last = tuple(dense(self, OpKind.FFN, step, layer, batch, attn)) or tuple(
                            attn
                        )
                last = tuple(dense(self, OpKind.HEAD, step, -1, batch, last))
                t += 1
        self.out.ep = replace(
            self.ep, copies=self.n_copies, pairs_sent=tuple(int(n) for n in self.sent)
        )
        self.reserve_staging()

    def overlapped(
        self, policy: SlotPolicy, t: int, step: int, batch: int, lasts: list[tuple[int, ...]]
    ) -> list[tuple[int, ...]]:
        """Iteration t as micro-batches (two-batch overlap): each layer emits every micro-batch's
        dense work and gate in turn, then each one's all-to-all and experts, so a GPU's compute
        stream runs micro-batch 1's attention while micro-batch 0's tokens travel, and 0's next
        attention while 1's results come back. Tensor-parallel dense work moves no token: each
        layer runs every micro-batch's attention, then each one's gate and experts (or FFN), so
        one's all-reduces run beside the other's compute (DeepSeek's TBO). Micro-batch i waits
        only for its own previous layer (`lasts[i]`; at layer 0 the previous batch's head).
        Returns each one's head."""
        m, micro = self.ctx.model, range(self.layout.micro_batches)
        for layer in range(m.n_layers):
            if m.is_moe(layer):
                lasts = self.moe_layer_micro(policy, t, step, layer, batch, lasts)
                continue
            if self.layout.dense == Dense.TENSOR:  # every attention first (`attentions`)
                attns = self.attentions(step, layer, batch, lasts)
                ffns = [
                    dense(self, OpKind.FFN, step, layer, batch, a, micro=i)
                    for i, a in enumerate(attns)
                ]
                lasts = [tuple(f or a) for f, a in zip(ffns, attns, strict=True)]
                continue
            nxt = []
            for i in micro:
                attn = dense(self, OpKind.ATTENTION, step, layer, batch, lasts[i], micro=i)
                ffn = dense(self, OpKind.FFN, step, layer, batch, attn, micro=i)
                nxt.append(tuple(ffn or attn))
            lasts = nxt
        return [tuple(dense(self, OpKind.HEAD, step, -1, batch, lasts[i], micro=i)) for i in micro]

    def attentions(
        self, step: int, layer: int, batch: int, lasts: list[tuple[int, ...]]
    ) -> list[list[int]]:
        """Every micro-batch's attention of a layer, in turn (tensor-parallel dense work): a
        GPU's compute stream runs micro-batch 1's attention while micro-batch 0's is all-reduced,
        rather than wait for that all-reduce before 0's next op. Returns each one's all-reduce."""
        return [
            dense(self, OpKind.ATTENTION, step, layer, batch, last, micro=i)
            for i, last in enumerate(lasts)
        ]

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
            brings, free = gb_apart(per_gpu, max(self.room, 0))
            raise CapacityError(
                f"planner.params.replica_slots={self.layout.replica_slots}: replica moves bring up "
                "to "
                f"{per_gpu // eb} experts ({brings} GB) to one GPU in one iteration, "
                f"each held beside the copy it replaces until that is sent, beyond its "
                f"{free} GB free; lower replica_slots, or re-home less "
                "often (rehome_interval)"
            )
        self.out.reserve(Tier.GPU, total)
        self.out.ep = replace(self.ep, staging_bytes=per_gpu)

    @property
    def ep(self) -> EPLayout:
        """The layout this runner records on the schedule."""
        assert self.out.ep is not None, "set by __post_init__"
        return self.out.ep

    def seqs(self, d: int, micro: int = -1) -> int:
        """The sequences of a batch GPU `d` runs dense work (and the gate) on: its share of them
        (data-parallel, the first `batch % G` GPUs one more), or all of them (tensor-parallel).
        Of micro-batch `micro`: that part of them (`EPLayout.micro_seqs`: data-parallel, each GPU
        splits its own sequences, so a sequence stays on its GPU and the all-to-all moves the
        same pairs as the whole batch's; tensor-parallel, every GPU the same part)."""
        s0, s1 = self.micro_seqs(d, micro)
        return s1 - s0

    def micro_seqs(self, d: int, micro: int) -> tuple[int, int]:
        return self.ep.micro_seqs(self.ctx.workload.batch_size, d, micro)

    def micro_rows(self, micro: int, per: int) -> np.ndarray:
        """The rows of the batch's routing (`GateView.ids`, `per` tokens a sequence) that
        micro-batch `micro` holds (data-parallel: GPU by GPU)."""
        return self.ep.micro_rows(self.ctx.workload.batch_size, micro, per)

    def refill(
        self, moe: int, slots: np.ndarray, after: tuple[int, ...], step: int, layer: int, t: int
    ) -> list[tuple[int, ...]]:
        """Copies bringing each device's slots to `slots`; returns each device's ops to wait for."""
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
            common = dict(
                step=step,
                layer=layer,
                expert=e,
                tensor=Tensor.EXPERT,
                nbytes=m.expert_bytes,
                src=Tier.GPU,
                dst=Tier.GPU,
            )
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
        tp = lay.dense == Dense.TENSOR  # every GPU holds every token: no all-to-all, one all-reduce
        shared = dense(self, OpKind.FFN, step, layer, batch, gates, reduce=not tp)
        start = shared[-1] if lay.lanes and shared else None
        ends = self.routed(slots, view, gates, copy_waits, start, step, layer, batch)
        if tp:
            shared = self.moe_sum([*gates, *ends, *shared], step, layer, batch)
        done = (*gates, *ends, *shared)
        self.mark_done(moe, done, copy_waits)
        return done

    def moe_sum(
        self, parts: list[int], step: int, layer: int, batch: int, micro: int = -1
    ) -> list[int]:
        """Tensor-parallel: an MoE layer's routed and shared partial sums (of micro-batch
        `micro`: its tokens'), summed over the GPUs at once."""
        m = self.ctx.model
        n_tok = self.seqs(0, micro) * self.ctx.workload.step_tokens(step)
        act_bytes = m.hidden_size * m.dtype_bytes
        return all_reduce(self, parts, n_tok * act_bytes, step, layer, batch, n_tok, micro=micro)

    def moe_layer_micro(
        self,
        policy: SlotPolicy,
        t: int,
        step: int,
        layer: int,
        batch: int,
        lasts: list[tuple[int, ...]],
    ) -> list[tuple[int, ...]]:
        """An MoE layer of iteration t as micro-batches (`overlapped`): one placement and refill
        for the batch; each micro-batch's attention, gate and shared experts in turn, then each
        one's all-to-all and experts, moving its tokens as soon as its own gate has run
        (tensor-parallel: every attention, then each one's gate, experts and all-reduce in turn).
        The policy observes the whole batch once its last micro-batch is gated. Returns the ops
        each micro-batch's next layer waits for."""
        moe, per = self.ctx.model.moe_index(layer), self.ctx.workload.step_tokens(step)
        slots, copy_waits = self.placed(policy, t, step, layer, batch)
        tp = self.layout.dense == Dense.TENSOR
        attns = self.attentions(step, layer, batch, lasts) if tp else []
        gated, done, whole = [], [], None
        for i in range(self.layout.micro_batches):
            attn = (
                attns[i]
                if tp
                else dense(self, OpKind.ATTENTION, step, layer, batch, lasts[i], micro=i)
            )
            parts = [(self.compute[d], self.seqs(d, i), (op,)) for d, op in enumerate(attn)]
            gates, view, last = self.em.gate_micro(
                step, layer, batch, parts, i, self.layout.micro_batches, self.micro_rows(i, per)
            )
            whole = last or whole
            shared = dense(self, OpKind.FFN, step, layer, batch, gates, reduce=not tp, micro=i)
            gated.append((gates, view, shared))
            if tp:
                ends = self.routed(slots, view, gates, copy_waits, None, step, layer, batch, i)
                summed = self.moe_sum([*gates, *ends, *shared], step, layer, batch, i)
                done.append((*gates, *ends, *summed))
        assert whole is not None
        policy.observe(t, moe, whole, tuple(g for gates, _, _ in gated for g in gates))
        for i, (gates, view, shared) in enumerate([] if tp else gated):
            ends = self.routed(slots, view, gates, copy_waits, None, step, layer, batch, i)
            done.append((*gates, *ends, *shared))
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
        # The placement itself, for executors holding real experts per device (real/distributed.py).
        self.ep.placements[(step, batch, moe)] = slots.tolist()
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
        Returns the ops ending them.

        All-to-all (G GPUs, data-parallel dense work): each GPU sends the pairs of its own
        sequences' tokens to the GPUs computing them, out of its link (`p2p_out:d`), while it
        receives the pairs it computes into it (`p2p:d`), the two directions at once; a GPU's
        experts wait for its receive and for the sends of every GPU sending to it. The combine
        sends the results back the same way, once the experts that computed them are done."""
        m, lay = self.ctx.model, self.layout
        tokens = split_tokens(
            slots, np.asarray(view.counts, dtype=np.int64), lay.dispatch
        )  # [G, E]
        common = dict(step=step, layer=layer, batch=batch, micro=micro)
        g = lay.n_devices
        moved = np.zeros((g, g), dtype=np.int64)  # [src, dst] pairs
        a2a = bool(self.sends)  # G GPUs, dense work data-parallel (else no token moves)
        if a2a:
            rows = [self.seqs(d, micro) * self.ctx.workload.step_tokens(step) for d in range(g)]
            moved = traffic(tokens, source_counts(view.ids, rows, m.n_experts))
        home = np.diag(moved)
        out_, in_ = moved.sum(1) - home, moved.sum(0) - home  # [G] pairs sent, received
        self.sent += out_
        sends = [
            self._move(OpKind.DISPATCH, self.sends[d], gates, out_[d], common)
            for d in range(g)
            if a2a
        ]
        recvs = [
            self._move(OpKind.DISPATCH, self.dispatch[d], gates, in_[d], common)
            for d in range(g)
            if a2a
        ]
        experts: list[int | None] = []
        for d in range(g):
            senders = np.flatnonzero(moved[:, d]) if a2a else ()  # numpy: G of them, G times
            waits = (recvs[d], *(sends[s] for s in senders if s != d)) if a2a else ()
            deps = (*waits, *gates, *copy_waits[d])
            last = self._device_experts(d, tokens[d], deps, start, common)
            experts.append(last if last != start else None)
        ends: list[int] = []
        for d in range(g):
            # d sends back the results it computed for others, and receives its own tokens'
            # results once the GPUs computing them are done
            back = came = None
            if a2a:
                back = self._move(OpKind.COMBINE, self.sends[d], (experts[d],), in_[d], common)
                came = self._move(
                    OpKind.COMBINE,
                    self.combine[d],
                    (experts[x] for x in np.flatnonzero(moved[d]) if x != d),
                    out_[d],
                    common,
                )
            ends.extend(op for op in (experts[d], back, came) if op is not None)
        return ends

    def _move(
        self,
        kind: OpKind,
        stream: str,
        deps: Iterable[int | None],
        n: np.integer | int,
        common: dict[str, int],
    ) -> int | None:
        """A dispatch or combine op moving `n` (token, expert) pairs' hidden states (none: no
        op)."""
        if not n:
            return None
        act_bytes = self.ctx.model.hidden_size * self.ctx.model.dtype_bytes
        return self.out.add(
            kind,
            stream,
            tuple(deps),
            tokens=int(n),
            nbytes=int(n) * act_bytes,
            tensor=Tensor.HIDDEN,
            **common,
        )

    def _device_experts(
        self,
        d: int,
        tokens: np.ndarray,
        deps: tuple[int | None, ...],
        start: int | None,
        common: dict[str, int],
    ) -> int | None:
        """Device d's expert work of a layer on its `tokens` [E] per expert, after `deps` (its
        tokens here, the gates, its replica copies) and `start` (lanes: the shared experts): one
        grouped GEMM, or one op per expert in turn. Returns the last op (`start`: none)."""
        m, lay, b = self.ctx.model, self.layout, self.out
        prev = start
        busy = np.flatnonzero(tokens)
        if lay.grouped_gemm and len(busy):  # one grouped GEMM over the device's experts
            n_d = int(tokens.sum())
            return b.add(
                OpKind.EXPERT,
                self.compute[d],
                (prev, *deps),
                tensor=Tensor.EXPERT,
                tokens=n_d,
                flops=m.expert_flops(n_d),
                touch_bytes=len(busy) * m.expert_bytes,
                width=expert_width(m, tokens[busy]) if lay.shared else 0,
                **common,
            )
        for e in [] if lay.grouped_gemm else busy:
            n = int(tokens[e])
            prev = b.add(
                OpKind.EXPERT,
                self.compute[d],
                (prev, *deps),
                expert=int(e),
                tensor=Tensor.EXPERT,
                tokens=n,
                flops=m.expert_flops(n),
                touch_bytes=m.expert_bytes,
                width=expert_width(m, [n]) if lay.shared else 0,
                **common,
            )
        return prev
