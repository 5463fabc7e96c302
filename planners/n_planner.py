"""Klotski's constraint-sensitive planner for n, the batches per group (paper §7, Eqs. 4-7).

Times come from the cost model (decode step at mid-generation context); routing statistics
(per-layer expert popularity of a warm-up routing) give the hot experts' tokens and the expected
number of cold experts len(Q) a group of n*bs tokens activates. The smallest n meeting (4)-(7)
in every streamed MoE layer is chosen (for experts on disk also the disk's pace, which the paper's
inequalities, written for experts in CPU memory, leave out), then checked against memory: an n that
does not fit is lowered to the largest that does (what the paper did by hand for 8x22B on Env 1),
and the summary says so.

Usage:
    choice = solve_n(model, hardware, workload, CostModel(hardware), popularity, hot_k=2)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from core.activations import activation_bytes
from core.cost import CostModel
from core.errors import CapacityError, fix_words, without_fix
from core.hardware import HardwareSpec
from core.spec import ModelSpec, Workload
from core.types import OpKind, Resource, Tier
from planners.placement import Placement, klotski_placement

log = logging.getLogger(__name__)

N_MAX = 256  # beyond this the paper asks for manual adjustment
INEQUALITIES = (
    "(4) gate loaded",
    "(5) hot experts loaded",
    "(6) first cold expert loaded",
    "(7) next attention ready",
    "disk read-ahead keeps pace",
)


@dataclass(frozen=True)
class LayerTimes:
    """Seconds, from the cost model, for one decode step (per batch where marked)."""

    attention_s: float  # t_cA, one batch
    gate_s: float  # t_cG, one batch
    io_attention_s: float  # t_IO_A (0 when attention weights are resident)
    io_gate_s: float  # t_IO_G
    io_expert_s: float  # t_IO_E, one expert
    # Experts on disk: the disk's time for the layer's read-ahead (every expert, the routing is
    # unknown that early), which the layer's compute must cover or the window drains; 0 off disk.
    io_disk_layer_s: float = 0.0


Times = list[LayerTimes]  # one per layer of the shares they go with


@dataclass(frozen=True)
class NChoice:
    n: int
    binding: str  # the inequality that forced n (the last one to hold)
    auto: bool  # solved (True) or given by hand (False)
    satisfied: bool  # all of (4)-(7) hold at n

    def meta(self) -> dict[str, object]:
        return {
            "n": self.n,
            "n_auto": self.auto,
            "binding": self.binding,
            "inequalities_hold": self.satisfied,
        }


def layer_times(
    model: ModelSpec, wl: Workload, cost: CostModel, placement: Placement
) -> LayerTimes:
    step = max(1, wl.gen_len // 2)  # a typical decode step
    bs, ctx = wl.batch_size, wl.step_context(step)
    gpu = Resource.GPU
    streamed = placement.dense != Tier.GPU
    attn = cost.compute_s(
        gpu,
        OpKind.ATTENTION,
        model.attention_flops(bs, ctx, sequences=bs),
        model.attn_bytes + bs * ctx * model.kv_bytes_per_token,
    )
    gate = cost.compute_s(gpu, OpKind.GATE, model.gate_flops(bs), model.gate_bytes)
    h2d = lambda nbytes: cost.transfer_s(Resource.H2D, nbytes)  # noqa: E731
    return LayerTimes(
        attn,
        gate,
        h2d(model.attn_bytes) if streamed else 0.0,
        h2d(model.gate_bytes) if streamed else 0.0,
        h2d(model.expert_bytes),
    )


def expert_s(model: ModelSpec, cost: CostModel, tokens: float) -> float:
    if tokens <= 0:
        return 0.0
    return cost.compute_s(
        Resource.GPU, OpKind.EXPERT, model.expert_flops(int(round(tokens))), model.expert_bytes
    )


def holds(
    n: int,
    t: LayerTimes,
    share: np.ndarray,
    tokens_per_batch: int,
    k_hot: int,
    top_k: int,
    expert_time: Callable[[float], float],
) -> list[bool]:
    """Which of (4)-(7), and the disk's pace, hold at n for one layer; share [E] = each expert's
    share of selections."""
    tokens = n * tokens_per_batch  # tokens of the group
    order = np.argsort(-share, kind="stable")
    hot, cold = order[:k_hot], order[k_hot:]
    hot_s = sum(expert_time(tokens * top_k * share[e]) for e in hot)
    p_token = np.minimum(top_k * share[cold], 1.0)  # chance one token picks e
    q_len = float(np.sum(1.0 - (1.0 - p_token) ** tokens))  # expected active cold experts
    cold_s = sum(expert_time(tokens * top_k * share[e]) for e in cold)
    front = n * (t.attention_s + t.gate_s)
    return [
        n * t.attention_s >= t.io_gate_s,
        front >= t.io_gate_s + k_hot * t.io_expert_s,
        q_len < 0.5 or front + hot_s >= t.io_gate_s + (k_hot + 1) * t.io_expert_s,
        front + hot_s + cold_s >= t.io_gate_s + (k_hot + q_len) * t.io_expert_s + t.io_attention_s,
        front + hot_s + cold_s >= t.io_disk_layer_s,
    ]


def smallest_n(
    at: Callable[[int], tuple[Times, np.ndarray]],
    tokens_per_batch: int,
    k_hot: int,
    top_k: int,
    expert_time: Callable[[float], float],
    n_max: int = N_MAX,
) -> NChoice:
    """Smallest n meeting (4)-(7) (and the disk's pace) in every layer whose experts n's
    placement streams: `at(n)` gives those layers' times, one LayerTimes each, and their shares
    [L', E] (none: nothing to hide), or raises
    CapacityError when n does not fit, and then the largest n that does is taken, marked as
    not meeting them. n_max, marked so, if no n does."""
    last_failed = "none (n=1 already hides all I/O)"
    for n in range(1, n_max + 1):
        try:
            t, shares = at(n)
        except CapacityError as e:
            if n == 1:
                raise
            why = without_fix(e)  # its fix is what this does: a smaller n
            log.warning("n-planner: n=%d does not fit memory (%s); using n=%d", n, why, n - 1)
            return NChoice(
                n - 1, f"memory (n={n} does not fit; {last_failed} fails at n={n - 1})", True, False
            )
        if not len(shares):
            what = "none (every expert resident on the GPU)" if n == 1 else last_failed
            return NChoice(n, what, True, True)
        failed = failed_at(n, t, shares, tokens_per_batch, k_hot, top_k, expert_time)
        if not failed:
            return NChoice(n, last_failed, True, True)
        last_failed = INEQUALITIES[failed[-1]]
    return NChoice(n_max, last_failed + f" (still fails at n={n_max})", True, False)


def failed_at(
    n: int,
    t: Times,
    shares: np.ndarray,
    tokens_per_batch: int,
    k_hot: int,
    top_k: int,
    expert_time: Callable[[float], float],
) -> list[int]:
    """Indices into INEQUALITIES of those that fail at n in some layer of shares [L, E] (t: one
    LayerTimes per layer)."""
    ok = [
        holds(n, lt, s, tokens_per_batch, k_hot, top_k, expert_time)
        for lt, s in zip(t, shares, strict=True)
    ]
    return [i for i in range(len(INEQUALITIES)) if not all(layer[i] for layer in ok)]


def group_activation_bytes(model: ModelSpec, wl: Workload, real_activations: bool) -> int:
    """Activations of the group in `wl` that the GPU holds: the real executor's buffers
    (`core.spec.activation_bytes`), or the paper's system's 3 hidden states per prompt token."""
    if real_activations:
        return activation_bytes(model, wl).total
    return 3 * wl.n_sequences * wl.prompt_len * model.hidden_size * model.dtype_bytes


def placement_for(
    model: ModelSpec,
    hw: HardwareSpec,
    wl: Workload,
    window_layers: int,
    real_activations: bool = False,
) -> Placement:
    """Klotski's placement for the group in `wl`; CapacityError names the n that does not fit.
    `real_activations`: count the real executor's activation buffers (`group_activation_bytes`)."""
    m = model
    kv_buf = (
        2 * wl.batch_size * (wl.prompt_len + wl.gen_len) * m.kv_bytes_per_token
    )  # two batches' KV in flight
    stream = m.attn_bytes + m.gate_bytes + m.shared_ffn_bytes + m.head_bytes
    act = group_activation_bytes(m, wl, real_activations)
    context = wl.prompt_len + wl.gen_len
    try:
        return klotski_placement(m, hw, wl.n_sequences, context, stream, act, window_layers, kv_buf)
    except CapacityError as e:
        if wl != _least(wl) and _refused(m, hw, _least(wl), window_layers, real_activations):
            raise  # the least workload is refused too: no smaller n or batch helps, e's fix does
        kv_gb = (
            wl.n_sequences * (wl.prompt_len + wl.gen_len) * m.kv_bytes_per_token * m.n_layers / 1e9
        )
        # the GPU's line names the activations already: said once
        acts = "" if "activations" in str(e) else f", activations {act / 1e9:.3g} GB"
        cause, fixes = _group_fixes(e, wl.n_batches)
        raise CapacityError(
            f"n={wl.n_batches} batches of {wl.batch_size} sequences does not fit: {cause}. "
            f"KV cache of the group: {kv_gb:.3g} GB{acts}; {fixes}"
        ) from None


_SMALLER_N = "pick a smaller n (planner.params.n; where n is -1, the workload's n_batches)"
_GROUP_LOWER = ("workload.batch_size", "workload.prompt_len", "workload.gen_len")


def _group_fixes(e: CapacityError, n_batches: int) -> tuple[str, str]:
    """`e`'s cause, and the fixes of a group it refuses where the least workload fits: a smaller
    n (where n > 1) and `e`'s own, each named once (n_batches is n)."""
    first = (_SMALLER_N,) if n_batches > 1 else ()
    if e.cause:
        lower = [k for k in e.lower if k != "workload.n_batches"] or _GROUP_LOWER
        return e.cause, fix_words(lower, e.more, *first)
    cause, _, fix = str(e).rpartition("; ")
    if not cause:  # no fix of its own: a smaller group is what is left
        return str(e), fix_words(_GROUP_LOWER, (), *first)
    return cause, fix_words((), (), *first, fix) if "workload" in fix else fix_words(
        _GROUP_LOWER, (), *first, fix
    )


def _least(wl: Workload) -> Workload:
    """The smallest workload of `wl`'s kind: one batch of one sequence, one token each way."""
    return wl.with_(n_batches=1, batch_size=1, prompt_len=1, gen_len=1)


def _refused(
    m: ModelSpec, hw: HardwareSpec, wl: Workload, window_layers: int, real_activations: bool
) -> bool:
    """Whether `placement_for` refuses `wl`."""
    try:
        placement_for(m, hw, wl, window_layers, real_activations)
    except CapacityError:
        return True
    return False


def solve_n(
    model: ModelSpec,
    hw: HardwareSpec,
    wl: Workload,
    cost: CostModel,
    shares: np.ndarray,
    k_hot: int,
    window_layers: int = 2,
    real_activations: bool = False,
) -> NChoice:
    """The smallest n meeting (4)-(7) in the MoE layers whose experts are streamed, each n judged
    at its own placement (a larger group's KV cache can push weights off the GPU); memory-checked.

    shares [L, E]: per MoE layer, each expert's share of selections (rows sum to 1).
    """
    return smallest_n(
        timing(model, hw, wl, cost, shares, window_layers, real_activations),
        wl.batch_size,
        k_hot,
        model.top_k,
        lambda tok: expert_s(model, cost, tok),
    )


def check_n(
    model: ModelSpec,
    hw: HardwareSpec,
    wl: Workload,
    cost: CostModel,
    shares: np.ndarray,
    k_hot: int,
    n: int,
    window_layers: int = 2,
    real_activations: bool = False,
) -> NChoice:
    """A hand-set n, with whether (4)-(7) hold at it (CapacityError if it does not fit)."""
    t, streamed = timing(model, hw, wl, cost, shares, window_layers, real_activations)(n)
    failed = (
        failed_at(
            n,
            t,
            streamed,
            wl.batch_size,
            k_hot,
            model.top_k,
            lambda tok: expert_s(model, cost, tok),
        )
        if len(streamed)
        else []
    )
    return NChoice(
        n, "manual" + (f": {INEQUALITIES[failed[-1]]} fails" if failed else ""), False, not failed
    )


def timing(
    model: ModelSpec,
    hw: HardwareSpec,
    wl: Workload,
    cost: CostModel,
    shares: np.ndarray,
    window_layers: int,
    real_activations: bool = False,
) -> Callable[[int], tuple[Times, np.ndarray]]:
    """n -> (per streamed MoE layer, its times at n's placement; those layers' shares);
    CapacityError when n's group does not fit."""

    def at(n: int) -> tuple[Times, np.ndarray]:
        placement = placement_for(model, hw, wl.with_(n_batches=n), window_layers, real_activations)
        streamed = [
            i for i, layer in enumerate(model.moe_layers) if placement.experts[layer] != Tier.GPU
        ]
        base = layer_times(model, wl, cost, placement)
        on_disk = [placement.experts[model.moe_layers[i]] == Tier.DISK for i in streamed]
        if not any(on_disk):  # a machine without a disk tier has no disk link to time
            return [base] * len(streamed), shares[streamed]
        read_s = cost.transfer_s(Resource.DISK, model.expert_disk_bytes)
        cpu_room = hw.memory_bytes[Tier.CPU] - placement.resident_bytes.get(Tier.CPU, 0)
        if cpu_room >= window_layers * model.n_experts * model.expert_bytes:
            # Klotski's rolling window: the disk reads every expert of each disk layer
            disk = replace(base, io_disk_layer_s=model.n_experts * read_s)
        else:  # each expert read when its copy is issued: the slower link paces the copies
            disk = replace(base, io_expert_s=max(base.io_expert_s, read_s))
        return [disk if d else base for d in on_disk], shares[streamed]

    return at
