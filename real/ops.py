"""The op semantics of the real executor: what a load, a free, a gate, an attention, an expert,
a KV copy or an activation transfer does to the model's weights and activations. The interpreter
(`real.interpreter`) decides when; these methods do the op, on the calling worker's thread (and
CUDA stream). `Executor` (real/executor.py) holds the run's state they read and write.

Usage: mixed into `real.executor.Executor`; `_run_op(op, spec, cuda_stream)` and `_release(op)`
are what its interpreter calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import numpy as np
import torch

from core.activations import EXPERT_ROWS
from core.ep_layout import EPLayout
from core.errors import MoepipeError, ScheduleBug
from core.routing import GateView
from core.schedule import Op, StreamSpec
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from real.checkpoint import Unit
from real.decoding import next_tokens
from real.kv_ops import KVSemantics, _consecutive
from real.model import KVCache, expert_tokens, moe_output, new_slots, put_expert
from real.state import _BatchState, _Pending, bst_index, unit_of
from real.store import aligned

log = logging.getLogger(__name__)

# Shape legend: b sequences per batch, P prompt tokens, S tokens this step, T = b*S, H hidden,
# V vocab, k top-k, E experts.


class OpSemantics(KVSemantics):
    """The op code of `Executor`, apart from its interpreter (see the module's docstring)."""

    def _run_op(self, op: Op, spec: StreamSpec, cuda_stream: torch.cuda.Stream | None) -> None:
        """The op's work; its memory effect (`_release`) follows once the work is done."""
        k = op.kind
        if k == OpKind.FREE:
            return
        if self.peers is not None and self.peers.moves(op):
            self.peers.transfer(self, op, spec)
            return
        if self.tp is not None and self.tp.runs(op):  # dense=tensor: real/tensor_parallel.py
            self.tp.run(op, spec)
            return
        if k == OpKind.LOAD and unit_of(op) is not None:
            self._load(op, cuda_stream)
        elif k == OpKind.KV_LOAD:
            self._kv_copy(op, to_device=True)
        elif k == OpKind.KV_STORE:
            self._kv_copy(op, to_device=False)
        elif k in COMPUTE_KINDS:
            self._compute(op, spec)
        else:  # activations to/from the CPU, all-to-all: move the op's bytes for real
            self._scratch_copy(op)

    def _load(self, op: Op, cuda_stream: torch.cuda.Stream | None) -> None:
        u = unit_of(op)
        assert u is not None
        st = self.store
        if op.src == Tier.DISK and op.dst == Tier.CPU:
            self._hold(u, Tier.CPU)
            st.read_disk(u)
        elif op.src == Tier.CPU and op.dst == Tier.GPU:
            self._hold(u, Tier.GPU)
            if not st.holds(u, Tier.CPU):  # the planner assumed a host copy: read it now
                self._fallbacks += 1
                log.warning("%s: %s is not in host memory; reading it from disk", op.label(), u)
                st.read_disk(u)
            st.to_device(u, cuda_stream)
        else:
            self._scratch_copy(op)

    def _hold(self, u: Unit, tier: Tier) -> None:
        """Count a load's reference to the unit's copy in `tier`, once an eviction of that copy
        that a free began has ended. A free and a later load of the same unit need not be
        ordered: the load found the copy the free was about to evict, the free evicted it, and
        the compute after the load read the unit synchronously ("weights not loaded")."""
        refs = self._dev_refs if tier == Tier.GPU else self._host_refs
        with self._evicted:
            self._evicted.wait_for(lambda: (u, tier) not in self._evicting)
            refs[u] = refs.get(u, 0) + 1

    def _release(self, op: Op) -> None:
        """The end-of-op memory effect on the store: drop the unit's copy on the freed tier; a
        KV_STORE drops its batch's device cache of the layer (its kernels have finished)."""
        if op.kind == OpKind.KV_STORE and op.free_tier == Tier.GPU:
            with self._refs_lock:
                self._batches[op.batch].kv_dev[op.layer] = None
            return
        u = unit_of(op)
        if u is None or not op.free_bytes or op.free_tier is None:
            return
        if op.free_tier == Tier.GPU:
            refs, tier = self._dev_refs, Tier.GPU
        elif op.free_tier == Tier.CPU:
            refs, tier = self._host_refs, Tier.CPU
        else:
            return
        with self._refs_lock:
            n = refs.get(u, 0)
            if n <= 0:  # a resident unit whose "free" is bookkeeping only
                return
            refs[u] = n - 1
            drop = n == 1 and not (tier == Tier.CPU and u in self._host_resident)
            if drop:  # a load of the unit meanwhile waits for the eviction (`_hold`)
                self._evicting.add((u, tier))
        if drop:
            try:
                self.store.evict(u, tier)
            finally:
                with self._evicted:
                    self._evicting.discard((u, tier))
                    self._evicted.notify_all()

    def _weights(self, u: Unit, on_cpu: bool) -> Mapping[str, torch.Tensor]:
        st = self.store
        order = (Tier.CPU, Tier.GPU) if on_cpu else (Tier.GPU, Tier.CPU)
        w = st.resident(u, order[0])
        if w is None and not on_cpu:
            w = self._resident.get(u)
        if w is None:
            w = st.resident(u, order[1])
        if w is None and on_cpu:
            w = self._resident.get(u)
        if w is None:  # nowhere: the planner relies on a placement we did not preload
            self._fallbacks += 1
            log.warning("%s: weights not loaded; reading them synchronously", u)
            w = st.read_disk(u)
            if not on_cpu:
                w = st.to_device(u)
                self._resident[u] = dict(w)
                st.evict(u, Tier.CPU)
            else:
                self._host_resident.add(u)
        return aligned(w)  # a host-tier unit's views lie at the file's alignment

    def _compute(self, op: Op, spec: StreamSpec) -> None:
        m, s = self.model, self.model.spec
        u = unit_of(op)
        assert u is not None, f"{op.label()}: compute without weights"
        w = self._weights(u, spec.resource == Resource.CPU)
        if op.kind == OpKind.EXPERT:
            self._expert(op, w)
            return
        assert op.batch >= 0, f"{op.label()}: only experts may run over all batches"
        if op.kind == OpKind.GATE and op.batches > 1:  # each batch's router, in one op
            for b in range(op.batch, op.batch + op.batches):
                self._gate(op._replace(batch=b, batches=1), self._batches[b], w)
            return
        if op.batches > 1:
            self._attention_span(op, w)
            return
        bst = self._batches[op.batch]
        if op.kind == OpKind.GATE:
            self._gate(op, bst, w)
            return
        s0, s1 = self._range[op.id]
        assert 0 <= s0 < s1 <= self.wl.batch_size, f"{op.label()}: covers sequences {s0}..{s1}"
        h = self._hidden(bst, op.step)  # [b, S, H]
        if op.kind == OpKind.ATTENTION:
            if op.layer == 0:
                tokens_in = bst.prompt if op.step == 0 else bst.tokens[:, op.step - 1 : op.step]
                h[s0:s1] = m.embed(self._resident[Unit(Tensor.EMBED)], tokens_in[s0:s1])
            self._finish_moe(bst, h, s0, s1, op.micro, op.step)
            own = tuple(t[s0:s1] for t in self._kv_dev(bst, op))
            kv = KVCache(tuple(own if i == op.layer else () for i in range(s.n_layers)))
            part = m.attention_part(op.layer, w, h[s0:s1], kv, self._positions(op.step))
            h[s0:s1] = self._clamped((op.step, op.layer, 0), h[s0:s1] + part)
            self._note_finite(op.step, op.layer, 0, op.batch, "attention", h[s0:s1])
        elif op.kind == OpKind.FFN:
            if s.is_moe(op.layer):
                p = (
                    bst.pending.get(op.micro)
                    if self.peers is None
                    else self.peers.pending(self, op.step, op.layer, op.batch, op.micro)
                )
                assert p is not None and p.layer == op.layer, (
                    f"{op.label()}: shared FFN before its gate"
                )
                rows = slice(s0 * h.shape[1], s1 * h.shape[1])
                y = m.shared_ffn(w, p.normed[rows])  # [rows, H]
                with self._refs_lock:
                    if p.shared is None:
                        p.shared = torch.zeros_like(p.normed)
                        self._landed()
                p.shared[rows] = y.to(p.shared.device)
            else:
                h[s0:s1] = self._clamped(
                    (op.step, op.layer, 1), h[s0:s1] + m.dense_ffn_part(w, h[s0:s1])
                )
                self._note_finite(op.step, op.layer, 1, op.batch, "FFN", h[s0:s1])
        elif op.kind == OpKind.HEAD:
            self._finish_moe(bst, h, s0, s1, op.micro, op.step)
            logits = m.head(w, h[s0:s1])  # [s1-s0, V]
            with self._refs_lock:
                if bst.logits is None:
                    bst.logits = logits.new_zeros(self.wl.batch_size, logits.shape[1])
                    self._landed()
                bst.written[op.step] += s1 - s0
            bst.logits[s0:s1] = logits
            self._note_finite(op.step, s.n_layers, 0, op.batch, "logits", logits)
            so_far = bst.tokens[s0:s1, : op.step]  # [s1-s0, step]
            chosen = next_tokens(m.greedy, logits, bst.prompt[s0:s1], so_far, self.wl.gen_len)
            bst.tokens[s0:s1, op.step] = chosen

    def _attention_span(self, op: Op, w: Mapping[str, torch.Tensor]) -> None:
        """One attention call over the whole batches op.batch .. op.batch + op.batches - 1: the
        layer's weights are read once for all of them. Their hidden rows are gathered (b
        sequences x S tokens each, small at decode); their device caches are consecutive slices
        of the group's cache of the layer (`_kv_dev`), so the call reads and writes them in
        place. Where they are not (a cache some other op made apart), batch by batch."""
        m, bs = self.model, self.wl.batch_size
        if op.kind != OpKind.ATTENTION or op.micro >= 0 or self.peers is not None:
            raise ScheduleBug(
                f"{op.label()}: only an attention over whole batches, in one process, may span "
                "several batches"
            )
        if op.batch + op.batches > self.wl.n_batches:
            raise ScheduleBug(
                f"{op.label()}: spans past the group's last batch {self.wl.n_batches - 1}"
            )
        assert self._range[op.id] == (0, bs), f"{op.label()}: a span covers whole batches"
        batches = range(op.batch, op.batch + op.batches)
        hs = []  # [b, S, H] each
        for b in batches:
            bst = self._batches[b]
            h = self._hidden(bst, op.step)
            if op.layer == 0:
                tokens_in = bst.prompt if op.step == 0 else bst.tokens[:, op.step - 1 : op.step]
                h[:] = m.embed(self._resident[Unit(Tensor.EMBED)], tokens_in)
            self._finish_moe(bst, h, 0, bs, op.micro, op.step)
            hs.append(h)
        caches = [self._kv_dev(self._batches[b], op) for b in batches]
        whole = _consecutive(caches)  # [n*b, Hkv, M, D] each, or None
        pos, key = self._positions(op.step), (op.step, op.layer, 0)
        if whole is None:
            for h, own in zip(hs, caches, strict=True):
                kv = KVCache(tuple(own if i == op.layer else () for i in range(m.spec.n_layers)))
                h[:] = self._clamped(key, h + m.attention_part(op.layer, w, h, kv, pos))
        else:
            kv = KVCache(tuple(whole if i == op.layer else () for i in range(m.spec.n_layers)))
            x = torch.cat(hs)  # [n*b, S, H]
            y = self._clamped(key, x + m.attention_part(op.layer, w, x, kv, pos))
            for i, h in enumerate(hs):
                h[:] = y[i * bs : (i + 1) * bs]
        for b, h in zip(batches, hs, strict=True):
            self._note_finite(op.step, op.layer, 0, b, "attention", h)

    def _hidden(self, bst: _BatchState, step: int) -> torch.Tensor:
        """The batch's hidden state buffer for `step` (fresh at a new step; two steps before it
        are over: every op of this batch's step - 1 ran after them, on some stream)."""
        with self._refs_lock:
            if step not in bst.hidden:
                s = self.model.spec
                shape = (self.wl.batch_size, self.wl.step_tokens(step), s.hidden_size)
                bst.hidden[step] = torch.zeros(
                    shape,
                    dtype=self._resident[Unit(Tensor.EMBED)]["embed"].dtype,
                    device=self.device,
                )
                for old in [x for x in bst.hidden if x < step - 1]:
                    del bst.hidden[old]
                self._landed()
            return bst.hidden[step]

    def _landed(self) -> None:
        """Wait until this thread's stream has run what it queued. A buffer that ops on other
        CUDA streams fill part by part (one device's sequences each) is zeroed by the first op
        that needs it: without this, its fill could land after another stream's rows and wipe
        them, or a part's rows after the read of the op that completes the buffer."""
        if self.cuda:
            self._wait_stream()

    def _wait_stream(self) -> None:
        """Wait (sleeping, not spinning a core) until this thread's CUDA stream is done."""
        done = torch.cuda.Event(blocking=True)
        done.record(torch.cuda.current_stream(self.device))
        done.synchronize()

    def _positions(self, step: int) -> torch.Tensor:
        p = self.wl.prompt_len
        return torch.arange(0, p) if step == 0 else torch.arange(p + step - 1, p + step)

    def _gate(self, op: Op, bst: _BatchState, w: Mapping[str, torch.Tensor]) -> None:
        """The router over the op's sequences [s0, s1) (all of the batch, one device's share, or
        its part of a micro-batch); the batch's (micro-batch's) routing is published once every
        sequence of it has been gated."""
        s, wl = self.model.spec, self.wl
        moe = s.moe_index(op.layer)
        s0, s1 = self._range[op.id]
        fi, fw = self._forced_routing(op, s0, s1)
        h = self._hidden(bst, op.step)
        normed, ids, weights = self.model.gate(op.layer, w, h[s0:s1], fi, fw)
        if self.peers is not None:  # the other ranks' parts arrive by transfer
            self.peers.gate_part(self, op, normed, ids, weights)
            return
        rows = slice(s0 * h.shape[1], s1 * h.shape[1])
        whole = (s0, s1) == (0, wl.batch_size)
        if self.cuda and not whole:  # the part that completes the batch reads every part's rows
            self._wait_stream()
        with self._refs_lock:
            # (the previous layer stays pending until every part's attention ran)
            p = bst.gating.get(op.micro)
            if p is None:
                n_rows = wl.batch_size * h.shape[1]
                # rows no part of this gate covers (another micro-batch's) choose no expert
                nrm, i, wt = (
                    (normed, ids, weights)
                    if whole
                    else (
                        normed.new_zeros(n_rows, normed.shape[1]),
                        ids.new_full((n_rows, ids.shape[1]), -1),
                        weights.new_zeros(n_rows, weights.shape[1]),
                    )
                )
                outside = ~self._micro_mask(op.micro)  # nothing to gate there, nor to add
                p = bst.gating[op.micro] = _Pending(
                    op.step,
                    op.layer,
                    nrm,
                    i,
                    wt,
                    new_slots(nrm, s.top_k),
                    outside.clone(),
                    outside.clone(),
                )
            assert (p.step, p.layer) == (op.step, op.layer), f"{op.label()}: gate parts interleave"
            if p.normed is not normed:
                p.normed[rows], p.ids[rows], p.weights[rows] = normed, ids, weights
                self._landed()  # read by the part that completes the batch, on its stream
            p.gated[s0:s1] = True
            if not bool(p.gated.all()):
                return
            old = bst.pending.get(op.micro)
            assert old is None or bool(old.done.all()), f"{op.label()}: previous layer unfinished"
            bst.pending[op.micro] = p
            del bst.gating[op.micro]
        self._publish(op, p.ids, p.weights, moe)

    def _forced_routing(
        self, op: Op, s0: int, s1: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A replay's experts and weights [T, k] for a gate op over sequences [s0, s1) of its
        batch; (None, None) where the gate chooses (live)."""
        if self._routing is None:
            return None, None
        s, wl = self.model.spec, self.wl
        moe = s.moe_index(op.layer)
        seqs = slice(op.batch * wl.batch_size + s0, op.batch * wl.batch_size + s1)
        pos = self._routing.step_slice(op.step, wl)
        fi = torch.from_numpy(
            self._routing.expert_ids[seqs, pos, moe].reshape(-1, s.top_k).astype(np.int64)
        )
        fw = torch.from_numpy(
            np.ascontiguousarray(self._routing.gate_weights[seqs, pos, moe].reshape(-1, s.top_k))
        )
        return fi, fw

    def _publish(self, op: Op, ids: torch.Tensor, weights: torch.Tensor, moe: int) -> None:
        """A gated batch's routing (`ids`, `weights` [T, k] over the batch's rows; a
        micro-batch's: -1 and 0 outside its rows), for the planner (live) and the run's output:
        at once, or of a micro-batch (its rows, `EPLayout.micro_rows`) and, once every
        micro-batch of the batch is gated, the whole batch's."""
        n_e, key = self.model.spec.n_experts, (op.step, moe, op.batch)
        ids, weights = ids.cpu(), weights.cpu()

        def view(i: torch.Tensor) -> GateView:
            return GateView(
                i.numpy().astype(np.int16), np.bincount(i.flatten().numpy(), minlength=n_e)
            )

        with self._cv:
            if op.micro >= 0:
                ep = self._ep_meta()
                rows = ep.micro_rows(self.wl.batch_size, op.micro, self.wl.step_tokens(op.step))
                self._views[(*key, op.micro)] = view(ids[torch.from_numpy(rows)])
                parts = self._micro_parts.setdefault(key, [])
                parts.append((ids, weights))
                self._cv.notify_all()
                if len(parts) < ep.micro_batches:
                    return
                del self._micro_parts[key]
                ids = torch.stack([i for i, _ in parts]).max(0).values  # -1 outside each's rows
                weights = torch.stack([w for _, w in parts]).sum(0)  # 0 outside
            self._views[key] = view(ids)
            self._used[key] = (ids, weights)
            self._cv.notify_all()

    def _ep_meta(self) -> EPLayout:
        """The expert-parallel layout of the schedule under way (a replay's, or the one a live
        planner is building: its layout is set before its first op)."""
        ep = self._schedule.ep if self._schedule is not None else self._builder.ep
        assert ep is not None, "an expert-parallel op in a schedule with no layout"
        return ep

    def _ep_slots(self) -> dict[tuple[int, int, int], list[list[int]]]:
        """(step, batch, MoE layer) -> each device's expert slots (the planner's placements)."""
        return self._ep_meta().placements

    def _micro_mask(self, micro: int) -> torch.Tensor:
        """[b] bool: the batch's sequences in micro-batch `micro` (-1: all of them)."""
        bs = self.wl.batch_size
        if micro < 0:
            return torch.ones(bs, dtype=torch.bool)
        ep, mask = self._ep_meta(), torch.zeros(bs, dtype=torch.bool)
        for d in range(ep.n_devices):
            s0, s1 = ep.micro_seqs(bs, d, micro)
            mask[s0:s1] = True
        return mask

    def _expert(
        self,
        op: Op,
        w: Mapping[str, torch.Tensor],
        pending: Callable[[int], _Pending] | None = None,
    ) -> None:
        """One expert over its tokens in one batch, or in every batch of the group (batch=-1).
        `pending`: batch -> the MoE layer it reads (a tensor-parallel device's own)."""
        batches = range(self.wl.n_batches) if op.batch == -1 else (op.batch,)
        parts, xs = [], []
        for b in batches:
            p = (
                pending(b)
                if pending is not None
                else self._batches[b].pending.get(op.micro)
                if self.peers is None
                else self.peers.pending(self, op.step, op.layer, b, op.micro)
            )
            assert p is not None and p.layer == op.layer, (
                f"{op.label()}: batch {b} has no gate output"
            )
            rows, slot = expert_tokens(p.ids, op.expert)
            if op.batch >= 0:  # expert-parallel planners split an expert's tokens over copies
                t0, t1 = self._range[op.id]
                if t1 > len(rows):
                    raise ScheduleBug(
                        f"{op.label()}: runs tokens {t0}..{t1} of the expert, "
                        f"the gate routed {len(rows)}"
                    )
                rows, slot = rows[t0:t1], slot[t0:t1]
            if len(rows):
                parts.append((p, rows, slot))
                xs.append(p.normed[rows])  # [n, H]
        if not xs:
            return
        dev = next(iter(w.values())).device
        x = torch.cat(xs).to(dev) if len(xs) > 1 else xs[0].to(dev)
        # in chunks of rows: a Klotski group's hot expert can take every token of n batches,
        # whose [rows, ffn] intermediate at once would be many GB (Mixtral, n = 61: 14 GB)
        y = torch.cat(
            [self.model.expert(w, x[i : i + EXPERT_ROWS]) for i in range(0, len(x), EXPERT_ROWS)]
        )  # [sum n, H]
        at = 0
        for p, rows, slot in parts:
            put_expert(p.slots, rows, slot, y[at : at + len(rows)])
            at += len(rows)

    def _finish_moe(
        self, bst: _BatchState, h: torch.Tensor, s0: int, s1: int, micro: int, step: int
    ) -> None:
        """Add the pending MoE layer's output (of micro-batch `micro`, at `step`) to sequences
        [s0, s1) (once)."""
        p = bst.pending.get(micro)
        if p is None or bool(p.done[s0:s1].all()):
            return
        rows = slice(s0 * h.shape[1], s1 * h.shape[1])
        shared = None if p.shared is None else p.shared[rows]
        h[s0:s1] = self._clamped(
            (step, p.layer, 1),
            moe_output(
                h[s0:s1], p.slots[rows], p.weights[rows], shared, self.model.float32_combine
            ),
        )
        p.done[s0:s1] = True
        self._note_finite(step, p.layer, 1, bst_index(self._batches, bst), "MoE", h[s0:s1])

    def _note_finite(
        self, step: int, layer: int, order: int, batch: int, what: str, x: torch.Tensor
    ) -> None:
        """Record (without waiting for it) whether an op's output `x` is finite everywhere."""
        self._finite.append(((step, layer, order, batch, what), torch.isfinite(x).all()))

    def _clamped(self, key: tuple[int, int, int], summed: torch.Tensor) -> torch.Tensor:
        """`Model.clamp_overflow` of an op's residual sum [b, S, H] at key (step, layer, order),
        noting for Switch in float16 (without waiting for it) whether the sum overflowed and
        whether it holds a value the clamp of an overflowing batch (to max - 1000) would move:
        `_check_overflow` refuses a run whose ops decided apart what transformers decides
        over the whole batch."""
        out = self.model.clamp_overflow(summed)
        if out is not summed:  # Switch in float16
            moved = self.model.clamp_overflow(out.new_full((1,), float("inf")))[0]
            near = (out.abs() > moved).any()
            self._overflow.append((key, torch.isinf(summed).any(), near))
        return out

    def _overflow_seen(self) -> dict[tuple[int, int, int], list[bool]]:
        """(step, layer, order) -> [did an op's sum overflow, did an op keep a value within 1000
        of float16's max], over this process's ops (Switch in float16; else empty)."""
        if not self._overflow:
            return {}
        flags = torch.stack([torch.stack((i, n)) for _, i, n in self._overflow]).cpu()
        seen: dict[tuple[int, int, int], list[bool]] = {}
        for (key, _, _), (inf, near) in zip(self._overflow, flags.tolist(), strict=True):
            got = seen.setdefault(key, [False, False])
            got[0], got[1] = got[0] or inf, got[1] or near
        return seen

    def _check_overflow(self) -> None:
        """A warning where one op of a (step, layer, residual add) overflowed float16 and
        another kept a value within 1000 of its max: transformers' block clamps its whole batch
        to max - 1000 where any value overflows, so it would have clamped that value too, which
        ops that each hold a part of the run's sequences cannot know in time. Where one op
        holds every sequence, or none of them keeps such a value, the run is transformers'.
        A distributed run's ranks each hold their sequences: `gather_ranks` merged every rank's
        flags into `_overflow_ranks`, and rank 0 says the run's line."""
        seen = self._overflow_ranks if self._overflow_ranks is not None else self._overflow_seen()
        if self.peers is not None and self.peers.rank != 0:
            return
        split = sorted(k for k, (inf, near) in seen.items() if inf and near)
        if split:
            step, layer, order = split[0]
            log.warning(
                f"layer {layer} ({'FFN' if order else 'attention'}) at step {step} "
                f"({len(split)} such): one op's sequences overflowed float16 and another op's "
                "kept a value within 1000 of its max, which transformers' Switch block, "
                "clamping its whole batch, would have clamped to max - 1000; the logits may "
                "differ from its: run the sequences in one batch of one process "
                "(workload.n_batches=1, no micro-batches, no executor.distributed) for its "
                "clamp, or executor.dtype=float32"
            )

    def _check_finite(self) -> None:
        """A MoepipeError naming the first layer (in step, then layer order) whose output held
        NaN or infinity: the run's tokens would be computed from garbage."""
        if not self._finite:
            return
        ok = torch.stack([f for _, f in self._finite]).cpu()  # one synchronisation
        bad = sorted(k for (k, _), f in zip(self._finite, ok.tolist(), strict=True) if not f)
        if not bad:
            return
        step, layer, _, batch, what = bad[0]
        where = "the LM head" if what == "logits" else f"layer {layer} ({what})"
        raise MoepipeError(
            f"non-finite values (NaN or inf) in the output of {where}"
            + f" at step {step}, batch {batch} ({len(bad)} op output(s) affected); "
            "the checkpoint's weights "
            "hold NaN/inf or overflow their dtype: check or rewrite the checkpoint"
        )

    def _scratch_copy(self, op: Op) -> None:
        """Move op.nbytes between host and device scratch buffers (activation transfers)."""
        n = max(int(op.nbytes), 1)
        key_src = "dev" if op.src == Tier.GPU else "host"
        key_dst = "dev" if op.dst == Tier.GPU else "host"
        src = self._scratch_buf(key_src + "_a", n)
        dst = self._scratch_buf(key_dst + "_b", n)
        dst[:n].copy_(src[:n], non_blocking=self.cuda)

    def _scratch_buf(self, key: str, n: int) -> torch.Tensor:
        with self._refs_lock:
            buf = self._scratch.get(key)
            if buf is None or buf.numel() < n:
                if buf is not None:  # a copy on another stream may still use it: keep it alive
                    self._retired.append(buf)
                if key.startswith("dev"):
                    buf = torch.zeros(max(n, 1 << 20), dtype=torch.uint8, device=self.device)
                else:  # host: a slab of its exact size (pinned on CUDA), reused only once
                    # the executor (its scratch and retired buffers) is gone
                    buf = self.store.slabs.lend(max(n, 1 << 20))
                self._scratch[key] = buf
            return buf
