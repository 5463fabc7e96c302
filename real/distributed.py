"""One rank of a G-process real run: the part of `real.executor.Executor` that crosses processes.
Each rank runs only its own device's ops of the whole schedule; gate parts, dispatch, combine and
replica copies travel between ranks as point-to-point transfers tagged by op (gloo), and rank 0
gathers every rank's ops at the end. With tensor-parallel dense work (planner dense=tensor) every
rank gates every sequence, no token moves, and the all-reduce ops are collectives
(real/tensor_parallel.py, on the groups made here). Gate parts and replica copies each have a
connection of their own, apart from the all-to-all's: gloo keeps a pair's messages in order, so
a gate part or a dispatch queued behind a replica copy (7-15 ms a dispatch against 2-4 ms), where
the schedule runs copies beside the all-to-all, sharing the link. How each crossing works:
docs/replication-model.md#real-expert-parallelism.

Usage (inside a process group of G ranks, one per device of the schedule):
    ex = Executor(store, model, workload, prompts, peers=Peers(schedule.ep, ...))
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from core.dispatch import micro_batch_seqs, split_tokens
from core.ep_layout import EPLayout
from core.errors import ConfigError, MoepipeError
from core.schedule import Op, Schedule, StreamSpec
from core.spec import ModelSpec, Workload
from core.types import Dense, OpKind, Resource, Tensor, Tier
from real.checkpoint import Unit, torch_dtype, unit_layout
from real.executor import Executor, _Pending, _Stop
from real.gathered_times import gather_ranks
from real.model import expert_tokens, new_slots, put_expert

# Shape legend: T tokens of a batch (step), k top-k, H hidden, n pairs moved.

_KINDS = {"gate": 0, "dispatch": 1, "combine": 2, "copy": 3}
_SUBS = 8  # tensors one transfer may move under its tags (an expert's 2-3; a gate part's 2)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class PeerLost(MoepipeError):
    """Another rank stopped (died, or failed and left): this rank stops too."""


@dataclass(frozen=True)
class GateKey:
    step: int
    layer: int
    batch: int
    micro: int


class Peers:
    """This process's rank of a G-process run of one expert-parallel schedule."""

    def __init__(self, ep: EPLayout, spec: ModelSpec, wl: Workload) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if ep.n_devices != self.world:
            raise ConfigError(
                f"the schedule has {ep.n_devices} devices, the process group {self.world} "
                "ranks; plan with planner.params.n_devices equal to the number of processes"
            )
        if ep.lanes:
            raise ConfigError(
                "lanes (G streams of one GPU) run in one process; set executor.distributed=false"
            )
        self.spec, self.wl = spec, wl
        # dense=tensor: every rank runs every sequence on its shard (real/tensor_parallel.py),
        # gates them all itself and moves no token; its all-reduces are collectives
        self.tensor = ep.dense == Dense.TENSOR and self.world > 1
        self.micro_batches = ep.micro_batches
        self.dispatch = ep.dispatch
        self.layout = unit_layout(spec)
        self.dtype = torch_dtype(spec)
        self._cv = threading.Condition()
        self._parts: dict[GateKey, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._own: dict[GateKey, tuple[Op, torch.Tensor]] = {}  # this rank's part: op, normed
        self._pending: dict[GateKey, _Pending] = {}
        self._dest: dict[GateKey, torch.Tensor] = {}
        self._error: BaseException | None = None
        self._listener: threading.Thread | None = None
        self._sender: threading.Thread | None = None
        # this rank's gate parts for the sender thread, in gate order (None: stop)
        self._outbox: queue.Queue[tuple[GateKey, Op, tuple[torch.Tensor, torch.Tensor]] | None]
        self._outbox = queue.Queue()
        self.gone: PeerLost | None = None  # the first peer found gone
        # gate parts sent, not yet waited for: (work, buffer, destination rank)
        self._posted: list[tuple[Any, torch.Tensor, int]] = []
        # the gate parts' own connection (module doc); every rank makes it here (collective)
        self._gate_group = self._new_group()
        # replica copies' own connection, so the all-to-all does not wait behind them
        self._copy_group = self._new_group()
        # dense=tensor's all-reduce ops (one stream's, in schedule order) and QK-norm's
        # statistics inside attention (the compute stream's), each on a group of its own
        self._tp_groups = (self._new_group(), self._new_group()) if self.tensor else None

    def _new_group(self) -> Any:
        """A process group of every rank (collective): a peer gone meanwhile is `lost`."""
        try:
            return dist.new_group(backend=dist.get_backend())
        except RuntimeError as e:
            raise self.lost(None, e, "while the ranks set up") from None

    def tp_groups(self) -> tuple[Any, Any]:
        """dense=tensor's process groups: (the all-reduce ops', QK-norm's statistics')."""
        assert self._tp_groups is not None, "a data-parallel run has no tensor-parallel groups"
        return self._tp_groups

    def lost_in_collective(self, e: BaseException) -> PeerLost:
        """A tensor-parallel collective that failed: a peer went away."""
        return self.lost(None, e)

    # ---- which ops, rows and tags ------------------------------------------------------------
    def runs(self, spec: StreamSpec) -> bool:
        return spec.device == self.rank

    def seqs(self, device: int, micro: int) -> tuple[int, int]:
        """The sequences [s0, s1) of a batch `device` runs dense work and gates for."""
        return micro_batch_seqs(self.wl.batch_size, self.world, self.micro_batches, device, micro)

    def rows(self, device: int, key: GateKey) -> slice:
        per = self.wl.step_tokens(key.step)
        s0, s1 = self.seqs(device, key.micro)
        return slice(s0 * per, s1 * per)

    def gaters(self, key: GateKey) -> list[int]:
        """Ranks with a gate part of `key` (a share of its sequences)."""
        return [
            d for d in range(self.world) if self.seqs(d, key.micro)[1] > self.seqs(d, key.micro)[0]
        ]

    def tag(self, kind: str, key: GateKey, src: int, sub: int = 0) -> int:
        """A transfer's tag: what it is (kind, the batch's layer, the sending rank) and which of
        its tensors (`sub`), so one rank's streams may post theirs in any order."""
        wl, s = self.wl, self.spec
        t = key.step
        for n, v in (
            (s.n_layers, key.layer),
            (wl.n_batches, key.batch),
            (self.micro_batches + 1, key.micro + 1),
            (self.world, src),
        ):
            t = t * n + v
        return (t * len(_KINDS) + _KINDS[kind]) * _SUBS + sub

    def copy_tag(self, in_op: int, sub: int) -> int:
        """A replica copy's tag: the id of its op on the destination, which of the expert's
        tensors."""
        return (in_op * len(_KINDS) + _KINDS["copy"]) * _SUBS + sub

    def own_rows(self, micro: int) -> torch.Tensor:
        """[b] bool: the batch's sequences this rank's dense ops finish."""
        mask = torch.zeros(self.wl.batch_size, dtype=torch.bool)
        s0, s1 = self.seqs(self.rank, micro)
        mask[s0:s1] = True
        return mask

    # ---- point-to-point ------------------------------------------------------------------
    def _send(self, pieces: list[tuple[torch.Tensor, int, int]], group: Any = None) -> None:
        """(tensor, destination rank, tag) each, posted at once, waited for. Through host memory
        (gloo moves CPU tensors; on CUDA the copy out is part of the op)."""
        for w, _, dst in self._post(pieces, group):
            self._wait(w, dst)

    def _post(
        self, pieces: list[tuple[torch.Tensor, int, int]], group: Any = None
    ) -> list[tuple[Any, torch.Tensor, int]]:
        """(tensor, destination rank, tag) each, posted: (work, host buffer, destination) per
        piece; the buffer must live until the work completes."""
        bufs = [t.detach().to("cpu").contiguous() for t, _, _ in pieces]
        posted = []
        for b, (_, dst, tag) in zip(bufs, pieces, strict=True):
            try:  # a pair gloo knows is closed fails here, not in the wait
                posted.append((dist.isend(b, dst, group=group, tag=tag), b, dst))
            except RuntimeError as e:
                raise self.lost(dst, e) from None
        return posted

    def _drain(self) -> None:
        """Stop the sender; wait for the gate parts still on their way to other ranks."""
        if self._sender is not None:
            self._outbox.put(None)
            self._sender.join()
        with self._cv:
            posted, self._posted = self._posted, []
        for w, _, dst in posted:
            self._wait(w, dst)

    def _recv(self, pieces: list[tuple[torch.Tensor, int, int]], group: Any = None) -> None:
        """(buffer, source rank, tag) each, filled."""
        bufs = [
            t if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype)
            for t, _, _ in pieces
        ]
        works = []
        for b, (_, src, tag) in zip(bufs, pieces, strict=True):
            try:  # as in `_post`
                works.append(dist.irecv(b, src, group=group, tag=tag))
            except RuntimeError as e:
                raise self.lost(src, e) from None
        for w, (_, src, _) in zip(works, pieces, strict=True):
            self._wait(w, src)
        for b, (t, _, _) in zip(bufs, pieces, strict=True):
            if b is not t:
                t.copy_(b)

    def _wait(self, work: Any, peer: int) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise self.lost(peer, e) from None

    def lost(self, peer: int | None, e: BaseException, when: str = "during the run") -> PeerLost:
        """The one line for a peer that went away: the rank this one was exchanging with (of 2,
        the other one), and gloo's own first line."""
        if peer is None and self.world == 2:
            peer = 1 - self.rank
        who = f"rank {peer}" if peer is not None else "another rank"
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        first = re.sub(r"^\[[^\]]*\] ", "", first).split(". ")[0]  # no source path, one clause
        waited = re.search(r"Timed out waiting (\d+)ms", first)
        if waited:  # alive but hung or stopped: "died" sent the user to look for a crash
            lost = PeerLost(
                f"{who} did not answer within {int(waited.group(1)) / 1000:g} s {when} (hung, "
                f"stopped or far behind; executor.rendezvous_timeout_s bounds the wait); rank "
                f"{self.rank} stopped"
            )
        else:
            lost = PeerLost(f"{who} died or left {when}; rank {self.rank} stopped (gloo: {first})")
        with self._cv:
            self.gone = self.gone or lost
            self._cv.notify_all()
        return lost

    def wait_gone(self, timeout_s: float) -> PeerLost | None:
        """The first peer this rank found gone, waiting up to `timeout_s` for one (a launcher
        that stops the survivors may do so before their transfers fail)."""
        with self._cv:
            self._cv.wait_for(lambda: self.gone is not None, timeout=timeout_s)
            return self.gone

    # ---- the gate --------------------------------------------------------------------------
    def gate_part(
        self, ex: Executor, op: Op, normed: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """This rank's part of a gate (its sequences' rows), handed to the sender thread, which
        sends it to every other rank. The batch's routing is assembled (`_assemble`) once every
        rank's part is here, by whichever comes last, the sender or the listener receiving the
        others'; the ops that read it wait for it (`pending`), as the schedule has them depend
        on every gate op. The gate is done once its routing is computed: exchanging it is the
        all-to-all's part of the work (the simulator's gate moves nothing), and shows in the
        dispatch that waits for it."""
        key = GateKey(op.step, op.layer, op.batch, op.micro)
        mine = ids.to(torch.int64).cpu(), weights.float().cpu()
        with self._cv:
            self._parts.setdefault(key, {})[self.rank] = mine
            self._own[key] = (op, normed)
            self._cv.notify_all()
        self._outbox.put((key, op, mine))

    def _send_parts(self, ex: Executor) -> None:
        """The sender thread: each gate part of this rank, posted to the other ranks in gate
        order (not waited for: `_drain` does at the end), then the routing assembled if it is
        the last part."""
        others = [d for d in range(self.world) if d != self.rank]
        while (item := self._outbox.get()) is not None:
            key, op, mine = item
            try:
                posted = self._post(
                    [
                        (t, d, self.tag("gate", key, self.rank, sub))
                        for d in others
                        for sub, t in enumerate(mine)
                    ],
                    self._gate_group,
                )
            except RuntimeError as e:
                raise self.lost(None, e) from None
            with self._cv:
                self._posted = [p for p in self._posted if not p[0].is_completed()] + posted
            self._assemble(ex, key, op)

    def _check(self, ex: Executor) -> None:
        if self._error is not None:
            raise self._error
        if ex._error is not None:
            raise _Stop

    def listen(self, ex: Executor) -> None:
        """Start the thread receiving the other ranks' gate parts, key by key in op order."""

        def run() -> None:
            seen: set[GateKey] = set()
            i = 0
            try:
                while True:
                    with ex._cv:
                        while i >= len(ex._ops):
                            if ex._planner_done or ex._error is not None:
                                return
                            ex._cv.wait(0.05)
                        op = ex._ops[i]
                    i += 1
                    if op.kind != OpKind.GATE:
                        continue
                    key = GateKey(op.step, op.layer, op.batch, op.micro)
                    if key in seen:
                        continue
                    seen.add(key)
                    self._receive_parts(ex, key, op)
            except BaseException as e:  # noqa: BLE001 - handed to the executor's main thread
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                ex._fail(e)

        self._listener = threading.Thread(target=run, name="gate-listener", daemon=True)
        self._listener.start()

        def send() -> None:
            try:
                self._send_parts(ex)
            except BaseException as e:  # noqa: BLE001 - handed to the executor's main thread
                with self._cv:
                    self._error = self._error or e
                    self._cv.notify_all()
                ex._fail(e)

        self._sender = threading.Thread(target=send, name="gate-sender", daemon=True)
        self._sender.start()

    def _receive_parts(self, ex: Executor, key: GateKey, op: Op) -> None:
        k = self.spec.top_k
        pieces, got = [], {}
        for d in self.gaters(key):
            if d == self.rank:
                continue
            n = self.rows(d, key).stop - self.rows(d, key).start
            ids = torch.empty(n, k, dtype=torch.int64)
            w = torch.empty(n, k, dtype=torch.float32)
            pieces += [(ids, d, self.tag("gate", key, d, 0)), (w, d, self.tag("gate", key, d, 1))]
            got[d] = (ids, w)
        self._recv(pieces, self._gate_group)
        with self._cv:
            self._parts.setdefault(key, {}).update(got)
            self._cv.notify_all()
        self._assemble(ex, key, op)

    def _assemble(self, ex: Executor, key: GateKey, op: Op) -> None:
        """Once every gater's part is here (this rank's too, where it has one): the batch's
        (micro-batch's) Pending with the whole routing, published for the planner and output."""
        with self._cv:
            parts = self._parts.get(key, {})
            if key in self._pending or set(parts) != set(self.gaters(key)):
                return
            own = self._own.get(key)
            if own is None and self.rank in parts:
                return
            s, wl = self.spec, self.wl
            n_rows = wl.batch_size * wl.step_tokens(key.step)
            any_w = next(iter(parts.values()))[1]
            ids = torch.full((n_rows, s.top_k), -1, dtype=torch.int64)
            weights = torch.zeros(n_rows, s.top_k, dtype=any_w.dtype)
            for d, (i, w) in parts.items():
                rows = self.rows(d, key)
                ids[rows], weights[rows] = i, w
            dev = ex.device
            h = s.hidden_size
            dtype = ex._resident[Unit(Tensor.EMBED)]["embed"].dtype  # the hidden state's
            normed = torch.zeros(n_rows, h, dtype=dtype, device=dev)
            if own is not None:
                normed[self.rows(self.rank, key)] = own[1]
            mine = ex._micro_mask(key.micro) & self.own_rows(key.micro)
            p = _Pending(
                key.step,
                key.layer,
                normed,
                ids.to(dev),
                weights.to(dev),
                new_slots(normed, s.top_k),
                ~mine,
                torch.ones(wl.batch_size, dtype=torch.bool),
            )
            self._pending[key] = p
            for old in [x for x in self._parts if x.step < key.step - 1]:  # done with
                for held in (self._pending, self._dest, self._own, self._parts):
                    held.pop(old, None)
            if own is not None:  # this rank's dense ops add its rows' share of the layer
                bst = ex._batches[key.batch]
                with ex._refs_lock:
                    old = bst.pending.get(key.micro)
                    assert old is None or bool(old.done.all()), f"{key}: previous layer unfinished"
                    bst.pending[key.micro] = p
            self._cv.notify_all()
        ex._publish(op, p.ids, p.weights, s.moe_index(key.layer))

    def pending(self, ex: Executor, step: int, layer: int, batch: int, micro: int) -> _Pending:
        """The batch's (micro-batch's) MoE layer state, once its whole routing is here."""
        key = GateKey(step, layer, batch, micro)
        with self._cv:
            while key not in self._pending:
                self._check(ex)
                self._cv.wait(0.05)
            return self._pending[key]

    # ---- dispatch, combine, replica copies ------------------------------------------------------
    def dest(self, ex: Executor, key: GateKey, p: _Pending) -> torch.Tensor:
        """[T, k] the rank computing each (token, slot) pair (-1: none): expert e's pairs in
        (token, slot) order, the first `tokens[0, e]` on device 0, ... (`split_tokens` over the
        iteration's placement, the cut of the schedule's expert ops)."""
        with self._cv:
            if key in self._dest:
                return self._dest[key]
        s = self.spec
        slots = np.asarray(ex._ep_slots()[(key.step, key.batch, s.moe_index(key.layer))])
        ids = p.ids.cpu()
        counts = np.bincount(ids[ids >= 0].numpy(), minlength=s.n_experts)
        tokens = split_tokens(slots, counts, self.dispatch)  # [G, E]
        dest = torch.full_like(ids, -1)
        for e in np.flatnonzero(counts):
            rows, slot = expert_tokens(ids, int(e))
            at = 0
            for d in range(self.world):
                n = int(tokens[d, e])
                dest[rows[at : at + n], slot[at : at + n]] = d
                at += n
            assert at == len(rows), f"expert {e}: {at} of {len(rows)} pairs placed"
        with self._cv:
            self._dest[key] = dest
        return dest

    def pairs(
        self, dest: torch.Tensor, key: GateKey, owner: int, computer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, slots) of the pairs of `owner`'s tokens that `computer` computes, in (token,
        slot) order: sender and receiver derive the same list."""
        rows = self.rows(owner, key)
        r, sl = (dest[rows] == computer).nonzero(as_tuple=True)
        return r + rows.start, sl

    def transfer(self, ex: Executor, op: Op, spec: StreamSpec) -> None:
        """A dispatch, combine or replica copy op of this rank: the data it stands for, moved."""
        if op.kind == OpKind.LOAD:
            self._copy(ex, op, spec)
            return
        key = GateKey(op.step, op.layer, op.batch, op.micro)
        p = self.pending(ex, op.step, op.layer, op.batch, op.micro)
        dest = self.dest(ex, key, p)
        me, out = self.rank, spec.resource == Resource.P2P_OUT
        others = [d for d in range(self.world) if d != me]
        kind = "dispatch" if op.kind == OpKind.DISPATCH else "combine"
        tag = self.tag(kind, key, me) if out else None
        h = self.spec.hidden_size
        if op.kind == OpKind.DISPATCH and out:  # my tokens' rows to the ranks computing them
            pieces = [
                (p.normed[r], d, tag)
                for d in others
                for r, _ in [self.pairs(dest, key, me, d)]
                if len(r)
            ]
            self._send(pieces)
        elif op.kind == OpKind.DISPATCH:  # the rows of the pairs I compute, from their owners
            got = []
            for d in others:
                r, _ = self.pairs(dest, key, d, me)
                if len(r):
                    got.append(
                        (r, torch.empty(len(r), h, dtype=p.normed.dtype, device=p.normed.device), d)
                    )
            self._recv([(buf, d, self.tag(kind, key, d)) for _, buf, d in got])
            for r, buf, _ in got:
                p.normed[r] = buf
        elif out:  # my experts' outputs for other ranks' tokens, back to them
            pieces = []
            for d in others:
                r, sl = self.pairs(dest, key, d, me)
                if len(r):
                    pieces.append((p.slots[r, sl], d, tag))
            self._send(pieces)
        else:  # my tokens' outputs computed elsewhere
            got = []
            for d in others:
                r, sl = self.pairs(dest, key, me, d)
                if len(r):
                    got.append(
                        (
                            r,
                            sl,
                            torch.empty(len(r), h, dtype=p.slots.dtype, device=p.slots.device),
                            d,
                        )
                    )
            self._recv([(buf, d, self.tag(kind, key, d)) for _, _, buf, d in got])
            for r, sl, buf, _ in got:
                put_expert(p.slots, r, sl, buf)

    def _copy(self, ex: Executor, op: Op, spec: StreamSpec) -> None:
        """A replica copy: the planner emits each copy as the destination's op on `replicas{dst}`
        followed by the source's on `replicas_out{src}`; the weights go from one to the other."""
        incoming = spec.resource == Resource.P2P
        in_id = op.id if incoming else op.id - 1
        partner_id = op.id + 1 if incoming else op.id - 1
        with ex._cv:
            while partner_id >= len(ex._ops):
                ex._wait(lambda: partner_id < len(ex._ops) or ex._planner_done)
                if partner_id >= len(ex._ops):
                    # a planner's bug (its copies come in pairs), no input of the user's
                    raise AssertionError(
                        f"{op.label()}: a replica copy with no op on the other GPU"
                    )
            partner = ex._ops[partner_id]
        peer = ex._stream_specs()[partner.stream].device
        assert (partner.kind, partner.expert, partner.layer) == (op.kind, op.expert, op.layer), (
            f"{op.label()}: its partner op is {partner.label()}"
        )
        u = Unit(Tensor.EXPERT, op.layer, op.expert)
        keys = sorted(self.layout[u])
        if incoming:
            w = {
                key: torch.empty(self.layout[u][key].shape, dtype=self.dtype, device=ex.device)
                for key in keys
            }
            self._recv(
                [(w[key], peer, self.copy_tag(in_id, i)) for i, key in enumerate(keys)],
                self._copy_group,
            )
            with ex._refs_lock:
                ex._resident[u] = w
        else:
            w = ex._weights(u, on_cpu=False)
            self._send(
                [(w[key], peer, self.copy_tag(in_id, i)) for i, key in enumerate(keys)],
                self._copy_group,
            )

    # ---- start and end -----------------------------------------------------------------------
    def moves(self, op: Op) -> bool:
        """Does the op move data between ranks (rather than within this process)?"""
        if op.kind in (OpKind.DISPATCH, OpKind.COMBINE):
            return True
        return op.kind == OpKind.LOAD and (op.src, op.dst) == (Tier.GPU, Tier.GPU)

    def start(self, ex: Executor) -> None:
        """Wait for every rank to be ready to run (their clocks start together), then listen
        for the other ranks' gate parts."""
        try:
            dist.barrier()
        except RuntimeError as e:
            raise self.lost(None, e, "before the run") from None
        if not self.tensor:  # dense=tensor: every rank gates every sequence itself
            self.listen(ex)

    def own_units(
        self, resident: Mapping[Unit, Tier], ep_slots: Mapping[Any, Any]
    ) -> dict[Unit, Tier]:
        """The units this rank holds before the run: every dense one, and the experts of its
        first placement (the others arrive by replica copies)."""
        s = self.spec
        first = {}
        for (step, batch, moe), slots in ep_slots.items():
            if (step, batch) == (0, 0):  # -1: an empty replica slot
                first[s.moe_layers[moe]] = {int(e) for e in slots[self.rank] if e >= 0}
        own = {u: t for u, t in resident.items() if u.kind != Tensor.EXPERT}
        own.update(
            {Unit(Tensor.EXPERT, layer, e): Tier.GPU for layer, held in first.items() for e in held}
        )
        return own

    def gather(self, ex: Executor, schedule: Schedule) -> None:
        """Every rank's op times, tokens and logits, merged on every rank (after the run)."""
        gather_ranks(self, ex, schedule)
