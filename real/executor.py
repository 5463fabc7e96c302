"""The real executor: runs a planner's schedule on the real model with real tiered weights.

One worker thread per logical stream; on CUDA each worker also owns a CUDA stream, records a
start/end event around every op and waits for the end event before marking the op done, so the
dependency, memory and resource logic is one host-side code path for CPU and GPU. Semantics as in
DESIGN.md and sim/: a stream is a FIFO; an op starts once its deps are done, its allocation fits
the tier (it waits, never over-commits) and its physical resource is free (one lock per resource);
it frees memory at its end. Any worker error stops every worker and is re-raised; a run where no op
runs and none finishes for `stall_timeout_s` raises naming the stuck ops, and an op that runs longer
than that (a hung read or collective) raises naming it. Never hangs.

An expert-parallel schedule's G devices run in this one process, or as G processes (one rank
each, `peers`: real/distributed.py), each running its own device's ops with the same op code.

Usage:
    ex = Executor(store, model, workload, prompts)            # prompts [n*bs, P]
    out = ex.run_replay(schedule, routing)                    # gate forced to `routing`
    out = ex.run_live(plan, capacity_bytes, resident)         # model's own gate, planner fed live
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.dispatch import micro_batch_rows, micro_batch_seqs
from core.ep_layout import EPLayout
from core.errors import MoepipeError, ScheduleError
from core.routing import CausalRouting, GateView, Routing
from core.schedule import Op, Schedule, ScheduleBuilder, StreamSpec, describe_stuck
from core.spec import Workload
from core.types import COMPUTE_KINDS, OpKind, Resource, Tensor, Tier
from real.checkpoint import Unit
from real.model import KVCache, Model, expert_tokens, moe_output, new_slots, put_expert
from real.store import TENSOR_ALIGN, TieredStore, aligned, round_up

if TYPE_CHECKING:
    from real.distributed import Peers

log = logging.getLogger(__name__)

# Shape legend: b sequences per batch, P prompt tokens, S tokens this step, T = b*S, H hidden,
# V vocab, k top-k, E experts.

_POLL_S = 0.05  # how often a waiting thread re-checks for errors
_WEIGHT_TENSORS = {Tensor.ATTENTION, Tensor.GATE, Tensor.EXPERT, Tensor.FFN, Tensor.HEAD}

PlanFn = Callable[[CausalRouting, ScheduleBuilder], None]  # runs a planner into a builder


@functools.cache  # one measurement per process: a machine's load, not a run's
def cpu_compute_threads(reps: int = 5) -> int:
    """Torch intra-op threads of a CPU-only run, measured, not assumed: the count among every
    core, every core but one, and one that runs a small expert-shaped FFN fastest (median of
    `reps` interleaved timings, about 0.1-0.5 s). The device-pool "GPU" is the CPU itself, and
    whether a core is free for it depends on what else runs: on the 2-core VM here, idle, every
    core was fastest; shared with other work (load 14), two OpenMP threads took 8x one's time
    (146 against 19 ms), a descheduled thread holding up every op. The transfer workers need
    little CPU beside compute (O_DIRECT reads wait on DMA). `experiments.calibrate` times
    compute with the count this picks."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    counts = sorted({cores, max(1, cores - 1), 1}, reverse=True)
    if len(counts) == 1:
        return cores
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = (torch.randn(*s, generator=g) for s in ((64, 512), (1536, 512), (512, 1536)))
    before = torch.get_num_threads()
    times: dict[int, list[float]] = {n: [] for n in counts}
    try:
        with torch.inference_mode():
            for _ in range(reps):
                for n in counts:
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    torch.nn.functional.silu(x @ w1.T) @ w2.T
                    times[n].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return min(counts, key=lambda n: (sorted(times[n])[reps // 2], -n))


EXPERT_ROWS = 8192  # tokens an expert op runs through its FFN at once


class _Stop(Exception):
    """Raised inside a waiting thread once another thread has failed."""


def unit_of(op: Op) -> Unit | None:
    """The weight unit an op moves, computes with or frees; None for KV/activation ops."""
    if op.tensor not in _WEIGHT_TENSORS:
        return None
    if op.tensor == Tensor.HEAD:
        return Unit(Tensor.HEAD)
    return Unit(op.tensor, op.layer, op.expert if op.tensor == Tensor.EXPERT else -1)


def resident_units(schedule: Schedule, n_experts: int = 0) -> dict[Unit, Tier]:
    """Units the schedule uses without ever loading from disk: where they must sit before t=0.

    Loaded to the GPU but never read from disk -> host RAM; computed on but never loaded -> the
    tier of the stream that computes with them (device pool for gpu streams, host for cpu ones).
    With `n_experts`, a layer with one host-resident expert gets all its experts in host RAM
    (placements put a layer's experts on one tier; a live run may use experts the plan did not).
    """
    from_disk, to_gpu, computed = set(), set(), {}
    for op in schedule.ops:
        u = unit_of(op)
        if u is None:
            continue
        if op.kind == OpKind.LOAD and op.src == Tier.DISK:
            from_disk.add(u)
        elif op.kind == OpKind.LOAD and op.src == Tier.CPU and op.dst == Tier.GPU:
            to_gpu.add(u)
        elif op.kind in COMPUTE_KINDS:
            res = schedule.streams[op.stream].resource
            computed.setdefault(u, Tier.CPU if res == Resource.CPU else Tier.GPU)
    out = {u: Tier.CPU for u in to_gpu - from_disk}
    for u, tier in computed.items():
        if u not in from_disk and u not in to_gpu:
            out[u] = tier
        elif u in from_disk and u not in to_gpu and tier == Tier.GPU:
            out.setdefault(u, Tier.GPU)  # read to host for a CPU user elsewhere; GPU copy resident
    if schedule.ep is not None:  # expert parallelism keeps every expert resident on the GPU
        for layer in {u.layer for u in computed if u.kind == Tensor.EXPERT}:
            for e in range(n_experts):
                out.setdefault(Unit(Tensor.EXPERT, layer, e), Tier.GPU)
    host_layers = {u.layer for u, t in out.items() if u.kind == Tensor.EXPERT and t == Tier.CPU}
    for layer in host_layers:
        for e in range(n_experts):
            u = Unit(Tensor.EXPERT, layer, e)
            if u not in from_disk:
                out.setdefault(u, Tier.CPU)
    return out


@dataclass
class RunOutput:
    """What a real run produced: op times, the schedule run, the generated tokens and logits."""

    schedule: Schedule
    start_s: np.ndarray  # [ops] seconds from the run's start
    end_s: np.ndarray  # [ops]
    tokens: torch.Tensor  # [n*b, gen_len] generated token ids
    logits: torch.Tensor  # [n*b, V] float32 logits of the last step
    routing: Routing  # the experts the gates used (replayed or chosen live)
    fallback_loads: int = 0  # units a compute found nowhere and read synchronously (should be 0)


@dataclass
class _Pending:
    """A batch's MoE layer between its gate and the next op that reads its hidden state. Its
    gate may run in parts, each over a share of the sequences (one per device, data-parallel
    expert parallelism): `gated` says which have run."""

    step: int
    layer: int
    normed: torch.Tensor  # [T, H]
    ids: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    slots: torch.Tensor  # [T, k, H]
    done: torch.Tensor  # [b] bool: sequences whose hidden state has the layer's output added
    gated: torch.Tensor  # [b] bool: sequences the gate has run on
    shared: torch.Tensor | None = None  # [T, H]


@dataclass
class _BatchState:
    """One batch's activations. Dense ops may each take a share of its sequences (data-parallel
    expert-parallel planners): `Executor._range` holds each op's [s0, s1)."""

    prompt: torch.Tensor  # [b, P]
    tokens: torch.Tensor  # [b, G] generated so far
    # per decoder layer, the cache attention reads (device), [B, H, M, D] each: allocated when a
    # layer's first attention or KV_LOAD starts, dropped when a KV_STORE releases it (KV kept in
    # host memory), so the device holds the KV the schedule's memory effects say it holds
    kv_dev: list[tuple[torch.Tensor, ...] | None]
    # KV_STORE puts it here, KV_LOAD takes it: [M, B, H, D] each (`_host_kv`); allocated when
    # the batch's first KV op is planned (None where the schedule keeps its KV on the device)
    kv_host: KVCache | None
    # step -> [b, S, H]: the hidden state of each step under way (micro-batches of one batch
    # may be a step apart: one's next step starts while another's head still reads this one)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # micro-batch (-1: the whole batch) -> the MoE layer whose output its next ops add, and the
    # next one, while its gate parts run
    pending: dict[int, _Pending] = field(default_factory=dict)
    gating: dict[int, _Pending] = field(default_factory=dict)
    written: list[int] = field(default_factory=list)  # per step: sequences whose head ran
    logits: torch.Tensor | None = None  # [b, V]


def bst_index(batches: list[_BatchState], bst: _BatchState) -> int:
    """The batch index of a batch's state (for an error line)."""
    return next(i for i, b in enumerate(batches) if b is bst)


class Executor:
    def __init__(
        self,
        store: TieredStore,
        model: Model,
        workload: Workload,
        prompts: torch.Tensor,
        stall_timeout_s: float = 120.0,
        compute_threads: int | None = None,
        peers: Peers | None = None,
    ) -> None:
        """`peers`: this process is one rank of a G-process run (`real.distributed`): it runs
        its own device's ops of the schedule, the others' data arrives by transfer ops."""
        wl = workload
        if tuple(prompts.shape) != (wl.n_sequences, wl.prompt_len):
            raise MoepipeError(
                f"prompts have shape {list(prompts.shape)}, the workload needs "
                f"[{wl.n_sequences}, {wl.prompt_len}] (n_batches*batch_size, prompt_len)"
            )
        self.store, self.model, self.wl = store, model, wl
        self.prompts = prompts.long()
        self.device = store.device
        self.cuda = self.device.type == "cuda"
        self.stall_timeout_s = stall_timeout_s
        self.peers = peers
        # Torch intra-op threads per worker on a CPU device (None on CUDA: kernels run on the GPU).
        self.compute_threads = None if self.cuda else (compute_threads or cpu_compute_threads())

    # ---- entry points -----------------------------------------------------------------------
    def run_replay(self, schedule: Schedule, routing: Routing) -> RunOutput:
        """Run a finished schedule with every gate forced to `routing`'s experts and weights."""
        self._reset(schedule.capacity_bytes, schedule.resident_bytes, routing)
        self._schedule = schedule
        self._preload(self._own(resident_units(schedule), schedule.ep))
        for op in schedule.ops:
            self._add_op(op, schedule.streams[op.stream])
        self._planner_done = True
        self._execute()
        return self._output(schedule)

    def run_timing(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        """Run a schedule for its op times only (calibration: ops that compute no tokens)."""
        self._reset(schedule.capacity_bytes, schedule.resident_bytes, None)
        self._schedule = schedule
        for op in schedule.ops:
            self._add_op(op, schedule.streams[op.stream])
        self._planner_done = True
        self._execute()
        return np.asarray(self._start), np.asarray(self._end)

    def run_live(
        self,
        plan: PlanFn,
        capacity_bytes: Mapping[Tier, int],
        resident: Mapping[Unit, Tier],
        kv_batches: Iterable[int] = (),
        first_ep: EPLayout | None = None,
    ) -> RunOutput:
        """Run with the model's own gates while the planner plans: each op it emits is queued at
        once, and its `CausalRouting` blocks at a gate until that gate op has really run.

        `resident`: where units the schedule never loads sit (from a dry replay plan's
        `resident_units`; planners' placement does not depend on routing values).
        `kv_batches`: the batches whose KV the dry plans keep in host memory; their host caches
        are made before the run starts (else the planner thread pins them mid-run).
        `first_ep`: a dry plan's expert-parallel layout, whose first placement a rank of a
        G-process run holds before the start.
        """
        self._reset(capacity_bytes, None, None)
        self._preload(self._own(resident, first_ep))
        for b in kv_batches:
            self._ensure_host_kv(b)
        holder: dict[str, CausalRouting] = {}

        def seen(key: tuple[int, ...]) -> GateView:
            revealed = (
                holder["causal"].revealed if len(key) == 3 else holder["causal"].micro_revealed
            )
            if key not in revealed:
                raise MoepipeError(
                    "this planner looks at routing before its gate (an oracle); it cannot run "
                    "with routing_mode=live, use routing_mode=replay"
                )
            with self._cv:
                self._wait(lambda: key in self._views)
                return self._views[key]

        def source(step: int, moe_idx: int, batch: int) -> GateView:
            return seen((step, moe_idx, batch))

        def micro_source(step: int, moe_idx: int, batch: int, micro: int) -> GateView:
            return seen((step, moe_idx, batch, micro))

        causal = CausalRouting(
            source, self.model.spec.n_experts, self.model.spec.top_k, micro_source=micro_source
        )
        holder["causal"] = causal
        builder = ScheduleBuilder(
            capacity_bytes, sink=lambda op: self._add_op(op, builder.streams[op.stream])
        )
        self._builder = builder

        def run_planner() -> None:
            try:
                plan(causal, builder)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                self._fail(e)
            finally:
                with self._cv:
                    self._planner_done = True
                    self._cv.notify_all()

        planner = threading.Thread(target=run_planner, name="planner", daemon=True)
        planner.start()
        try:
            self._execute()
        finally:
            planner.join(timeout=5)
            del self._builder  # its sink refers back to this executor: no cycle for gc to find
        schedule = builder.build()
        schedule.meta.setdefault("oracle", causal.peeked)
        return self._output(schedule)

    # ---- setup ------------------------------------------------------------------------------
    def _own(self, resident: Mapping[Unit, Tier], ep: EPLayout | None) -> Mapping[Unit, Tier]:
        """The resident units this process holds: all of them, or one rank's (`Peers`)."""
        if self.peers is None:
            return resident
        return self.peers.own_units(resident, ep.placements if ep is not None else {})

    def _reset(
        self,
        capacity: Mapping[Tier, int],
        resident: Mapping[Tier, int] | None,
        routing: Routing | None,
    ) -> None:
        s, wl = self.model.spec, self.wl
        self._cv = threading.Condition()
        self._capacity = dict(capacity)
        self._resident_bytes = dict(resident) if resident is not None else None
        self._free: dict[Tier, int] | None = None  # set when the first op arrives (after reserves)
        self._room: dict[
            Tier, int
        ] = {}  # each tier's bytes beside the resident ones (the most free)
        self._routing = routing
        self._schedule: Schedule | None = None
        self._ops: list[Op] = []
        self._done: list[bool] = []
        self._start: list[float] = []
        self._end: list[float] = []
        self._queues: dict[str, deque[Op]] = {}
        self._threads: list[threading.Thread] = []
        self._locks: dict[str, threading.Lock] = {}
        self._error: BaseException | None = None
        self._planner_done = False
        self._progress = 0
        self._running: dict[int, float] = {}  # op id -> monotonic start, while its work runs
        # (step, moe, batch) -> its routing; (step, moe, batch, micro) -> a micro-batch's
        self._views: dict[tuple[int, ...], GateView] = {}
        self._used: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (step, moe, batch) -> (ids, weights) of its micro-batches gated so far
        self._micro_parts: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._dev_refs: dict[Unit, int] = {}
        self._host_refs: dict[Unit, int] = {}
        self._refs_lock = threading.Lock()
        self._resident: dict[Unit, dict[str, torch.Tensor]] = {}
        self._host_resident: set[Unit] = set()
        self._fallbacks = 0
        # (step, layer, order, batch, what) -> a device bool: were that op's outputs finite?
        # Read once at the end (`_check_finite`), so checking costs no synchronisation.
        self._finite: list[tuple[tuple[int, int, int, int, str], torch.Tensor]] = []
        self._scratch: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown scratch buffers, kept to the run's end
        self._cursor: dict[tuple[object, ...], int] = {}
        self._range: dict[int, tuple[int, int]] = {}  # op -> [s0, s1) sequences, or token chunk
        self._batches = []
        for b in range(wl.n_batches):
            prompt = self.prompts[b * wl.batch_size : (b + 1) * wl.batch_size].to(self.device)
            gen = torch.zeros(wl.batch_size, wl.gen_len, dtype=torch.long, device=self.device)
            dev: list[tuple[torch.Tensor, ...] | None] = [None] * s.n_layers
            self._batches.append(_BatchState(prompt, gen, dev, None, written=[0] * wl.gen_len))
        # one layer's device cache: shapes and dtypes
        self._kv_shapes = [
            (t.shape, t.dtype)
            for t in KVCache.allocate(s, wl.batch_size, wl.prompt_len + wl.gen_len, "meta").layers[
                0
            ]
        ]
        if self.cuda:
            # blocking events: a worker waiting on one sleeps instead of spinning a CPU core,
            # which the disk reader and CPU experts need
            self._t0_event = torch.cuda.Event(enable_timing=True, blocking=True)

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
                else:
                    length = p + self.wl.gen_len
                kv = bst.kv_dev[op.layer] = tuple(
                    torch.empty((*shape[:2], length, *shape[3:]), dtype=dtype, device=self.device)
                    for shape, dtype in self._kv_shapes
                )
            return kv

    def _ensure_host_kv(self, batch: int) -> None:
        bst = self._batches[batch]
        if bst.kv_host is None:
            bst.kv_host = self._host_kv(self.wl.batch_size, self.wl.prompt_len + self.wl.gen_len)

    def _host_kv(self, batch: int, max_len: int) -> KVCache:
        """A batch's host KV cache, zeroed, position-major ([M, B, H, D] each): the span of
        positions a KV_LOAD or KV_STORE moves is one contiguous block, which CUDA copies straight
        from or into pinned memory (a strided span goes through an unpinned temporary). One buffer
        lent by the store's host slabs, pinned at its exact size on CUDA, reused only once these
        views are gone."""
        shapes = KVCache.allocate(self.model.spec, batch, max_len, "meta")
        layout, end = [], 0
        for layer in shapes.layers:
            row = []
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

    def _preload(self, resident: Mapping[Unit, Tier]) -> None:
        """Put placement-resident units where the schedule expects them (untimed)."""
        st = self.store
        for u, tier in {**resident, Unit(Tensor.EMBED): Tier.GPU}.items():
            st.read_disk(u)
            if tier == Tier.CPU:
                self._host_resident.add(u)
                continue
            w = st.to_device(u)
            self._resident[u] = dict(w)
            st.evict(u, Tier.CPU)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- scheduling machinery ---------------------------------------------------------------
    def _add_op(self, op: Op, spec: StreamSpec) -> None:
        if op.kind == OpKind.EXPERT and op.expert < 0:
            raise MoepipeError(
                f"{op.label()}: a grouped expert op (all of a device's experts in one op) runs in "
                "the simulator only; set planner.params.grouped_gemm=false for real runs"
            )
        if op.kind in (OpKind.KV_LOAD, OpKind.KV_STORE):
            # when planned (a replay plans every op before the run's start; a live run makes
            # the dry plans' batches first): pinning a host buffer takes longer than its copies
            self._ensure_host_kv(op.batch)
        with self._cv:
            if self._free is None:
                res = self._resident_bytes
                if res is None:  # live: the builder's reserves are all made before the first op
                    res = self._builder.resident_bytes
                self._resident_bytes = dict(res)
                self._free = {t: self._capacity[t] - res.get(t, 0) for t in Tier}
                self._room = dict(self._free)
            assert op.id == len(self._ops), "ops arrive in id order"
            self._note_range(op, spec)
            self._ops.append(op)
            self._done.append(False)
            self._start.append(0.0)
            self._end.append(0.0)
            if self.peers is not None and not self.peers.runs(spec):
                # another rank runs it; a dep on it is honoured by the transfer op that brings
                # its data (`real.distributed`)
                self._done[-1] = True
                self._cv.notify_all()
                return
            q = self._queues.get(op.stream)
            if q is None:
                q = self._queues[op.stream] = deque()
                rid = spec.resource_id
                if rid not in self._locks:
                    self._locks[rid] = threading.Lock()
                # a pool's streams share their resource (a GPU's SMs, a link) with no lock, as in the
                # simulator
                lock = None if spec.resource == Resource.NONE or spec.pool else self._locks[rid]
                t = threading.Thread(
                    target=self._worker,
                    args=(op.stream, q, lock, spec),
                    name=f"stream-{op.stream}",
                    daemon=True,
                )
                self._threads.append(t)
                if self._started:
                    t.start()
            q.append(op)
            self._cv.notify_all()

    _started = False

    def _note_range(self, op: Op, spec: StreamSpec) -> None:
        """Which share of its batch an op works on, from the ops of its kind emitted before it:
        sequences [s0, s1) for a dense op, a chunk of the expert's tokens for an expert op. A
        micro-batch's dense op: its GPU's part of it (`micro_batch_seqs`), whatever came before."""
        if op.batch < 0:
            return
        dense = op.kind in (OpKind.ATTENTION, OpKind.GATE, OpKind.FFN, OpKind.HEAD)
        if dense and op.micro >= 0:
            ep = self._ep_meta()
            self._range[op.id] = micro_batch_seqs(
                self.wl.batch_size, ep.n_devices, ep.micro_batches, spec.device, op.micro
            )
            return
        if dense:
            per = 1 if op.kind == OpKind.HEAD else self.wl.step_tokens(op.step)
            n = op.tokens // per if op.tokens else self.wl.batch_size
            key: tuple[object, ...] = (op.kind, op.step, op.layer, op.batch)
        elif op.kind == OpKind.EXPERT:
            n, key = op.tokens, (op.kind, op.step, op.layer, op.batch, op.micro, op.expert)
        else:
            return
        first = self._cursor.get(key, 0)
        self._cursor[key] = first + n
        self._range[op.id] = (first, first + n)

    def _execute(self) -> None:
        grad_before = torch.is_grad_enabled()  # restored on return: the caller's autograd state
        torch.set_grad_enabled(False)
        threads_before = torch.get_num_threads()
        if self.compute_threads is not None:
            torch.set_num_threads(self.compute_threads)
        if self.peers is not None:  # every rank's clock starts once all have set up
            self.peers.start(self)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._t0_event.record(torch.cuda.current_stream(self.device))  # on the run's device
            self._t0_event.synchronize()  # elapsed_time needs both events complete
        self._t0 = time.perf_counter()
        with self._cv:
            self._started = True
            for t in self._threads:
                t.start()
        last_progress, last_time = -1, time.monotonic()
        try:
            while True:
                with self._cv:
                    self._cv.wait(timeout=0.2)
                    if self._error is not None:
                        break
                    finished = self._planner_done and all(self._done)
                    if finished:
                        break
                    now = time.monotonic()
                    if self._progress != last_progress or self._running:
                        last_progress, last_time = self._progress, now
                    if self._running:  # something runs: a stall only if it runs too long
                        oid, since = min(self._running.items(), key=lambda kv: kv[1])
                        if now - since > self.stall_timeout_s:
                            self._error = ScheduleError(
                                f"real run: {self._ops[oid].label()} has run for "
                                f"{now - since:.0f} s (stall_timeout_s={self.stall_timeout_s:g}); "
                                "a hung disk read or collective?"
                            )
                            self._cv.notify_all()
                            break
                    elif now - last_time > self.stall_timeout_s:
                        free = self._free or {t: 0 for t in Tier}
                        stuck = Schedule(self._ops, self._stream_specs(), self._capacity, {}, {})
                        self._error = ScheduleError(
                            f"real run made no progress for {self.stall_timeout_s:g} s: "
                            + describe_stuck(stuck, self._done, free)
                        )
                        self._cv.notify_all()
                        break
        finally:
            self._started = False
            with self._cv:
                threads = list(self._threads)
            for t in threads:
                if t.is_alive():
                    t.join(timeout=max(5.0, self.stall_timeout_s))
            torch.set_num_threads(threads_before)
            torch.set_grad_enabled(grad_before)
            if self.cuda:  # after a failure too: no queued copy reads or writes host slabs after
                try:
                    torch.cuda.synchronize(self.device)
                except RuntimeError:
                    if self._error is None:
                        raise
        if self._error is not None:
            raise self._error

    def _stream_specs(self) -> dict[str, StreamSpec]:
        if self._schedule is not None:
            return self._schedule.streams
        return self._builder.streams

    def _fail(self, e: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = e
            self._cv.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait (holding self._cv) until ready(); raise _Stop if another thread failed."""
        while not ready():
            if self._error is not None:
                raise _Stop
            self._cv.wait(timeout=_POLL_S)
        if self._error is not None:
            raise _Stop

    def _worker(
        self, name: str, q: deque[Op], lock: threading.Lock | None, spec: StreamSpec
    ) -> None:
        cuda_stream = torch.cuda.Stream(self.device) if self.cuda else None
        torch.set_grad_enabled(False)
        if self.compute_threads is not None:  # OpenMP's thread count is per calling thread
            torch.set_num_threads(self.compute_threads)
        try:
            while True:
                with self._cv:
                    self._wait(lambda: bool(q) or self._planner_done)
                    if not q:
                        return
                    op = q.popleft()
                    self._wait(lambda op=op: all(self._done[d] for d in op.deps))
                    if op.alloc_bytes:
                        assert self._free is not None and op.alloc_tier is not None
                        free = self._free
                        self._wait(lambda op=op, free=free: free[op.alloc_tier] >= op.alloc_bytes)
                        free[op.alloc_tier] -= op.alloc_bytes
                use_lock = lock is not None and op.kind != OpKind.FREE
                if use_lock:
                    while not lock.acquire(timeout=_POLL_S):
                        if self._error is not None:
                            raise _Stop
                with self._cv:
                    self._running[op.id] = time.monotonic()
                try:
                    start, end = self._timed(op, spec, cuda_stream)
                finally:
                    if use_lock:
                        lock.release()
                with self._cv:
                    del self._running[op.id]
                    if op.free_bytes:
                        assert self._free is not None and op.free_tier is not None
                        self._free[op.free_tier] += op.free_bytes
                        if self._free[op.free_tier] > self._room[op.free_tier]:
                            raise ScheduleError(  # as the simulator's check (sim/executor.py)
                                f"{op.label()} frees {op.free_bytes} B of {op.free_tier}, more "
                                "than the ops before it hold: each free must match an "
                                "allocation still held"
                            )
                    self._start[op.id], self._end[op.id] = start, end
                    self._done[op.id] = True
                    self._progress += 1
                    self._cv.notify_all()
        except _Stop:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            if not isinstance(e, MoepipeError | OSError):
                log.exception("stream %s failed", name)
            self._fail(e)

    def _timed(
        self, op: Op, spec: StreamSpec, cuda_stream: torch.cuda.Stream | None
    ) -> tuple[float, float]:
        """Run one op; its (start, end) in seconds from the run's start (CUDA: from events)."""
        if cuda_stream is None:
            start = time.perf_counter() - self._t0
            self._run_op(op, spec, None)
            end = time.perf_counter() - self._t0
            self._release(op)
            return start, end
        ev_start = torch.cuda.Event(enable_timing=True)
        ev_end = torch.cuda.Event(enable_timing=True, blocking=True)
        with torch.cuda.stream(cuda_stream):
            ev_start.record(cuda_stream)
            self._run_op(op, spec, cuda_stream)
            ev_end.record(cuda_stream)
        ev_end.synchronize()  # the op's data is ready for every other stream once marked done
        # Only now drop what the op frees: its kernels have read the weights. Freed earlier, the
        # caching allocator could hand their block (allocated on a load stream) to the next load
        # on that stream while this op's kernels still read it.
        self._release(op)
        return self._t0_event.elapsed_time(ev_start) / 1e3, self._t0_event.elapsed_time(
            ev_end
        ) / 1e3

    # ---- ops -> real work ---------------------------------------------------------------------
    def _run_op(self, op: Op, spec: StreamSpec, cuda_stream: torch.cuda.Stream | None) -> None:
        """The op's work; its memory effect (`_release`) follows once the work is done."""
        k = op.kind
        if k == OpKind.FREE:
            return
        if self.peers is not None and self.peers.moves(op):
            self.peers.transfer(self, op, spec)
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
            with self._refs_lock:
                self._host_refs[u] = self._host_refs.get(u, 0) + 1
            st.read_disk(u)
        elif op.src == Tier.CPU and op.dst == Tier.GPU:
            with self._refs_lock:
                self._dev_refs[u] = self._dev_refs.get(u, 0) + 1
            if not st.holds(u, Tier.CPU):  # the planner assumed a host copy: read it now
                self._fallbacks += 1
                log.warning("%s: %s is not in host memory; reading it from disk", op.label(), u)
                st.read_disk(u)
            st.to_device(u, cuda_stream)
        else:
            self._scratch_copy(op)

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
        if drop:
            self.store.evict(u, tier)

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
            h[s0:s1] = m.attention(op.layer, w, h[s0:s1], kv, self._positions(op.step))
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
                h[s0:s1] = m.dense_ffn(w, h[s0:s1])
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
            bst.tokens[s0:s1, op.step] = logits.argmax(-1)

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
        fi = fw = None
        if self._routing is not None:
            seqs = slice(op.batch * wl.batch_size + s0, op.batch * wl.batch_size + s1)
            pos = self._routing.step_slice(op.step, wl)
            fi = torch.from_numpy(
                self._routing.expert_ids[seqs, pos, moe].reshape(-1, s.top_k).astype(np.int64)
            )
            fw = torch.from_numpy(
                np.ascontiguousarray(
                    self._routing.gate_weights[seqs, pos, moe].reshape(-1, s.top_k)
                )
            )
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
        self._publish(op, p, moe)

    def _publish(self, op: Op, p: _Pending, moe: int) -> None:
        """A gated batch's routing, for the planner (live) and the run's output: at once, or of a
        micro-batch (its rows, `micro_batch_rows`) and, once every micro-batch of the batch is
        gated, the whole batch's."""
        n_e, key = self.model.spec.n_experts, (op.step, moe, op.batch)
        ids, weights = p.ids.cpu(), p.weights.cpu()

        def view(i: torch.Tensor) -> GateView:
            return GateView(
                i.numpy().astype(np.int16), np.bincount(i.flatten().numpy(), minlength=n_e)
            )

        with self._cv:
            if op.micro >= 0:
                ep = self._ep_meta()
                rows = micro_batch_rows(
                    self.wl.batch_size,
                    ep.n_devices,
                    ep.micro_batches,
                    op.micro,
                    self.wl.step_tokens(op.step),
                )
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
            s0, s1 = micro_batch_seqs(bs, ep.n_devices, ep.micro_batches, d, micro)
            mask[s0:s1] = True
        return mask

    def _expert(self, op: Op, w: Mapping[str, torch.Tensor]) -> None:
        """One expert over its tokens in one batch, or in every batch of the group (batch=-1)."""
        batches = range(self.wl.n_batches) if op.batch == -1 else (op.batch,)
        parts, xs = [], []
        for b in batches:
            p = (
                self._batches[b].pending.get(op.micro)
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
                    raise ScheduleError(
                        f"{op.label()}: runs tokens {t0}..{t1} of the expert, the gate routed {len(rows)}"
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
        h[s0:s1] = moe_output(
            h[s0:s1], p.slots[rows], p.weights[rows], shared, self.model.float32_combine
        )
        p.done[s0:s1] = True
        self._note_finite(step, p.layer, 1, bst_index(self._batches, bst), "MoE", h[s0:s1])

    def _note_finite(
        self, step: int, layer: int, order: int, batch: int, what: str, x: torch.Tensor
    ) -> None:
        """Record (without waiting for it) whether an op's output `x` is finite everywhere."""
        self._finite.append(((step, layer, order, batch, what), torch.isfinite(x).all()))

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
            + f" at step {step}, batch {batch} ({len(bad)} op output(s) affected); the checkpoint's weights "
            "hold NaN/inf or overflow their dtype: check or rewrite the checkpoint"
        )

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

    # ---- results ------------------------------------------------------------------------------
    def _output(self, schedule: Schedule) -> RunOutput:
        s, wl = self.model.spec, self.wl
        if self.peers is not None:
            self.peers.gather(self, schedule)
        self._check_finite()
        for b, bst in enumerate(self._batches):
            if bst.written != [wl.batch_size] * wl.gen_len:
                raise ScheduleError(
                    f"batch {b}: head ops covered {bst.written} sequences per step, expected "
                    f"{wl.batch_size} each"
                )
        tokens = torch.cat([b.tokens.cpu() for b in self._batches])  # [n*b, G]
        logits = torch.cat([b.logits.cpu() for b in self._batches if b.logits is not None])
        n_moe, k = len(s.moe_layers), s.top_k
        ids = np.zeros((wl.n_sequences, wl.seq_positions, n_moe, k), np.int16)
        ws = np.zeros(ids.shape, np.float32)
        for (step, moe, batch), (i, w) in self._used.items():
            seqs = slice(batch * wl.batch_size, (batch + 1) * wl.batch_size)
            n_pos = wl.step_tokens(step)
            first = 0 if step == 0 else wl.prompt_len + step - 1
            pos = slice(first, first + n_pos)
            ids[seqs, pos, moe] = i.view(wl.batch_size, n_pos, k).numpy()
            ws[seqs, pos, moe] = w.view(wl.batch_size, n_pos, k).float().numpy()
        desc = self._routing.description if self._routing is not None else "live (the model's gate)"
        return RunOutput(
            schedule,
            np.asarray(self._start),
            np.asarray(self._end),
            tokens,
            logits,
            Routing(ids, ws, s.n_experts, desc),
            self._fallbacks,
        )
