"""How a batch's routed tokens split over the expert-parallel devices that hold each expert:
the one rule the planners model and every rank of a real run applies (`split_tokens`), so the
simulator and `real/distributed.py` agree on it without `real` importing `planners`.

    split_tokens(slots, counts, "even")   # [G, E] whole tokens per device and expert
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.types import Dense, Dispatch

DENSE = tuple(Dense)  # dense work over G GPUs: each its sequences, or every sequence's 1/G
DISPATCH = tuple(Dispatch)  # a replicated expert's tokens: even over copies, or water-filled


def micro_batch_seqs(
    batch_size: int, n_devices: int, micro_batches: int, device: int, micro: int
) -> tuple[int, int]:
    """Sequences [s0, s1) of a batch that GPU `device` holds in micro-batch `micro` (two-batch
    overlap): its contiguous data-parallel share (the first `batch_size % G` GPUs one more),
    split in `micro_batches` contiguous parts (the first `share % parts` one more), as SGLang's
    ranks each split their own; `micro` -1: the whole share. The planner and the real executor
    both cut micro-batches by this."""

    base, extra = divmod(batch_size, n_devices)  # the first `extra` GPUs hold one more
    s0 = device * base + min(device, extra)  # closed form: a sum over G GPUs, called G times
    n = base + (device < extra)
    if micro < 0:
        return s0, s0 + n
    parts = [n // micro_batches + (i < n % micro_batches) for i in range(micro_batches)]
    s0 += sum(parts[:micro])
    return s0, s0 + parts[micro]


def micro_batch_rows(
    batch_size: int, n_devices: int, micro_batches: int, micro: int, per: int
) -> np.ndarray:
    """The rows of a batch's routing ([T, k], `per` tokens a sequence) micro-batch `micro`
    holds, GPU by GPU (`micro_batch_seqs`): ascending."""
    spans = [
        micro_batch_seqs(batch_size, n_devices, micro_batches, d, micro) for d in range(n_devices)
    ]
    return np.concatenate([np.arange(s0 * per, s1 * per) for s0, s1 in spans])


def times_held(slots: np.ndarray, n_experts: int) -> np.ndarray:
    """[G, E] how many copies of expert e device d holds in slots [G, K] (-1: an empty slot)."""
    g = slots.shape[0]
    cells = (np.arange(g)[:, None] * (n_experts + 1) + slots + 1).ravel()  # column 0: empty
    return np.bincount(cells, minlength=g * (n_experts + 1)).reshape(g, n_experts + 1)[:, 1:]


def balanced_split(slots: np.ndarray, load: np.ndarray, tol: float = 1e-3) -> np.ndarray:
    """[G, E] tokens per device and expert (fractional) when each replicated expert's load [E]
    goes to the devices holding it in slots [G, K] so that the device loads are as even as the
    placement allows. Experts held by one device stay there; each replicated one, hottest first,
    is water-filled over its holders given every other expert's tokens (the level its holders
    rise to together), again and again until no expert's split moves by `tol` tokens (at most 200
    rounds): block coordinate descent on the sum of squared device loads, a convex objective
    whose minimum over these splits is also the smallest busiest-device load.
    Measured against that least load: within 0.003 tokens on random and chained placements up to
    G = 8; on long chains of experts shared by neighbouring devices it converges slowly (0.3%
    above at G = 24, 2% at G = 64). A device holding an expert twice holds it once here.
    Deterministic: every rank of a real run derives the same split from the same counts."""
    e = len(load)
    hold = times_held(slots, e) > 0  # [G, E]
    copies = hold.sum(0)
    if (copies[load > 0] == 0).any():
        missing = np.flatnonzero((copies == 0) & (load > 0)).tolist()
        raise AssertionError(f"experts {missing} have tokens but no copy on any device")
    out = np.where(hold, load / np.maximum(copies, 1), 0.0)  # start from the even split
    multi = [int(x) for x in np.argsort(-load, kind="stable") if copies[x] > 1 and load[x] > 0]
    if not multi:
        return out
    dev = out.sum(1).tolist()  # python floats: a few holders per expert, loops beat numpy here
    who = {x: np.flatnonzero(hold[:, x]).tolist() for x in multi}
    split = {x: [float(load[x]) / len(who[x])] * len(who[x]) for x in multi}
    for _ in range(200):  # a bound the tolerance reaches first (a few passes in practice)
        moved = 0.0
        for x in multi:
            hs, old = who[x], split[x]
            base = [dev[h] - t for h, t in zip(hs, old, strict=True)]
            new = water_fill_level(base, float(load[x]))
            for i, h in enumerate(hs):
                dev[h] = base[i] + new[i]
                moved = max(moved, abs(new[i] - old[i]))
            split[x] = new
        if moved < tol:
            break
    for x in multi:
        out[who[x], x] = split[x]
    return out


def water_fill_level(base: list[float], amount: float) -> list[float]:
    """How much of `amount` each bin takes when it fills bins at loads `base` from the lowest up,
    to one common level: [max(0, level - b)]."""
    order = sorted(range(len(base)), key=base.__getitem__)
    filled, level = 0.0, 0.0
    for k, i in enumerate(order, 1):
        filled += base[i]
        level = (amount + filled) / k
        if k == len(order) or level <= base[order[k]]:
            break
    return [max(0.0, level - b) for b in base]


def whole_tokens(share: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """share [G, E] fractional tokens whose columns sum to counts [E] -> [G, E] whole tokens with
    the same column sums, each within a token of its share: every share rounded down, then each
    token left (hottest expert first) to the device with a remainder for that expert that holds
    the fewest tokens so far (then the largest remainder, then the lower device), so the +1s of
    several experts do not pile onto one device."""
    out = np.floor(share + 1e-9).astype(np.int64)
    left = counts - out.sum(0)  # [E], 0 <= left < holders
    rem = share - out
    load = out.sum(1)
    for x in sorted(np.flatnonzero(left > 0).tolist(), key=lambda x: (-int(counts[x]), x)):
        cand = np.flatnonzero(rem[:, x] > 1e-9)
        if len(cand) < left[x]:  # float dust: any device with a share of it
            cand = np.flatnonzero(share[:, x] > 0)
        for _ in range(int(left[x])):
            d = int(cand[np.lexsort((cand, -rem[cand, x], load[cand]))[0]])
            out[d, x] += 1
            load[d] += 1
            cand = cand[cand != d]
    return out


def split_tokens(
    slots: np.ndarray, counts: np.ndarray, dispatch: str = Dispatch.EVEN
) -> np.ndarray:
    """[G, E] tokens each device computes per expert: an expert's tokens split evenly over its
    copies, or (dispatch="balanced") `balanced_split` rounded to whole tokens. Evenly, copy i
    (in device order) of expert e takes one token more where (i + e) % copies < count % copies:
    the remainder starts at a copy that turns with the expert, so no device always takes it.

    slots [G, K] expert ids (-1 empty), counts [E] tokens per expert.
    """
    if dispatch == Dispatch.BALANCED:
        return whole_tokens(balanced_split(slots, counts), counts)
    g, e = slots.shape[0], len(counts)
    dev = np.repeat(np.arange(g), slots.shape[1])
    ids = slots.ravel()
    keep = ids >= 0
    dev, ids = dev[keep], ids[keep]
    copies = np.bincount(ids, minlength=e)  # [E]
    if (copies[counts > 0] == 0).any():
        missing = np.flatnonzero((copies == 0) & (counts > 0)).tolist()
        raise AssertionError(f"experts {missing} have tokens but no copy on any device")
    order = np.argsort(ids, kind="stable")
    rank = np.empty_like(ids)
    rank[order] = np.arange(len(ids)) - np.searchsorted(
        ids[order], ids[order]
    )  # copy index of each slot
    share = counts[ids] // copies[ids] + ((rank + ids) % copies[ids] < counts[ids] % copies[ids])
    out = np.zeros((g, e), dtype=np.int64)
    np.add.at(out, (dev, ids), share)
    return out


def source_counts(ids: np.ndarray, rows: list[int], n_experts: int) -> np.ndarray:
    """[G, E] pairs per expert of each device's tokens: ids [T, k] of a batch in sequence order,
    device d holding the next `rows[d]` tokens (its contiguous share of the sequences)."""
    assert sum(rows) == len(ids), (rows, ids.shape)
    owner = np.repeat(np.arange(len(rows)), rows)  # [T] device holding each token
    cells = owner[:, None] * n_experts + ids.astype(np.int64)
    return np.bincount(cells.ravel(), minlength=len(rows) * n_experts).reshape(len(rows), n_experts)


def traffic(tokens: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """[G, G] pairs device s's tokens send to device d for d's experts (the diagonal: pairs that
    stay home), given tokens [G, E] each device computes per expert (`split_tokens`) and sources
    [G, E] each device's tokens route to each expert (`source_counts`).

    Expert e's pairs in (token, slot) order come from the devices in order (each holds a
    contiguous share of the sequences) and are cut into one run per device holding e, in device
    order, as long as `tokens` says: the rule `real.distributed.destinations` sends by. So s
    sends d the overlap of s's run and d's."""
    assert (tokens.sum(0) == sources.sum(0)).all(), "tokens and sources count different pairs"
    g, e = tokens.shape
    # Each expert's runs as bounds on one line, expert e's shifted past expert e-1's (by `span`
    # each): the pieces between the merged bounds of both cuts each lie in one source's run and
    # one destination's. O(G E log) where the overlap of every pair was a [G, G, E] array (10^10
    # cells, the machine's memory, at 2,000 devices of 5,000 experts).
    zero = np.zeros((1, e), dtype=np.int64)
    src = np.concatenate([zero, np.cumsum(sources, 0, dtype=np.int64)])  # [G + 1, E]
    dst = np.concatenate([zero, np.cumsum(tokens, 0, dtype=np.int64)])
    span = int(src[-1].max(initial=0)) + 1
    shift = np.arange(e, dtype=np.int64) * span  # [E]
    src_line, dst_line = (src + shift).T.ravel(), (dst + shift).T.ravel()  # [E * (G + 1)] sorted
    bounds = np.union1d(src_line, dst_line)
    lo, hi = bounds[:-1], bounds[1:]
    inside = lo // span == hi // span  # not the gap between one expert's end and the next's
    lo, size = lo[inside], (hi - lo)[inside]
    s = (np.searchsorted(src_line, lo, side="right") - 1) % (g + 1)  # the run holding lo
    d = (np.searchsorted(dst_line, lo, side="right") - 1) % (g + 1)
    pairs = np.bincount(s * g + d, weights=size, minlength=g * g)
    return np.rint(pairs).astype(np.int64).reshape(g, g)


def copies_sent(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """[G] how many of `copy_moves(old, new)` each device sends, from slots [G, K] (-1 empty)
    without listing them (the replica gate's inner loop): the copies of expert e are the
    devices that hold it after and not before, all sent from the source `copy_moves` picks."""
    g = old.shape[0]
    e = int(max(old.max(initial=-1), new.max(initial=-1))) + 1
    before, after = times_held(old, e) > 0, times_held(new, e) > 0
    copies = (after & ~before).sum(0)  # [E]
    keep = before & after
    held = np.asarray(before.any(0))  # [E]
    assert held[copies > 0].all(), "an expert has no copy on any device before the move"
    src = np.where(keep.any(0), keep.argmax(0), before.argmax(0))  # the first keeper, else holder
    return np.bincount(src, weights=copies, minlength=g).astype(np.int64)


def copy_moves(
    old: Sequence[Sequence[int]], new: Sequence[Sequence[int]]
) -> list[tuple[int, int, int]]:
    """(expert, source device, destination device) of every copy that takes one MoE layer's
    holdings from old[d] to new[d] (expert ids; -1, an empty slot, ignored), sorted: the order
    every rank of a real run runs them in, so each send meets its receive. The source is a device
    that holds the expert before and after, where one does (it keeps the expert anyway), else the
    lowest that held it. A second slot of an expert a device holds needs no copy."""
    before = [{int(e) for e in x if e >= 0} for x in old]
    after = [{int(e) for e in x if e >= 0} for x in new]
    out = []
    for dst, want in enumerate(after):
        for e in sorted(want - before[dst]):
            holders = [r for r, held in enumerate(before) if e in held]
            assert holders, f"expert {e} has no copy on any device before the move"
            keep = [r for r in holders if e in after[r]]
            out.append((e, (keep or holders)[0], dst))
    return sorted(out)
