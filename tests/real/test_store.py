"""The tiered store: O_DIRECT reads return the checkpoint's bytes, capacities are enforced with
errors that name the sizes, units move and leave tiers as asked, concurrent loads are safe."""

import errno
import gc
import logging
import os
import threading

import pytest
import torch

from core.errors import CapacityError, MoepipeError
from core.types import Tensor, Tier
from real.checkpoint import Unit, load_checkpoint, read_tensor, reduced_spec, unit_layout
from real.checkpoint_write import write_checkpoint
from real.store import (
    ALIGN,
    DiskReader,
    HostSlabs,
    TieredStore,
    aligned_empty,
)


@pytest.fixture
def store(mixtral_tiny, tmp_path):
    s = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    yield s
    s.close()


def test_units_are_aligned_reads_of_the_checkpoint_itself(mixtral_tiny):
    """No second copy: a store opened on a checkpoint, every unit read, leaves the checkpoint's
    folder as it was, and reads aligned ranges of its safetensors files."""
    before = sorted((p.name, p.stat().st_size) for p in mixtral_tiny.rglob("*"))
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    for u in store.records:
        store.read_disk(u)
        store.evict(u, Tier.CPU)
    store.close()
    assert sorted((p.name, p.stat().st_size) for p in mixtral_tiny.rglob("*")) == before
    for rec in store.records.values():
        assert rec.nbytes == sum(r.nbytes for r in rec.reads) and rec.nbytes % ALIGN == 0
        for r in rec.reads:
            assert r.offset % ALIGN == 0 and r.nbytes % ALIGN == 0 and r.into % ALIGN == 0
            assert r.file.parent == mixtral_tiny and r.file.suffix == ".safetensors"
            assert 0 < r.needed <= r.nbytes


def test_a_checkpoint_rewritten_in_place_is_read_anew(tmp_path):
    """Nothing cached from an earlier checkpoint of the same shape and size: a store opened after
    the files were overwritten reads the new weights (a stale offload copy gave NaN logits)."""
    spec = reduced_spec("mixtral-tiny")
    ckpt = write_checkpoint(spec, tmp_path / "c", seed=0)
    unit = Unit(Tensor.EXPERT, 1, 3)
    first = TieredStore(ckpt, device_capacity_bytes=2**30)
    old = {k: v.clone() for k, v in first.read_disk(unit).items()}
    first.close()
    size = (ckpt / "model.safetensors").stat().st_size
    write_checkpoint(spec, ckpt, seed=1)
    assert (ckpt / "model.safetensors").stat().st_size == size
    second = TieredStore(ckpt, device_capacity_bytes=2**30)
    new = second.read_disk(unit)
    _, index = load_checkpoint(ckpt)
    for key, ts in unit_layout(spec)[unit].items():
        assert torch.equal(new[key], read_tensor(index[ts.hf_name]))
        assert not torch.equal(new[key], old[key])
    second.close()


def test_direct_read_equals_plain_read_and_checkpoint(store, mixtral_tiny):
    spec, index = load_checkpoint(mixtral_tiny)
    layout = unit_layout(spec)
    if os.uname().sysname == "Linux":
        logging.getLogger(__name__).info("O_DIRECT in use: %s", store.disk.direct)
    for unit in [Unit(Tensor.EXPERT, 2, 5), Unit(Tensor.ATTENTION, 0), Unit(Tensor.HEAD)]:
        got = store.read_disk(unit)
        buf = store.host.buffers[unit]
        assert buf.data_ptr() % ALIGN == 0
        for r in store.records[unit].reads:
            with open(r.file, "rb") as f:
                f.seek(r.offset)
                plain = f.read(r.needed)
            assert bytes(buf[r.into : r.into + r.needed].numpy()) == plain
        for key, ts in layout[unit].items():
            assert torch.equal(got[key], read_tensor(index[ts.hf_name])), (unit, key)


def test_reads_bypass_the_page_cache(store, tmp_path):
    """O_DIRECT where the filesystem takes it (ext4, xfs; tmpfs refuses it on older kernels)."""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(bytes(ALIGN))
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path}'s filesystem refuses O_DIRECT")
    assert store.disk.direct


def test_no_o_direct_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    """A filesystem that refuses O_DIRECT (EINVAL, as tmpfs did) gives one warning and buffered
    reads of the same bytes."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 32)
    real_open = os.open

    def refuse_direct(file, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(file, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    with caplog.at_level(logging.WARNING, logger="real.disk"):
        r = DiskReader(path)
    buf = aligned_empty(2 * ALIGN)
    r.read_into(buf, 0)
    r.close()
    assert not r.direct and bytes(buf.numpy()) == path.read_bytes()
    assert sum("O_DIRECT unsupported" in m for m in caplog.messages) == 1


def test_failed_probe_closes_its_descriptor(monkeypatch, tmp_path):
    """A probe read that fails for another reason than EINVAL raises and leaves no open fd."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(2 * ALIGN))
    opened: list[int] = []
    real_open = os.open

    def record_open(file, flags, *args):
        fd = real_open(file, flags, *args)
        opened.append(fd)
        return fd

    def eio(*args):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "open", record_open)
    monkeypatch.setattr(os, "preadv", eio)
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT here")
    with pytest.raises(OSError, match="Input/output error"):
        DiskReader(path)
    monkeypatch.undo()
    for fd in opened:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed


def test_checkpoint_cut_short_after_opening_raises(tmp_path):
    """The file ends inside a unit's tensors: the read names the file, the space goes back."""
    ckpt = write_checkpoint(reduced_spec("mixtral-tiny"), tmp_path / "c", seed=0)
    store = TieredStore(ckpt, device_capacity_bytes=2**30)
    last = max(store.records.values(), key=lambda r: r.reads[-1].offset + r.reads[-1].needed)
    r = last.reads[-1]
    os.truncate(r.file, r.offset + r.needed - 1)
    with pytest.raises(OSError, match=r"model.safetensors: file ends at byte .* truncated"):
        store.read_disk(last.unit)
    assert store.host.used_bytes == 0  # the failed read gave its space back
    store.close()


def test_a_read_past_a_files_unaligned_end_is_zero_filled(tmp_path):
    """The aligned range around the last tensor runs past the file's end: those bytes are zeros."""
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(256)) * 20)  # 5120 bytes: 1024 past one block
    r = DiskReader(path)
    buf = aligned_empty(2 * ALIGN)
    buf.fill_(7)
    r.read_into(buf, 0, needed=5120)
    assert bytes(buf[:5120].numpy()) == path.read_bytes() and not buf[5120:].any()
    with pytest.raises(OSError, match="truncated"):
        r.read_into(buf, 0, needed=5121)
    r.close()


def test_device_pool_too_small_names_sizes(mixtral_tiny, tmp_path):
    probe = TieredStore(mixtral_tiny, device_capacity_bytes=1)
    attn, gate = Unit(Tensor.ATTENTION, 1), Unit(Tensor.GATE, 1)
    cap = probe.unit_bytes(attn) + probe.unit_bytes(gate) - 1
    store = TieredStore(mixtral_tiny, device_capacity_bytes=cap)
    store.read_disk(attn)
    store.read_disk(gate)
    store.to_device(attn)
    need = store.unit_bytes(attn) + store.unit_bytes(gate)
    with pytest.raises(
        CapacityError,
        match=rf"device pool of {cap} bytes too small for layer 1's working set of {need} bytes",
    ):
        store.to_device(gate)
    store.free(attn)
    assert store.to_device(gate)["router"].shape == (8, 128)
    store.close()
    probe.close()


def test_host_capacity_and_tier_moves(mixtral_tiny, tmp_path):
    unit = Unit(Tensor.EXPERT, 0, 0)
    probe = TieredStore(mixtral_tiny, device_capacity_bytes=1)
    n = probe.unit_bytes(unit)
    store = TieredStore(mixtral_tiny, device_capacity_bytes=n, host_capacity_bytes=n)
    with pytest.raises(AssertionError, match="not in the host tier"):
        store.to_device(unit)
    host = store.read_disk(unit)
    with pytest.raises(CapacityError, match=f"host tier of {n} bytes too small"):
        store.read_disk(Unit(Tensor.EXPERT, 0, 1))
    dev = store.to_device(unit)
    assert all(torch.equal(host[k], dev[k]) for k in host)
    assert dev["w1"].data_ptr() != host["w1"].data_ptr()
    store.evict(unit, Tier.CPU)
    assert store.resident(unit, Tier.CPU) is None and store.resident(unit, Tier.GPU) is not None
    store.evict(unit, Tier.GPU)
    with pytest.raises(AssertionError, match="not in the device pool"):
        store.free(unit)
    assert store.pool.used_bytes == 0 and store.host.used_bytes == 0
    store.close()
    probe.close()


def test_concurrent_loads_of_the_same_units(store):
    units = [Unit(Tensor.EXPERT, layer, e) for layer in range(4) for e in range(8)]
    errors = []

    def worker():
        try:
            for u in units:
                store.read_disk(u)
                store.to_device(u)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.host.used_bytes == store.pool.used_bytes == sum(store.unit_bytes(u) for u in units)


def test_host_buffers_are_slab_slots_reused_once_nothing_reads_them(
    mixtral_tiny, tmp_path, monkeypatch
):
    """Host buffers are exact-size slots of shared slabs (no power-of-two rounding): a slot given
    back is reused, but not while a view of it is alive (a CPU expert still computing from it)."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 0)  # mixtral-tiny's units are small: 3 a slab
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    spec, index = load_checkpoint(mixtral_tiny)
    layout = unit_layout(spec)
    n = store.unit_bytes(Unit(Tensor.EXPERT, 0, 0))
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 3 * n)
    units = [Unit(Tensor.EXPERT, 0, e) for e in range(8)]
    held = {u: store.read_disk(u) for u in units[:4]}
    assert store.slabs.reserved_bytes == 6 * n  # two slabs of three slots, for four units
    ptrs = {u: store.host.buffers[u].data_ptr() for u in held}
    assert all(p % ALIGN == 0 for p in ptrs.values()) and len(set(ptrs.values())) == 4
    viewed = held.pop(units[0])  # a CPU expert still computing from unit 0's host copy
    store.evict(units[0], Tier.CPU)
    store.evict(units[1], Tier.CPU)
    del held[units[1]]
    for u in units[4:7]:  # the second slab's two free slots, then unit 1's
        store.read_disk(u)
    assert store.host.buffers[units[6]].data_ptr() == ptrs[units[1]]
    assert store.slabs.reserved_bytes == 6 * n
    store.read_disk(units[7])  # only unit 0's slot is free, and it is still read: a new slab
    assert store.host.buffers[units[7]].data_ptr() != ptrs[units[0]]
    assert store.slabs.reserved_bytes == 9 * n
    for u, w in [(units[0], viewed), *((u, store.resident(u, Tier.CPU)) for u in units[4:])]:
        assert all(torch.equal(w[k], read_tensor(index[t.hf_name])) for k, t in layout[u].items())
    store.close()


def test_a_buffer_taken_alone_is_a_slab_of_its_size_and_reused():
    """`alone` (KV caches, activation scratch: taken once a run) reserves exactly the buffer, not
    a slab of slots that would sit unused; given back and no longer viewed, it is reused."""
    from real.slabs import SLAB_SLOTS, HostSlabs

    slabs = HostSlabs()
    a = slabs.take(3 * ALIGN, alone=True)
    assert slabs.reserved_bytes == 3 * ALIGN
    ptr = a.data_ptr()
    slabs.give(a)
    del a
    assert slabs.take(3 * ALIGN, alone=True).data_ptr() == ptr and slabs.reserved_bytes == 3 * ALIGN
    slabs.take(ALIGN)  # a unit's size: a shared slab of slots
    assert slabs.reserved_bytes == 3 * ALIGN + SLAB_SLOTS * ALIGN


class _Copy:
    """A stand-in for a CUDA event of a queued copy."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_a_host_slot_still_copied_from_is_waited_for_not_reused_early(monkeypatch):
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 2 * ALIGN)
    slabs = HostSlabs()
    a, b = slabs.take(ALIGN), slabs.take(ALIGN)
    queued, landed = _Copy(False), _Copy(True)
    slabs.give(a, [queued])
    slabs.give(b, [landed])
    assert slabs.take(ALIGN).data_ptr() == b.data_ptr() and not queued.waited  # the landed one
    assert slabs.take(ALIGN).data_ptr() == a.data_ptr() and queued.waited  # waited, not grown
    assert slabs.reserved_bytes == 2 * ALIGN


def test_evicting_a_host_copy_waits_for_the_copy_reading_it(mixtral_tiny, tmp_path, monkeypatch):
    """A host copy dropped while `to_device` is about to copy from it: the eviction waits, so
    the slot cannot go to another unit's disk read under the copy."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 0)  # one slot a slab: a given-back slot is next
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    a, b = Unit(Tensor.EXPERT, 0, 0), Unit(Tensor.EXPERT, 0, 1)
    store.read_disk(a)
    want = {k: t.clone() for k, t in store.resident(a, Tier.CPU).items()}
    ptr = store.host.buffers[a].data_ptr()
    entered, gate = threading.Event(), threading.Event()
    real_alloc = store.alloc

    def slow_alloc(unit):  # to_device holds its source when it allocates the device copy
        entered.set()
        gate.wait()
        return real_alloc(unit)

    monkeypatch.setattr(store, "alloc", slow_alloc)
    copy = threading.Thread(target=store.to_device, args=(a,))
    copy.start()
    entered.wait()
    drop = threading.Thread(target=store.evict, args=(a, Tier.CPU))
    drop.start()
    drop.join(0.3)
    assert drop.is_alive()  # waits for the copy
    gate.set()
    copy.join()
    drop.join()
    got = store.resident(a, Tier.GPU)
    assert all(torch.equal(got[k], want[k]) for k in want)
    store.read_disk(b)  # now the slot is free to reuse
    assert store.host.buffers[b].data_ptr() == ptr
    store.close()


def test_an_evicted_host_copy_hands_its_queued_copies_to_the_slot(
    mixtral_tiny, tmp_path, monkeypatch
):
    """CUDA copies are queued: the events `to_device` recorded go with the slot when the host
    copy is evicted, and the next read into that slot waits for them (a fake event here)."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 0)
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    a, b = Unit(Tensor.EXPERT, 0, 0), Unit(Tensor.EXPERT, 0, 1)
    store.read_disk(a)
    queued = _Copy(False)
    store._read_from[a] = [queued]  # what to_device records on CUDA
    store.evict(a, Tier.CPU)
    assert not queued.waited
    store.read_disk(b)
    assert queued.waited
    store.close()


def test_read_disk_returns_views_the_slot_cannot_be_reused_under(
    mixtral_tiny, tmp_path, monkeypatch
):
    """Another worker evicts the unit and reads one of the same size just as `read_disk` makes
    its views: they still hold the unit's own bytes (made under the lock, they count as users)."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 0)
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    spec, index = load_checkpoint(mixtral_tiny)
    layout = unit_layout(spec)
    a, b = Unit(Tensor.EXPERT, 0, 0), Unit(Tensor.EXPERT, 0, 1)
    real_arrive, others = store._arrive, []

    def arrive(pool, unit, buf):
        real_arrive(pool, unit, buf)
        if pool is store.host and unit == a:
            t = threading.Thread(target=lambda: (store.evict(a, Tier.CPU), store.read_disk(b)))
            t.start()
            t.join(0.3)
            others.append(t)

    monkeypatch.setattr(store, "_arrive", arrive)
    got = store.read_disk(a)
    for t in others:
        t.join()
    assert all(torch.equal(got[k], read_tensor(index[t.hf_name])) for k, t in layout[a].items())
    store.close()


def test_resident_views_hold_the_slot_against_a_racing_evict(mixtral_tiny, tmp_path, monkeypatch):
    """`resident` makes its views under the lock: an evict and a read of another unit that
    start while it does so cannot reuse the slot under them."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 0)
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    spec, index = load_checkpoint(mixtral_tiny)
    layout = unit_layout(spec)
    a, b = Unit(Tensor.EXPERT, 0, 0), Unit(Tensor.EXPERT, 0, 1)
    store.read_disk(a)
    real_views, others = store._views, []

    def views(unit, buf, host):
        if unit == a and not others:  # the first views of a, made by resident()
            t = threading.Thread(target=lambda: (store.evict(a, Tier.CPU), store.read_disk(b)))
            t.start()
            t.join(0.3)
            others.append(t)
        return real_views(unit, buf, host)

    monkeypatch.setattr(store, "_views", views)
    got = store.resident(a, Tier.CPU)
    for t in others:
        t.join()
    assert all(torch.equal(got[k], read_tensor(index[t.hf_name])) for k, t in layout[a].items())
    store.close()


def test_pinned_slabs_are_unregistered_once_no_slot_is_left(monkeypatch):
    """cudaHostRegister'ed slabs (a stand-in cudart here) are unregistered when the last slot
    dies, not when the slabs object does, and at close() after the device synchronized."""
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append(("register", ptr))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", 0)))
    slabs = HostSlabs(pin_for=torch.device("cuda"))
    slot = slabs.take(ALIGN)
    ptr = calls[0][1]
    del slabs
    gc.collect()
    assert calls == [("register", ptr)]  # a slot still uses the slab's memory
    del slot
    gc.collect()
    assert calls == [("register", ptr), ("unregister", ptr)]
    closing = HostSlabs(pin_for=torch.device("cuda"))
    kept = closing.take(ALIGN)
    closing.close()
    assert calls[-2:] == [("sync", 0), ("unregister", calls[-3][1])] and kept.numel() == ALIGN
    closing.close()  # once only
    assert len(calls) == 5


@pytest.mark.gpu
def test_cuda_pinned_host_and_stream_copy(mixtral_tiny, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    store = TieredStore(mixtral_tiny, device_capacity_bytes=2**30)
    unit = Unit(Tensor.EXPERT, 1, 3)
    host = store.read_disk(unit)
    assert host["w1"].is_pinned()
    assert store.slabs.registered, (
        "pinned at exact size by cudaHostRegister, not PyTorch's rounding"
    )
    stream = torch.cuda.Stream()
    dev = store.to_device(unit, stream)
    stream.synchronize()
    assert dev["w1"].is_cuda and torch.equal(dev["w1"].cpu(), host["w1"])
    store.close()


def test_release_idle_drops_wholly_free_slabs_only(monkeypatch):
    """A slab goes back to the system once every slot of it is given back and nothing views
    it; a slab with a slot taken, or a given-back slot still viewed, stays."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 2 * ALIGN)
    slabs = HostSlabs()
    a, b = slabs.take(ALIGN), slabs.take(ALIGN)  # one slab of two slots
    c = slabs.take(3 * ALIGN)  # a slab of its own size
    assert slabs.reserved_bytes == 5 * ALIGN
    slabs.give(a)
    slabs.give(c)
    view = c[:10]
    assert slabs.release_idle() == 0  # b is taken; c is still viewed
    del view
    assert slabs.release_idle() == 3 * ALIGN and slabs.reserved_bytes == 2 * ALIGN
    slabs.give(b)
    assert slabs.release_idle() == 2 * ALIGN and slabs.reserved_bytes == 0
    assert slabs.take(ALIGN).numel() == ALIGN and slabs.reserved_bytes == 2 * ALIGN  # cut anew


def test_slabs_are_cut_within_the_host_budget(monkeypatch):
    """With a budget (the host tier's memory), a new slab gets no more slots than keep the
    slabs within it, and one at least once they are over it."""
    monkeypatch.setattr("real.slabs.SLAB_BYTES", 8 * ALIGN)
    slabs = HostSlabs(budget_bytes=3 * ALIGN)
    slabs.take(ALIGN)
    assert slabs.reserved_bytes == 3 * ALIGN  # 3 slots, not 8
    slabs.take(ALIGN), slabs.take(ALIGN), slabs.take(ALIGN)
    assert slabs.reserved_bytes == 4 * ALIGN  # over it: one slot a slab
    assert len(HostSlabs()._slab(ALIGN)) == 8  # no budget: a whole slab's slots


@pytest.mark.parametrize(
    ("given", "hint"),
    [("CPU", "did you mean 'cpu'? "), ("Cuda:0", "did you mean 'cuda'? "), ("xyzzy", "")],
)
def test_a_device_not_torchs_names_the_nearest_and_the_key(given: str, hint: str) -> None:
    """`executor.device=CPU` was refused saying to pass cpu, without a suggestion, and the
    line's second choice named `device=`, not the key the user typed."""
    from real.store import resolve_device

    with pytest.raises(MoepipeError) as info:
        resolve_device(given, "executor.device")
    line = str(info.value)
    assert line.startswith(f"executor.device={given}: not a device; {hint}pass ")
    assert "executor.device=cpu or executor.device=cuda" in line
