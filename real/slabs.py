"""Host-tier buffers of the real executor's weight store (`HostSlabs`): exact-size slots cut from
ALIGN-aligned slabs, pinned on CUDA with cudaHostRegister, each reused only once nothing reads it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch

from core.errors import MoepipeError
from real.disk import ALIGN, aligned_empty, round_up

SLAB_BYTES = 64 << 20  # host buffers of one size are cut from slabs of about this many bytes,
SLAB_SLOTS = 64  # and of at most this many buffers


# PyTorch's (private) storage use count; a build without it gets unshared buffers, as before slabs
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _storage_users(t: torch.Tensor) -> int:
    """Tensors (views included) sharing t's storage, t counted."""
    assert _USE_COUNT is not None
    return int(_USE_COUNT(t.untyped_storage()._cdata)) - 1  # less the wrapper's


class HostSlabs:
    """Host-tier buffers by size, cut from ALIGN-aligned slabs that are, on CUDA, pinned at their
    exact size with cudaHostRegister. PyTorch's pinned allocator rounds every request up to a
    power of two (a 336 MiB Mixtral-8x7B expert takes 512 MiB, a 16.5 MiB DeepSeek-V2-Lite one
    32 MiB); here each size wastes at most one slab's unused slots.

    A buffer given back is handed out again only once nothing can still read it: no view of it
    is alive (a CPU expert computing from it) and the host->device copies queued from it, whose
    events come with it, have completed."""

    def __init__(
        self, pin_for: torch.device | None = None, budget_bytes: float | None = None
    ) -> None:
        self.pin_for = pin_for  # the CUDA device the slabs are pinned for; None: not pinned
        # the host tier's memory: a new slab is cut with no more slots than leave the slabs
        # within it (one at least), so spare slots do not take memory the schedule never counted
        self.budget_bytes = budget_bytes
        self.reserved_bytes = 0  # in slabs
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, tuple[torch.cuda.Event, ...]]]] = {}
        self._registered: list[weakref.finalize] = []  # each unregisters a pinned slab
        # slab base address -> (the slab, its slots' bytes, its slots)
        self._slabs: dict[int, tuple[torch.Tensor, int, int]] = {}

    @property
    def registered(self) -> int:
        """Slabs pinned with cudaHostRegister (not yet unregistered)."""
        return len(self._registered)

    def take(self, nbytes: int, alone: bool = False) -> torch.Tensor:
        """A uint8 buffer of nbytes (a multiple of ALIGN) at an ALIGN boundary; contents undefined.
        `alone`: a new one comes from a slab of its own (exactly nbytes), for buffers taken once
        a run (KV caches, activation scratch), where the slots beside it would sit unused."""
        assert nbytes % ALIGN == 0, nbytes
        if _USE_COUNT is None:  # cannot tell when a buffer is free to reuse: a fresh one each time
            return aligned_empty(nbytes, pin=self.pin_for is not None)
        with self._lock:  # the oldest slot given back that nothing reads, else one still copied
            free, pick = self._free.setdefault(nbytes, []), None
            for i, (buf, copying) in enumerate(free):
                if _storage_users(buf) == 1:
                    if all(e.query() for e in copying):
                        pick = i
                        break
                    pick = i if pick is None else pick
            got = free.pop(pick) if pick is not None else None
        if got is not None:
            buf, copying = got
            for e in copying:  # queued copies still read it: wait rather than grow
                e.synchronize()
            return buf
        slots = self._slab(nbytes, 1 if alone else None)  # every free slot is still read by a view
        with self._lock:
            self._free[nbytes].extend((b, ()) for b in slots[1:])
        return slots[0]

    def lend(self, nbytes: int) -> torch.Tensor:
        """A uint8 view of nbytes, ALIGN-aligned, in a slab of its own size, for a buffer kept a
        whole run (KV caches, activation scratch); contents undefined. Its slot goes back at
        once and is reused only once this view and every view of it are gone."""
        raw = self.take(round_up(max(nbytes, 1), ALIGN), alone=True)
        view = raw[:nbytes]
        self.give(raw)
        return view

    def give(self, buf: torch.Tensor, copying: Sequence[torch.cuda.Event] = ()) -> None:
        """Return a buffer from `take`; `copying`: events of queued copies that read it."""
        if _USE_COUNT is None:
            return
        with self._lock:
            self._free[buf.numel()].append((buf, tuple(copying)))

    def release_idle(self) -> int:
        """Drop the slabs whose every slot is given back, unread and uncopied (the host copies
        the executor's preload made of units that then live in the device pool: each a slab of
        its own size, which no later read of another size would reuse); their memory goes back
        to the system. Returns the bytes released."""
        if _USE_COUNT is None:
            return 0
        with self._lock:
            idle: dict[int, list[int]] = {}  # slab base -> indices into its size's free list
            for base, (_, nbytes, slots) in self._slabs.items():
                free = self._free.get(nbytes, [])
                idx = [
                    i
                    for i, (buf, copying) in enumerate(free)
                    if base <= buf.data_ptr() < base + slots * nbytes
                    and _storage_users(buf) == 1
                    and all(e.query() for e in copying)
                ]
                if len(idx) == slots:
                    idle[base] = idx
            released = 0
            for base, idx in idle.items():
                _, nbytes, slots = self._slabs.pop(base)
                drop = set(idx)
                self._free[nbytes] = [x for i, x in enumerate(self._free[nbytes]) if i not in drop]
                released += nbytes * slots
            self.reserved_bytes -= released
            return released

    def close(self) -> None:
        """Unregister the pinned slabs once no copy can read them (their memory stays valid,
        pageable)."""
        with self._lock:
            registered, self._registered = self._registered, []
        if registered:
            torch.cuda.synchronize(self.pin_for)
        for unregister in registered:
            unregister()

    def _slab(self, nbytes: int, slots: int | None = None) -> list[torch.Tensor]:
        """A new slab cut into `slots` (default: as many as SLAB_BYTES holds, at most SLAB_SLOTS)
        slots of nbytes, each its own storage (so `_storage_users` counts the views of one slot,
        not of the whole slab)."""
        n = slots or min(max(1, SLAB_BYTES // nbytes), SLAB_SLOTS)
        if self.budget_bytes is not None:
            with self._lock:
                n = max(1, min(n, int(self.budget_bytes - self.reserved_bytes) // nbytes))
        slab = aligned_empty(n * nbytes)
        whole = slab.numpy()  # every slot keeps it alive, and it the slab's memory
        if self.pin_for is not None:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(slab.data_ptr(), n * nbytes, 0)
            if int(err):
                raise MoepipeError(
                    f"pinning a {n * nbytes}-byte host slab failed (cudaHostRegister: "
                    f"{cudart.cudaGetErrorString(err)}); free host memory or shrink the host tier"
                )
            # unregistered at `close`, or once no slot is left
            unregister = weakref.finalize(whole, cudart.cudaHostUnregister, slab.data_ptr())
            unregister.atexit = False  # at exit the process's pinned memory goes anyway
            with self._lock:
                self._registered.append(unregister)
        with self._lock:
            self._slabs[slab.data_ptr()] = (slab, nbytes, n)
            self.reserved_bytes += n * nbytes
        return [torch.from_numpy(whole[i * nbytes : (i + 1) * nbytes]) for i in range(n)]
