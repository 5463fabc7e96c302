"""The disk tier of the real executor's weight store: where each unit's bytes are in the
checkpoint's safetensors files (`unit_records`: aligned reads, tensors' places in a unit's buffer)
and `DiskReader`, which reads them with O_DIRECT so that disk bandwidth is real, not the page
cache's. Any I/O error raises (no retries).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from core.errors import ConfigError, quoted
from core.files import no_file_there
from core.spec import ModelSpec
from real.checkpoint import TensorEntry, Unit, load_checkpoint, unit_layout, weight_dtype
from real.fp8 import SCALE_SUFFIX

log = logging.getLogger(__name__)

ALIGN = 4096  # O_DIRECT needs block-aligned offset, length and buffer
TENSOR_ALIGN = 64  # buffers the executor lends start at multiples of this (SIMD alignment)
MERGE_GAP_BYTES = 64 << 10  # tensors of a unit at most this far apart in a file: one read
_READ_CHUNK = 0x7FFFF000  # Linux caps one read at this many bytes (a multiple of ALIGN)


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
    # where the run computes in another dtype than the saved one: (key, saved dtype, shape, byte
    # offset) per tensor in the buffer the reads fill (of `staged_nbytes`), each converted into
    # `tensors`' place (then the device layout, in the compute dtype) as it arrives; () : none
    staged: tuple[tuple[str, torch.dtype, tuple[int, ...], int], ...] = ()
    staged_nbytes: int = 0
    block: tuple[int, int] = (0, 0)  # FP8 weights' scale block (real.fp8), staged beside them

    @property
    def offset(self) -> int:
        """Where its first read starts in its file (an order for sequential reading)."""
        return self.reads[0].offset


def unit_records(ckpt_dir: str | Path, dtype: str | None = None) -> dict[Unit, UnitRecord]:
    """Every unit -> its aligned reads from the checkpoint's safetensors files and its tensors'
    places in the unit's buffer. A unit's tensors that lie within MERGE_GAP_BYTES of each other
    in one file are one read of the aligned range around them; the buffer holds the ranges one
    after another, and each tensor is a view at its place in its range. `dtype`: the run's
    compute dtype (`load_checkpoint`'s); a unit saved in another is read into a staging buffer
    and converted into its buffer (`_convert`), whose bytes are the compute dtype's."""
    spec, index = load_checkpoint(ckpt_dir, dtype)
    records = {}
    for unit, tensors in unit_layout(spec).items():
        entries = {key: index[ts.hf_name] for key, ts in tensors.items()}
        # an FP8 weight's scales are read beside it and dequantize it in the staging buffer
        scales = {k + SCALE_SUFFIX: e.scale for k, e in entries.items() if e.scale is not None}
        rec = _record(unit, entries | scales)
        if scales or any(t[1] != weight_dtype(spec, t[0]) for t in rec.tensors):
            block = next((e.block for e in entries.values() if e.scale is not None), (0, 0))
            rec = _convert(rec, spec, block)
        records[unit] = rec
    return records


def _convert(rec: UnitRecord, spec: ModelSpec, block: tuple[int, int]) -> UnitRecord:
    """`rec` for a run computing in `spec`'s dtype: its reads fill a staging buffer (the saved
    layout, FP8 weights' scales of `block` included), and its host and device buffers hold each
    tensor in its `weight_dtype` (the compute dtype, DeepSeek-V2's router float32) at
    TENSOR_ALIGN."""
    placed, end = [], 0
    for key, _, shape, _ in rec.tensors:
        if key.endswith(SCALE_SUFFIX):
            continue
        end = round_up(end, TENSOR_ALIGN)
        dtype = weight_dtype(spec, key)
        placed.append((key, dtype, shape, end))
        end += dtype.itemsize * int(torch.Size(shape).numel())
    staged_nbytes = rec.reads[-1].into + rec.reads[-1].nbytes
    return replace(
        rec,
        nbytes=round_up(end, ALIGN),
        tensors=tuple(placed),
        placed=tuple(placed),
        staged=rec.tensors,
        staged_nbytes=staged_nbytes,
        block=block,
    )


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
                    f"{e.file}: tensor of {unit} ({quoted(key)}) starts at byte {e.offset}, not a "
                    f"multiple of its {e.dtype} size; re-save the checkpoint with safetensors"
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
            raise ConfigError(
                f"{self.path}: {no_file_there(self.path)}; re-copy or rewrite the checkpoint"
            )
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
                    "%s: O_DIRECT unsupported on this filesystem (tmpfs?); reading through the "
                    "page cache, so reads show RAM, not disk, bandwidth",
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
