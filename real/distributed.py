"""Expert-parallel greedy generation over a torch.distributed process group, one rank per device.

Per MoE layer a rank holds only the experts its placement gives it at the current step (homes +
replicas, computed by an EP planner and passed in as plain data). At the start of each later
step every MoE layer's copies are posted at once (`batch_isend_irecv` on a process group of their
own, from a rank that keeps the expert where one does), and a layer waits for its own just before
its gate: the copies of later layers travel while earlier layers compute, as the simulator
prefetches replicas behind earlier layers. Experts a rank no longer holds are dropped (those it
sends, once sent), so a rank holds the placement's slots, not the union of every step's. A
replicated expert's pairs split evenly over its copies in (token, slot) order (`split_tokens`'
rule: copy i of expert e takes one more where (i + e) % copies < count % copies), or with dispatch="balanced" in the whole numbers
`split_tokens` gives each rank holding it (every rank derives them from the gathered routing).
Dense work (embedding, attention, gate, shared experts, head) runs in one of two modes, as the
simulator models them (planners/expert_parallel.py, EPParams.dense):
- dense="data": rank r runs the dense work for its contiguous share of the batch's sequences with
  the whole dense weights; each (token, slot) pair goes to its expert's rank by
  `all_to_all_single` (gloo has it since torch 2.x; NCCL on CUDA) and comes back by the reverse.
- dense="tensor" (vLLM's TP attention + EP experts; for batches smaller than the group): every rank
  runs every sequence on its share of the query heads, FFN columns and vocabulary, and the parts
  are summed by `all_reduce` (GQA kv heads fewer than the ranks are replicated, as vLLM does;
  OLMoE's QK-norm adds up its per-token statistics by one more, small, all-reduce); at an MoE layer every rank gates every token, runs the pairs its
  experts are given and adds its shared-expert part, summed by one all-reduce per layer.
Both combine exactly as the reference forward does, up to float summation order.
Two-batch overlap (micro_batches=2, dense=data): each rank splits its sequences as the simulator
does (`core.dispatch.micro_batch_seqs`) and posts each micro-batch's dispatch and combine with
async_op, so one micro-batch's all-to-all travels while the other's attention or experts run
(`EPRank.forward` gives the order).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from core.dispatch import DENSE, DISPATCH, copy_moves, micro_batch_seqs, split_tokens
from core.errors import ConfigError
from core.routing import Routing
from core.spec import ModelSpec
from core.types import Tensor
from real.checkpoint import Unit, load_checkpoint, read_tensor, unit_layout
from real.model import (
    KVCache,
    Model,
    Weights,
    expert_tokens,
    ffn_shard,
    head_shard,
    kv_shard,
    moe_output,
    moe_part,
    new_slots,
    put_expert,
)

# Shape legend: B batch, Br this rank's sequences (dense=tensor: all B), S tokens per sequence
# this step, T tokens of the batch (Tr this rank's), H hidden, V vocab (Vr this rank's share),
# k top-k, G ranks, R pairs received.

# placement[step][moe][rank] = the expert ids rank holds a copy of at that step and MoE layer
# (an id twice = two copies). Every step's lists come from the planner's iteration (step, batch 0).
Placement = Sequence[Sequence[Sequence[Sequence[int]]]]
Pairs = tuple[torch.Tensor, torch.Tensor]  # (rows [n], top-k slots [n]) of (token, slot) pairs


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous [lo, hi) of n items: n // G each, the first n % G ranks one more."""
    lo = rank * (n // world) + min(rank, n % world)
    return lo, lo + n // world + (rank < n % world)


def shard_sizes(n: int, world: int) -> list[int]:
    """How many of n items each rank's `shard` holds, in rank order."""
    return [hi - lo for lo, hi in (shard(n, world, r) for r in range(world))]


def check_dense(spec: ModelSpec, dense: str, world: int) -> None:
    """Refuse a dense mode this model cannot run on `world` ranks, before any rank waits."""
    if dense not in DENSE:
        raise ConfigError(f"dense={dense!r} unknown; valid: {', '.join(DENSE)}")
    if dense == "data":
        return
    why = spec.tensor_split_error(world)
    if why:
        raise ConfigError(
            f"dense=tensor splits attention heads over {world} ranks, but model {spec.name}'s "
            f"{why}; use dense=data or another number of ranks"
        )


def check_micro_batches(micro_batches: int, dense: str, batch: int, world: int) -> None:
    """Refuse a two-batch overlap the run cannot make, before any rank waits (the planner's
    rules, for callers of `ep_generate` that did not plan with it)."""
    if micro_batches < 1:
        raise ConfigError(f"micro_batches={micro_batches} must be >= 1 (2: two-batch overlap)")
    if micro_batches > 1 and dense != "data":
        raise ConfigError(
            f"micro_batches={micro_batches} overlaps one micro-batch's all-to-all with another's "
            "compute, but dense=tensor moves no tokens; use micro_batches=1 or dense=data"
        )
    if micro_batches > -(-batch // world):
        raise ConfigError(
            f"micro_batches={micro_batches} splits each rank's share of the batch's sequences, "
            f"but batch {batch} over {world} ranks gives a rank at most {-(-batch // world)}; "
            "lower micro_batches or raise batch_size"
        )


@dataclass
class RankStats:
    """What one rank held and computed (pairs = (token, top-k slot) pairs through an expert)."""

    rank: int
    experts_held: dict[int, list[int]] = field(default_factory=dict)  # layer -> ids, first step
    # layer -> the most experts held at once over the run, a step's move included (an expert a
    # rank drops is kept until it has sent it where it is the only source)
    most_held: dict[int, int] = field(default_factory=dict)
    copies_in: int = 0  # experts received from another rank when the placement moved them
    copy_bytes_in: int = 0
    # seconds layers waited for their copies after the step posted them (what compute did not
    # hide); gloo (CPU) only: on CUDA a wait only orders the streams, and this is None
    copy_wait_s: float | None = 0.0
    # seconds compute waited for its all-to-alls (dense=data; gloo only, as copy_wait_s): with
    # micro_batches=1 about all of their time, with two-batch overlap what the other
    # micro-batch's compute did not hide
    a2a_wait_s: float | None = 0.0
    experts_computed: dict[int, list[int]] = field(default_factory=dict)  # layer -> expert ids
    pairs_computed: int = 0  # pairs this rank ran through its experts
    # dense=data: of its own tokens' pairs, those computed on another rank (all-to-all traffic);
    # dense=tensor: 0, every rank holds every token and only partial sums cross
    pairs_sent: int = 0
    outside_placement: int = 0  # pairs computed for an expert the step's placement did not give


def held_experts(placement: Placement, spec: ModelSpec, rank: int) -> dict[int, list[int]]:
    """Decoder layer -> the experts rank holds at the first step (the weights it loads)."""
    return {
        layer: sorted(set(placement[0][spec.moe_index(layer)][rank])) for layer in spec.moe_layers
    }


def load_rank_units(
    ckpt: str | Path, held: dict[int, list[int]], device: str
) -> dict[Unit, Weights]:
    """Dense units and the held experts only, read from the checkpoint onto `device`."""
    spec, index = load_checkpoint(ckpt)
    return {
        unit: {key: read_tensor(index[ts.hf_name]).to(device) for key, ts in tensors.items()}
        for unit, tensors in unit_layout(spec).items()
        if unit.kind != Tensor.EXPERT or unit.expert in held.get(unit.layer, ())
    }


def tensor_units(
    spec: ModelSpec, units: dict[Unit, Weights], world: int, rank: int
) -> dict[Unit, Weights]:
    """`units` with the dense ones cut to rank's tensor-parallel share: its query heads, its
    columns of each dense and shared FFN, its rows of the LM head. Copied, so that the whole
    tensors can be freed; embedding, norms, gates and experts stay as they are."""

    def cut(unit: Unit, w: Weights) -> Weights:
        if unit.kind == Tensor.ATTENTION:
            w = head_shard(spec, w, shard(spec.n_heads, world, rank))
        elif unit.kind == Tensor.FFN:
            up = w["wi"] if "wi" in w else w["w1"]  # [F, H]
            w = ffn_shard(w, shard(up.shape[0], world, rank))
        elif unit.kind == Tensor.HEAD:
            lo, hi = shard(spec.vocab_size, world, rank)
            w = dict(w, lm_head=w["lm_head"][lo:hi])
        else:
            return w
        return {k: t.clone(memory_format=torch.contiguous_format) for k, t in w.items()}

    return {unit: cut(unit, w) for unit, w in units.items()}


def destinations(
    all_ids: torch.Tensor,
    copies: Sequence[Sequence[int]],
    n_experts: int,
    dispatch: str = "even",
) -> torch.Tensor:
    """Rank computing each pair: all_ids [T, k] of the whole batch, copies[rank] its experts ->
    dest [T, k]. Expert e's pairs, in (token, slot) order, are cut into one run per copy (even),
    or per rank holding it, as long as `split_tokens(..., "balanced")` says (balanced)."""
    dest = torch.full_like(all_ids, -1)
    share = None
    if dispatch == "balanced":
        width = max(1, max(len(held) for held in copies))
        slots_of = np.full((len(copies), width), -1, dtype=np.int64)
        for r, held in enumerate(copies):
            slots_of[r, : len(held)] = held
        counts = np.bincount(all_ids.reshape(-1).cpu().numpy(), minlength=n_experts)
        share = split_tokens(slots_of, counts, "balanced")  # [ranks, E]
    for e in range(n_experts):
        rows, slots = expert_tokens(all_ids, e)
        holders = [r for r, held in enumerate(copies) for x in held if x == e]
        assert holders or not len(rows), f"expert {e} has tokens but no copy on any rank"
        if share is not None:
            holders = list(dict.fromkeys(holders))  # a rank holding e twice takes one run
        n, c = len(rows), len(holders)
        start = 0
        for i, r in enumerate(holders):
            take = n // c + ((i + e) % c < n % c) if share is None else int(share[r, e])
            dest[rows[start : start + take], slots[start : start + take]] = r
            start += take
    return dest


def pairs_to(
    dest: torch.Tensor, ids: torch.Tensor, lo: int, hi: int, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of tokens [lo, hi) that rank r computes, ordered by expert (stable): (rows, slots),
    rows relative to lo. Sender and receiver both derive this order, so nothing else is sent."""
    rows, slots = (dest[lo:hi] == r).nonzero(as_tuple=True)
    order = torch.sort(ids[lo:hi][rows, slots], stable=True).indices
    return rows[order], slots[order]


class EPRank:
    """One rank's part of an expert-parallel run: its weights, KV cache and collectives."""

    def __init__(
        self,
        ckpt: str | Path,
        spec: ModelSpec,
        placement: Placement,
        batch: int,
        device: str,
        dense: str = "data",
        dispatch: str = "even",
        micro_batches: int = 1,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.dispatch, self.micro_batches = dispatch, micro_batches
        self.spec, self.placement, self.device = spec, placement, device
        self.model = Model.from_checkpoint(ckpt, spec)
        self.batch, self.tensor = batch, dense == "tensor"
        # the sequences this rank runs dense work for: all of them, or its share
        self.lo, self.hi = (0, batch) if self.tensor else shard(batch, self.world, self.rank)
        self.stats = RankStats(self.rank, held_experts(placement, spec, self.rank))
        self.stats.most_held = {layer: len(held) for layer, held in self.stats.experts_held.items()}
        if device != "cpu":
            self.stats.copy_wait_s = self.stats.a2a_wait_s = None
        if self.tensor:  # no all-to-all: its all-reduces are waited for where they are posted
            self.stats.a2a_wait_s = None
        units = load_rank_units(ckpt, self.stats.experts_held, device)
        self.units = tensor_units(spec, units, self.world, self.rank) if self.tensor else units
        self.index, self.layout = load_checkpoint(ckpt)[1], unit_layout(spec)
        # the copies' own communicator (on NCCL its own stream), so they overlap the layers'
        # collectives instead of queueing with them; the barrier sets it up on every rank
        self.copy_group = dist.new_group(backend=dist.get_backend())
        dist.barrier(group=self.copy_group)
        self.pending: dict[int, PendingMoves] = {}  # decoder layer -> copies in flight

    def start_moves(self, step: int) -> None:
        """Post every MoE layer's copies from step-1's placement to step's: drop at once what this
        rank no longer holds and sends nowhere, send and receive its own copies (`copy_moves`' order,
        one `batch_isend_irecv` per layer on `copy_group`); `finish_moves` installs a layer's."""
        s, me = self.spec, self.rank
        assert not self.pending, "the previous step's copies were not all waited for"
        for layer in s.moe_layers:
            m = s.moe_index(layer)
            old, new = self.placement[step - 1][m], self.placement[step][m]
            todo = copy_moves(old, new)
            sources = {e for e, src, _ in todo if src == me}
            gone = set(old[me]) - set(new[me])
            for e in gone - sources:
                del self.units[Unit(Tensor.EXPERT, layer, e)]
            ops, incoming = [], {}
            for e, src, dst in todo:
                unit = Unit(Tensor.EXPERT, layer, e)
                if me == src:
                    ops += [dist.P2POp(dist.isend, self.units[unit][key], dst, self.copy_group)
                            for key in sorted(self.layout[unit])]  # fmt: skip
                elif me == dst:
                    w: Weights = {}
                    for key in sorted(self.layout[unit]):
                        entry = self.index[self.layout[unit][key].hf_name]
                        w[key] = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                        ops.append(dist.P2POp(dist.irecv, w[key], src, self.copy_group))
                    incoming[unit] = w
            if not ops:
                continue
            # held while in flight: the experts kept, those still to send, and the buffers
            held = sum(u.kind == Tensor.EXPERT and u.layer == layer for u in self.units)
            self.stats.most_held[layer] = max(self.stats.most_held[layer], held + len(incoming))
            works = dist.batch_isend_irecv(ops)
            self.pending[layer] = PendingMoves(works, incoming, gone & sources)

    def finish_moves(self, layer: int) -> None:
        """Wait for `layer`'s copies (the time waited goes to `copy_wait_s`), take in what arrived
        and drop the experts that were only kept to be sent."""
        todo = self.pending.pop(layer, None)
        if todo is None:
            return
        t0 = time.perf_counter()
        for work in todo.works:
            work.wait()  # gloo: until done; NCCL: the compute stream waits for the copy stream
        if self.stats.copy_wait_s is not None:
            self.stats.copy_wait_s += time.perf_counter() - t0
        for unit, w in todo.incoming.items():
            self.units[unit] = w
            self.stats.copies_in += 1
            self.stats.copy_bytes_in += sum(t.numel() * t.element_size() for t in w.values())
        for e in todo.sent:
            del self.units[Unit(Tensor.EXPERT, layer, e)]

    def kv_caches(self, max_len: int) -> list[KVCache]:
        """The cache of each micro-batch's sequences of this rank (`micro_spans`); dense=tensor:
        only its kv heads (MLA: whole)."""
        s = self.spec
        lo, hi = kv_shard(s, shard(s.n_heads, self.world, self.rank)) if self.tensor else (0, 0)
        heads = hi - lo if self.tensor else s.n_kv_heads
        return [KVCache.allocate(s, b - a, max_len, self.device, heads)
                for a, b in self.micro_spans()]  # fmt: skip

    def summed(self, part: torch.Tensor) -> torch.Tensor:
        """dense=tensor: every rank's part added up (in place); dense=data: part, already whole."""
        if self.tensor:
            dist.all_reduce(part)
        return part

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Concatenate every rank's x [counts[r], ...] in rank order (padded: gather needs equal shapes)."""
        pad = x.new_zeros((max(counts), *x.shape[1:]))
        pad[: len(x)] = x
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    def route(
        self, step: int, layer: int, ids: torch.Tensor, seq_len: int, micro: int
    ) -> tuple[list[Pairs], list[Pairs], torch.Tensor]:
        """Who computes what: every rank gathers micro-batch `micro`'s routing (T x k ints,
        cheaper than a separate all-to-all of counts) so sender and receiver derive the same pair
        order; its replicated experts split its own pairs, as the simulator's `routed` splits each
        micro-batch's (one micro-batch, micro 0: the batch).
        Returns (pairs this rank sends to each rank, pairs it receives from each, expert of
        each received pair [R])."""
        spans = [micro_batch_seqs(self.batch, self.world, self.micro_batches, r, micro)
                 for r in range(self.world)]  # fmt: skip
        counts = [(s1 - s0) * seq_len for s0, s1 in spans]
        all_ids = self.all_gather_rows(ids, counts)  # [T, k]: the micro-batch's
        dest = destinations(
            all_ids,
            self.placement[step][self.spec.moe_index(layer)],
            self.spec.n_experts,
            self.dispatch,
        )
        at = [sum(counts[:r]) for r in range(self.world + 1)]
        me = self.rank
        send = [pairs_to(dest, all_ids, at[me], at[me + 1], r) for r in range(self.world)]
        recv = [pairs_to(dest, all_ids, at[r], at[r + 1], me) for r in range(self.world)]
        experts = torch.cat([all_ids[at[r] :][rows, slots] for r, (rows, slots) in enumerate(recv)])
        return send, recv, experts

    def start_moe(
        self,
        step: int,
        layer: int,
        hidden: torch.Tensor,
        forced: tuple[torch.Tensor, torch.Tensor] | None,
        micro: int,
    ) -> InFlight:
        """dense=data: gate this rank's tokens of micro-batch `micro` (0 of 1: the batch) and post
        the all-to-all sending each (token, slot) pair to its expert's rank; the shared experts
        run while the pairs travel. hidden [Br, S, H] (Br: the micro-batch's sequences)."""
        s, m = self.spec, self.model
        fi, fw = forced if forced is not None else (None, None)
        normed, ids, weights = m.gate(layer, self.units[Unit(Tensor.GATE, layer)], hidden, fi, fw)
        send, recv, experts = self.route(step, layer, ids, hidden.shape[1], micro)
        x_send = torch.cat([normed[rows] for rows, _ in send])  # [sum sent, H]
        x_recv = normed.new_empty(sum(len(rows) for rows, _ in recv), normed.shape[1])  # [R, H]
        n_send, n_recv = [len(rows) for rows, _ in send], [len(rows) for rows, _ in recv]
        work = dist.all_to_all_single(x_recv, x_send, n_recv, n_send, async_op=True)
        shared = (
            m.shared_ffn(self.units[Unit(Tensor.FFN, layer)], normed) if s.shared_ffn_size else None
        )
        self.stats.pairs_sent += len(x_send) - n_send[self.rank]
        return InFlight(
            hidden, normed, weights, shared, send, n_send, n_recv, experts, x_send, x_recv, work
        )

    def run_moe(self, step: int, layer: int, f: InFlight) -> None:
        """Wait for `f`'s pairs, run them through this rank's experts and post the all-to-all
        sending the results back."""
        self.wait(f.work)
        f.buf = self.run_experts(step, layer, f.experts, f.buf)  # [R, H], kept until sent
        f.back = f.normed.new_empty(sum(f.n_send), f.normed.shape[1])
        f.work = dist.all_to_all_single(f.back, f.buf, f.n_send, f.n_recv, async_op=True)

    def finish_moe(self, f: InFlight) -> torch.Tensor:
        """Wait for `f`'s results and weigh them into its hidden state -> [Br, S, H]."""
        self.wait(f.work)
        out = new_slots(f.normed, self.spec.top_k)  # [Tr, k, H]
        rows = torch.cat([r for r, _ in f.send])
        slots = torch.cat([sl for _, sl in f.send])
        assert f.back is not None, "finish_moe before run_moe"
        put_expert(out, rows, slots, f.back)
        return moe_output(f.hidden, out, f.weights, f.shared, self.model.float32_combine)

    def wait(self, work: dist.Work) -> None:
        """Wait for an all-to-all; gloo: the time waited (what compute did not hide) goes to
        `a2a_wait_s`."""
        t0 = time.perf_counter()
        work.wait()
        if self.stats.a2a_wait_s is not None:
            self.stats.a2a_wait_s += time.perf_counter() - t0

    def moe_tensor(
        self,
        step: int,
        layer: int,
        hidden: torch.Tensor,
        forced: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """dense=tensor: gate every token, this rank's experts' part, summed: [B, S, H] -> same."""
        fi, fw = forced if forced is not None else (None, None)
        gate = self.units[Unit(Tensor.GATE, layer)]
        normed, ids, weights = self.model.gate(layer, gate, hidden, fi, fw)
        return hidden + self.moe_part(step, layer, normed, ids, weights).view_as(hidden)

    def moe_part(
        self,
        step: int,
        layer: int,
        normed: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
    ) -> torch.Tensor:
        """dense=tensor: every rank gated every token alike, so it picks its own pairs (by
        `destinations`, as data mode sends them) with no all-to-all; its weighted expert outputs
        plus its shared-expert columns, summed over ranks by one all-reduce. normed [T, H],
        ids and weights [T, k] -> [T, H]."""
        s, m = self.spec, self.model
        dest = destinations(
            ids, self.placement[step][s.moe_index(layer)], s.n_experts, self.dispatch
        )  # [T, k]
        rows, slots = pairs_to(dest, ids, 0, len(ids), self.rank)
        out = new_slots(normed, s.top_k)  # [T, k, H], zero where another rank computes the pair
        put_expert(out, rows, slots, self.run_experts(step, layer, ids[rows, slots], normed[rows]))
        shared = (
            m.shared_ffn(self.units[Unit(Tensor.FFN, layer)], normed) if s.shared_ffn_size else None
        )
        return self.summed(moe_part(out, weights, shared, m.float32_combine))

    def run_experts(
        self, step: int, layer: int, experts: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """Each received pair through its expert: experts [R] ids (grouped, ascending per source
        rank; dense=tensor: this rank's pairs, ascending), x [R, H] -> [R, H]."""
        y = torch.empty_like(x)
        given = self.placement[step][self.spec.moe_index(layer)][self.rank]
        done = self.stats.experts_computed.setdefault(layer, [])
        for e in experts.unique().tolist():
            idx = (experts == e).nonzero(as_tuple=True)[0]
            y[idx] = self.model.expert(self.units[Unit(Tensor.EXPERT, layer, e)], x[idx])
            self.stats.pairs_computed += len(idx)
            self.stats.outside_placement += 0 if e in given else len(idx)
            if e not in done:
                done.append(e)
        return y

    def micro_spans(self) -> list[tuple[int, int]]:
        """This rank's sequences of each micro-batch, [a, b) of its own (`micro_batch_seqs`);
        dense=tensor: every rank runs the whole batch, one micro-batch."""
        if self.tensor:
            return [(0, self.batch)]
        spans = [micro_batch_seqs(self.batch, self.world, self.micro_batches, self.rank, i)
                 for i in range(self.micro_batches)]  # fmt: skip
        return [(s0 - self.lo, s1 - self.lo) for s0, s1 in spans]

    def forward(
        self,
        step: int,
        tokens: torch.Tensor,
        kvs: list[KVCache],
        start: int,
        forced: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """This rank's sequences, tokens [Br, S] at positions start.., -> logits [Br, V].
        kvs: the cache of each micro-batch's sequences (`micro_spans`). forced: (ids, weights)
        [Br, S, L, k] to replay, else the model's own gates. Dense parts are whole in data mode;
        in tensor mode `summed` adds up the ranks' parts.
        Two-batch overlap (micro_batches > 1, dense=data): each layer runs every micro-batch's
        attention and gate in turn, posting its dispatch, then each one's experts, posting its
        combine, which the next layer waits for only before that micro-batch's attention: one
        micro-batch's all-to-all travels while another computes, in the simulator's op order
        (`EPRunner.overlapped`)."""
        s, m, u = self.spec, self.model, self.units
        n = tokens.shape[1]
        positions = torch.arange(start, start + n)
        spans = self.micro_spans()
        hidden = [m.embed(u[Unit(Tensor.EMBED)], tokens[a:b]) for a, b in spans]  # [Bi, S, H]
        flying: list[InFlight | None] = [None] * len(spans)
        for layer in range(s.n_layers):
            w = u[Unit(Tensor.ATTENTION, layer)]
            for i, (a, b) in enumerate(spans):
                if (f := flying[i]) is not None:
                    hidden[i], flying[i] = self.finish_moe(f), None
                part = m.attention_part(layer, w, hidden[i], kvs[i], positions, self.summed)
                h = hidden[i] + self.summed(part)
                if not s.is_moe(layer):
                    hidden[i] = h + self.summed(m.dense_ffn_part(u[Unit(Tensor.FFN, layer)], h))
                    continue
                if i == 0:
                    self.finish_moves(layer)  # this step's copies of this layer's experts
                forced_i = None
                if forced is not None:
                    mi = s.moe_index(layer)
                    forced_i = (forced[0][a:b, :, mi].flatten(0, 1),
                                forced[1][a:b, :, mi].flatten(0, 1))  # fmt: skip  # [Ti, k]
                if self.tensor:
                    hidden[i] = self.moe_tensor(step, layer, h, forced_i)
                else:
                    flying[i] = self.start_moe(step, layer, h, forced_i, i)
            for f in flying:
                if f is not None:
                    self.run_moe(step, layer, f)
        hidden = [
            self.finish_moe(f) if f is not None else h for f, h in zip(flying, hidden, strict=True)
        ]
        logits = m.head(u[Unit(Tensor.HEAD)], torch.cat(hidden))  # [Br, V]; tensor: [B, Vr]
        if not self.tensor:
            return logits
        vocab = shard_sizes(s.vocab_size, self.world)
        return self.all_gather_rows(logits.T.contiguous(), vocab).T  # [B, V]


@dataclass
class InFlight:
    """One batch's (or micro-batch's) MoE layer between its gate and its combine (dense=data):
    what the combine needs, and the all-to-all in flight (the dispatch, then the results back)."""

    hidden: torch.Tensor  # [Br, S, H], the residual
    normed: torch.Tensor  # [Tr, H]
    weights: torch.Tensor  # [Tr, k]
    shared: torch.Tensor | None  # [Tr, H]
    send: list[Pairs]  # the pairs sent to each rank
    n_send: list[int]
    n_recv: list[int]
    experts: torch.Tensor  # [R], the expert of each received pair
    x_send: torch.Tensor  # [sum sent, H], held until its dispatch is done
    buf: torch.Tensor  # [R, H]: the pairs received, then their results being sent back
    work: dist.Work
    back: torch.Tensor | None = None  # [sum sent, H], the results coming back


@dataclass
class PendingMoves:
    """One MoE layer's copies in flight: their works, the buffers being received into, and the
    experts this rank drops once sent."""

    works: list[dist.Work]
    incoming: dict[Unit, Weights]
    sent: set[int]


@dataclass
class EPOutput:
    tokens: torch.Tensor  # [B, gen_len] on CPU, the whole batch
    logits: torch.Tensor  # [B, V] float32 on CPU: the last step's
    stats: list[RankStats]  # one per rank, in rank order


def ep_generate(
    ckpt: str | Path,
    spec: ModelSpec,
    prompt_tokens: torch.Tensor,
    gen_len: int,
    placement: Placement,
    forced_routing: Routing | None = None,
    device: str = "cpu",
    dense: str = "data",
    dispatch: str = "even",
    micro_batches: int = 1,
) -> EPOutput:
    """`reference_generate` (real/model.py) over the initialised default process group: every rank
    calls it with the same arguments and gets the same whole-batch result. prompt_tokens [B, P].
    dense: "data" (B >= G) or "tensor" (any B; `ModelSpec.tensor_split_error` permitting);
    dispatch: how a replicated expert's pairs split over its copies (`EPParams.dispatch`);
    micro_batches: two-batch overlap (`EPParams.micro_batches`; dense=data), the placement planned
    with the same."""
    if dispatch not in DISPATCH:
        raise ConfigError(f"dispatch={dispatch!r} unknown; valid: {', '.join(DISPATCH)}")
    b, p = prompt_tokens.shape
    assert len(placement) >= gen_len, f"placement covers {len(placement)} steps, need {gen_len}"
    world = dist.get_world_size()
    check_dense(spec, dense, world)
    check_micro_batches(micro_batches, dense, b, world)
    for t, step in enumerate(placement[:gen_len]):
        for m, ranks in enumerate(step):
            if len(ranks) != world:
                raise ConfigError(
                    f"placement step {t}, MoE layer {m}: {len(ranks)} ranks' experts for a "
                    f"process group of {world}; plan with n_devices={world}"
                )
    ep = EPRank(ckpt, spec, placement, b, device, dense, dispatch, micro_batches)
    try:
        return _generate(ep, prompt_tokens, gen_len, forced_routing)
    finally:  # a process may call this many times: free the copies' group each time
        dist.destroy_process_group(ep.copy_group)


def _generate(
    ep: EPRank, prompt_tokens: torch.Tensor, gen_len: int, forced_routing: Routing | None
) -> EPOutput:
    b, p = prompt_tokens.shape
    device = ep.device
    lo, hi = ep.lo, ep.hi
    kvs = ep.kv_caches(p + gen_len)
    forced = None
    if forced_routing is not None:
        ids = torch.from_numpy(forced_routing.expert_ids[lo:hi].astype("int64")).to(device)
        forced = (ids, torch.from_numpy(forced_routing.gate_weights[lo:hi]).to(device))
    step_in, start, out = prompt_tokens[lo:hi].long().to(device), 0, []
    with torch.inference_mode():
        for step in range(gen_len):
            if step:  # copies travel while the layers before theirs compute (`forward`)
                ep.start_moves(step)
            n = step_in.shape[1]
            f = (
                None
                if forced is None
                else (forced[0][:, start : start + n], forced[1][:, start : start + n])
            )
            logits = ep.forward(step, step_in, kvs, start, f)  # [Br, V]
            out.append(logits.argmax(-1))
            start += n
            step_in = out[-1][:, None]
        tokens = torch.stack(out, dim=1)  # [Br, gen_len]
        if not ep.tensor:  # each rank has its sequences' tokens and logits only
            counts = shard_sizes(b, ep.world)
            tokens = ep.all_gather_rows(tokens, counts)  # [B, gen_len]
            logits = ep.all_gather_rows(logits, counts)  # [B, V]
    stats: list[RankStats | None] = [None] * ep.world
    dist.all_gather_object(stats, ep.stats)
    return EPOutput(tokens.cpu(), logits.cpu(), [st for st in stats if st is not None])
