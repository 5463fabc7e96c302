"""The simulator's time for one device's expert work in one layer (`ExpertTime`), as the replica
gate models it, and the token split over copies it models it from (`predicted_tokens`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.cost import TILE, CostModel, gemm_blocks, pool_makespan_s
from core.dispatch import balanced_split, copies_sent, times_held
from core.planner import PlanContext
from core.spec import ModelSpec
from core.types import Dispatch, OpKind, Resource
from planners.ep.params import Layout


def expert_width(m: ModelSpec, rows: Iterable[int]) -> int:
    """Thread blocks of a device's expert op (one expert's tokens, or each expert's of a grouped
    GEMM): those of its up-projection GEMM (SwiGLU's gate and up fused: (matrices - 1) x F
    columns) and of its down-projection (H columns), averaged by the weight bytes each reads."""
    return max(1, round(_mean_blocks(m, gemm_blocks(rows, TILE))))  # rows -> output row tiles


def expert_widths(m: ModelSpec, rows: np.ndarray) -> np.ndarray:
    """`expert_width` of many one-expert ops at once, each of `rows` [N] (> 0) tokens."""
    tiles = -(-rows.astype(np.int64) // TILE)
    return np.maximum(1, np.round(_mean_blocks(m, tiles))).astype(np.int64)


def _mean_blocks(m: ModelSpec, row_tiles: Any) -> Any:
    """`expert_width` before rounding, for ops of `row_tiles` output row tiles (an int, or an
    array of them): each GEMM's blocks are its row tiles times its column tiles."""
    k = m.ffn_matrices - 1
    up, down = (
        row_tiles * -(-(k * m.expert_ffn_size) // TILE),
        row_tiles * -(-m.hidden_size // TILE),
    )
    return (k * up + down) / (k + 1)


@dataclass(frozen=True)
class ExpertTime:
    """The simulator's time for one device's expert work in one layer: `core.cost`'s duration of
    the op(s) `EPRunner.moe_layer` emits for it, so the replica gate and the simulation agree."""

    cost: CostModel
    expert_params_flops: float  # flops of one token through one expert
    expert_bytes: int  # weight bytes of one expert
    grouped: bool  # one grouped-GEMM op (else one op per expert)
    copy_s: float  # one replica copy on the device link (lanes: within the GPU's memory)
    share: float = 1.0  # of the GPU each device gets: 1/G for lanes (`Layout.share`)
    # lanes sharing the GPU's SMs (`Layout.shared`): the model, for its kernels' widths
    pool_model: ModelSpec | None = None
    dispatch: Dispatch = (
        Dispatch.EVEN
    )  # how a replicated expert's tokens split (`EPParams.dispatch`)
    one_link: bool = False  # lanes: every lane's copies queue on the one GPU's copy path
    # micro-batches a layer's expert work runs as (`EPParams.micro_batches`): each its own op(s),
    # with its share of every expert's tokens, reading the experts' weights again
    micro: int = 1
    # the share of a GPU's SMs a replica copy holds while it runs (`gpu.copy_sms`; G GPUs): the
    # compute beside it runs that much slower, hidden copy or not
    copy_sm_share: float = 0.0
    # G devices run as processes of one machine at once (`hardware.processes`,
    # `core.cost.as_processes`): their expert ops' time over the cost model's alone, and how
    # long after it is ready each starts; 1 and 0 on lanes
    scale: float = 1.0
    delay_s: float = 0.0

    @classmethod
    def of(cls, ctx: PlanContext, layout: Layout) -> ExpertTime:
        cost, m, procs = CostModel(ctx.hardware), ctx.model, ctx.hardware.processes
        copy_s = cost.transfer_s(Resource.D2D if layout.lanes else Resource.P2P, m.expert_bytes)
        return cls(
            cost,
            m.expert_flops(1),
            m.expert_bytes,
            layout.grouped_gemm,
            copy_s,
            layout.share,
            m if layout.shared else None,
            layout.dispatch,
            layout.lanes,
            layout.micro_batches,
            0.0 if layout.lanes else ctx.hardware.gpu.copy_share,
            *(
                (procs.scale(OpKind.EXPERT), procs.delay_s(OpKind.EXPERT))
                if not layout.lanes and layout.n_devices > 1
                else (1.0, 0.0)
            ),
        )

    def queue(self, slots: np.ndarray, resident: np.ndarray) -> int:
        """The copies `slots` needs over `resident` on the longest copy queue: on lanes all of
        them on the one GPU's (`new_copies`); on G GPUs per direction of each GPU's link, the
        copies into it or out of it (from the source `copy_moves` picks), the longer."""
        into = new_copies(slots, resident, self.one_link)
        if self.one_link or not into:
            return into
        return max(into, int(copies_sent(resident, slots).max()))

    def late_copy_s(self, queue: int, layer_s: float) -> float:
        """What the longest queue of `queue` copies (`queue`) adds to a layer: copies run behind
        earlier layers on the device's link, which the all-to-all mostly leaves free while
        experts compute (a GPU's results may start coming back during its own expert phase), so
        in steady state each layer's copies get the link for about one expert phase (`layer_s`,
        the busiest device's modelled time); only the excess is late. Where copies hold SMs
        (`copy_sm_share`: NCCL's p2p kernels) each also slows the compute it runs beside, hidden
        or not, by that share of its time."""
        busy = queue * self.copy_s
        return max(0.0, busy - layer_s) + busy * self.copy_sm_share

    def span(self, slots: np.ndarray, load: np.ndarray, scenarios: np.ndarray | None) -> float:
        """The layer's modelled expert time with slots [G, K]: the busiest device's time under
        load [E], or with `scenarios` [S, E] its mean over them (an expectation over loads the
        prediction may turn out to be)."""
        if scenarios is None:
            return self._span(slots, load)
        return float(np.mean([self._span(slots, s) for s in scenarios]))

    def _span(self, slots: np.ndarray, load: np.ndarray) -> float:
        """The busiest device's time; on lanes that share the SMs the phase as the simulator's
        pool runs it (`pool_makespan_s`: the lanes' ops side by side, each at most its cap)."""
        if self.pool_model is None:
            return float(self.device_times(slots, load).max())
        tokens = predicted_tokens(slots, load, self.dispatch)
        return pool_makespan_s([self.pool_ops(row) for row in tokens])

    def device_times(self, slots: np.ndarray, load: np.ndarray) -> np.ndarray:
        """[G] each device's modelled time (`device_s`) for slots [G, K] if load [E] splits
        over the copies by `dispatch`."""
        tokens = predicted_tokens(slots, load, self.dispatch)
        if self.pool_model is not None:
            return np.array([self.device_s(row) for row in tokens])
        return self._own_times(tokens)

    def _own_times(self, tokens: np.ndarray) -> np.ndarray:
        """[G] `device_s` of devices that do not share the SMs, for tokens [G, E], all at once
        (the gate's inner loop): each row's sums run along it (so a row alone gives the same).
        As `micro` micro-batches: that many times the ops over 1/micro of each expert's tokens
        (how a predicted load would split; the real split is each micro-batch's routing)."""
        busy, m = tokens > 0, self.micro
        if self.grouped:  # one op per device with tokens: all its tokens, every expert it reads
            n = busy.sum(1)
            flops = self.expert_params_flops * np.where(busy, tokens, 0.0).sum(1) / m
            t = self.cost.compute_vec(
                Resource.GPU, OpKind.EXPERT, flops, n * float(self.expert_bytes), self.share
            )
            return np.where(n > 0, m * (t * self.scale + self.delay_s), 0.0)
        t = self.cost.compute_vec(
            Resource.GPU,
            OpKind.EXPERT,
            (self.expert_params_flops * tokens / m).ravel(),
            np.full(tokens.size, float(self.expert_bytes)),
            self.share,
        )
        t = t * self.scale + self.delay_s
        return np.where(busy, m * t.reshape(tokens.shape), 0.0).sum(1)

    def _ops(self, tokens: np.ndarray) -> list[tuple[float, float, list[float]]]:
        """The expert ops of a device computing tokens [E]: (flops, bytes, rows per expert)."""
        busy = tokens[tokens > 0]
        if self.grouped:
            f = self.expert_params_flops * busy.sum()
            return [(f, len(busy) * self.expert_bytes, list(busy))] if len(busy) else []
        return [(self.expert_params_flops * n, self.expert_bytes, [n]) for n in busy]

    def pool_ops(self, tokens: np.ndarray) -> list[tuple[float, float, float]]:
        """A lane's expert ops on a shared GPU: (overhead, work at the whole GPU, cap) each."""
        assert self.pool_model is not None
        over, out = self.cost.overhead_s(Resource.GPU, OpKind.EXPERT), []
        if not self.grouped:  # one op per expert: all of them at once
            busy = tokens[tokens > 0]
            fl = self.expert_params_flops * busy
            by = np.full(len(busy), float(self.expert_bytes))
            works = self.cost.compute_vec(Resource.GPU, OpKind.EXPERT, fl, by, 1.0) - over
            caps = self.cost.cap_vec(
                Resource.GPU, fl, by, expert_widths(self.pool_model, np.ceil(busy))
            )
            return [(over, w, c) for w, c in zip(works.tolist(), caps.tolist(), strict=True)]
        for f, b, rows in self._ops(tokens):
            width = expert_width(self.pool_model, np.ceil(rows))
            work = self.cost.compute_s(Resource.GPU, OpKind.EXPERT, f, b) - over
            out.append((over, work, self.cost.cap(Resource.GPU, f, b, width)))
        return out

    def device_s(self, tokens: np.ndarray) -> float:
        """tokens [E] (may be fractional: predicted) this device computes per expert. On lanes
        that share the SMs: each op's launch plus its work at the share its width can fill, as
        if the lane had the GPU to itself."""
        if self.pool_model is not None:
            return sum(over + work / cap for over, work, cap in self.pool_ops(tokens))
        return float(self._own_times(np.asarray(tokens, dtype=np.float64)[None])[0])


def new_copies(slots: np.ndarray, resident: np.ndarray, one_queue: bool = False) -> int:
    """The longest per-device queue of copies that `slots` [G, K] needs over `resident` [G, K]:
    per device, the experts it holds and did not hold before (each empty slot is -1; a second
    slot of an expert the device holds already shares its weights: no copy, as in the real
    run's `copy_moves`); `one_queue` (lanes): all devices' copies in one queue."""
    e = int(max(slots.max(initial=-1), resident.max(initial=-1))) + 1
    more = (times_held(slots, e) > 0) & (times_held(resident, e) == 0)
    per = more.sum(1)
    return int(per.sum() if one_queue else per.max(initial=0))


def predicted_tokens(
    slots: np.ndarray, load: np.ndarray, dispatch: str = Dispatch.EVEN
) -> np.ndarray:
    """[G, E] tokens per device and expert if each expert's load [E] splits (fractionally) over its
    copies in slots [G, K]: evenly, or by `balanced_split` (dispatch="balanced")."""
    if dispatch == Dispatch.BALANCED:
        return balanced_split(slots, load)
    g, e = slots.shape[0], len(load)
    dev = np.repeat(np.arange(g), slots.shape[1])
    ids = slots.ravel()
    keep = ids >= 0
    copies = np.bincount(ids[keep], minlength=e)  # [E]
    out = np.zeros((g, e))
    np.add.at(out, (dev[keep], ids[keep]), load[ids[keep]] / np.maximum(copies[ids[keep]], 1))
    return out
