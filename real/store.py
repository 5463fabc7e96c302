"""The real executor's tiered weight store: disk (O_DIRECT), host RAM, a fixed-capacity device pool.

The disk tier is the checkpoint itself (real.disk): a unit's (real.checkpoint.Unit) tensors are
read straight from its safetensors files with O_DIRECT, one aligned read per run of adjacent
tensors, into an aligned host buffer (real.slabs; pinned on CUDA). No second copy of the model is
written. `TieredStore` moves units disk -> host -> device; each unit is one contiguous buffer
whose tensors are views under the short keys real.model takes.
Every operation is synchronous and thread-safe, and any I/O error raises (no retries).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from core.errors import CapacityError, MoepipeError, did_you_mean
from core.files import unchanged_since, unwritten_state
from core.types import Tier
from real.checkpoint import Unit
from real.disk import (
    ALIGN,
    MERGE_GAP_BYTES,
    TENSOR_ALIGN,
    DiskReader,
    Read,
    UnitRecord,
    aligned_empty,
    round_up,
    unit_records,
)
from real.fp8 import SCALE_SUFFIX, dequantize
from real.slabs import HostSlabs

# Re-exported: the store's callers take these from here
__all__ = [
    "ALIGN",
    "MERGE_GAP_BYTES",
    "TENSOR_ALIGN",
    "DiskReader",
    "HostSlabs",
    "Read",
    "TieredStore",
    "UnitRecord",
    "aligned",
    "aligned_empty",
    "resolve_device",
    "round_up",
    "unit_records",
]

Weights = Mapping[str, torch.Tensor]


def resolve_device(device: str | None, key: str = "device", empty_ok: bool = False) -> torch.device:
    """The torch device of a `key=` argument (unset: cuda where there is one, else cpu; so is
    '' where `empty_ok`, an option whose default it is); a MoepipeError naming `key=` for one
    this machine cannot run on, or an empty one where null is the option's unset."""
    if device is None or (empty_ok and not device):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not device:
        raise MoepipeError(f"{key}='': no device; pass {key}=cpu or {key}=cuda, or leave it unset")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        hint = did_you_mean(device.split(":")[0], ("cpu", "cuda"))  # `CPU`, `Cuda:0`, `cuda0`
        raise MoepipeError(
            f"{key}={device}: not a device; {hint}pass {key}=cpu or {key}=cuda (or cuda:N)"
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
                f"{key}=cuda:N with N < {torch.cuda.device_count()}"
            )
    elif dev.type != "cpu":
        raise MoepipeError(f"{key}={device}: moepipe runs on cpu or cuda; pass one of those")
    elif dev.index:  # torch takes cpu:N and runs on the one CPU device whatever N is
        raise MoepipeError(f"{key}={device}: torch has one CPU device; pass {key}=cpu")
    return dev


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
        host_budget_bytes: float | None = None,
        dtype: str | None = None,
    ) -> None:
        """`host_budget_bytes`: the host memory the schedule counts, which the host slabs are cut
        within (not enforced here: the executor enforces the schedule's); default the host
        capacity. `dtype`: the run's compute dtype (`load_checkpoint`'s); the host and device
        tiers hold the units in it, the disk tier as saved."""
        self.ckpt_dir = Path(ckpt_dir)
        # the files read whole once opened: what was opened is the checkpoint the records are of
        before = unwritten_state(self.ckpt_dir, "checkpoint")
        self.records = unit_records(ckpt_dir, dtype)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self._pin = self.device.type == "cuda"
        files = sorted({r.file for rec in self.records.values() for r in rec.reads})
        self.disks: dict[Path, DiskReader] = {}
        try:
            for f in files:
                self.disks[f] = DiskReader(f, direct)
            unchanged_since(self.ckpt_dir, "checkpoint", before)
        except BaseException:
            for d in self.disks.values():
                d.close()
            raise
        self.disk = self.disks[files[0]]  # the first shard's reader (`direct` is every one's)
        self.host = _Pool(
            "host tier", float("inf") if host_capacity_bytes is None else host_capacity_bytes
        )
        self.pool = _Pool("device pool", device_capacity_bytes)
        # the host tier's buffers, cut within its capacity where it has one
        budget = host_capacity_bytes if host_budget_bytes is None else host_budget_bytes
        self.slabs = HostSlabs(self.device if self._pin else None, budget)
        # A device pool in RAM (no CUDA): units in slots of slabs of their own size, reused by
        # the next unit of that size, not malloc'd from the heap the activations share. There a
        # freed unit's block, cut up by smaller activations, left the next unit to grow the heap:
        # 550 MB beyond the pool's own peak on a 7 GB OLMoE cut at a 2.4 GB budget.
        self.ram_pool = HostSlabs() if self.device.type == "cpu" else None
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
            self._read_into(rec, buf)
        except BaseException:
            self.slabs.give(buf)
            self._release(self.host, unit, rec.nbytes)
            raise
        with self._cv:  # (re-entrant) views made under the lock, as in `resident`
            self._arrive(self.host, unit, buf)
            return self._views(unit, buf, True)

    def _read_into(self, rec: UnitRecord, buf: torch.Tensor) -> None:
        """The unit's reads into `buf`; where the run computes in another dtype than the saved
        one, into a staging buffer first, each tensor then converted into its place in `buf`."""
        into = aligned_empty(rec.staged_nbytes) if rec.staged else buf
        for r in rec.reads:
            self.disks[r.file].read_into(into[r.into : r.into + r.nbytes], r.offset, r.needed)
        if not rec.staged:
            return
        staged = {key: (saved, shape, s) for key, saved, shape, s in rec.staged}
        for key, dtype, shape, h in rec.tensors:
            saved, _, s = staged[key]
            n = int(torch.Size(shape).numel())
            dst = buf[h : h + n * dtype.itemsize].view(dtype)
            src = into[s : s + n * saved.itemsize].view(saved)
            if key + SCALE_SUFFIX in staged:  # FP8: times its blocks' scales (real.fp8)
                _, grid, g = staged[key + SCALE_SUFFIX]
                scale = into[g : g + 4 * int(torch.Size(grid).numel())].view(torch.float32)
                src = dequantize(src.view(shape), scale.view(grid), rec.block).view(-1)
            dst.copy_(src)

    def alloc(self, unit: Unit) -> Weights:
        """Reserve the unit's space in the device pool (contents undefined until `to_device`)."""
        rec = self._record(unit)
        with self._cv:
            if unit in self.pool.buffers:
                return self._views(unit, self.pool.buffers[unit], False)
            self._check_fits(self.pool, unit, rec.nbytes)
            self.pool.used_bytes += rec.nbytes
            self.pool.buffers[unit] = (
                self.ram_pool.take(rec.nbytes)
                if self.ram_pool is not None
                else torch.empty(rec.nbytes, dtype=torch.uint8, device=self.device)
            )
            return self._views(unit, self.pool.buffers[unit], False)

    def to_device(self, unit: Unit, stream: torch.cuda.Stream | None = None) -> Weights:
        """Copy a host-resident unit into the device pool (allocating unless `alloc`ed); returns
        its device tensors."""
        with self._cv:
            src = self.host.buffers.get(unit) if unit in self.host.filled else None
            if src is not None:  # the host copy stays until this copy is queued (`evict`)
                self._copying[unit] = self._copying.get(unit, 0) + 1
        if src is None:
            # the executor's bug, not the user's: a validated schedule reads before it copies
            raise AssertionError(
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
                # a validated schedule frees only what it holds: the executor's bug
                raise AssertionError(f"evict({unit}, {tier}): the unit is not in the {pool.name}")
            buf = pool.buffers.pop(unit)
            pool.filled.discard(unit)
            pool.used_bytes -= self._record(unit).nbytes
            if tier == Tier.GPU:
                self._copied.pop(unit, None)
                if self.ram_pool is not None:
                    self.ram_pool.give(buf)
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
            raise AssertionError("the disk tier holds every unit; evict from Tier.CPU or Tier.GPU")
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
            f"({unit} needs {nbytes} bytes, {pool.used_bytes} in use by {len(pool.buffers)} "
            "units); free units first or raise the capacity"
        )

    def _reserve(self, pool: _Pool, unit: Unit, nbytes: int) -> bool:
        """Claim space for a load; False if the unit is there or is once a concurrent load ends."""
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
