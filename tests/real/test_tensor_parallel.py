"""The rendezvous of tensor-parallel rounds in one process (real/tensor_parallel.py): what each
device gets back, and that a failed run never leaves a device waiting. The rounds inside whole
runs: test_executor.py and test_distributed.py (`test_tensor_parallel_dense_*`)."""

import threading
from itertools import pairwise

import pytest
import torch

from real.interpreter import _Stop
from real.tensor_parallel import ThreadCollective, _ordered_sum, _padded, shard


def run_devices(world: int, body) -> list:
    """body(device) on `world` threads at once -> their results, in device order."""
    out: list = [None] * world

    def one(d: int) -> None:
        out[d] = body(d)

    threads = [threading.Thread(target=one, args=(d,)) for d in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    return out


def test_a_reduce_scatter_then_all_gather_is_the_sum_on_every_device():
    """3 devices, 10 numbers each (padded to 12, chunks of 4): device d's reduce-scatter is
    chunk d of the sum, and the all-gather gives every device the whole sum, the same bits;
    the rounds are dropped once every device has its result."""
    world, g = 3, torch.Generator().manual_seed(0)
    parts = [torch.randn(10, generator=g) for _ in range(world)]
    group = ThreadCollective(world, lambda: False, lambda: None)

    def device(d: int) -> torch.Tensor:
        chunks = list(_padded(parts[d], world).chunk(world))
        mine = group.all_to_all(7, d, chunks, _ordered_sum)
        assert mine.shape == (4,)
        return group.all_gather(8, d, mine, torch.cat)[:10]

    got = run_devices(world, device)
    want = parts[0] + parts[1] + parts[2]
    for whole in got:
        assert torch.equal(whole, got[0])
        torch.testing.assert_close(whole, want)
    assert not group._rounds


def test_a_failed_run_stops_a_device_waiting_at_a_round():
    """Device 1 never comes: device 0 waits until the run has failed, then stops (no hang)."""
    failed = threading.Event()
    group = ThreadCollective(2, failed.is_set, lambda: None)
    threading.Timer(0.2, failed.set).start()
    with pytest.raises(_Stop):
        group.all_gather(0, 0, torch.zeros(2), torch.cat)


@pytest.mark.parametrize("n, world", [(8, 2), (7, 3), (2, 4)])
def test_shards_cover_every_item_once(n, world):
    spans = [shard(n, world, r) for r in range(world)]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in pairwise(spans))
    assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1
