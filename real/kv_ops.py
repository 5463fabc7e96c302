"""The real executor's KV caches: a batch's device cache of a layer (one tensor for the group
where the schedule keeps it on the device, each batch's cache a slice), its host cache (position-
major, in the store's host slabs), and the KV_LOAD / KV_STORE copies between them.

Usage: mixed into `real.ops.OpSemantics` (and so `real.executor.Executor`), whose run state
these methods read.
"""

from __future__ import annotations

import numpy as np
import torch

from core.schedule import Op
from core.types import OpKind, Tier
from real.model import KVCache
from real.state import _BatchState
from real.store import TENSOR_ALIGN, round_up


class KVSemantics:
    """The KV methods of `real.ops.OpSemantics`."""

    def _kv_copy(self, op: Op, to_device: bool) -> None:
        """KV_LOAD: the batch's past keys/values host -> device; KV_STORE: this step's new ones
        device -> host (the device buffer is released by the schedule's memory effect)."""
        p = self.wl.prompt_len
        bst = self._batches[op.batch]
        if to_device:
            span = slice(0, p + op.step - 1)
        else:
            span = slice(0, p) if op.step == 0 else slice(p + op.step - 1, p + op.step)
        assert bst.kv_host is not None, "allocated when the op was added"
        layers = bst.kv_host.layers[op.layer], self._kv_dev(bst, op)
        for host, dev in zip(*layers, strict=True):
            # the host span is contiguous (position-major); the device side is gathered or
            # scattered by a kernel on the copying stream
            on_dev = dev.movedim(2, 0)[span]
            if to_device:
                on_dev.copy_(host[span], non_blocking=self.cuda)
            else:
                host[span].copy_(on_dev, non_blocking=self.cuda)

    def _kv_dev(self, bst: _BatchState, op: Op) -> tuple[torch.Tensor, ...]:
        """The batch's device cache of `op.layer`, allocated at its first use. Uninitialised: a
        position is read only after its attention wrote it or a KV_LOAD brought it back.

        A cache the schedule keeps on the device holds every position the run will write. One
        it offloads lives from a KV_LOAD (or a prefill's attention, which allocates it) to the
        KV_STORE that drops it, and holds the positions of that step only, the bytes the
        schedule's alloc counts (`planners.common`'s kv_load and attention)."""
        with self._refs_lock:
            kv = bst.kv_dev[op.layer]
            if kv is None:
                p = self.wl.prompt_len
                if op.kind == OpKind.KV_LOAD:
                    length = p + op.step
                elif op.kind == OpKind.ATTENTION and op.alloc_tier == Tier.GPU:
                    length = p  # an offloaded layer's prefill
                else:  # kept on the device: one cache for the group, a slice per batch
                    return self._group_kv(bst, op.layer)
                kv = bst.kv_dev[op.layer] = tuple(
                    torch.empty((*shape[:2], length, *shape[3:]), dtype=dtype, device=self.device)
                    for shape, dtype in self._kv_shapes
                )
            return kv

    def _group_kv(self, bst: _BatchState, layer: int) -> tuple[torch.Tensor, ...]:
        """(holding `_refs_lock`) The device cache of `layer` for every batch of the group
        still without one, made at once as one tensor per cache tensor, [n*b, Hkv, M, D], each
        batch's cache its rows [k*b, (k+1)*b): consecutive batches' caches are then one slice
        of it, which an attention over several batches reads and writes in place."""
        n, bs, length = self.wl.n_batches, self.wl.batch_size, self.wl.prompt_len + self.wl.gen_len
        group = tuple(
            torch.empty((n * bs, *shape[1:2], length, *shape[3:]), dtype=dtype, device=self.device)
            for shape, dtype in self._kv_shapes
        )
        for k, other in enumerate(self._batches):
            if other.kv_dev[layer] is None:
                other.kv_dev[layer] = tuple(t[k * bs : (k + 1) * bs] for t in group)
        kv = bst.kv_dev[layer]
        assert kv is not None
        return kv

    def _ensure_host_kv(self, batch: int) -> None:
        bst = self._batches[batch]
        if bst.kv_host is None:
            layers = None if self._kv_layers is None else self._kv_layers.get(batch, frozenset())
            bst.kv_host = self._host_kv(
                self.wl.batch_size, self.wl.prompt_len + self.wl.gen_len, layers
            )

    def _host_kv(self, batch: int, max_len: int, layers: frozenset[int] | None = None) -> KVCache:
        """A batch's host KV cache of `layers` (None: every layer; the others get none), zeroed,
        position-major ([M, B, H, D] each): the span of positions a KV_LOAD or KV_STORE moves is
        one contiguous block, which CUDA copies straight from or into pinned memory (a strided
        span goes through an unpinned temporary). One buffer lent by the store's host slabs,
        pinned at its exact size on CUDA, reused only once these views are gone."""
        shapes = KVCache.allocate(self.model.spec, batch, max_len, "meta")
        layout, end = [], 0
        for i, layer in enumerate(shapes.layers):
            row = []
            if layers is not None and i not in layers:
                layout.append(row)  # kept on the device: no host copy
                continue
            for t in layer:
                b, h, m, d = t.shape
                row.append((end, t.dtype, (m, b, h, d)))
                end = round_up(end + t.numel() * t.element_size(), TENSOR_ALIGN)
            layout.append(row)
        buf = self.store.slabs.lend(end)
        buf.zero_()
        return KVCache(
            tuple(
                tuple(buf[o:].view(dt)[: int(np.prod(sh))].view(sh) for o, dt, sh in row)
                for row in layout
            )
        )


def _consecutive(caches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...] | None:
    """The caches of consecutive batches (each a tuple of [b, Hkv, M, D] tensors) as one tuple
    of [n*b, Hkv, M, D] views, where each batch's tensor is the next rows of the same storage
    (`_group_kv`); None where they are not."""
    out = []
    for parts in zip(*caches, strict=True):
        first = parts[0]
        rows, stride = first.shape[0], first.stride()
        storage = first.untyped_storage().data_ptr()
        if any(
            t.untyped_storage().data_ptr() != storage
            or t.shape != first.shape
            or t.stride() != stride
            or t.storage_offset() != first.storage_offset() + i * rows * stride[0]
            for i, t in enumerate(parts)
        ):
            return None
        out.append(first.as_strided((rows * len(parts), *first.shape[1:]), stride))
    return tuple(out)
