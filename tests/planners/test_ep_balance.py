"""The token split over an expert's copies (even, balanced) and the balance metrics
(balancedness, utilisation, GPU load, phases), on hand-worked examples."""

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from core.balance import balance_metrics
from core.errors import ConfigError
from core.types import OpKind, Tensor
from experiments.common.pipeline import simulate_run
from planners.expert_parallel import (
    balanced_split,
    predicted_tokens,
    split_tokens,
    times_held,
)
from tests.planners.ep_common import _timer, tiny_spec


def test_split_tokens_even_over_copies():
    """Expert 0 has copies on device 0 (first) and device 1: its 5 tokens split 3 + 2."""
    slots = np.array([[0, 1], [2, 0]])
    out = split_tokens(slots, np.array([5, 2, 3]))
    assert out.tolist() == [[3, 2, 0], [2, 0, 3]]


def test_split_tokens_even_turns_the_remainder_with_the_expert():
    """Experts 0 and 1 each on devices 0 and 1, 3 tokens each: expert 0's extra token goes to its
    first copy, expert 1's to its second, so the devices get 3 and 3 (the first copy always
    taking it gave device 0 four and device 1 two)."""
    slots = np.array([[0, 1, 2], [1, 0, 3]])
    out = split_tokens(slots, np.array([3, 3, 0, 0]))
    assert out.tolist() == [[2, 1, 0, 0], [1, 2, 0, 0]]


def test_split_tokens_balanced_over_holders():
    """Device 0 holds experts 0 and 1, device 1 experts 2 and 0; tokens [5, 4, 1]. Evenly, expert
    0 splits 3 + 2: loads 7 and 3. Balanced, it fills the lighter device first, to a common level:
    1 + 4, loads 5 and 5. Whole tokens, each expert's count kept."""
    slots = np.array([[0, 1], [2, 0]])
    assert split_tokens(slots, np.array([5, 4, 1])).sum(1).tolist() == [7, 3]
    out = split_tokens(slots, np.array([5, 4, 1]), "balanced")
    assert out.tolist() == [[1, 4, 0], [4, 0, 1]]
    # 4 tokens over 3 holders at equal loads: 4/3 each, rounded 2 + 1 + 1 (lower device first)
    three = np.array([[0], [0], [0]])
    assert split_tokens(three, np.array([4]), "balanced")[:, 0].tolist() == [2, 1, 1]
    # the tokens left after rounding down go to the device holding fewest so far, not each
    # expert's lowest device: experts 0-3 on both devices, 1 token each -> 2 and 2 (not 4 and 0)
    both = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    assert split_tokens(both, np.array([1, 1, 1, 1]), "balanced").sum(1).tolist() == [2, 2]
    mixed = np.array([[0, 2, -1, 1, 0], [1, 3, 1, -1, 2]])
    assert split_tokens(mixed, np.array([1, 2, 1, 2]), "balanced").sum(1).tolist() == [3, 3]


def min_max_load(slots: np.ndarray, load: np.ndarray) -> float:
    """The smallest busiest-device load any split of load [E] over its holders in slots [G, K]
    allows: the most, over sets S of devices, of the load of the experts held only inside S
    divided by |S| (Hall's condition; exact, and exponential in G)."""
    g = slots.shape[0]
    hold = times_held(slots, len(load)) > 0
    best = 0.0
    for mask in range(1, 1 << g):
        inside = np.array([(mask >> d) & 1 for d in range(g)], dtype=bool)
        only = hold.any(0) & ~hold[~inside].any(0)
        best = max(best, float(load[only].sum()) / int(inside.sum()))
    return best


def test_balanced_split_reaches_the_smallest_busiest_load():
    """On random placements (homes plus random replicas, some slots empty, some ids twice on a
    device) the balanced split's busiest device is within its tolerance of the least any split
    allows (`min_max_load`, Hall's bound, exact), never above the even split's, and the whole
    tokens keep every expert's count, on devices holding it, within a token of the fractions."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        g = int(rng.integers(2, 6))
        e = int(rng.integers(g, 3 * g))
        homes = -(-e // g)
        slots = np.full((g, homes + int(rng.integers(1, 4))), -1)
        for x in range(e):
            slots[x % g, x // g] = x
        slots[:, homes:] = rng.integers(-1, e, size=(g, slots.shape[1] - homes))
        load = rng.integers(0, 50, size=e)
        frac = balanced_split(slots, load.astype(float))
        assert np.allclose(frac.sum(0), load)
        assert frac.sum(1).max() <= min_max_load(slots, load.astype(float)) + 1e-2
        assert frac.sum(1).max() <= predicted_tokens(slots, load.astype(float)).sum(1).max() + 1e-9
        whole = split_tokens(slots, load, "balanced")
        assert (whole.sum(0) == load).all() and (whole >= 0).all()
        assert not whole[times_held(slots, e) == 0].any() and np.abs(whole - frac).max() < 1


def test_min_max_load_by_hand():
    """Experts 0 (6) and 1 (2) only on device 0, expert 2 (4) on both: device 0 alone must take
    8, so 8 is the least busiest load, whatever expert 2 does; with expert 0 on both, 6."""
    assert min_max_load(np.array([[0, 1, 2], [2, -1, -1]]), np.array([6.0, 2, 4])) == 8.0
    assert min_max_load(np.array([[0, 1, 2], [2, 0, -1]]), np.array([6.0, 2, 4])) == 6.0


def test_balanced_dispatch_in_the_simulator():
    """dispatch=balanced: the expert ops carry balanced_split's tokens, so the same eplb
    placement is at least as balanced as under the even split; the gate's model uses the same
    rule (ExpertTime.dispatch), and the run's meta records it."""
    even = simulate_run(tiny_spec("eplb", replica_slots=1))
    bal = simulate_run(tiny_spec("eplb", replica_slots=1, dispatch="balanced"))
    assert bal.schedule.ep.dispatch == "balanced"
    assert even.schedule.ep.dispatch == "even"
    assert bal.summary["balancedness"] >= even.summary["balancedness"]
    # the gate's model: device 0 holds experts 0 and 1, device 1 experts 2 and 0
    slots, load = np.array([[0, 1], [2, 0]]), np.array([5.0, 4, 1])
    timer = replace(_timer(), dispatch="balanced")
    assert timer.device_times(slots, load).tolist() == [5.0, 5.0]
    assert _timer().device_times(slots, load).tolist() == [6.5, 3.5]
    with pytest.raises(
        ConfigError, match="planner.params.dispatch='greedy' unknown; valid: even, balanced"
    ):
        simulate_run(tiny_spec("eplb", dispatch="greedy"))


def test_gpu_load_of_shared_lanes_counts_kernels_not_launches():
    """Two lanes of one GPU sharing its SMs: lane 0's op spans [0, 3] s with a 1 s launch (its
    kernel runs [1, 3]), lane 1's [0, 2] with a 0.5 s launch ([0.5, 2]): a kernel runs in
    [0.5, 3], so GPUtil's load is 2.5 / 3; without launch_s both ops count from 0 (load 1)."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 2,
            "resource": ["gpu", "gpu:1"],
            "stream": ["lane0", "lane1"],
            "step": [0, 0],
            "layer": [1, 1],
            "batch": [0, 0],
            "tokens": [4, 4],
            "start_s": [0.0, 0.0],
            "end_s": [3.0, 2.0],
            "sm_s": [1.0, 0.5],
            "launch_s": [1.0, 0.5],
        }
    )
    assert balance_metrics(trace, 2, lanes=True)["gpu_load"] == pytest.approx(2.5 / 3)
    assert balance_metrics(trace.drop(columns="launch_s"), 2, lanes=True)["gpu_load"] == 1.0


def test_balance_metrics_hand_worked():
    """One layer, 2 devices: device 0 runs 30 tokens in [0, 3] s, device 1 10 tokens in [0, 1] s.
    balancedness = mean 20 / max 30; utilisation = (3 + 1) / (2 x 3)."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 2,
            "resource": ["gpu", "gpu:1"],
            "step": [0, 0],
            "layer": [1, 1],
            "batch": [0, 0],
            "tokens": [30, 10],
            "start_s": [0.0, 0.0],
            "end_s": [3.0, 1.0],
        }
    )
    m = balance_metrics(trace, 2)
    assert m["balancedness"] == pytest.approx(2 / 3)
    assert m["utilisation"] == pytest.approx(4 / 6)
    assert m["device_busy_frac"] == pytest.approx([1.0, 1 / 3], abs=1e-4)


def test_phases_give_each_layer_and_batch_its_own_row():
    """Two phases on 2 devices. Layer 1: 30 and 10 tokens in [0, 3] and [0, 1] s: balancedness
    20 / 30, util (3 + 1) / (2 x 3). Layer 2: device 1 alone, 8 tokens in [4, 6] s: device 0 has
    0 tokens, balancedness 4 / 8, util 2 / (2 x 2)."""
    from core.balance import phases

    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 3,
            "resource": ["gpu", "gpu:1", "gpu:1"],
            "step": [0, 0, 0],
            "layer": [1, 1, 2],
            "batch": [0, 0, 0],
            "tokens": [30, 10, 8],
            "start_s": [0.0, 0.0, 4.0],
            "end_s": [3.0, 1.0, 6.0],
        }
    )
    t = phases(trace, 2).set_index("layer")
    assert t.loc[1, ["tokens_0", "tokens_1", "max_tokens", "mean_tokens"]].tolist() == [
        30,
        10,
        30,
        20,
    ]
    assert t.loc[2, ["tokens_0", "tokens_1"]].tolist() == [0, 8]
    assert t["balancedness"].tolist() == pytest.approx([2 / 3, 1 / 2])
    assert t["span_s"].tolist() == pytest.approx([3.0, 2.0])
    assert t["phase_util"].tolist() == pytest.approx([4 / 6, 2 / 4])


def test_utilisation_is_busy_over_makespan_and_phase_util_is_separate():
    """Device 0: expert [0, 3] s then attention [3, 4] s; device 1: expert [0, 1] s. Makespan 4 s:
    utilisation = (4 + 1) / (2 x 4) = 5/8; expert phase [0, 3]: phase util = (3 + 1) / (2 x 3)."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)],
            "resource": ["gpu", "gpu:1", "gpu"],
            "step": [0, 0, 0],
            "layer": [1, 1, 2],
            "batch": [0, 0, 0],
            "tokens": [30, 10, 40],
            "start_s": [0.0, 0.0, 3.0],
            "end_s": [3.0, 1.0, 4.0],
        }
    )
    m = balance_metrics(trace, 2)
    assert m["utilisation"] == pytest.approx(5 / 8)
    assert m["expert_phase_util"] == pytest.approx(4 / 6)
    assert m["device_busy_frac"] == pytest.approx([1.0, 0.25], abs=1e-4)


def test_on_lanes_a_whole_gpu_op_keeps_every_lane_busy():
    """Lanes (2 partitions of one GPU): expert [0, 3] s on lane 0, [0, 1] s on lane 1, then
    attention [3, 4] s on the whole GPU (stream `compute`). Utilisation = (3 + 1 + 1 + 1) / (2 x 4);
    as 2 GPUs (the attention on GPU 0 alone) it is (3 + 1 + 1) / (2 x 4)."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 2 + [str(OpKind.ATTENTION)],
            "resource": ["gpu", "gpu:1", "gpu"],
            "stream": ["lane0", "lane1", "compute"],
            "step": [0, 0, 0],
            "layer": [1, 1, 2],
            "batch": [0, 0, 0],
            "tokens": [30, 10, 40],
            "start_s": [0.0, 0.0, 3.0],
            "end_s": [3.0, 1.0, 4.0],
        }
    )
    assert balance_metrics(trace, 2, lanes=True)["utilisation"] == pytest.approx(6 / 8)
    assert balance_metrics(trace, 2, lanes=True)["device_busy_frac"] == pytest.approx([1.0, 0.5])
    assert balance_metrics(trace, 2)["utilisation"] == pytest.approx(5 / 8)


def test_gpu_load_is_the_time_some_kernel_runs_per_gpu():
    """GPUtil's load. Lanes: one GPU, some kernel runs in [0, 3.5] and [4, 5] of 5 s (lane 0
    [0, 3], lane 1 [0, 1] and [2.5, 3.5], whole GPU [4, 5]): 4.5 / 5, while the lanes' mean busy
    time is (3 + 1 + 1 + 1 + 1) / (2 x 5) = 0.7. As 2 GPUs: GPU 0 busy 4 of 5 s, GPU 1 2 of 5:
    load 0.6, the same as utilisation."""
    trace = pd.DataFrame(
        {
            "kind": [str(OpKind.EXPERT)] * 3 + [str(OpKind.ATTENTION)],
            "resource": ["gpu", "gpu:1", "gpu:1", "gpu"],
            "stream": ["lane0", "lane1", "lane1", "compute"],
            "step": [0] * 4,
            "layer": [1, 1, 3, 2],
            "batch": [0] * 4,
            "tokens": [30, 10, 10, 40],
            "start_s": [0.0, 0.0, 2.5, 4.0],
            "end_s": [3.0, 1.0, 3.5, 5.0],
        }
    )
    lanes = balance_metrics(trace, 2, lanes=True)
    assert lanes["gpu_load"] == pytest.approx(4.5 / 5)
    assert lanes["utilisation"] == pytest.approx(0.7)
    gpus = balance_metrics(trace, 2)
    assert gpus["gpu_load"] == pytest.approx(0.6) == gpus["utilisation"]
    # GPU 1 receives tokens over its link in [1, 2] (a dispatch kernel) and gets a replica copy
    # in [3.5, 5] (the copy engine): load (4 + 3) / 10, utilisation unchanged
    moves = pd.DataFrame(
        {
            "kind": [str(OpKind.DISPATCH), str(OpKind.LOAD)],
            "resource": ["p2p:1", "p2p:1"],
            "stream": ["dispatch1", "replicas1"],
            "step": [0, 0],
            "layer": [1, 1],
            "batch": [0, 0],
            "tokens": [10, 0],
            "start_s": [1.0, 3.5],
            "end_s": [2.0, 5.0],
        }
    )
    both = pd.concat(
        [trace, moves.assign(tensor=[str(Tensor.HIDDEN), str(Tensor.EXPERT)])], ignore_index=True
    )
    gpus = balance_metrics(both, 2)
    assert gpus["gpu_load"] == pytest.approx(0.7) and gpus["utilisation"] == pytest.approx(0.6)
    # moved by NCCL's p2p kernels instead (gpu.copy_sms): the copy is load too, (4 + 4.5) / 10
    nccl = balance_metrics(both, 2, copy_kernels=True)
    assert nccl["gpu_load"] == pytest.approx(0.85) and nccl["utilisation"] == pytest.approx(0.6)
