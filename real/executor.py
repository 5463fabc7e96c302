"""The real executor: runs a planner's schedule on the real model with real tiered weights.

Two parts: the interpreter (`real.interpreter`: a worker thread per stream, deps, memory, resource
locks, the clock; semantics as in DESIGN.md and sim/) and the op semantics (`real.ops`: what each
op does to weights and activations). This class holds a run's state and wires the two: it feeds
the interpreter a replayed schedule, or a live planner's ops as they are emitted.

An expert-parallel schedule's G devices run in this one process, or as G processes (one rank
each, `peers`: real/distributed.py), each running its own device's ops with the same op code.

Usage:
    ex = Executor(store, model, workload, prompts)            # prompts [n*bs, P]
    out = ex.run_replay(schedule, routing)                    # gate forced to `routing`
    out = ex.run_live(plan, capacity_bytes, resident)         # model's own gate, planner fed live
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.ep_layout import EPLayout
from core.errors import MoepipeError, ScheduleBug
from core.routing import CausalRouting, GateView, Routing
from core.schedule import Op, Schedule, ScheduleBuilder, StreamSpec
from core.spec import Workload
from core.types import OpKind, Tensor, Tier
from real.checkpoint import Unit
from real.interpreter import Interpreter, _Stop, cache_freed_memory, cpu_compute_threads
from real.model import KVCache, Model
from real.ops import OpSemantics
from real.state import (
    RunOutput,
    _BatchState,
    _Pending,
    host_kv_layers,
    resident_units,
    unit_of,
)
from real.store import TieredStore
from real.tensor_parallel import TensorParallel, tensor_parallel

if TYPE_CHECKING:
    from real.distributed import Peers

# the names this module has always offered (real/distributed.py, experiments/, tests/)
__all__ = [
    "Executor",
    "PlanFn",
    "RunOutput",
    "_Pending",
    "_Stop",
    "cpu_compute_threads",
    "resident_units",
    "unit_of",
]

PlanFn = Callable[[CausalRouting, ScheduleBuilder], None]  # runs a planner into a builder

# a live run reveals a gate's routing only once the gate has run: a planner that peeks ahead
LIVE_ORACLE = (
    "looks at routing before its gate (an oracle), which executor.routing_mode=live cannot give "
    "it; pass executor.routing_mode=replay"
)


class Executor(OpSemantics):
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
                f"[{wl.n_sequences}, {wl.prompt_len}] (n_batches*batch_size, prompt_len); "
                "pass prompts of that shape"
            )
        self.store, self.model, self.wl = store, model, wl
        self.prompts = prompts.long()
        self.device = store.device
        self.cuda = self.device.type == "cuda"
        self.stall_timeout_s = stall_timeout_s
        self.peers = peers
        if not self.cuda:  # before any kernel: it sets what oneDNN reads at its first
            cache_freed_memory()
        # Torch intra-op threads per worker on a CPU device (None on CUDA: kernels run on the GPU).
        self.compute_threads = None if self.cuda else (compute_threads or cpu_compute_threads())

    # ---- entry points -----------------------------------------------------------------------
    def run_replay(self, schedule: Schedule, routing: Routing) -> RunOutput:
        """Run a finished schedule with every gate forced to `routing`'s experts and weights."""
        self._reset(schedule.capacity_bytes, schedule.resident_bytes, routing)
        self._schedule = schedule
        self._kv_layers = host_kv_layers(schedule.ops)
        self._preload(self._own(resident_units(schedule), schedule.ep))
        for op in schedule.ops:
            self._add_op(op, schedule.streams[op.stream])
        self._interp.finish_adding()
        self._execute()
        return self._output(schedule)

    def run_timing(self, schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
        """Run a schedule for its op times only (calibration: ops that compute no tokens)."""
        self._reset(schedule.capacity_bytes, schedule.resident_bytes, None)
        self._schedule = schedule
        for op in schedule.ops:
            self._add_op(op, schedule.streams[op.stream])
        self._interp.finish_adding()
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
        causal = self._live_routing()
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
                self._interp.finish_adding()

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

    def _live_routing(self) -> CausalRouting:
        """The routing a live planner sees: a gate's view once that gate op has really run."""
        holder: dict[str, CausalRouting] = {}

        def seen(key: tuple[int, ...]) -> GateView:
            revealed = (
                holder["causal"].revealed if len(key) == 3 else holder["causal"].micro_revealed
            )
            if key not in revealed:
                raise MoepipeError(f"this planner {LIVE_ORACLE}")
            with self._cv:
                self._wait(lambda: key in self._views)
                return self._views[key]

        def source(step: int, moe_idx: int, batch: int) -> GateView:
            return seen((step, moe_idx, batch))

        def micro_source(step: int, moe_idx: int, batch: int, micro: int) -> GateView:
            return seen((step, moe_idx, batch, micro))

        s = self.model.spec
        causal = CausalRouting(source, s.n_experts, s.top_k, micro_source=micro_source)
        holder["causal"] = causal
        return causal

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

        def reserves() -> Mapping[Tier, int]:
            # live: the builder's reserves are all made before its first op
            return resident if resident is not None else self._builder.resident_bytes

        self._interp = Interpreter(
            self._run_op,
            self._release,
            self.device,
            capacity,
            reserves,
            self.stall_timeout_s,
            self.compute_threads,
        )
        self._routing = routing
        self._schedule: Schedule | None = None
        # (step, moe, batch) -> its routing; (step, moe, batch, micro) -> a micro-batch's
        self._views: dict[tuple[int, ...], GateView] = {}
        self._used: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # (step, moe, batch) -> (ids, weights) of its micro-batches gated so far
        self._micro_parts: dict[tuple[int, int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._dev_refs: dict[Unit, int] = {}
        self._host_refs: dict[Unit, int] = {}
        self._refs_lock = threading.Lock()
        # units' copies a free is evicting, and the condition a load of one waits on (`_hold`)
        self._evicting: set[tuple[Unit, Tier]] = set()
        self._evicted = threading.Condition(self._refs_lock)
        self._resident: dict[Unit, dict[str, torch.Tensor]] = {}
        self._host_resident: set[Unit] = set()
        self._fallbacks = 0
        # (step, layer, order, batch, what) -> a device bool: were that op's outputs finite?
        # Read once at the end (`_check_finite`), so checking costs no synchronisation.
        self._finite: list[tuple[tuple[int, int, int, int, str], torch.Tensor]] = []
        # Switch in float16: (step, layer, order), did an op's residual sum overflow, did its
        # output keep a value within 1000 of the max (`_check_overflow`, read at the end too)
        self._overflow: list[tuple[tuple[int, int, int], torch.Tensor, torch.Tensor]] = []
        self._overflow_ranks: dict[tuple[int, int, int], list[bool]] | None = None  # every rank's
        self._scratch: dict[str, torch.Tensor] = {}
        # batch -> the layers whose KV the schedule keeps in host memory (None: unknown before
        # the run, as for a live planner: every layer)
        self._kv_layers: dict[int, frozenset[int]] | None = None
        self._retired: list[torch.Tensor] = []  # outgrown scratch buffers, kept to the run's end
        self._cursor: dict[tuple[object, ...], int] = {}
        self.tp: TensorParallel | None = None  # dense=tensor's, made at the schedule's first op
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
        # the host copies the device-resident units came through: slabs of their own sizes that
        # no later read reuses, and memory beyond the host tier's that the schedule counts
        st.slabs.release_idle()

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
        if op.id == 0:
            self.tp = tensor_parallel(self, self._ep_of_run())
        self._note_range(op, spec)
        # another rank runs it or not; a dep on another rank's op is honoured by the transfer op
        # that brings its data (`real.distributed`)
        self._interp.add(op, spec, local=self.peers is None or self.peers.runs(spec))

    def _note_range(self, op: Op, spec: StreamSpec) -> None:
        """Which share of its batch an op works on, from the ops of its kind emitted before it:
        sequences [s0, s1) for a dense op, a chunk of the expert's tokens for an expert op. A
        micro-batch's dense op, or a tensor-parallel one: its GPU's part of the batch
        (`EPLayout.micro_seqs`), whatever came before."""
        if op.batch < 0:
            return
        dense = op.kind in (OpKind.ATTENTION, OpKind.GATE, OpKind.FFN, OpKind.HEAD)
        if dense and (op.micro >= 0 or self.tp is not None):
            # tensor-parallel: every device the same sequences, on its weights' share
            ep = self._ep_meta()
            self._range[op.id] = ep.micro_seqs(self.wl.batch_size, spec.device, op.micro)
            return
        if dense:
            per = 1 if op.kind == OpKind.HEAD else self.wl.step_tokens(op.step)
            # an attention over several batches covers each of them whole
            n = op.tokens // per // op.batches if op.tokens else self.wl.batch_size
            key: tuple[object, ...] = (op.kind, op.step, op.layer, op.batch)
        elif op.kind == OpKind.EXPERT:
            n, key = op.tokens, (op.kind, op.step, op.layer, op.batch, op.micro, op.expert)
        else:
            return
        first = self._cursor.get(key, 0)
        self._cursor[key] = first + n
        self._range[op.id] = (first, first + n)

    def _ep_of_run(self) -> EPLayout | None:
        """The expert-parallel layout of the run under way (a live planner sets its layout
        before its first op), or None."""
        return self._schedule.ep if self._schedule is not None else self._builder.ep

    def _execute(self) -> None:
        """Run every op queued (and, live, those the planner still emits) to the end."""
        peers = self.peers
        self._interp.execute(None if peers is None else lambda: peers.start(self))

    def _stream_specs(self) -> dict[str, StreamSpec]:
        if self._schedule is not None:
            return self._schedule.streams
        return self._builder.streams

    # ---- the interpreter's state, as the op code and `real.distributed.Peers` read it ---------
    @property
    def _cv(self) -> threading.Condition:
        return self._interp.cv

    @property
    def _ops(self) -> list[Op]:
        return self._interp.ops

    @property
    def _planner_done(self) -> bool:
        return self._interp.planner_done

    @property
    def _error(self) -> BaseException | None:
        return self._interp.error

    @property
    def _t0(self) -> float:
        return self._interp.t0

    @property
    def _start(self) -> list[float]:
        return self._interp.start_s

    @property
    def _end(self) -> list[float]:
        return self._interp.end_s

    def _fail(self, e: BaseException) -> None:
        self._interp.fail(e)

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Wait (holding `self._cv`) until ready(); raise _Stop if another thread failed."""
        self._interp.wait(ready)

    # ---- results ------------------------------------------------------------------------------
    def _output(self, schedule: Schedule) -> RunOutput:
        s, wl = self.model.spec, self.wl
        if self.peers is not None:
            self.peers.gather(self, schedule)
        self._check_finite()
        self._check_overflow()
        for b, bst in enumerate(self._batches):
            if bst.written != [wl.batch_size] * wl.gen_len:
                raise ScheduleBug(
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
        given = self._routing
        desc = given.description if given is not None else "live (the model's gate)"
        fields = dict(given.fields) if given is not None else {"source": "live"}
        return RunOutput(
            schedule,
            np.asarray(self._start),
            np.asarray(self._end),
            tokens,
            logits,
            Routing(ids, ws, s.n_experts, desc, fields=fields),
            self._fallbacks,
        )
