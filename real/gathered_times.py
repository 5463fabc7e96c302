"""The op times a G-process run gathers, made comparable with a one-process run's: each op starts
when its deps on other ranks ended and a transfer when its other end was posted (`from_ready`),
as the simulator and one process start them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core.schedule import Op, StreamSpec
from core.types import OpKind, Resource, Tier


def from_ready(
    ops: Sequence[Op], streams: Mapping[str, StreamSpec], start: list[float], end: list[float]
) -> None:
    """Move each op's recorded start (in place) to when it could begin. A rank takes another
    rank's ops as done at once (the op carrying their data honours the dep), so its op starts
    early and blocks: a receive posted before the sender sends, an expert waiting for the other
    ranks' gate parts. One process starts an op once all its deps are done, and the simulator
    runs a transfer from when both of its ends are ready, so here an op starts no earlier than
    its deps on other ranks end, and a transfer (dispatch, combine, replica copy) no earlier
    than its other end is posted; the wait before is idle time, as in a one-process run."""
    dev = [streams[op.stream].device for op in ops]
    for i, op in enumerate(ops):
        remote = [end[d] for d in op.deps if dev[d] != dev[i]]
        if remote and max(remote) > start[i]:
            start[i] = min(max(remote), end[i])
    posted = list(start)
    for i, others in transfer_partners(ops, streams).items():
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
