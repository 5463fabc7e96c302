"""Tensor-parallel dense work of an expert-parallel schedule (planner dense=tensor) in the real
executor: every device runs every sequence of a batch on its shard of the weights (1/G of the
attention heads, `head_shard`; of the FFN columns, `ffn_shard`; of the vocabulary,
`vocab_shard`), and the schedule's ALL_REDUCE ops sum the partial results over the devices as
`planners.ep.dense` emits them: a reduce-scatter round then an all-gather round (attention, a
dense FFN, an MoE layer's routed and shared experts), or one gather round (the head's logits).

Each device keeps its own hidden state, KV heads, MoE layer and generated tokens (a
micro-batch's ops, under two-batch overlap, work on its sequences' rows of them), so the G
devices of one process (virtual devices on threads, `ThreadCollective`) and G processes
(`ProcessCollective` over torch.distributed, one device each; such a process keeps only its
device's shard of each dense unit, `keep_shards`) run the same code. A round's
devices meet in one collective: in one process at a rendezvous, across processes in a
torch.distributed collective each rank issues in schedule order (its ALL_REDUCE ops are one
stream's), through which a dep on another rank's op is honoured.

QK-norm (OLMoE) needs the sums of squares of every head's q and k midway through attention:
they are summed inside the attention op (its own collective). The planner charges that
all-reduce as two rounds after attention; those ops run the same collective again on the same
statistics, so their measured time is a collective of the size planned.

Usage (the executor makes it at a schedule's first op; `Executor._run_op` hands it its ops):
    tp = tensor_parallel(ex, schedule.ep)   # None unless dense=tensor over G > 1 GPUs
    if tp is not None and tp.runs(op): tp.run(op, spec)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from core.ep_layout import EPLayout
from core.errors import MoepipeError
from core.schedule import Op, StreamSpec
from core.shards import shard
from core.types import Dense, OpKind, Resource, Tensor, Tier
from real.checkpoint import Unit
from real.decoding import next_tokens
from real.interpreter import _Stop
from real.model import KVCache, ffn_shard, head_shard, kv_shard, moe_part, new_slots, vocab_shard
from real.state import _Pending, unit_of

if TYPE_CHECKING:
    from real.executor import Executor

# Shape legend: b sequences per batch, S tokens this step, T = b*S, H hidden, V vocab, G devices,
# n a flattened partial's elements (padded to a multiple of G).

# the dense units each device holds a shard of (`head_shard`, `ffn_shard`, `vocab_shard`)
_SHARDED = (Tensor.ATTENTION, Tensor.FFN, Tensor.HEAD)
_POLL_S = 0.05  # how often a device waiting at a rendezvous re-checks for a failed run

# what an ALL_REDUCE op's round combines (`TensorParallel._what`) and its rounds
ROUNDS = {"attention": 2, "stats": 2, "ffn": 2, "moe": 2, "logits": 1}


Fold = Callable[[list[torch.Tensor]], torch.Tensor]  # the parts, in device order -> the result


class Collective(Protocol):
    """The G devices of one round meet here: each hands its part and gets `fold` of the parts it
    is owed, in device order."""

    def all_to_all(
        self, key: object, device: int, chunks: list[torch.Tensor], fold: Fold
    ) -> torch.Tensor:
        """`chunks[j]` goes to device j; folds what each device sent this one."""
        ...

    def all_gather(self, key: object, device: int, t: torch.Tensor, fold: Fold) -> torch.Tensor:
        """Folds every device's `t`."""
        ...


class ThreadCollective:
    """G virtual devices of one process (a worker thread each): a rendezvous per round, keyed
    by the round (its device-0 op id); raises the interpreter's stop once the run failed. The
    parts stay held until every device has folded them (`landed`: on CUDA, its stream has run
    the fold), so no part's memory is reused while another device's kernels still read it."""

    def __init__(self, world: int, failed: Callable[[], bool], landed: Callable[[], None]) -> None:
        self.world, self.failed, self.landed = world, failed, landed
        self._cv = threading.Condition()
        self._rounds: dict[object, tuple[dict[int, Any], list[int]]] = {}

    def _meet(
        self, key: object, device: int, value: Any, pick: Callable[[Any], torch.Tensor], fold: Fold
    ) -> torch.Tensor:
        self.landed()  # (CUDA) the part is computed before another device's thread reads it
        with self._cv:
            parts, read = self._rounds.setdefault(key, ({}, [0]))
            assert device not in parts, f"device {device} met twice at {key}"
            parts[device] = value
            self._cv.notify_all()
            while len(parts) < self.world:
                if self.failed():
                    raise _Stop
                self._cv.wait(_POLL_S)
            got = [pick(parts[d]) for d in range(self.world)]
        out = fold(got)
        self.landed()
        with self._cv:
            read[0] += 1
            if read[0] == self.world:  # every device has folded its parts: the round is over
                del self._rounds[key]
        return out

    def all_to_all(
        self, key: object, device: int, chunks: list[torch.Tensor], fold: Fold
    ) -> torch.Tensor:
        return self._meet(key, device, chunks, lambda sent: sent[device], fold)

    def all_gather(self, key: object, device: int, t: torch.Tensor, fold: Fold) -> torch.Tensor:
        return self._meet(key, device, t, lambda part: part, fold)


class ProcessCollective:
    """One rank of G processes: torch.distributed collectives on a process group of their own
    (called from one thread, in schedule order, as every rank calls them). Through host memory
    on gloo; `lost` turns a failed collective into the run's one line naming the peer."""

    def __init__(self, group: Any, lost: Callable[[BaseException], BaseException]) -> None:
        import torch.distributed as dist

        self.dist, self.group, self.lost = dist, group, lost
        self.world = dist.get_world_size(group)
        self.host = dist.get_backend(group) == "gloo"

    def _on_link(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu").contiguous() if self.host else t.contiguous()

    def all_to_all(
        self, key: object, device: int, chunks: list[torch.Tensor], fold: Fold
    ) -> torch.Tensor:
        dev = chunks[0].device
        send = [self._on_link(c) for c in chunks]
        got = [torch.empty_like(c) for c in send]
        try:
            self.dist.all_to_all(got, send, group=self.group)
        except RuntimeError as e:
            raise self.lost(e) from None
        return fold([g.to(dev) for g in got])

    def all_gather(self, key: object, device: int, t: torch.Tensor, fold: Fold) -> torch.Tensor:
        dev, mine = t.device, self._on_link(t)
        got = [torch.empty_like(mine) for _ in range(self.world)]
        try:
            self.dist.all_gather(got, mine, group=self.group)
        except RuntimeError as e:
            raise self.lost(e) from None
        return fold([g.to(dev) for g in got])


Part = tuple[int, int]  # (batch, micro-batch; -1: the whole batch)


@dataclass
class _Device:
    """One device's state: its copy of every batch's activations, its KV heads, MoE layer. A
    micro-batch's ops read and write its sequences' rows; what awaits a reduce is its own."""

    hidden: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (batch, step)
    kv: dict[tuple[int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)  # (b, layer)
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)  # batch -> [b, gen] generated
    moe: dict[Part, _Pending] = field(default_factory=dict)  # its MoE layer under way
    partial: dict[Part, torch.Tensor] = field(default_factory=dict)  # awaiting a reduce
    stats: dict[Part, torch.Tensor] = field(default_factory=dict)  # QK-norm's [b', S, 2]
    chunk: dict[Part, torch.Tensor] = field(default_factory=dict)  # reduced [n / G]


def tensor_parallel(ex: Executor, ep: EPLayout | None) -> TensorParallel | None:
    """The run's tensor-parallel dense work, or None (no layout, data-parallel, one device)."""
    if ep is None or ep.dense != Dense.TENSOR or ep.lanes or ep.n_devices < 2:
        return None
    peers = ex.peers
    if peers is None:
        group = ThreadCollective(ep.n_devices, lambda: ex._error is not None, ex._landed)
        return TensorParallel(ex, ep.n_devices, range(ep.n_devices), group, group)
    reduce_group, stats_group = peers.tp_groups()
    tp = TensorParallel(
        ex,
        ep.n_devices,
        (peers.rank,),
        ProcessCollective(reduce_group, peers.lost_in_collective),
        ProcessCollective(stats_group, peers.lost_in_collective),
    )
    tp.keep_shards(peers.rank)
    return tp


class TensorParallel:
    """The dense ops (attention, gate, FFN, head), expert ops and ALL_REDUCE ops of a
    dense=tensor schedule, for the devices this process runs (`devices`)."""

    def __init__(
        self,
        ex: Executor,
        world: int,
        devices: range | tuple[int, ...],
        reduce: Collective,
        stats: Collective,
    ) -> None:
        self.ex, self.world, self.reduce, self.stats_group = ex, world, reduce, stats
        self.spec = ex.model.spec
        self.writer = devices[0]  # the device whose results are the run's output
        self.dev = {d: _Device() for d in devices}
        self._what_of: dict[int, tuple[str, int]] = {}  # ALL_REDUCE op id -> (what, round)
        s = self.spec
        self.heads = [shard(s.n_heads, world, d) for d in range(world)]
        self.vocab = [shard(s.vocab_size, world, d) for d in range(world)]
        self.sharded: set[Unit] = set()  # dense units held as one device's shard (`keep_shards`)

    def keep_shards(self, d: int) -> None:
        """A process that runs one device of G keeps only that device's shard of each
        device-resident dense unit (attention, a dense FFN or shared experts, the head), as the
        planner counts it (`planners.ep.dense.dense_share`): the shard is copied out and the
        whole unit's buffer goes back to the store. The router and embeddings stay whole."""
        ex = self.ex
        for u in [u for u in ex._resident if u.kind in _SHARDED]:
            part = {k: t.clone() for k, t in self.shard_of(u, d, ex._resident[u]).items()}
            ex._resident[u] = part
            if ex.store.holds(u, Tier.GPU):
                ex.store.free(u)
            self.sharded.add(u)

    def shard_of(self, u: Unit, d: int, w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Device d's shard of unit u's weights `w` (`w` itself where this process holds only
        that shard already, or the unit is not cut)."""
        if u in self.sharded or u.kind not in _SHARDED:
            return dict(w)
        if u.kind == Tensor.ATTENTION:
            return head_shard(self.spec, dict(w), self.heads[d])
        if u.kind == Tensor.HEAD:
            return vocab_shard(dict(w), self.vocab[d])
        width = (w["wi"] if "wi" in w else w["w1"]).shape[0]
        return ffn_shard(dict(w), shard(width, self.world, d))

    def runs(self, op: Op) -> bool:
        """Is the op one this class does (rather than the single-process op code)?"""
        if op.kind in (OpKind.KV_LOAD, OpKind.KV_STORE):
            raise MoepipeError(
                f"{op.label()}: planner dense=tensor keeps each GPU's KV heads on it; the real "
                "executor runs no KV offload with it (use dense=data)"
            )
        return op.kind in (
            OpKind.ATTENTION,
            OpKind.GATE,
            OpKind.FFN,
            OpKind.HEAD,
            OpKind.EXPERT,
            OpKind.ALL_REDUCE,
        )

    def run(self, op: Op, spec: StreamSpec) -> None:
        d = spec.device
        assert d in self.dev, f"{op.label()}: device {d} is not this process's"
        assert op.batch >= 0, f"{op.label()}: dense=tensor runs no op over every batch"
        if op.kind == OpKind.ALL_REDUCE:
            self._all_reduce(op, d)
            return
        u = unit_of(op)
        assert u is not None, f"{op.label()}: compute without weights"
        w = self.shard_of(u, d, self.ex._weights(u, spec.resource == Resource.CPU))
        if op.kind == OpKind.EXPERT:  # the op's chunk of the expert's pairs, as data-parallel
            self.ex._expert(op, w, pending=lambda b: self.dev[d].moe[(b, op.micro)])
        elif op.kind == OpKind.ATTENTION:
            self._attention(op, d, w)
        elif op.kind == OpKind.GATE:
            self._gate(op, d, w)
        elif op.kind == OpKind.FFN:
            self._ffn(op, d, w)
        else:
            h = self._hidden(d, op)
            self.dev[d].partial[(op.batch, op.micro)] = self.ex.model.head(w, h)

    # ---- dense ops on one device's shard ------------------------------------------------------
    def _span(self, micro: int) -> tuple[int, int]:
        """The sequences [s0, s1) of a batch micro-batch `micro` holds (-1: all of them)."""
        return self.ex._ep_meta().micro_seqs(self.ex.wl.batch_size, 0, micro)

    def _hidden(self, d: int, op: Op) -> torch.Tensor:
        """Device d's hidden state [b', S, H] of the op's batch at its step, its micro-batch's
        rows (fresh at a new step; two steps before it are over: one micro-batch's next step
        may start while another's head still reads this one)."""
        held, key = self.dev[d].hidden, (op.batch, op.step)
        if key not in held:
            wl, s = self.ex.wl, self.spec
            emb = self.ex._resident[Unit(Tensor.EMBED)]["embed"]
            shape = (wl.batch_size, wl.step_tokens(op.step), s.hidden_size)
            held.pop((op.batch, op.step - 2), None)
            held[key] = torch.zeros(shape, dtype=emb.dtype, device=self.ex.device)
        s0, s1 = self._span(op.micro)
        return held[key][s0:s1]

    def _kv(self, d: int, batch: int, layer: int, seqs: tuple[int, int]) -> KVCache:
        """Device d's cache of `layer` for the batch's sequences [s0, s1): its kv heads (MLA:
        the whole latent), every position the run writes; the other layers empty."""
        dev, wl, s = self.dev[d], self.ex.wl, self.spec
        if (batch, layer) not in dev.kv:
            lo, hi = kv_shard(s, self.heads[d]) if not s.kv_dim else (0, 1)
            shapes = KVCache.allocate(
                s, wl.batch_size, wl.prompt_len + wl.gen_len, "meta", kv_heads=hi - lo
            ).layers[0]
            dev.kv[(batch, layer)] = tuple(
                torch.zeros(t.shape, dtype=t.dtype, device=self.ex.device) for t in shapes
            )
        own = tuple(t[seqs[0] : seqs[1]] for t in dev.kv[(batch, layer)])
        return KVCache(tuple(own if i == layer else () for i in range(s.n_layers)))

    def _attention(self, op: Op, d: int, w: Any) -> None:
        """Device d's heads over every sequence (of the op's micro-batch): its part of
        attention's output, to be summed."""
        ex, dev, b, part = self.ex, self.dev[d], op.batch, (op.batch, op.micro)
        h, (s0, s1) = self._hidden(d, op), self._span(op.micro)
        if op.layer == 0:
            if op.step == 0:
                tokens_in = ex._batches[b].prompt[s0:s1]
            else:
                tokens_in = dev.tokens[b][s0:s1, op.step - 1 : op.step]
            h[:] = ex.model.embed(ex._resident[Unit(Tensor.EMBED)], tokens_in)
        key = ("stats", op.id - d)

        def reduce(stats: torch.Tensor) -> torch.Tensor:  # QK-norm's sums, over every device
            dev.stats[part] = stats
            return self.stats_group.all_gather(key, d, stats, _ordered_sum)

        kv = self._kv(d, b, op.layer, (s0, s1))
        pos = ex._positions(op.step)
        dev.partial[part] = ex.model.attention_part(op.layer, w, h, kv, pos, reduce)

    def _gate(self, op: Op, d: int, w: Any) -> None:
        """The router over every sequence of the op's micro-batch (its weights are whole on each
        device): device d's MoE layer; the writer device publishes the routing."""
        ex, s, (s0, s1) = self.ex, self.spec, self._span(op.micro)
        fi, fw = ex._forced_routing(op, s0, s1)
        normed, ids, weights = ex.model.gate(op.layer, w, self._hidden(d, op), fi, fw)
        n = s1 - s0
        p = _Pending(
            op.step,
            op.layer,
            normed,
            ids,
            weights,
            new_slots(normed, s.top_k),
            torch.zeros(n, dtype=torch.bool),
            torch.ones(n, dtype=torch.bool),
        )
        self.dev[d].moe[(op.batch, op.micro)] = p
        if d == self.writer:  # the batch's rows: a micro-batch's, the others none (-1)
            per, k = ex.wl.step_tokens(op.step), s.top_k
            all_ids = ids.new_full((ex.wl.batch_size * per, k), -1)
            all_w = weights.new_zeros(all_ids.shape)
            all_ids[s0 * per : s1 * per], all_w[s0 * per : s1 * per] = ids, weights
            ex._publish(op, all_ids, all_w, s.moe_index(op.layer))

    def _ffn(self, op: Op, d: int, w: Any) -> None:
        """Device d's FFN columns: an MoE layer's shared experts (its part, added in the layer's
        sum) or a dense layer's FFN (its part, to be summed)."""
        ex, dev, key = self.ex, self.dev[d], (op.batch, op.micro)
        if self.spec.is_moe(op.layer):
            p = dev.moe[key]
            assert p.layer == op.layer, f"{op.label()}: shared experts before the gate"
            p.shared = ex.model.shared_ffn(w, p.normed)  # [T, H]
        else:
            dev.partial[key] = ex.model.dense_ffn_part(w, self._hidden(d, op))

    # ---- the all-reduce -------------------------------------------------------------------
    def _what(self, op: Op) -> tuple[str, int]:
        """What an ALL_REDUCE op's round combines and which round it is, from its deps as
        `planners.ep.dense` emits them: after attention, its output (QK-norm: first its
        statistics, then the output); after a dense FFN, its output; after an MoE layer's gates
        and experts, the layer's output; after the head, the logits; after a round, the next
        round (or, after the statistics' last, attention's output)."""
        if op.id in self._what_of:
            return self._what_of[op.id]
        deps = [self.ex._ops[i] for i in op.deps]
        kinds = {dep.kind for dep in deps}
        if kinds == {OpKind.ALL_REDUCE}:
            what, rnd = self._what(deps[0])
            if rnd < ROUNDS[what]:
                out = (what, rnd + 1)
            else:
                assert what == "stats", f"{op.label()}: a round after a finished {what} reduce"
                out = ("attention", 1)
        elif OpKind.HEAD in kinds:
            out = ("logits", 1)
        elif OpKind.GATE in kinds:
            out = ("moe", 1)
        elif OpKind.ATTENTION in kinds:
            out = ("stats" if self.spec.qk_norm else "attention", 1)
        else:
            assert kinds == {OpKind.FFN}, f"{op.label()}: an all-reduce after {sorted(kinds)}"
            out = ("ffn", 1)
        self._what_of[op.id] = out
        return out

    def _round_key(self, op: Op, d: int) -> int:
        """The round's id on every device: its device-0 op (`all_reduce` emits a round's ops
        device by device, consecutively)."""
        first = self.ex._ops[op.id - d]
        assert (first.kind, first.step, first.layer, first.batch, first.micro) == (
            op.kind,
            op.step,
            op.layer,
            op.batch,
            op.micro,
        ), f"{op.label()}: its round's ops are not consecutive"
        return op.id - d

    def _all_reduce(self, op: Op, d: int) -> None:
        what, rnd = self._what(op)
        ex, dev, b, key = self.ex, self.dev[d], (op.batch, op.micro), self._round_key(op, d)
        if what == "logits":  # every device's slice of the vocabulary, side by side
            self._logits(op, d, key)
            return
        if rnd == 1:  # reduce-scatter: this device's 1/G of the sum, added in device order
            part = self._part(what, d, b)
            chunks = list(_padded(part.reshape(-1), self.world).chunk(self.world))
            dev.chunk[b] = self.reduce.all_to_all(key, d, chunks, _ordered_sum)
            return
        chunk = dev.chunk.pop(b)  # all-gather: every device's reduced chunk, the whole sum
        whole = self.reduce.all_gather(key, d, chunk, torch.cat)
        if what == "stats":  # summed inside attention already (module doc)
            return
        h = self._hidden(d, op)
        h += whole[: h.numel()].view_as(h)
        order = 1 if what in ("ffn", "moe") else 0
        clamped = ex._clamped((op.step, op.layer, order), h)  # Switch in float16
        if clamped is not h:
            h.copy_(clamped)
        if what == "moe":
            dev.moe.pop(b)
        ex._note_finite(op.step, op.layer, order, op.batch, what, h)

    def _part(self, what: str, d: int, b: Part) -> torch.Tensor:
        """Device d's part of what a round-1 op sums."""
        dev = self.dev[d]
        if what == "stats":
            return dev.stats.pop(b)
        if what == "moe":  # its experts' pairs (the rest are zero) and its shared columns
            p = dev.moe[b]
            return moe_part(p.slots, p.weights, p.shared, self.ex.model.float32_combine)
        return dev.partial.pop(b)

    def _logits(self, op: Op, d: int, key: int) -> None:
        """The head's gather: the whole logits [b', V] of the op's sequences on every device,
        their next tokens; the writer device's are the run's."""
        ex, dev, b, wl = self.ex, self.dev[d], op.batch, self.ex.wl
        s0, s1 = self._span(op.micro)
        part = dev.partial.pop((b, op.micro))  # [b', V / G]
        width = max(hi - lo for lo, hi in self.vocab)
        padded = torch.nn.functional.pad(part, (0, width - part.shape[1]))

        def side_by_side(got: list[torch.Tensor]) -> torch.Tensor:  # [b, V]
            return torch.cat(
                [g[:, : hi - lo] for g, (lo, hi) in zip(got, self.vocab, strict=True)], 1
            )

        logits = self.reduce.all_gather(key, d, padded, side_by_side)
        if b not in dev.tokens:
            dev.tokens[b] = torch.zeros(
                wl.batch_size, wl.gen_len, dtype=torch.long, device=ex.device
            )
        prompt, so_far = ex._batches[b].prompt[s0:s1], dev.tokens[b][s0:s1, : op.step]
        chosen = next_tokens(ex.model.greedy, logits, prompt, so_far, wl.gen_len)  # [b']
        dev.tokens[b][s0:s1, op.step] = chosen
        if d != self.writer:
            return
        bst = ex._batches[b]
        if bst.logits is None:  # one device's logits ops write it (the writer's stream)
            bst.logits = logits.new_zeros(wl.batch_size, logits.shape[1])
        bst.logits[s0:s1] = logits
        bst.tokens[s0:s1, op.step] = chosen
        bst.written[op.step] += s1 - s0
        ex._note_finite(op.step, self.spec.n_layers, 0, b, "logits", logits)


def _padded(flat: torch.Tensor, world: int) -> torch.Tensor:
    """flat [n'] padded with zeros to a multiple of `world` elements."""
    return torch.nn.functional.pad(flat, (0, -len(flat) % world))


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts added in device order: every device (and process) gets the same bits."""
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total
