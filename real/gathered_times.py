"""What a G-process run gathers at its end (`gather_ranks`): every rank's op times, tokens and
logits; the times made comparable with a one-process run's: each op starts when its deps on
other ranks ended and a transfer when its other end was posted (`from_ready`), as the simulator
and one process start them."""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from core.schedule import Op, Schedule, StreamSpec
from core.types import OpKind, Resource, Tier

if TYPE_CHECKING:
    from real.distributed import Peers
    from real.executor import Executor


def from_ready(
    ops: Sequence[Op], streams: Mapping[str, StreamSpec], start: list[float], end: list[float]
) -> None:
    """Move each op's recorded start (in place) to when it could begin. A rank takes another
    rank's ops as done at once (the op carrying their data honours the dep), so its op starts
    early and blocks: a receive posted before the sender sends, an expert waiting for the other
    ranks' gate parts. One process starts an op once all its deps are done, and the simulator
    runs a transfer from when both of its ends are ready, so here an op starts no earlier than
    its deps on other ranks end, and a transfer (dispatch, combine, replica copy) no earlier
    than its other end is posted; the wait before is idle time, as in a one-process run.
    A send is over once its data arrived: it ends no later than its other ends, the receives
    (a sending rank's call may return later, and a receiver's next op, which depends on the
    send, would seem to run before its dep ended: a critical path longer than the run)."""
    partners = transfer_partners(ops, streams)
    for i, others in partners.items():
        if streams[ops[i].stream].resource == Resource.P2P_OUT:
            end[i] = max(start[i], min(end[i], max(end[p] for p in others)))
    dev = [streams[op.stream].device for op in ops]
    for i, op in enumerate(ops):
        remote = [end[d] for d in op.deps if dev[d] != dev[i]]
        if remote and max(remote) > start[i]:
            start[i] = min(max(remote), end[i])
    posted = list(start)
    for i, others in partners.items():
        begin = min(posted[p] for p in others)
        if begin > start[i]:
            start[i] = min(begin, end[i])


def transfer_partners(ops: Sequence[Op], streams: Mapping[str, StreamSpec]) -> dict[int, list[int]]:
    """Each transfer op's other ends on other devices: a dispatch or combine's ops of the same
    (step, layer, batch, micro) in the other direction (`p2p` in, `p2p_out` out); a replica
    copy's one partner (its op on the destination is emitted just before the source's)."""
    ends: dict[tuple[object, ...], list[int]] = {}
    out: dict[int, list[int]] = {}
    for op in ops:
        res = streams[op.stream].resource
        if op.kind in (OpKind.DISPATCH, OpKind.COMBINE):
            key = (op.kind, op.step, op.layer, op.batch, op.micro, res == Resource.P2P_OUT)
            ends.setdefault(key, []).append(op.id)
        elif op.kind == OpKind.LOAD and (op.src, op.dst) == (Tier.GPU, Tier.GPU):
            out[op.id] = [op.id + 1 if res == Resource.P2P else op.id - 1]
    for (*key, sending), ids in ends.items():
        other = ends.get((*key, not sending), [])
        for i in ids:
            d = streams[ops[i].stream].device
            partners = [p for p in other if streams[ops[p].stream].device != d]
            if partners:
                out[i] = partners
    return out


def gather_ranks(peers: Peers, ex: Executor, schedule: Schedule) -> None:
    """Every rank's op times, tokens and logits, merged on every rank (after the run). Times
    go on one clock (`clock_shifts`); each op's start is then when it could begin
    (`from_ready`), as the simulator and a one-process run have it."""
    peers._drain()
    specs = schedule.streams
    own = [i for i, op in enumerate(ex._ops) if peers.runs(specs[op.stream])]
    mine = dict(
        host=socket.gethostname(),
        t0=ex._t0,
        ops=own,
        start=[ex._start[i] for i in own],
        end=[ex._end[i] for i in own],
        batches=[
            (
                b.tokens.cpu(),
                None if b.logits is None else b.logits.cpu(),
                list(b.written),
                _head_rows(peers, ex, specs, i),
            )
            for i, b in enumerate(ex._batches)
        ],
        used={k: (i.cpu(), w.cpu()) for k, (i, w) in ex._used.items()},
        overflow=ex._overflow_seen(),  # Switch in float16: decided over every rank's sequences
    )
    everyone: list[Any] = [None] * peers.world
    try:
        dist.all_gather_object(everyone, mine)
    except RuntimeError as e:
        raise peers.lost(None, e, "at the run's end") from None
    ex._overflow_ranks = merged_overflow([got["overflow"] for got in everyone])
    one_host = len({got["host"] for got in everyone}) == 1
    shifts = clock_shifts([got["t0"] for got in everyone], one_host)
    for got, shift in zip(everyone, shifts, strict=True):
        for i, s0, e0 in zip(got["ops"], got["start"], got["end"], strict=True):
            ex._start[i], ex._end[i] = s0 + shift, e0 + shift
    for r, got in enumerate(everyone):
        if r == peers.rank or peers.tensor:  # dense=tensor: every rank has every sequence's
            continue
        for bst, (tokens, logits, written, rows) in zip(ex._batches, got["batches"], strict=True):
            if not rows.any():
                continue
            bst.tokens[rows] = tokens[rows].to(bst.tokens.device)
            if bst.logits is None:
                bst.logits = torch.zeros(peers.wl.batch_size, logits.shape[1], dtype=logits.dtype)
            bst.logits[rows] = logits[rows].to(bst.logits.device)
            bst.written = [a + b for a, b in zip(bst.written, written, strict=True)]
        for k, v in got["used"].items():
            ex._used.setdefault(k, v)
    from_ready(ex._ops, specs, ex._start, ex._end)


def clock_shifts(t0s: Sequence[float], one_host: bool) -> list[float]:
    """What to add to each rank's op times (from its own start `t0`) to put them on the clock
    of the rank that started first, from its start: ranks of one host share the monotonic
    clock and leave the barrier a little apart (on rank 0's clock, a rank that left it first
    ran ops before 0, busy time outside the makespan); across hosts each counts from the
    common barrier."""
    first = min(t0s)
    return [t0 - first if one_host else 0.0 for t0 in t0s]


def _head_rows(
    peers: Peers, ex: Executor, specs: Mapping[str, StreamSpec], batch: int
) -> torch.Tensor:
    """[b] bool: the batch's sequences this rank's head ops generated."""
    rows = torch.zeros(peers.wl.batch_size, dtype=torch.bool)
    for op in ex._ops:
        if op.kind == OpKind.HEAD and op.batch == batch and peers.runs(specs[op.stream]):
            s0, s1 = ex._range[op.id]
            rows[s0:s1] = True
    return rows


def merged_overflow(
    ranks: list[dict[tuple[int, int, int], list[bool]]],
) -> dict[tuple[int, int, int], list[bool]]:
    """Every rank's Switch float16 flags (`Executor._overflow_seen`) as one run's: per (step,
    layer, residual add), did any rank's op overflow, did any keep a value near the max."""
    merged: dict[tuple[int, int, int], list[bool]] = {}
    for seen in ranks:
        for key, flags in seen.items():
            merged[key] = [a or b for a, b in zip(merged.get(key, flags), flags, strict=True)]
    return merged
