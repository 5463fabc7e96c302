"""EPLB's algorithm (planners/eplb_algo.py) against hand-worked and README examples."""

import numpy as np
import pytest

from core.errors import ConfigError
from planners.eplb_algo import balanced_packing, gpu_loads, rebalance_experts, replicate_experts


def test_replicate_gives_copies_to_largest_per_copy_load():
    """Loads [10, 1, 1, 1], 6 slots: 10/1 -> 2 copies (5 each) -> 3 copies (3.33 each)."""
    phy2log, rank, cnt = replicate_experts(np.array([[10.0, 1, 1, 1]]), 6)
    assert cnt.tolist() == [[3, 1, 1, 1]]
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 0]]
    assert rank.tolist() == [[0, 0, 0, 0, 1, 2]]


def test_packing_is_cardinality_constrained_lpt():
    """Items [5, 4, 3, 3, 1, 0] on 2 packs of 3: 5->p0, 4->p1, 3->p1 (7), 3->p0 (8), 1->p1 (8),
    0 -> p0 (p1 is full)."""
    pack, rank = balanced_packing(np.array([[5.0, 4, 3, 3, 1, 0]]), 2)
    assert pack.tolist() == [[0, 1, 1, 0, 1, 0]]
    assert rank.tolist() == [[0, 0, 1, 1, 2, 2]]


def test_one_item_a_pack_stays_in_place():
    """As DeepSeek's: with one item a pack nothing is balanced by moving, so item i stays on pack
    i (before, the heaviest went to pack 0, and every re-placement moved experts between GPUs)."""
    pack, rank = balanced_packing(np.array([[1.0, 4, 2, 3]]), 4)
    assert pack.tolist() == [[0, 1, 2, 3]] and rank.tolist() == [[0, 0, 0, 0]]
    phy2log, _, _ = rebalance_experts(np.array([[1.0, 4, 2, 3]]), 4, 1, 1, 4)
    assert phy2log.tolist() == [[0, 1, 2, 3]]


def test_global_policy_hand_worked():
    """[10, 1, 1, 1], 6 slots on 2 GPUs: copies 3.33 x3 and 1 x3; LPT: gpu0 = 3.33 + 3.33 + 1,
    gpu1 = 3.33 + 1 + 1."""
    phy2log, log2phy, cnt = rebalance_experts(np.array([[10.0, 1, 1, 1]]), 6, 1, 1, 2)
    loads = gpu_loads(np.array([[10.0, 1, 1, 1]]), phy2log, cnt, 2)
    np.testing.assert_allclose(loads, [[10 / 3 * 2 + 1, 10 / 3 + 2]])
    assert sorted(log2phy[0, 0].tolist()) == sorted(np.flatnonzero(phy2log[0] == 0).tolist())
    assert (log2phy[0, 1:, 1:] == -1).all()


def test_readme_example_hierarchical():
    """DeepSeek EPLB README: 2 layers, 12 experts, 4 groups, 2 nodes, 8 GPUs, 16 slots. The README's
    phy2log, and layer 0's per-GPU loads as worked out in replication.md §2.1
    (max/mean 1.21, 1.24)."""
    w = np.array(
        [
            [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
        ],
        dtype=float,
    )
    phy2log, _, cnt = rebalance_experts(w, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    loads = gpu_loads(w, phy2log, cnt, 8)
    np.testing.assert_allclose(loads[0], [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152])
    np.testing.assert_allclose(loads.max(1) / loads.mean(1), [1.208, 1.242], atol=1e-3)
    assert (cnt.sum(1) == 16).all()


@pytest.mark.parametrize(
    "shape, args, match",
    [
        ((12,), (16, 4, 2, 8), "load matrix"),  # 1-d load
        ((2, 12), (14, 4, 2, 8), "multiple"),  # slots not a multiple of GPUs
        ((2, 12), (8, 4, 2, 8), ">= 12"),  # fewer slots than experts
        ((2, 12), (16, 5, 1, 8), "divisible"),  # experts not divisible by groups
        ((2, 12), (16, 4, 4, 2), "divisible"),  # GPUs not divisible by nodes
        ((2, 12), (16, 0, 1, 8), "num_groups=0"),
        ((2, 4), (16, 1, 1, 8), "num_gpus=8"),  # more GPUs than experts
        ((2, 8), (8, 1, 3, 2), "divisible by num_nodes"),  # 2 GPUs on 3 nodes, any policy
    ],
)
def test_bad_input_is_one_config_error(shape, args, match):
    with pytest.raises(ConfigError, match=match):
        rebalance_experts(np.ones(shape), *args)


def test_groups_that_do_not_split_over_nodes_take_the_global_policy():
    """As DeepSeek's rebalance_experts: where num_groups % num_nodes != 0 the global policy runs
    (one group, one node), which needs neither divisibility (it was refused)."""
    w = np.arange(1.0, 9.0)[None]
    got = rebalance_experts(w, 12, 3, 2, 4)
    want = rebalance_experts(w, 12, 1, 1, 4)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
