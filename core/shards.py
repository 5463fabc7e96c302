"""How tensor-parallel dense work cuts a model over G devices, for the planner that counts its
bytes (planners.ep.dense) and the real run that cuts them (real.tensor_parallel, real.model):
contiguous shards of heads, FFN columns and vocabulary, and the GQA kv heads a shard of query
heads reads.

Usage:
    lo, hi = shard(n_heads, world, rank)
    kv_lo, kv_hi = kv_shard(n_heads, n_kv_heads, (lo, hi))
"""

from __future__ import annotations


def shard(n: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's contiguous [lo, hi) of n items: n // G each, the first n % G ranks one more."""
    lo = rank * (n // world) + min(rank, n % world)
    return lo, lo + n // world + (rank < n % world)


def kv_shard(n_heads: int, n_kv_heads: int, heads: tuple[int, int]) -> tuple[int, int]:
    """The GQA key/value heads [lo, hi) that query heads `heads` read: whole groups' kv heads, or
    the one kv head of a group the shard holds part of (a kv head replicated over shards)."""
    lo, hi = heads
    rep = n_heads // n_kv_heads
    kv_lo, kv_hi = lo // rep, -(-hi // rep)
    assert (lo % rep == 0 and hi % rep == 0) or kv_hi - kv_lo == 1, (
        f"heads [{lo}, {hi}) split a group of {rep} and span more than one"
    )
    return kv_lo, kv_hi
