"""DeepSeek EPLB's placement algorithm (github deepseek-ai/EPLB, `rebalance_experts`) in numpy.

From a load matrix W [L, E] (tokens per logical expert per MoE layer) it decides how many copies
of each expert to make and which GPU holds each copy, so that the busiest GPU is as light as
possible under a fixed number of physical slots. Re-implemented from the description in
`../shared/reference/replication.md` §2.1 (hierarchical and global policies); no code copied.

Usage:
    phy2log, log2phy, logcnt = rebalance_experts(
        weight, num_replicas=80, num_groups=1, num_nodes=1, num_gpus=8
    )
    # phy2log [L, R]: logical expert in physical slot s; slot s lives on GPU s // (R / num_gpus)
"""

from __future__ import annotations

import numpy as np

from core.errors import ConfigError


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack the items of each row onto `num_packs` packs of equal cardinality (greedy LPT).

    weight [n, m] (m divisible by num_packs). Heaviest item first, onto the lightest pack that
    still has room; ties go to the lower pack index. One item a pack: the identity (nothing to
    balance, and moving items would only cost copies). Returns pack index and rank in pack, [n, m].
    """
    n, m = weight.shape
    per_pack = m // num_packs
    if per_pack == 1:  # one item a pack: item i stays on pack i, as DeepSeek's returns it
        return np.tile(np.arange(m, dtype=np.int64), (n, 1)), np.zeros((n, m), dtype=np.int64)
    pack = np.zeros((n, m), dtype=np.int64)
    rank = np.zeros((n, m), dtype=np.int64)
    for i in range(n):
        load = np.zeros(num_packs)
        items = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[i], kind="stable"):
            open_ = np.flatnonzero(items < per_pack)
            p = int(open_[np.argmin(load[open_])])
            pack[i, item], rank[i, item] = p, items[p]
            load[p] += weight[i, item]
            items[p] += 1
    return pack, rank


def replicate_experts(
    weight: np.ndarray, num_phy: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One copy of each logical expert, then each extra copy to the largest per-copy load.

    weight [n, num_log]. Returns phy2log [n, num_phy], replica rank [n, num_phy],
    logcnt [n, num_log].
    """
    n, num_log = weight.shape
    rows = np.arange(n)
    phy2log = np.tile(np.arange(num_phy), (n, 1))
    rank = np.zeros((n, num_phy), dtype=np.int64)
    logcnt = np.ones((n, num_log), dtype=np.int64)
    for s in range(num_log, num_phy):
        hot = np.argmax(weight / logcnt, axis=1)  # [n]; ties: lowest expert id
        phy2log[:, s] = hot
        rank[:, s] = logcnt[rows, hot]
        logcnt[rows, hot] += 1
    return phy2log, rank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups -> nodes (LPT), copies within each node (greedy), copies -> GPUs of the node (LPT).

    Returns phy2log [L, num_phy], replica rank [L, num_phy], logcnt [L, E].
    """
    n_layers, num_log = weight.shape
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    # 1. whole groups onto nodes; "mlog" numbers logical experts node by node
    group_load = weight.reshape(n_layers, num_groups, group_size).sum(-1)  # [L, groups]
    g_pack, g_rank = balanced_packing(group_load, num_nodes)
    first = (g_pack * groups_per_node + g_rank) * group_size  # [L, groups] first mlog of each group
    log2mlog = (first[:, :, None] + np.arange(group_size)).reshape(n_layers, num_log)
    mlog2log = _inverse(log2mlog)
    # 2. replicas inside each node: rows are (layer, node)
    mlog_load = np.take_along_axis(weight, mlog2log, -1).reshape(-1, num_log // num_nodes)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)
    # 3. copies onto the node's GPUs, each copy weighing load / copies
    copy_load = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, -1)
    pack, rank = balanced_packing(copy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(pack * phy_per_gpu + rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    offsets = np.arange(0, num_log, num_log // num_nodes)[
        None, :, None
    ]  # node-local -> global mlog
    pphy2mlog = (pphy2mlog.reshape(n_layers, num_nodes, -1) + offsets).reshape(n_layers, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, -1)
    phy_rank = np.take_along_axis(phy_rank, pphy2phy, -1).reshape(n_layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(n_layers, -1), log2mlog, -1)
    return phy2log, phy_rank, logcnt


def check_args(
    shape: tuple[int, ...], num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """Raise ConfigError, one line, for a load matrix or layout EPLB cannot place."""
    if len(shape) != 2 or shape[1] < 1:
        raise ConfigError(
            f"eplb: load matrix must be [layers, experts], got shape {shape}; pass one "
            "of that shape"
        )
    e = shape[1]
    if num_gpus < 1 or num_gpus > e:
        raise ConfigError(
            f"eplb: num_gpus={num_gpus} must be in [1, {e}] (the number of experts); pass one in it"
        )
    if num_replicas < e or num_replicas % num_gpus:
        raise ConfigError(
            f"eplb: num_replicas={num_replicas} physical slots must be >= {e} experts and a "
            f"multiple of num_gpus={num_gpus}; pass such a multiple"
        )
    if num_groups < 1 or num_nodes < 1:
        raise ConfigError(
            f"eplb: num_groups={num_groups} and num_nodes={num_nodes} must be >= 1; pass 1 or more"
        )
    if num_gpus % num_nodes:  # nodes of equal GPUs, whichever policy runs
        raise ConfigError(
            f"eplb: num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes}): each "
            "node holds the same number of GPUs; pass a num_nodes that divides num_gpus"
        )
    if num_groups % num_nodes:  # DeepSeek's global policy: one group, one node; nothing to divide
        return
    if e % num_groups:  # the hierarchical policy's
        raise ConfigError(
            f"eplb: need experts ({e}) divisible by num_groups ({num_groups}) and num_gpus "
            f"({num_gpus}) divisible by num_nodes ({num_nodes}); pass a num_groups that divides "
            f"{e}"
        )


def rebalance_experts(
    weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EPLB's entry point: hierarchical when groups divide evenly over nodes, else global.

    weight [L, E]; returns phy2log [L, R], log2phy [L, E, max copies] (-1 padded), logcnt [L, E].
    """
    weight = np.asarray(weight, dtype=np.float64)
    check_args(weight.shape, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:  # global policy: one group, one node
        phy2log, rank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    n_layers, e = weight.shape
    log2phy = np.full((n_layers, e, int(logcnt.max())), -1, dtype=np.int64)
    layer = np.repeat(np.arange(n_layers), num_replicas)
    log2phy[layer, phy2log.ravel(), rank.ravel()] = np.tile(np.arange(num_replicas), n_layers)
    return phy2log, log2phy, logcnt


def gpu_loads(
    weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int
) -> np.ndarray:
    """[L, num_gpus] load of each GPU when every expert's load splits evenly over its copies."""
    per_copy = np.take_along_axis(weight / logcnt, phy2log, -1)  # [L, R]
    return per_copy.reshape(weight.shape[0], num_gpus, -1).sum(-1)
