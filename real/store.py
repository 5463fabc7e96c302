"""Tiered weight store of the real executor: disk (O_DIRECT), host RAM, a fixed-capacity device pool.

The disk tier is the checkpoint itself: a unit's (real.checkpoint.Unit) tensors are read straight
from its safetensors files with O_DIRECT, one aligned read per run of adjacent tensors (the
4096-aligned range around them, sliced), into an aligned (pinned on CUDA) host buffer. No second
copy of the model is written. `TieredStore` moves units disk -> host -> device; each unit is one
contiguous buffer whose tensors are views under the short keys real.model takes.
Every operation is synchronous and thread-safe, and any I/O error raises (no retries).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import CapacityError, ConfigError, MoepipeError
from core.types import Tier
from real.checkpoint import TensorEntry, Unit, load_checkpoint, unit_layout

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT needs block-aligned offset, length and buffer
TENSOR_ALIGN = 64  # buffers the executor lends start at multiples of this (SIMD alignment)
MERGE_GAP_BYTES = 64 << 10  # tensors of a unit at most this far apart in a file: one read
_READ_CHUNK = 0x7FFFF000  # Linux caps one read at this many bytes (a multiple of ALIGN)

Weights = Mapping[str, torch.Tensor]


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Read:
    """One aligned O_DIRECT read of a unit: `nbytes` of `file` from `offset` into the unit's
    buffer at `into`."""

    file: Path
    offset: int  # multiple of ALIGN
    nbytes: int  # multiple of ALIGN (the file may end before: the rest is zeros)
    into: int  # byte offset in the unit's buffer, a multiple of ALIGN
    needed: int  # bytes from `offset` that hold tensors: a file ending before them is cut short


@dataclass(frozen=True)
class UnitRecord:
    """Where one unit's bytes are in the checkpoint and how its buffer splits into tensors."""

    unit: Unit
    reads: tuple[Read, ...]  # in buffer order
    nbytes: int  # bytes held per copy: the aligned ranges read, or the device layout if larger
    # (key, dtype, shape, byte offset in the host buffer) per tensor: where the reads put it
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...]
    # the same at TENSOR_ALIGN-aligned offsets: the device pool's layout. Kernels given weights
    # at the file's alignment (a safetensors header ends where it ends) round differently: an
    # expert's logits differed from the in-memory forward's in the last bit.
    placed: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...] = ()

    @property
    def offset(self) -> int:
        """Where its first read starts in its file (an order for sequential reading)."""
        return self.reads[0].offset


# ---- the disk tier: where each unit is in the checkpoint ----------------------------------


def resolve_device(device: str | None, key: str = "device") -> torch.device:
    """The torch device of a `key=` argument (unset: cuda where there is one, else cpu); a
    MoepipeError naming `key=` for one this machine cannot run on."""
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise MoepipeError(
            f"{key}={device}: not a device; pass {key}=cpu or device=cuda (or cuda:N)"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MoepipeError(
                f"{key}={device}: this machine has no CUDA device; pass {key}=cpu or leave "
                f"{key} unset"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise MoepipeError(
                f"{key}={device}: there are {torch.cuda.device_count()} CUDA device(s); pass "
                f"device=cuda:N with N < {torch.cuda.device_count()}"
            )
    elif dev.type != "cpu":
        raise MoepipeError(f"{key}={device}: moepipe runs on cpu or cuda; pass one of those")
    return dev


def unit_records(ckpt_dir: str | Path) -> dict[Unit, UnitRecord]:
    """Every unit -> its aligned reads from the checkpoint's safetensors files and its tensors'
    places in the unit's buffer. A unit's tensors that lie within MERGE_GAP_BYTES of each other
    in one file are one read of the aligned range around them; the buffer holds the ranges one
    after another, and each tensor is a view at its place in its range."""
    spec, index = load_checkpoint(ckpt_dir)
    return {
        unit: _record(unit, {key: index[ts.hf_name] for key, ts in tensors.items()})
        for unit, tensors in unit_layout(spec).items()
    }


def _record(unit: Unit, entries: Mapping[str, TensorEntry]) -> UnitRecord:
    order = sorted(entries.items(), key=lambda ke: (str(ke[1].file), ke[1].offset))
    runs: list[list[tuple[str, TensorEntry]]] = []
    for key, e in order:
        last = runs[-1][-1][1] if runs else None
        near = last is not None and last.file == e.file
        if near and e.offset - (last.offset + last.nbytes) <= MERGE_GAP_BYTES:  # type: ignore[union-attr]
            runs[-1].append((key, e))
        else:
            runs.append([(key, e)])
    reads, tensors, into = [], [], 0
    for run in runs:
        start = run[0][1].offset // ALIGN * ALIGN
        end = round_up(max(e.offset + e.nbytes for _, e in run), ALIGN)
        needed = max(e.offset + e.nbytes for _, e in run) - start
        reads.append(Read(run[0][1].file, start, end - start, into, needed))
        for key, e in run:
            off = into + e.offset - start
            if off % e.dtype.itemsize:
                raise ConfigError(
                    f"{e.file}: tensor of {unit} ({key}) starts at byte {e.offset}, not a multiple "
                    f"of its {e.dtype} size; re-save the checkpoint with safetensors"
                )
            tensors.append((key, e.dtype, e.shape, off))
        into += end - start
    by_key = {k: i for i, k in enumerate(entries)}  # the layout's order
    tensors.sort(key=lambda t: by_key[t[0]])
    placed, end = [], 0
    for key, dtype, shape, _ in tensors:
        end = round_up(end, TENSOR_ALIGN)
        placed.append((key, dtype, shape, end))
        end += entries[key].nbytes
    nbytes = max(into, round_up(end, ALIGN))
    return UnitRecord(unit, tuple(reads), nbytes, tuple(tensors), tuple(placed))


def aligned(weights: Weights) -> Weights:
    """`weights` with each tensor not at a TENSOR_ALIGN boundary (a host-tier view at the file's
    alignment) copied to one that is, so kernels on them round as on the device layout's."""
    if all(t.data_ptr() % TENSOR_ALIGN == 0 for t in weights.values()):
        return weights
    out = {}
    for k, t in weights.items():
        if t.data_ptr() % TENSOR_ALIGN:
            raw = torch.empty(t.nbytes + TENSOR_ALIGN, dtype=torch.uint8, device=t.device)
            skip = (-raw.data_ptr()) % TENSOR_ALIGN
            t = raw[skip : skip + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        out[k] = t
    return out


# ---- disk ---------------------------------------------------------------------------------


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU buffer of nbytes starting on an ALIGN boundary (pinned if asked)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + nbytes]


class DiskReader:
    """Reads byte ranges of one file with O_DIRECT (page cache bypassed) into aligned buffers.

    Where the filesystem refuses O_DIRECT (tmpfs) it logs one warning and reads buffered.
    """

    def __init__(self, path: str | Path, direct: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"{self.path}: missing file; re-copy or rewrite the checkpoint")
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
                os.preadv(self.fd, [memoryview(aligned_empty(ALIGN).numpy())], 0)  # probe
            except OSError as e:
                if self.fd >= 0:
                    os.close(self.fd)
                    self.fd = -1
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.warning(
                    "%s: O_DIRECT unsupported on this filesystem (tmpfs?); reading through the page "
                    "cache, so reads show RAM, not disk, bandwidth",
                    self.path,
                )
        if not self.direct:
            self.fd = os.open(self.path, os.O_RDONLY)

    def read_into(self, buf: torch.Tensor, offset: int, needed: int | None = None) -> None:
        """Fill buf (uint8, ALIGN-aligned address and length) from the file at offset. With
        `needed`, the file may end after that many bytes (the rest of buf is zeroed): a range
        rounded up to ALIGN past the end of a file."""
        assert buf.data_ptr() % ALIGN == 0 and buf.numel() % ALIGN == 0 and offset % ALIGN == 0
        view = memoryview(buf.numpy())
        done, n = 0, buf.numel()
        need = n if needed is None else needed
        while done < n:
            chunk = view[done : min(n, done + _READ_CHUNK)]
            got = os.preadv(self.fd, [chunk], offset + done)
            if got == 0:
                if done >= need:
                    buf[done:].zero_()
                    return
                raise OSError(
                    f"{self.path}: file ends at byte {offset + done}, reading {need} bytes at "
                    f"{offset}; the file is truncated (changed since it was opened?): re-copy or "
                    "rewrite it"
                )
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---- host buffers -------------------------------------------------------------------------

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

    def __init__(self, pin_for: torch.device | None = None) -> None:
        self.pin_for = pin_for  # the CUDA device the slabs are pinned for; None: not pinned
        self.reserved_bytes = 0  # in slabs
        self._lock = threading.Lock()
        self._free: dict[int, list[tuple[torch.Tensor, tuple[torch.cuda.Event, ...]]]] = {}
        self._registered: list[weakref.finalize] = []  # each unregisters a pinned slab
        self._slabs: list[torch.Tensor] = []

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
            self._slabs.append(slab)
            self.reserved_bytes += n * nbytes
        return [torch.from_numpy(whole[i * nbytes : (i + 1) * nbytes]) for i in range(n)]


# ---- tiers --------------------------------------------------------------------------------


@dataclass
class _Pool:
    """Capacity accounting and resident buffers of one memory tier (guarded by the store's lock)."""

    name: str
    capacity_bytes: float
    used_bytes: int = 0  # reserved by resident and in-flight units
    buffers: dict[Unit, torch.Tensor] = field(default_factory=dict)  # unit -> contiguous uint8
    filled: set[Unit] = field(default_factory=set)  # units whose bytes have arrived
    busy: set[Unit] = field(default_factory=set)  # units being read or copied right now


class TieredStore:
    """Units move disk -> host (`read_disk`) -> device pool (`to_device`) and leave by `evict`.

    The device pool is GPU memory on CUDA, else RAM; its capacity is enforced by accounting (the
    caching allocator does the placement). On CUDA, host buffers are pinned and `to_device`
    enqueues the copy on `stream` with non_blocking=True: wait on that stream (an event) before
    reading the tensors, and `record_stream` them if another stream uses them before `free`.
    """

    def __init__(
        self,
        ckpt_dir: str | Path,
        device_capacity_bytes: int,
        host_capacity_bytes: int | None = None,
        device: str | torch.device | None = None,
        direct: bool = True,
    ) -> None:
        self.ckpt_dir = Path(ckpt_dir)
        self.records = unit_records(ckpt_dir)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._pin = self.device.type == "cuda"
        files = sorted({r.file for rec in self.records.values() for r in rec.reads})
        self.disks: dict[Path, DiskReader] = {}
        try:
            for f in files:
                self.disks[f] = DiskReader(f, direct)
        except BaseException:
            for d in self.disks.values():
                d.close()
            raise
        self.disk = self.disks[files[0]]  # the first shard's reader (`direct` is every one's)
        self.host = _Pool(
            "host tier", float("inf") if host_capacity_bytes is None else host_capacity_bytes
        )
        self.pool = _Pool("device pool", device_capacity_bytes)
        self.slabs = HostSlabs(self.device if self._pin else None)  # the host tier's buffers
        self._cv = threading.Condition()
        # CUDA: unit -> the event its host->device copy records; a reader not ordered after the
        # copying op (another stream) makes its stream wait on it (`_ready`)
        self._copied: dict[Unit, torch.cuda.Event] = {}
        # CUDA: unit -> events of the queued copies from its host buffer, which the buffer
        # waits for before `HostSlabs` hands it out again
        self._read_from: dict[Unit, list[torch.cuda.Event]] = {}
        # unit -> `to_device` calls reading its host buffer: evicting that copy waits for them
        self._copying: dict[Unit, int] = {}

    # ---- queries ----------------------------------------------------------------------------
    def unit_bytes(self, unit: Unit) -> int:
        """Bytes one copy of the unit takes in a tier (payload padded to ALIGN)."""
        return self._record(unit).nbytes

    def holds(self, unit: Unit, tier: Tier) -> bool:
        """The unit's bytes have arrived in the tier (Tier.CPU or Tier.GPU)."""
        with self._cv:
            return unit in self._pool(tier).filled

    def resident(self, unit: Unit, tier: Tier) -> Weights | None:
        """The unit's tensors in a tier if they have arrived there, else None. Host tensors lie
        where the reads put them (the file's alignment): compute on them through `aligned`."""
        pool = self._pool(tier)
        with self._cv:  # views made under the lock: an evicted slot is not reused under them
            buf = pool.buffers.get(unit) if unit in pool.filled else None
            views = None if buf is None else self._views(unit, buf, pool is self.host)
        if views is not None and tier == Tier.GPU:
            self._ready(unit)
        return views

    # ---- operations -------------------------------------------------------------------------
    def read_disk(self, unit: Unit) -> Weights:
        """Read a unit from the checkpoint into the host tier (O_DIRECT reads); host tensors."""
        rec = self._record(unit)
        while not self._reserve(self.host, unit, rec.nbytes):
            got = self.resident(unit, Tier.CPU)
            if got is not None:
                return got  # else evicted since: read it again
        try:
            buf = self.slabs.take(rec.nbytes)
        except BaseException:
            self._release(self.host, unit, rec.nbytes)
            raise
        try:
            for r in rec.reads:
                self.disks[r.file].read_into(buf[r.into : r.into + r.nbytes], r.offset, r.needed)
        except BaseException:
            self.slabs.give(buf)
            self._release(self.host, unit, rec.nbytes)
            raise
        with self._cv:  # (re-entrant) views made under the lock, as in `resident`
            self._arrive(self.host, unit, buf)
            return self._views(unit, buf, True)

    def alloc(self, unit: Unit) -> Weights:
        """Reserve the unit's space in the device pool (contents undefined until `to_device`)."""
        rec = self._record(unit)
        with self._cv:
            if unit in self.pool.buffers:
                return self._views(unit, self.pool.buffers[unit], False)
            self._check_fits(self.pool, unit, rec.nbytes)
            self.pool.used_bytes += rec.nbytes
            self.pool.buffers[unit] = torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
            return self._views(unit, self.pool.buffers[unit], False)

    def to_device(self, unit: Unit, stream: torch.cuda.Stream | None = None) -> Weights:
        """Copy a host-resident unit into the device pool (allocating unless `alloc`ed); device tensors."""
        with self._cv:
            src = self.host.buffers.get(unit) if unit in self.host.filled else None
            if src is not None:  # the host copy stays until this copy is queued (`evict`)
                self._copying[unit] = self._copying.get(unit, 0) + 1
        if src is None:
            raise MoepipeError(
                f"to_device({unit}): the unit is not in the host tier; read_disk it first"
            )
        try:
            return self._copy_in(unit, src, stream)
        finally:
            with self._cv:
                self._copying[unit] -= 1
                if not self._copying[unit]:
                    del self._copying[unit]
                self._cv.notify_all()

    def _copy_in(self, unit: Unit, src: torch.Tensor, stream: torch.cuda.Stream | None) -> Weights:
        self.alloc(unit)
        with self._cv:
            while unit in self.pool.busy:
                self._cv.wait()
            filled = unit in self.pool.filled
            if not filled:
                self.pool.busy.add(unit)
            dst = self.pool.buffers[unit]
        if filled:
            self._ready(unit)
            return self._views(unit, dst, False)
        try:
            if self.device.type == "cuda":
                on = stream if stream is not None else torch.cuda.current_stream(self.device)
                with torch.cuda.stream(on):
                    self._place(unit, src, dst)
                    done = torch.cuda.Event(blocking=True)  # a wait on it sleeps
                    done.record(on)
                with self._cv:
                    self._copied[unit] = done
                    queued = [e for e in self._read_from.get(unit, []) if not e.query()]
                    self._read_from[unit] = [*queued, done]
            else:
                self._place(unit, src, dst)
        finally:
            with self._cv:
                self.pool.busy.discard(unit)
                self._cv.notify_all()
        self._arrive(self.pool, unit, dst)
        return self._views(unit, dst, False)

    def _place(self, unit: Unit, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the unit's tensors from its host buffer into the device layout (non-blocking on
        CUDA: on the current stream); tensors adjacent in both layouts go in one copy."""
        rec = self._record(unit)
        runs: list[list[int]] = []  # [host offset, device offset, bytes]
        for (_, dtype, shape, h), (_, _, _, d) in zip(rec.tensors, rec.placed, strict=True):
            n = dtype.itemsize * int(torch.Size(shape).numel())
            if runs and runs[-1][0] + runs[-1][2] == h and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += n
            else:
                runs.append([h, d, n])
        for h, d, n in runs:
            dst[d : d + n].copy_(src[h : h + n], non_blocking=True)

    def _ready(self, unit: Unit) -> None:
        """CUDA: the current stream waits (on the GPU, the host does not block) until the unit's
        host->device copy has landed; marked arrived when the copy was queued, a reader on
        another stream could otherwise read a half-filled buffer."""
        with self._cv:
            done = self._copied.get(unit)
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)

    def free(self, unit: Unit) -> None:
        """Release the unit's space in the device pool."""
        self.evict(unit, Tier.GPU)

    def evict(self, unit: Unit, tier: Tier) -> None:
        """Drop the unit's copy in the host tier (Tier.CPU) or device pool (Tier.GPU)."""
        pool = self._pool(tier)
        with self._cv:
            while unit in pool.busy or (pool is self.host and unit in self._copying):
                self._cv.wait()
            if unit not in pool.buffers:
                raise MoepipeError(f"evict({unit}, {tier}): the unit is not in the {pool.name}")
            buf = pool.buffers.pop(unit)
            pool.filled.discard(unit)
            pool.used_bytes -= self._record(unit).nbytes
            if tier == Tier.GPU:
                self._copied.pop(unit, None)
            else:
                self.slabs.give(buf, self._read_from.pop(unit, ()))

    def close(self) -> None:
        for d in self.disks.values():
            d.close()
        self.slabs.close()

    # ---- internals --------------------------------------------------------------------------
    def _record(self, unit: Unit) -> UnitRecord:
        try:
            return self.records[unit]
        except KeyError:
            raise MoepipeError(f"unit {unit} is not in this model ({self.ckpt_dir})") from None

    def _pool(self, tier: Tier) -> _Pool:
        if tier == Tier.DISK:
            raise MoepipeError("the disk tier holds every unit; evict from Tier.CPU or Tier.GPU")
        return self.pool if tier == Tier.GPU else self.host

    def _views(self, unit: Unit, buf: torch.Tensor, host: bool) -> dict[str, torch.Tensor]:
        """The unit's tensors in its buffer: the host layout (where the reads put them), or the
        device pool's (aligned)."""
        rec = self._record(unit)
        out = {}
        for key, dtype, shape, off in rec.tensors if host else rec.placed:
            n = dtype.itemsize * int(torch.Size(shape).numel())
            out[key] = buf[off : off + n].view(dtype).view(shape)
        return out

    def _check_fits(self, pool: _Pool, unit: Unit, nbytes: int) -> None:
        if pool.used_bytes + nbytes <= pool.capacity_bytes:
            return
        if pool is self.pool and unit.layer >= 0:
            layer = sum(self.records[u].nbytes for u in pool.buffers if u.layer == unit.layer)
            what = f"layer {unit.layer}'s working set of {layer + nbytes} bytes"
        else:
            what = f"{unit} of {nbytes} bytes"
        raise CapacityError(
            f"{pool.name} of {int(pool.capacity_bytes)} bytes too small for {what} "
            f"({unit} needs {nbytes} bytes, {pool.used_bytes} in use by {len(pool.buffers)} units); "
            "free units first or raise the capacity"
        )

    def _reserve(self, pool: _Pool, unit: Unit, nbytes: int) -> bool:
        """Claim space for a load; False if the unit is (or, once a concurrent load ends, is) there."""
        with self._cv:
            while unit in pool.busy:
                self._cv.wait()
            if unit in pool.buffers:
                return False
            self._check_fits(pool, unit, nbytes)
            pool.used_bytes += nbytes
            pool.busy.add(unit)
            return True

    def _release(self, pool: _Pool, unit: Unit, nbytes: int) -> None:
        with self._cv:
            pool.used_bytes -= nbytes
            pool.busy.discard(unit)
            self._cv.notify_all()

    def _arrive(self, pool: _Pool, unit: Unit, buf: torch.Tensor) -> None:
        with self._cv:
            pool.buffers[unit] = buf
            pool.filled.add(unit)
            pool.busy.discard(unit)
            self._cv.notify_all()
