"""Building blocks every planner shares: emitting weight loads through the tiers, attention with
its KV traffic, gates, expert and FFN computes, and the LM head, with the right sizes, flops and
memory effects. Planners decide *order and overlap*; this file knows *what* each op costs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from operator import is_not
from typing import TypeGuard, cast

import numpy as np

from core.planner import PlanContext
from core.routing import GateView
from core.schedule import Op, ScheduleBuilder, new_op
from core.spec import ModelSpec
from core.types import OpKind, Resource, Stream, Tensor, Tier
from planners.placement import Placement, staged_placement

# a dep that names an op (not None): a C call, made per dep of the hottest ops
_is_op = cast("Callable[[int | None], TypeGuard[int]]", partial(is_not, None))

# an op's fields (after its id) before its batch, those between its batch and its deps, and its
# batches: what ops of one kind and place share, made once (an op from them is one tuple, not
# `ScheduleBuilder.add`'s keywords bound again for each)
_Proto = tuple[tuple[object, ...], tuple[object, ...], int]
_BATCH, _DEPS = Op._fields.index("batch"), Op._fields.index("deps")


def _proto(kind: OpKind, stream: str, fields: Mapping[str, object]) -> _Proto:
    """`_Proto` of the op `ScheduleBuilder.add(kind, stream, ..., **fields)` adds: its fields
    and defaults are `Op`'s, in its order (a test checks they agree)."""
    op = Op(0, kind, stream, **fields)  # type: ignore[arg-type]
    return op[1:_BATCH], op[_BATCH + 1 : _DEPS], op.batches


@dataclass
class Emitter:
    """Wraps a builder with the model/placement arithmetic. One per plan() call."""

    ctx: PlanContext
    out: ScheduleBuilder
    placement: Placement
    last_kv_store: dict[tuple[int, int], int] = field(default_factory=dict)  # (layer, batch) -> op
    gate_ops: dict[tuple[int, int], list[int]] = field(
        default_factory=dict
    )  # (step, layer) -> gates by batch
    # the context's model and batch size, read for nearly every op (plain attributes: a
    # property's call each time was a fortieth of planning)
    model: ModelSpec = field(init=False, repr=False)
    bs: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.model, self.bs = self.ctx.model, self.ctx.workload.batch_size
        self._streamed: dict[tuple[Tensor, int], bool] = {}
        self._bytes: dict[tuple[Tensor, int], int] = {}
        # an op's fields but its batch and deps (`_Proto`), by its kind and what sets them
        self._protos: dict[tuple[object, ...], _Proto] = {}
        b = self.out
        self.compute = b.stream(Stream.COMPUTE, Resource.GPU)
        self.weights = b.stream(Stream.WEIGHTS, Resource.H2D)
        self.disk = b.stream(Stream.DISK, Resource.DISK)
        self.kv_load_stream = b.stream(Stream.KV_LOAD, Resource.H2D)
        self.kv_store_stream = b.stream(Stream.KV_STORE, Resource.D2H)
        for tier, nbytes in self.placement.resident_bytes.items():
            b.reserve(tier, nbytes)
        b.meta["placement"] = self.placement.summary()

    # ---- sizes ------------------------------------------------------------------------

    def tensor_tier(self, tensor: Tensor, layer: int) -> Tier:
        if tensor == Tensor.EXPERT:
            return self.placement.experts[layer]
        return self.placement.dense

    def tensor_bytes(self, tensor: Tensor, layer: int) -> int:
        key = (tensor, layer)
        known = self._bytes.get(key)
        if known is None:  # (the model is frozen: asked for most ops, known once)
            known = self._bytes[key] = self._tensor_bytes(tensor, layer)
        return known

    def _tensor_bytes(self, tensor: Tensor, layer: int) -> int:
        m = self.model
        if tensor == Tensor.ATTENTION:
            return m.attn_bytes
        if tensor == Tensor.GATE:
            return m.gate_bytes
        if tensor == Tensor.EXPERT:
            return m.expert_bytes
        if tensor == Tensor.FFN:
            return m.shared_ffn_bytes if m.is_moe(layer) else m.dense_ffn_bytes
        if tensor == Tensor.HEAD:
            return m.head_bytes
        raise AssertionError(tensor)

    def disk_read_bytes(self, tensor: Tensor, layer: int) -> int:
        """Bytes a disk read of the unit moves: as the disk holds them (an FP8 expert's 1 a
        weight and its scales, `ModelSpec.expert_disk_bytes`); the host holds `tensor_bytes`."""
        if tensor == Tensor.EXPERT:
            return self.model.expert_disk_bytes
        return self.tensor_bytes(tensor, layer)

    def streamed(self, tensor: Tensor, layer: int) -> bool:
        """True when the tensor must be loaded to the GPU before use (and freed after)."""
        key = (tensor, layer)
        known = self._streamed.get(key)
        if known is None:  # (the placement is frozen: asked for nearly every op, known once)
            tier, nbytes = self.tensor_tier(tensor, layer), self.tensor_bytes(tensor, layer)
            known = self._streamed[key] = tier != Tier.GPU and nbytes > 0
        return known

    # ---- loads --------------------------------------------------------------------------
    def load(
        self,
        tensor: Tensor,
        step: int,
        layer: int,
        expert: int = -1,
        stream: str | None = None,
        deps: tuple[int | None, ...] = (),
    ) -> int | None:
        """Bring a weight unit to the GPU; returns the op its users depend on (None if resident)."""
        if not self.streamed(tensor, layer):
            return None
        nbytes = self.tensor_bytes(tensor, layer)
        tier = self.tensor_tier(tensor, layer)
        common = dict(step=step, layer=layer, expert=expert, tensor=tensor)
        if tier == Tier.DISK:
            read = self.out.add(
                OpKind.LOAD,
                self.disk,
                deps,
                src=Tier.DISK,
                dst=Tier.CPU,
                alloc_tier=Tier.CPU,
                alloc_bytes=nbytes,
                nbytes=self.disk_read_bytes(tensor, layer),
                **common,
            )
            return self.out.add(
                OpKind.LOAD,
                stream or self.weights,
                (read,),
                src=Tier.CPU,
                dst=Tier.GPU,
                alloc_tier=Tier.GPU,
                alloc_bytes=nbytes,
                free_tier=Tier.CPU,
                free_bytes=nbytes,
                nbytes=nbytes,
                **common,
            )
        return self.out.add(
            OpKind.LOAD,
            stream or self.weights,
            deps,
            src=Tier.CPU,
            dst=Tier.GPU,
            alloc_tier=Tier.GPU,
            alloc_bytes=nbytes,
            nbytes=nbytes,
            **common,
        )

    def free(
        self, tensor: Tensor, step: int, layer: int, deps: tuple[int | None, ...], expert: int = -1
    ) -> int | None:
        """Release a streamed unit once `deps` are done (a zero-time op on the compute stream)."""
        if not self.streamed(tensor, layer):
            return None
        return self.out.add(
            OpKind.FREE,
            self.compute,
            deps,
            step=step,
            layer=layer,
            expert=expert,
            tensor=tensor,
            free_tier=Tier.GPU,
            free_bytes=self.tensor_bytes(tensor, layer),
        )

    def free_kwargs(self, tensor: Tensor, layer: int, last_use: bool) -> dict[str, object]:
        """Memory effect for the op that last uses a streamed unit: it frees it at its end."""
        if last_use and self.streamed(tensor, layer):
            return dict(free_tier=Tier.GPU, free_bytes=self.tensor_bytes(tensor, layer))
        return {}

    def _op(self, key: tuple[object, ...], batch: int, deps: tuple[int | None, ...]) -> int:
        """Add the op of `key` (its kind, then what sets its other fields: `_new_proto`) for
        `batch` after `deps`: from its fields made once (`_Proto`), one tuple."""
        proto = self._protos.get(key)
        if proto is None:
            proto = self._protos[key] = self._new_proto(key)
        head, rest, span = proto
        return self.out.append((*head, batch, *rest, tuple(filter(_is_op, deps)), span))

    def _new_proto(self, key: tuple[object, ...]) -> _Proto:
        """The fields of `_op`'s key's ops: (kind, step, layer, ...)."""
        kind = cast(OpKind, key[0])
        step, layer = cast(tuple[int, int], key[1:3])
        if kind == OpKind.ATTENTION:  # (..., last batch, batches)
            last_batch, batches = cast(tuple[bool, int], key[3:])
            fields = self._attention_fields(step, layer, last_batch, batches)
            return _proto(kind, self.compute, fields)
        if kind == OpKind.GATE:  # (..., last batch): one batch's router
            free = self.free_kwargs(Tensor.GATE, layer, cast(bool, key[3]))
            return _proto(kind, self.compute, self._gate_fields(step, layer, self.bs, free))
        if kind == OpKind.KV_LOAD:
            return _proto(kind, self.kv_load_stream, self._kv_load_fields(step, layer))
        assert kind == OpKind.KV_STORE, kind
        return _proto(kind, self.kv_store_stream, self._kv_store_fields(step, layer))

    # ---- attention and KV ----------------------------------------------------------------
    def kv_offloaded(self, layer: int) -> bool:
        return self.placement.kv[layer] != Tier.GPU

    def kv_load(
        self, step: int, layer: int, batch: int, deps: tuple[int | None, ...] = ()
    ) -> int | None:
        """Load a batch's past KV of one layer to the GPU (decode steps, KV kept on CPU)."""
        if step == 0 or not self.kv_offloaded(layer):
            return None
        prev = self.last_kv_store.get((layer, batch))
        return self._op((OpKind.KV_LOAD, step, layer), batch, (*deps, prev))

    def _kv_load_fields(self, step: int, layer: int) -> dict[str, object]:
        wl, m = self.ctx.workload, self.model
        past = self.bs * (wl.step_context(step) - 1) * m.kv_bytes_per_token
        buf = self.bs * wl.step_context(step) * m.kv_bytes_per_token
        return dict(
            step=step,
            layer=layer,
            tensor=Tensor.KV,
            nbytes=past,
            src=Tier.CPU,
            dst=Tier.GPU,
            alloc_tier=Tier.GPU,
            alloc_bytes=buf,
        )

    def attention(
        self,
        step: int,
        layer: int,
        batch: int,
        deps: tuple[int | None, ...],
        last_batch: bool,
        batches: int = 1,
    ) -> int:
        """Attention of `batches` consecutive batches from `batch` in one op: the layer's
        weights read once, each batch's KV read (several only where the layer's KV stays on the
        GPU: an offloaded cache is loaded and stored batch by batch)."""
        return self._op((OpKind.ATTENTION, step, layer, last_batch, batches), batch, deps)

    def _attention_fields(
        self, step: int, layer: int, last_batch: bool, batches: int
    ) -> dict[str, object]:
        """`attention`'s op fields but its batch and deps (the same for every batch)."""
        wl, m = self.ctx.workload, self.model
        assert batches == 1 or not self.kv_offloaded(layer), "a span of batches needs GPU KV"
        seqs = self.bs * batches
        tokens = seqs * wl.step_tokens(step)
        context = (wl.prompt_len + 1) / 2 if step == 0 else wl.step_context(step)
        kv_read = int(seqs * wl.step_context(step) * m.kv_bytes_per_token)
        extra: dict[str, object] = {}
        if step == 0 and self.kv_offloaded(layer):  # the new KV is built in a GPU buffer
            extra = dict(
                alloc_tier=Tier.GPU, alloc_bytes=self.bs * wl.prompt_len * m.kv_bytes_per_token
            )
        extra.update(self.free_kwargs(Tensor.ATTENTION, layer, last_batch))
        if batches != 1:
            extra["batches"] = batches
        return dict(
            step=step,
            layer=layer,
            tensor=Tensor.ATTENTION,
            tokens=tokens,
            flops=m.attention_flops(tokens, int(context), sequences=seqs),
            touch_bytes=m.attn_bytes + kv_read,
            **extra,
        )

    def kv_store(self, step: int, layer: int, batch: int, attn: int) -> int | None:
        """Write the batch's new KV back to CPU and release its GPU buffer."""
        if not self.kv_offloaded(layer):
            return None
        op = self._op((OpKind.KV_STORE, step, layer), batch, (attn,))
        self.last_kv_store[(layer, batch)] = op
        return op

    def _kv_store_fields(self, step: int, layer: int) -> dict[str, object]:
        wl, m = self.ctx.workload, self.model
        new = self.bs * wl.step_tokens(step) * m.kv_bytes_per_token
        context = wl.prompt_len if step == 0 else wl.step_context(step)
        return dict(
            step=step,
            layer=layer,
            tensor=Tensor.KV,
            nbytes=new,
            src=Tier.GPU,
            dst=Tier.CPU,
            free_tier=Tier.GPU,
            free_bytes=self.bs * context * m.kv_bytes_per_token,
        )

    # ---- MoE and FFN -------------------------------------------------------------------------
    def gate(
        self, step: int, layer: int, batch: int, deps: tuple[int | None, ...], last_batch: bool
    ) -> tuple[int, GateView]:
        """Run the router for one batch; the only place a planner learns that batch's routing."""
        op = self._op((OpKind.GATE, step, layer, last_batch), batch, deps)
        return op, self._reveal(op, step, layer, batch)

    def gate_span(
        self,
        step: int,
        layer: int,
        batch: int,
        batches: int,
        deps: tuple[int | None, ...],
        last_batch: bool,
    ) -> tuple[int, list[GateView]]:
        """The routers of batches batch .. batch + batches - 1 as one op (one call per batch
        inside it, without an op's overhead for each); their routings are all seen at it."""
        if batches == 1:
            op, view = self.gate(step, layer, batch, deps, last_batch)
            return op, [view]
        free = self.free_kwargs(Tensor.GATE, layer, last_batch)
        parts = [(self.compute, self.bs * batches, deps)]
        (op,) = self._gate_ops(step, layer, batch, parts, free, batches=batches)
        return op, [self._reveal(op, step, layer, b) for b in range(batch, batch + batches)]

    def gate_parts(
        self, step: int, layer: int, batch: int, parts: Sequence[tuple[str, int, tuple[int, ...]]]
    ) -> tuple[tuple[int, ...], GateView]:
        """The router of one batch split over devices, each part (stream, sequences, deps) on its
        own share of the batch's sequences (data-parallel expert parallelism: every GPU gates the
        tokens it holds, or every token under tensor parallelism). The batch's routing is known
        once all parts have run: `core.schedule.validate` checks that each expert op depends on
        every gate op of its batch. The router is resident on every device (no memory effect)."""
        assert parts and not self.streamed(Tensor.GATE, layer), "split gates: a resident router"
        return self._gate(step, layer, batch, parts, {})

    def gate_micro(
        self,
        step: int,
        layer: int,
        batch: int,
        parts: Sequence[tuple[str, int, tuple[int, ...]]],
        micro: int,
        of: int,
        rows: np.ndarray,
    ) -> tuple[tuple[int, ...], GateView, GateView | None]:
        """`gate_parts` for micro-batch `micro` of `of` (two-batch overlap), the batch's tokens
        `rows`: its ops, its own routing (seen at its last gate op, so its tokens may move before
        the next micro-batch is gated), and, at the last micro-batch, the whole batch's routing.
        `validate` checks each of its expert ops depends on every gate op of its micro-batch."""
        assert parts and not self.streamed(Tensor.GATE, layer), "split gates: a resident router"
        ops = self._gate_ops(step, layer, batch, parts, {}, micro=micro)
        view = self.ctx.routing.at_micro_gate(
            ops[-1], step, self.model.moe_index(layer), batch, micro, rows
        )
        whole = self._reveal(ops[-1], step, layer, batch) if micro == of - 1 else None
        return ops, view, whole

    def _gate(
        self,
        step: int,
        layer: int,
        batch: int,
        parts: Sequence[tuple[str, int, tuple[int | None, ...]]],
        free: dict[str, object],
    ) -> tuple[tuple[int, ...], GateView]:
        """Gate ops over (stream, sequences, deps) parts, the last with the memory effect `free`;
        the batch's routing is revealed at the last."""
        ops = self._gate_ops(step, layer, batch, parts, free)
        return ops, self._reveal(ops[-1], step, layer, batch)

    def _gate_ops(
        self,
        step: int,
        layer: int,
        batch: int,
        parts: Sequence[tuple[str, int, tuple[int | None, ...]]],
        free: dict[str, object],
        micro: int = -1,
        batches: int = 1,
    ) -> tuple[int, ...]:
        ops: list[int] = []
        for i, (stream, seqs, deps) in enumerate(parts):
            fields = self._gate_fields(step, layer, seqs, free if i == len(parts) - 1 else {})
            ops.append(
                self.out.add(
                    OpKind.GATE, stream, deps, batch=batch, micro=micro, batches=batches, **fields
                )
            )
        return tuple(ops)

    def _gate_fields(
        self, step: int, layer: int, seqs: int, free: dict[str, object]
    ) -> dict[str, object]:
        """A gate op's fields over `seqs` sequences, with the memory effect `free`, but its
        stream, deps, batch, micro-batch and batches."""
        m, per = self.model, self.ctx.workload.step_tokens(step)
        return dict(
            step=step,
            layer=layer,
            tensor=Tensor.GATE,
            tokens=seqs * per,
            flops=m.gate_flops(seqs * per),
            touch_bytes=m.gate_bytes,
            **free,
        )

    def _reveal(self, gate: int, step: int, layer: int, batch: int) -> GateView:
        """The batch's routing, seen at its last gate op `gate`."""
        view = self.ctx.routing.at_gate(gate, step, self.model.moe_index(layer), batch)
        gates = self.gate_ops.setdefault((step, layer), [])
        assert len(gates) == batch, "gates of a layer run in batch order"
        gates.append(gate)
        return view

    def expert(
        self,
        step: int,
        layer: int,
        batch: int,
        expert: int,
        tokens: int,
        deps: tuple[int | None, ...],
        last_use: bool,
    ) -> int:
        """One routed expert over `tokens` tokens (batch -1: the tokens of all batches).

        Depends on the gate(s) that routed those tokens: planners are causal.
        """
        m = self.ctx.model
        gates = self.gate_ops[(step, layer)]
        # (a gate over several batches is each one's: named once)
        deps = (*deps, *(dict.fromkeys(gates) if batch == -1 else gates[batch : batch + 1]))
        # the planners' most frequent op: built positionally (`ScheduleBuilder.append`, as
        # `add` would build it), the memory effect looked up only at a last use
        free_tier, free_bytes = None, 0
        if last_use and self.streamed(Tensor.EXPERT, layer):
            free_tier, free_bytes = Tier.GPU, m.expert_bytes
        return self.out.append(
            (
                OpKind.EXPERT,
                self.compute,
                step,
                layer,
                batch,
                expert,
                -1,  # micro: the whole batch
                Tensor.EXPERT,
                0,  # nbytes
                tokens,
                m.expert_flops(tokens),
                m.expert_bytes,  # touch_bytes
                0,  # width
                None,  # src
                None,  # dst
                None,  # alloc_tier
                0,  # alloc_bytes
                free_tier,
                free_bytes,
                tuple(filter(_is_op, deps)),
                1,  # batches: its own
            )
        )

    def expert_chain(
        self,
        step: int,
        layer: int,
        batch: int,
        counts: Sequence[int],
        loads: Mapping[int, int | None],
        last: int | None,
        extra: tuple[int, ...],
        release: bool = False,
    ) -> range:
        """The routed experts of one batch, one after another in index order: expert e (those
        with tokens, `counts[e]` of them) as `expert(step, layer, batch, e, counts[e],
        (loads[e], <the op before>, *extra), last_use=False)` would emit it, the first after
        `last`. Returns the ops' ids (consecutive). One call per batch, not per expert: the
        hottest loop of a planner that runs every chosen expert of a batch in turn.
        `release`: each op is its expert's last use: it frees a streamed expert at its end."""
        m, out = self.ctx.model, self.out
        gates = self.gate_ops[(step, layer)]
        tail = tuple(filter(_is_op, (*extra, *gates[batch : batch + 1])))
        flops, touch = 2.0 * m.expert_params, m.expert_bytes
        kind, stream, tensor = OpKind.EXPERT, self.compute, Tensor.EXPERT
        start = i = len(out.ops)
        ops = []
        freed = (Tier.GPU, touch) if release and self.streamed(tensor, layer) else (None, 0)
        for e, count in enumerate(counts):
            if count:
                load = loads[e]
                if load is None or last is None:  # a resident expert, or the first op
                    deps = tuple(filter(_is_op, (load, last, *tail)))
                else:
                    deps = (load, last) + tail  # (a C-level join: no list made)
                fields = (
                    i,
                    kind,
                    stream,
                    step,
                    layer,
                    batch,
                    e,
                    -1,  # micro: the whole batch
                    tensor,
                    0,  # nbytes
                    count,  # tokens
                    flops * count,
                    touch,  # touch_bytes
                    0,  # width
                    None,  # src
                    None,  # dst
                    None,  # alloc_tier
                    0,  # alloc_bytes
                    *freed,  # free_tier, free_bytes
                    deps,
                    1,  # batches: its own
                )
                ops.append(new_op(Op, fields))
                last = i
                i += 1
        out.extend(ops)
        return range(start, i)

    def ffn(
        self, step: int, layer: int, batch: int, deps: tuple[int | None, ...], last_batch: bool
    ) -> int | None:
        """Dense FFN (non-MoE layer) or shared experts (MoE layer) for one batch."""
        m = self.model
        nbytes = self.tensor_bytes(Tensor.FFN, layer)
        if nbytes == 0:
            return None
        tokens = self.bs * self.ctx.workload.step_tokens(step)
        return self.out.add(
            OpKind.FFN,
            self.compute,
            deps,
            step=step,
            layer=layer,
            batch=batch,
            tensor=Tensor.FFN,
            tokens=tokens,
            flops=m.ffn_flops(tokens, layer),
            touch_bytes=nbytes,
            **self.free_kwargs(Tensor.FFN, layer, last_batch),
        )

    def head(self, step: int, batch: int, deps: tuple[int | None, ...], last_batch: bool) -> int:
        """Final norm + LM head on the last position of each sequence."""
        m = self.model
        return self.out.add(
            OpKind.HEAD,
            self.compute,
            deps,
            step=step,
            batch=batch,
            tensor=Tensor.HEAD,
            tokens=self.bs,
            flops=m.head_flops(self.bs),
            touch_bytes=m.head_bytes,
            **self.free_kwargs(Tensor.HEAD, -1, last_batch),
        )


def standard_placement(
    ctx: PlanContext, kv_sequences: int, layers_in_flight: int, act_sequences: int | None = None
) -> Placement:
    """Greedy placement with GPU room for `layers_in_flight` streamed layers and KV buffers, and
    activations of `act_sequences` sequences (those live at once; default `kv_sequences`)."""
    m, wl = ctx.model, ctx.workload
    layer_max = max(m.layer_bytes(i) for i in range(m.n_layers))
    kv_buf = 2 * wl.batch_size * (wl.prompt_len + wl.gen_len) * m.kv_bytes_per_token
    live = kv_sequences if act_sequences is None else act_sequences
    act = 3 * live * wl.prompt_len * m.hidden_size * m.dtype_bytes
    # Experts on disk pass through CPU memory on their way to the GPU: reserve room for one (what
    # progress needs); any CPU memory the placement leaves free serves as read-ahead on top.
    weights = layers_in_flight * layer_max + m.head_bytes
    return staged_placement(
        m,
        ctx.hardware,
        m.expert_bytes,
        kv_sequences,
        wl.prompt_len + wl.gen_len,
        weights + kv_buf,
        act,
        working_weight_bytes=weights,
    )
