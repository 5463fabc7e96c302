"""The schedule IR: ops on streams with deps and memory effects, and its validator.

A planner emits ops through a `ScheduleBuilder` in program order; both executors run the result
with the same semantics (DESIGN.md): a stream is a FIFO; an op starts when its stream reaches it,
its deps are done and the memory it allocates is free; it frees memory when it ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import chain
from operator import is_not, itemgetter
from typing import Any, NamedTuple, TypeGuard, cast

import numpy as np

from core.ep_layout import EPLayout
from core.errors import CapacityError, ScheduleBug, ScheduleError, gb_apart
from core.types import ALSO_ON, COMPUTE_KINDS, LINK_OF, OpKind, Resource, Tensor, Tier

_ANY = -1  # "no layer / batch / expert" and "all batches of the group"
# a dep that names an op (not None): a C call, made per dep
_is_op = cast("Callable[[int | None], TypeGuard[int]]", partial(is_not, None))


class Op(NamedTuple):
    """One unit of work. A NamedTuple (immutable, like a frozen dataclass) because planners create
    hundreds of thousands of them and tuple construction is 4x cheaper."""

    id: int  # position in the schedule; deps always name smaller ids
    kind: OpKind
    stream: str  # logical stream name (a key of Schedule.streams)
    step: int = 0  # 0 = prefill, s >= 1 = decode step s
    layer: int = _ANY  # decoder layer
    batch: int = _ANY  # batch in the group; -1 = all batches (expert-wise compute)
    expert: int = _ANY  # routed expert id
    # micro-batch of the batch (two-batch overlap: each half of a batch's sequences runs its own
    # gate, all-to-all and experts); -1 = the whole batch
    micro: int = _ANY
    tensor: Tensor = Tensor.NONE  # what is moved / computed on
    nbytes: int = 0  # bytes moved (transfers)
    tokens: int = 0  # tokens computed (compute ops)
    flops: float = 0.0  # floating-point ops (compute ops)
    touch_bytes: int = 0  # bytes a compute op reads from its device memory (weights + KV)
    # thread blocks its kernels launch (a GEMM's output tiles); 0 = enough to fill the device.
    # Only a stream in a shared `pool` reads it: it caps the share of the SMs the op can use.
    width: int = 0
    src: Tier | None = None  # transfer source tier
    dst: Tier | None = None  # transfer destination tier
    alloc_tier: Tier | None = None  # memory taken when the op starts ...
    alloc_bytes: int = 0  # ... this many bytes
    free_tier: Tier | None = None  # memory released when the op ends ...
    free_bytes: int = 0  # ... this many bytes
    deps: tuple[int, ...] = ()  # ops that must be done before this one starts
    # consecutive batches a dense compute op covers: batch .. batch + batches - 1 (one attention
    # call over several batches of a group: their weights read once); 1 = the batch alone
    batches: int = 1

    def label(self) -> str:
        parts = [f"op {self.id} {self.kind}"]
        if self.tensor != Tensor.NONE:
            parts.append(str(self.tensor))
        for name in ("step", "layer", "batch", "micro", "expert"):
            v = getattr(self, name)
            if v != _ANY:
                parts.append(f"{name}={v}")
                if name == "batch" and self.batches > 1:
                    parts[-1] += f"..{v + self.batches - 1}"
        return " ".join(parts) + f" on {self.stream}"


# `new_op(Op, (id, kind, ...))`: an Op from all its fields in order, without binding keywords
new_op = tuple.__new__


@dataclass(frozen=True)
class StreamSpec:
    name: str
    resource: Resource  # the physical resource the stream's ops occupy
    device: int = 0  # which GPU (expert parallelism); 0 for single-device runs
    # The fraction of the device's compute rate and memory bandwidth the stream's ops get: 1, or
    # 1/G for one of G lanes that partition one GPU's SMs (CUDA green contexts, MPS). The per-op
    # overhead is not divided.
    share: float = 1.0
    # Streams naming the same pool share one GPU's SMs as plain CUDA streams do: their compute ops
    # run concurrently, each at most the share its `width` can fill, together at most the whole
    # GPU (processor sharing). The streams of one GPU link may form a pool too: their transfers
    # run concurrently, sharing its bandwidth evenly. "" = the stream holds its resource while an
    # op runs.
    pool: str = ""

    def __post_init__(self) -> None:
        assert 0 < self.share <= 1, f"stream {self.name}: share {self.share} outside (0, 1]"
        assert not self.pool or self.share == 1, f"stream {self.name}: a pool stream has share 1"

    @property
    def resource_id(self) -> str:
        """Resources are per device: 'gpu', 'gpu:1', 'h2d:1' ..."""
        return str(self.resource) if self.device == 0 else f"{self.resource}:{self.device}"


@dataclass
class Schedule:
    ops: list[Op]
    streams: dict[str, StreamSpec]
    capacity_bytes: dict[Tier, int]  # memory of each tier
    resident_bytes: dict[Tier, int]  # held for the whole run (weights placed there, KV cache)
    meta: dict[str, Any] = field(default_factory=dict)  # planner, params, n, placement, labels
    ep: EPLayout | None = None  # an expert-parallel schedule's device layout
    _columns: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ops)

    def resource_of(self, op: Op) -> str:
        return self.streams[op.stream].resource_id

    def columns(self) -> dict[str, np.ndarray]:
        """The ops as numpy columns (computed once): what the cost model, simulator, trace,
        metrics and validator read. `kind`, `stream`, `tensor` index `list(OpKind)`,
        `list(self.streams)`, `list(Tensor)`; tiers index `list(Tier)`, -1 = none; op i's deps
        are `dep_idx[dep_ptr[i]:dep_ptr[i + 1]]`, in its order."""
        cols = self._columns
        if cols is not None and len(cols["kind"]) == len(self.ops):
            return cols
        cols = _columns(self.ops, self.streams)
        self._columns = cols
        return cols


# ops per block of `_columns`' object array: its pointers bounded (6 MB), not a million ops'
_BLOCK = 1 << 15
# the numeric fields as their columns' dtypes: a float byte count is truncated, a unit whole
_UNITS = {"step", "layer", "batch", "micro", "expert", "batches"}  # (checked: 0.5 is refused)
_NUMERIC = {
    "id": np.int64,
    "nbytes": np.int64,
    "tokens": np.int64,
    "flops": np.float64,
    "touch_bytes": np.float64,
    "alloc_bytes": np.int64,
    "free_bytes": np.int64,
    "width": np.int64,
    "step": np.int32,
    "layer": np.int32,
    "batch": np.int32,
    "micro": np.int32,
    "expert": np.int32,
    "batches": np.int32,
}
_TIER_IDX: dict[Tier | None, int] = {None: -1, **{t: i for i, t in enumerate(Tier)}}
_CODED: dict[str, tuple[Mapping[Any, int], Any]] = {
    "kind": ({k: i for i, k in enumerate(OpKind)}, np.int16),
    "tensor": ({t: i for i, t in enumerate(Tensor)}, np.int16),
    **{name: (_TIER_IDX, np.int8) for name in ("src", "dst", "alloc_tier", "free_tier")},
}


class _Shapes(dict[tuple[Any, ...], int]):
    """An op's coded fields (`_CODED`'s, then its stream) -> a number for them, given as they
    are first met (a C-level lookup for every op after: one per op, not one per field);
    `codes` holds each number's codes, in `_CODED`'s order then the stream's index (-1: a
    stream not declared, which validate names). A value that is not its field's raises
    KeyError, as each field's lookup did."""

    def __init__(self, streams: Mapping[str, StreamSpec]) -> None:
        super().__init__()
        self.stream_idx = {s: i for i, s in enumerate(streams)}
        self.codes: list[int] = []

    def __missing__(self, key: tuple[Any, ...]) -> int:
        *fields, stream = key
        codes = [idx[v] for (idx, _), v in zip(_CODED.values(), fields, strict=True)]
        self.codes += (*codes, self.stream_idx.get(stream, -1))
        number = self[key] = len(self)
        return number


def _columns(ops: list[Op], streams: Mapping[str, StreamSpec]) -> dict[str, np.ndarray]:
    """`Schedule.columns`. A block of ops is read into one [ops, fields] object array in one
    C-level pass, and each numeric column cast from it (numpy's int() and float() of each value,
    as `fromiter` converts them): a Python-level pass per field took two to three times as long."""
    n, width = len(ops), len(Op._fields)
    at = {name: i for i, name in enumerate(Op._fields)}
    out = {name: np.empty(n, dt) for name, dt in _NUMERIC.items()}
    out |= {name: np.empty(n, dt) for name, (_, dt) in _CODED.items()}
    out["stream"] = np.empty(n, np.int16)
    shapes = _Shapes(streams)
    shape_of = itemgetter(*(at[name] for name in (*_CODED, "stream")))
    shape = np.empty(n, np.int64)
    n_deps = np.empty(n, np.int64)
    deps: list[np.ndarray] = []
    for a in range(0, n, _BLOCK):
        block = ops[a : a + _BLOCK]
        m = len(block)
        assert set(map(len, block)) <= {width}, "an op that is not all of an Op's fields"
        rows = np.fromiter(chain.from_iterable(block), object, m * width).reshape(m, width)
        for name, dt in _NUMERIC.items():
            try:  # a unit via its floats, whose int cast (NaN's warns: invalid) must equal them
                col = rows[:, at[name]].astype(np.float64 if name in _UNITS else dt)
                with np.errstate(invalid="ignore"):
                    out[name][a : a + m] = cast = col.astype(dt)
                if name in _UNITS and (cast != col).any():
                    raise ValueError(name)  # a unit of 0.5, NaN or 2**40: not its int
            except (TypeError, ValueError, OverflowError):  # a planner's None, a list, 10**20
                from core.schedule_units import not_a_number

                raise ScheduleBug(not_a_number(block, name, dt)) from None
        shape[a : a + m] = np.fromiter(map(shapes.__getitem__, map(shape_of, block)), np.int64, m)
        col = rows[:, at["deps"]]
        n_deps[a : a + m] = np.fromiter(map(len, col), np.int64, m)
        # ids < 2**31; counted, so that numpy allocates them once, not as they grow
        flat = chain.from_iterable(col)
        deps.append(np.fromiter(flat, np.int32, int(n_deps[a : a + m].sum())))
    codes = np.array(shapes.codes, np.int64).reshape(-1, len(_CODED) + 1)[shape]  # [ops, 8]
    for k, name in enumerate((*_CODED, "stream")):
        out[name][:] = codes[:, k]
    out["dep_ptr"] = np.r_[0, np.cumsum(n_deps)]
    out["dep_idx"] = np.concatenate(deps) if deps else np.zeros(0, np.int32)
    return out


class ScheduleBuilder:
    """Collects a planner's ops in program order and hands each to an optional sink.

    The sink lets the real executor start ops while the planner is still planning (live
    routing: the planner blocks in `CausalRouting.at_gate` until the gate has run).
    """

    def __init__(
        self,
        capacity_bytes: Mapping[Tier, int],
        sink: Callable[[Op], None] | None = None,
    ) -> None:
        self.ops: list[Op] = []
        self.streams: dict[str, StreamSpec] = {}
        self.capacity_bytes = dict(capacity_bytes)
        self.resident_bytes: dict[Tier, int] = {t: 0 for t in Tier}
        self.meta: dict[str, Any] = {}
        self.ep: EPLayout | None = None  # set by an expert-parallel planner before its first op
        self._sink = sink

    def stream(
        self, name: str, resource: Resource, device: int = 0, share: float = 1.0, pool: str = ""
    ) -> str:
        spec = StreamSpec(str(name), Resource(resource), device, float(share), pool)
        old = self.streams.setdefault(spec.name, spec)
        assert old == spec, f"stream {name} redefined"
        return spec.name

    def join_pool(self, name: str, pool: str) -> None:
        """Put stream `name`, defined but not used yet, into the shared `pool`."""
        assert not any(op.stream == name for op in self.ops), f"stream {name} already has ops"
        self.streams[name] = replace(self.streams[name], pool=pool)

    def reserve(self, tier: Tier, nbytes: int) -> None:
        """Hold memory for the whole run (resident weights, a KV cache kept on that tier)."""
        self.resident_bytes[tier] += int(nbytes)

    def add(
        self,
        kind: OpKind,
        stream: str,
        deps: Iterable[int | None] = (),
        *,
        step: Any = 0,
        layer: Any = _ANY,
        batch: Any = _ANY,
        expert: Any = _ANY,
        micro: Any = _ANY,
        tensor: Any = Tensor.NONE,
        nbytes: Any = 0,
        tokens: Any = 0,
        flops: Any = 0.0,
        touch_bytes: Any = 0,
        width: Any = 0,
        src: Any = None,
        dst: Any = None,
        alloc_tier: Any = None,
        alloc_bytes: Any = 0,
        free_tier: Any = None,
        free_bytes: Any = 0,
        batches: Any = 1,
    ) -> int:
        """Append an op (fields and defaults: `Op`'s, in its order: a test checks they agree;
        typed Any as planners pass memory effects as `dict[str, object]`).
        Built positionally, not through `Op(**fields)`: planners call this per op, and binding
        a dozen keywords twice was a sixth of planning's time."""
        ops = self.ops
        i = len(ops)
        op = new_op(
            Op,
            (
                i,
                kind,
                stream,
                step,
                layer,
                batch,
                expert,
                micro,
                tensor,
                nbytes,
                tokens,
                flops,
                touch_bytes,
                width,
                src,
                dst,
                alloc_tier,
                alloc_bytes,
                free_tier,
                free_bytes,
                tuple(filter(_is_op, deps)),
                batches,
            ),
        )
        ops.append(op)
        if self._sink is not None:
            self._sink(op)
        return i

    def append(self, fields: tuple[Any, ...]) -> int:
        """`add` for a planner's hottest op: `fields` are the Op's after `id`, in `Op`'s order,
        all of them (deps already op ids, no None; `batches` last). Tests check that an op
        appended equals the one `add` makes."""
        ops = self.ops
        i = len(ops)
        op = new_op(Op, (i, *fields))
        ops.append(op)
        if self._sink is not None:
            self._sink(op)
        return i

    def extend(self, ops: list[Op]) -> None:
        """Ops a planner built whole (`new_op`, for its hottest loop: one tuple per op), in
        order, their ids consecutive from `len(self.ops)`."""
        assert not ops or ops[0].id == len(self.ops), "ops' ids are their positions"
        self.ops += ops
        if self._sink is not None:
            for op in ops:
                self._sink(op)

    def build(self) -> Schedule:
        return Schedule(
            self.ops, self.streams, self.capacity_bytes, self.resident_bytes, self.meta, self.ep
        )


def validate(schedule: Schedule, check_finishes: bool = True) -> None:
    """Reject a schedule either executor could not run; raise naming the first bad op.

    `check_finishes=False` skips the zero-time run: the simulator detects a stuck schedule
    exactly as it runs it, so only the real executor (where a stall costs its timeout) needs it.

    Checks: ids and deps (deps point backwards, so no cycles), streams and resources fit the op
    kind, no single allocation exceeds a tier, every expert compute depends on its batch's gate
    (a micro-batch's: its own; planners are causal), an expert-parallel layout (`Schedule.ep`) uses
    only the links it has (lanes: d2d; G GPUs: p2p, p2p_out), and an instant-completion run of the
    streams finishes (no op waits forever for memory that only a later op frees) without freeing
    memory nothing holds.
    That run is one order of memory grants: with real durations another order can still leave
    every stream waiting (the simulator then stops, naming them), so it is a necessary check,
    not a proof that no timing deadlocks.
    """
    streams = schedule.streams
    _check_resident_and_pools(schedule)
    ops = schedule.ops
    cols = schedule.columns()
    owner = _check_ids_and_deps(ops, cols)
    first = _first_of_each_shape(ops, cols, streams)
    ep = schedule.ep
    if ep is not None:  # an expert-parallel layout: G lanes of one GPU, or G GPUs
        problem = _ep_problem(first.values(), streams, ep.lanes)
        if problem:
            raise ScheduleBug(problem)
    for ti, tier in enumerate(Tier):
        room = schedule.capacity_bytes[tier] - schedule.resident_bytes.get(tier, 0)
        over = np.flatnonzero((cols["alloc_tier"] == ti) & (cols["alloc_bytes"] > room))
        if len(over):
            op = ops[int(over[0])]
            wants, has = gb_apart(op.alloc_bytes, room)
            raise CapacityError(
                f"{op.label()}: allocates {wants} GB of {tier}, only {has} GB is not resident; "
                f"raise hardware.memory_gb.{tier}, or pass planner params that hold less"
            )
    from core.schedule_batches import check_gates, check_spans  # (it imports this module)

    check_spans(ops, cols)
    check_gates(schedule, cols, owner)
    if check_finishes:
        _check_finishes(schedule)


def _check_resident_and_pools(schedule: Schedule) -> None:
    """Resident memory fits each tier; the streams of one resource share one pool (or none)."""
    streams = schedule.streams
    for t in Tier:
        if schedule.resident_bytes.get(t, 0) > schedule.capacity_bytes[t]:
            held, has = gb_apart(schedule.resident_bytes[t], schedule.capacity_bytes[t])
            raise CapacityError(
                f"resident {t} memory {held} GB exceeds the {t} capacity {has} GB; raise "
                f"hardware.memory_gb.{t}, or pass planner params that keep less resident"
            )
    pools: dict[str, set[str]] = {}  # resource -> the pools of its streams ("" for none)
    for spec in streams.values():
        pools.setdefault(spec.resource_id, set()).add(spec.pool)
    mixed = next((r for r, p in pools.items() if len(p) > 1), None)
    if mixed:
        raise ScheduleBug(
            f"resource {mixed}: streams "
            f"{sorted(s.name for s in streams.values() if s.resource_id == mixed)} "
            f"mix pools {sorted(pools[mixed])} (a stream outside the pool would run beside its ops "
            "on the same SMs): put every stream of one GPU in one pool, or none"
        )


def _check_ids_and_deps(ops: list[Op], cols: dict[str, np.ndarray]) -> np.ndarray:
    """Each op's id is its position and its deps name earlier ops; returns, per dep, the op it
    belongs to."""
    n = len(ops)
    ids = cols["id"]
    ptr, deps = cols["dep_ptr"], cols["dep_idx"]
    owner = np.repeat(np.arange(n), np.diff(ptr))  # the op each dep belongs to
    bad = ids != np.arange(n)
    bad[owner[(deps < 0) | (deps >= owner)]] = True
    if bad.any():
        op = ops[int(np.argmax(bad))]
        if op.id != int(np.argmax(bad)):
            raise ScheduleBug(f"{op.label()}: id must equal its position {int(np.argmax(bad))}")
        raise ScheduleBug(f"{op.label()}: deps {op.deps} must name earlier ops")
    return owner


def _first_of_each_shape(
    ops: list[Op], cols: dict[str, np.ndarray], streams: Mapping[str, StreamSpec]
) -> dict[tuple[Any, ...], Op]:
    """Ops of one shape (kind, stream, tiers, memory effect) pass or fail together: check each
    shape once, at its first op, in op order, so the error names the first bad op. Returns each
    shape's first op (checked by the caller)."""
    no_tier = (cols["alloc_bytes"] < 0) | (cols["free_bytes"] < 0)
    no_tier |= (cols["alloc_bytes"] > 0) & (cols["alloc_tier"] < 0)
    no_tier |= (cols["free_bytes"] > 0) & (cols["free_tier"] < 0)
    n = len(ops)
    key = np.zeros(n, np.int64)
    for c, size in (
        (cols["kind"], len(OpKind)),
        (cols["stream"] + 1, len(streams) + 1),
        (cols["src"] + 1, len(Tier) + 1),
        (cols["dst"] + 1, len(Tier) + 1),
        (cols["alloc_tier"] + 1, len(Tier) + 1),
        (cols["free_tier"] + 1, len(Tier) + 1),
        (no_tier, 2),
    ):  # codes from -1 (none) up
        key = key * size + c.astype(np.int64)
    _, at = np.unique(key, return_index=True)
    first: dict[tuple[Any, ...], Op] = {}
    for i in np.sort(at).tolist():
        o = ops[i]
        shape = (o.kind, o.stream, o.src, o.dst, o.alloc_tier, o.free_tier, bool(no_tier[i]))
        first.setdefault(shape, o)
    for shape, op in first.items():
        problem = _shape_problem(shape, streams)
        if problem:
            raise ScheduleBug(f"{op.label()}: {problem}")
    return first


def _shape_problem(shape: tuple[Any, ...], streams: Mapping[str, StreamSpec]) -> str:
    kind, stream, src, dst, _, _, bad_memory = shape
    if stream not in streams:
        return f"stream {stream!r} is not declared"
    res = streams[stream].resource
    if kind in COMPUTE_KINDS and res not in (Resource.GPU, Resource.CPU):
        return f"compute op on {res}, needs gpu or cpu"
    if kind in (OpKind.LOAD, OpKind.KV_LOAD, OpKind.KV_STORE):
        if src is None or dst is None:
            return "transfer needs src and dst tiers"
        link = LINK_OF.get((src, dst))
        if link is None:
            hops = ", ".join(f"{a}->{b}" for a, b in LINK_OF)
            return f"no {src}->{dst} link; move it in hops over the links there are ({hops})"
        if link != res and res not in ALSO_ON.get((src, dst), ()):
            return f"{src}->{dst} runs on {link}, stream is on {res}"
    links = (Resource.P2P, Resource.P2P_OUT)
    if kind in (OpKind.DISPATCH, OpKind.COMBINE, OpKind.ALL_REDUCE) and res not in links:
        return f"{kind} moves tokens between GPUs: its stream must be on p2p or p2p_out, not {res}"
    if bad_memory:
        return "memory effect needs a tier and bytes >= 0"
    return ""


def _ep_problem(ops: Iterable[Op], streams: Mapping[str, StreamSpec], lanes: bool) -> str:
    """The first op (in op order) on a link its expert-parallel layout does not have: lanes
    share one GPU's memory (a replica copy runs on its copy path, d2d; no token leaves the GPU),
    G GPUs have no shared memory (a copy between them runs on p2p in and p2p_out out). The IR
    names lanes and GPUs alike (`gpu:d`), so only the layout (`Schedule.ep`) tells them apart."""
    wrong = {Resource.P2P, Resource.P2P_OUT} if lanes else {Resource.D2D}
    bad = min(
        (o for o in ops if streams[o.stream].resource in wrong), key=lambda o: o.id, default=None
    )
    if bad is None:
        return ""
    res = streams[bad.stream].resource
    if lanes:
        return (
            f"{bad.label()}: on {res}, but the layout is lanes of one GPU (Schedule.ep.lanes), "
            "whose memory they share: a replica copy runs on d2d, and no tokens move"
        )
    return (
        f"{bad.label()}: on d2d (a copy within one GPU), but the layout is G GPUs "
        "(Schedule.ep.lanes false): a copy between GPUs runs on p2p in and p2p_out out"
    )


def _check_finishes(schedule: Schedule) -> None:
    """Run streams with zero-duration ops in rounds, as time would order them: in each round
    the head of every stream whose deps finished in an earlier round asks for its memory, in
    op order (an op waiting on a dependency is later than one that is not, whatever the streams'
    order); if no head can move while ops remain, name them."""
    queues: dict[str, deque[Op]] = {name: deque() for name in schedule.streams}
    for op in schedule.ops:
        queues[op.stream].append(op)
    room = {t: schedule.capacity_bytes[t] - schedule.resident_bytes.get(t, 0) for t in Tier}
    free = dict(room)
    done = bytearray(len(schedule.ops))
    remaining = len(schedule.ops)
    while remaining:
        heads = sorted(
            (q[0] for q in queues.values() if q and all(done[d] for d in q[0].deps)),
            key=lambda o: o.id,
        )
        ran = []
        for op in heads:
            if op.alloc_bytes and free[op.alloc_tier] < op.alloc_bytes:  # type: ignore[index]
                continue  # waits for a free of this round or a later one
            if op.alloc_bytes:
                free[op.alloc_tier] -= op.alloc_bytes  # type: ignore[index]
            if op.free_bytes:
                free[op.free_tier] += op.free_bytes  # type: ignore[index]
                if free[op.free_tier] > room[op.free_tier]:  # type: ignore[index]
                    raise ScheduleBug(
                        f"{op.label()}: frees {op.free_bytes} B of {op.free_tier} that no "
                        f"earlier op allocated (freed twice, or before its allocation)"
                    )
            queues[op.stream].popleft()
            ran.append(op.id)
        if not ran:
            raise stuck_error(schedule, done, free, "schedule can never finish")
        for i in ran:  # done at the round's end: their successors start in the next
            done[i] = 1
        remaining -= len(ran)


def stuck_error(
    schedule: Schedule, done: bytearray | list[bool], free: Mapping[Tier, int], what: str
) -> ScheduleError:
    """`what: <each blocked stream's head and what it waits for>`. Where a head waits for memory
    its tier lacks, the user's config can fix it (a larger tier); where every head waits only on
    other ops, the planner ordered them so (a ScheduleBug)."""
    short = sorted({str(op.alloc_tier) for op in _stuck_heads(schedule, done) if _short(op, free)})
    line = f"{what}: {describe_stuck(schedule, done, free)}"
    if not short:
        return ScheduleBug(line)
    tiers = " or ".join(f"hardware.memory_gb.{t}" for t in short)
    return ScheduleError(f"{line}; raise {tiers}, or pass planner params that hold less")


def _stuck_heads(schedule: Schedule, done: bytearray | list[bool]) -> list[Op]:
    """The first op not done of each stream."""
    heads: dict[str, Op] = {}
    for op in schedule.ops:
        if not done[op.id] and op.stream not in heads:
            heads[op.stream] = op
    return list(heads.values())


def _short(op: Op, free: Mapping[Tier, int]) -> bool:
    """`op` waits for memory its tier does not have free."""
    return (
        bool(op.alloc_bytes) and op.alloc_tier is not None and free[op.alloc_tier] < op.alloc_bytes
    )


def describe_stuck(
    schedule: Schedule, done: bytearray | list[bool], free: Mapping[Tier, int]
) -> str:
    """Name the op at the head of each blocked stream and what it waits for."""
    parts = []
    for op in _stuck_heads(schedule, done):
        waits = [f"op {d}" for d in op.deps if not done[d]]
        if _short(op, free):
            tier = op.alloc_tier
            assert tier is not None
            waits.append(f"{op.alloc_bytes} B of {tier} ({free[tier]} B free)")
        parts.append(f"{op.label()} waits for {', '.join(waits) or 'its stream'}")
    return "; ".join(parts)
