"""Expert routing: which experts each token of each sequence picks at each MoE layer.

`Routing` holds top-k ids and gate weights per (sequence, position, MoE layer); `load_routing`
builds one from a workload's routing config (real ESFT trace or fitted synthetic generator).
`CausalRouting` is the only view planners get: a layer's routing is revealed at its gate op.
A routing may also carry each token's request label (the ESFT trace's task): what a serving
scheduler knows of a request when it forms the batch, before any gate, so planners may read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from core.errors import TraceError
from core.spec import ModelSpec, Workload
from core.types import RoutingSource


@dataclass(frozen=True)
class Routing:
    expert_ids: np.ndarray  # [S, P, L, k] int16: S sequences, P positions, L MoE layers, top-k
    # [S, P, L, k] float32: router probability of each chosen expert (`gate_weights`), or a
    # function that makes them when they are first read (a simulated run reads none)
    weights: np.ndarray | Callable[[], np.ndarray]
    n_experts: int
    description: str = ""  # where it came from, for summaries
    # [S, P] int: each token's request label (index into `label_names`, e.g. the ESFT task), or
    # None where the source has none (synthetic routing, a live gate)
    labels: np.ndarray | None = None
    label_names: tuple[str, ...] = ()
    # where it came from as data, written beside `description` (summary.json's routing_fields):
    # `source` (synthetic, trace, live, esft) and what drew it (a generator's knobs and seed, a
    # trace's tasks, sequences and layer cut), so a reader compares fields, not the words
    fields: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not callable(self.weights):
            assert self.expert_ids.shape == self.weights.shape, "ids and weights disagree"
        assert self.expert_ids.ndim == 4, "expected [S, P, L, k]"
        if self.labels is not None:
            assert self.labels.shape == self.expert_ids.shape[:2], "labels must be [S, P]"
            assert len(self.label_names) > int(self.labels.max(initial=-1)), "label without a name"

    @property
    def gate_weights(self) -> np.ndarray:
        """[S, P, L, k] float32 router probability of each chosen expert (made on first read)."""
        w = self.weights
        if callable(w):
            w = w()
            assert self.expert_ids.shape == w.shape, "ids and weights disagree"
            object.__setattr__(self, "weights", w)  # frozen: made once, kept
        return w

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a distributed run's ranks, a sweep's workers) with its weights made: the
        function that makes them is local to the generator and cannot be pickled."""
        self.gate_weights  # noqa: B018 - makes and keeps them
        return dict(self.__dict__)

    @property
    def n_sequences(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def n_positions(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def n_moe_layers(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[3])

    def check_fits(self, model: ModelSpec, workload: Workload) -> None:
        """Reject routing whose shape disagrees with the model or is too small for the workload."""
        want = (len(model.moe_layers), model.n_experts, model.top_k)
        have = (self.n_moe_layers, self.n_experts, self.top_k)
        if want != have:
            raise TraceError(
                f"routing ({self.description}) has (moe_layers, experts, top_k) = {have}, "
                f"model {model.name} needs {want}; pick routing that matches the model"
            )
        if self.n_sequences < workload.n_sequences or self.n_positions < workload.seq_positions:
            raise TraceError(
                f"routing ({self.description}) covers {self.n_sequences} sequences x "
                f"{self.n_positions} positions; the workload needs {workload.n_sequences} x "
                f"{workload.seq_positions}; lower workload.n_batches, batch_size, prompt_len or "
                "gen_len, or pass routing that covers them"
            )

    def step_slice(self, step: int, workload: Workload) -> slice:
        """Positions processed at a step: the prompt at step 0, one token after."""
        if step == 0:
            return slice(0, workload.prompt_len)
        p = workload.prompt_len + step - 1
        return slice(p, p + 1)

    def batch_ids(self, step: int, moe_idx: int, batch: int, workload: Workload) -> np.ndarray:
        """[T, k] expert ids of batch `batch`'s tokens at a step and MoE layer (T = bs * tokens)."""
        bs = workload.batch_size
        seqs = slice(batch * bs, (batch + 1) * bs)
        ids = self.expert_ids[seqs, self.step_slice(step, workload), moe_idx]
        return ids.reshape(-1, self.top_k)

    def batch_labels(self, step: int, batch: int, workload: Workload) -> np.ndarray:
        """[T] the request label of each token of batch `batch` at a step, in `batch_ids`' order."""
        assert self.labels is not None, "routing without request labels"
        bs = workload.batch_size
        return self.labels[batch * bs : (batch + 1) * bs, self.step_slice(step, workload)].ravel()

    def counts(self, workload: Workload) -> np.ndarray:
        """[steps, L, n_batches, E] int32: tokens each expert receives per step, layer and batch."""
        n, bs, e = workload.n_batches, workload.batch_size, self.n_experts
        n_layers, k = self.n_moe_layers, self.top_k
        out = np.zeros((workload.n_steps, n_layers, n, e), dtype=np.int32)
        if not n_layers:  # a dense model: nothing routed
            return out
        # [n, 1, L, 1] each (batch, layer)'s first bin: one pass turns int16 ids into bins
        first = np.arange(n_layers)[None, None, :, None] * n + np.arange(n)[:, None, None, None]
        first = (first * e).astype(np.intp)
        for step in range(workload.n_steps):
            ids = self.expert_ids[: n * bs, self.step_slice(step, workload)]  # [S, t, L, k]
            ids = ids.reshape(n, -1, n_layers, k)  # [n, bs*t, L, k]
            # a few batches at a time: a prompt's bins of every batch at once are tens of MB of
            # intp, a fresh allocation the kernel faults in page by page (more time than the
            # counting); blocks of COUNT_BLOCK ids reuse the same memory
            per = max(1, COUNT_BLOCK // ids[0].size)
            total = np.zeros(n_layers * n * e, np.int64)
            for b in range(0, n, per):
                bins = np.add(ids[b : b + per], first[b : b + per], dtype=np.intp)
                total += np.bincount(bins.ravel(), minlength=n_layers * n * e)
            out[step] = total.reshape(n_layers, n, e)
        return out


COUNT_BLOCK = 1 << 19  # ids per block of `Routing.counts` (4 MB of intp bins)


def resolve_source(model: ModelSpec, source: RoutingSource) -> RoutingSource:
    """`auto` means the real trace for models of its shape (or a cut of it to its first layers)
    and the synthetic generator otherwise."""
    if source != RoutingSource.AUTO:
        return source
    from core.traces import replays_esft

    return RoutingSource.TRACE if replays_esft(model) else RoutingSource.SYNTHETIC


def load_routing(model: ModelSpec, workload: Workload) -> Routing:
    """Routing for a workload, from the source its config names; checked against the model."""
    cfg = workload.routing
    source = resolve_source(model, cfg.source)
    # ids (int16) and weights (float32) of every token, layer and choice, in host memory
    need = workload.n_sequences * (workload.prompt_len + workload.gen_len)
    need *= len(model.moe_layers) * model.top_k * 6
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram // 2:
        raise TraceError(
            f"routing for {workload.n_sequences} sequences x "
            f"{workload.prompt_len + workload.gen_len} tokens would take {need / 2**30:.1f} GiB, "
            f"over half of this machine's {ram / 2**30:.0f} GiB RAM; "
            "reduce workload.batch_size or workload.n_batches"
        )
    if source == RoutingSource.SYNTHETIC:
        from core.synthetic import table_bytes

        tables = table_bytes(len(model.moe_layers), model.n_experts)
        if tables > ram // 2:
            raise TraceError(
                f"model {model.name}: synthetic routing's tables for {len(model.moe_layers)} MoE "
                f"layers x n_experts={model.n_experts} would take {tables / 2**30:.1f} GiB, over "
                f"half of this machine's {ram / 2**30:.0f} GiB RAM; pass fewer layers or experts, "
                "or replay a trace (workload.routing.source=trace)"
            )
    if source == RoutingSource.TRACE:
        from core.traces import esft_routing

        routing = esft_routing(model, workload)
    elif source == RoutingSource.SYNTHETIC:
        from core.synthetic import synthetic_routing

        routing = synthetic_routing(model, workload)
    else:
        raise TraceError(
            "workload.routing.source=live needs the real executor (the model's own gate); "
            "use trace or synthetic in the simulator"
        )
    routing.check_fits(model, workload)
    return routing


@dataclass
class GateView:
    """What a planner learns when a batch's gate runs."""

    ids: np.ndarray  # [T, k] expert ids per token of the batch
    counts: np.ndarray  # [E] tokens per expert


class _ReplayedView(GateView):
    """A replayed batch's view whose `ids` (a copy of the batch's rows of the routing) are made
    when first read: most planners read only `counts`, and the copies were a tenth of
    planning's time."""

    def __init__(self, ids: Callable[[], np.ndarray], counts: np.ndarray) -> None:
        self._make_ids: Callable[[], np.ndarray] | None = ids
        self._ids: np.ndarray | None = None
        self.counts = counts

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            assert self._make_ids is not None
            self._ids, self._make_ids = self._make_ids(), None
        return self._ids

    @ids.setter
    def ids(self, value: np.ndarray) -> None:
        self._ids, self._make_ids = value, None


@dataclass
class CausalRouting:
    """The planners' only window on routing: layer l of batch b is seen at its gate op.

    `labels`, where the routing has them, answers (step, batch) with each token's request label
    (`batch_labels`): not routing, but what the scheduler knew when it formed the batch.
    `at_gate` records the gate op id so `core.schedule.validate` can check that every expert
    compute of that batch depends on it. `source` answers a (step, moe_idx, batch) query: it
    replays a `Routing`, or in the real executor's live mode blocks until the gate has run.
    """

    source: Callable[[int, int, int], GateView]
    n_experts: int
    top_k: int
    revealed: dict[tuple[int, int, int], int] = field(
        default_factory=dict
    )  # (step, moe, batch) -> gate op
    micro_revealed: dict[tuple[int, int, int, int], int] = field(
        default_factory=dict
    )  # (step, moe, batch, micro) -> gate op of that micro-batch
    peeked: bool = False  # an oracle looked ahead: outputs are labelled (`peek_label`)
    labels: Callable[[int, int], np.ndarray] | None = None  # (step, batch) -> [T] request labels
    label_names: tuple[str, ...] = ()
    # (step, moe_idx, batch, micro) -> that micro-batch's routing alone, where `source` cannot
    # answer before the whole batch is gated (the real executor's live mode); None: `source`'s
    # rows of it
    micro_source: Callable[[int, int, int, int], GateView] | None = None

    @classmethod
    def replay(cls, routing: Routing, workload: Workload) -> CausalRouting:
        counts = routing.counts(workload)

        def source(step: int, moe_idx: int, batch: int) -> GateView:
            return _ReplayedView(
                partial(routing.batch_ids, step, moe_idx, batch, workload),
                counts[step, moe_idx, batch],
            )

        def labels(step: int, batch: int) -> np.ndarray:
            return routing.batch_labels(step, batch, workload)

        has = routing.labels is not None
        return cls(
            source,
            routing.n_experts,
            routing.top_k,
            labels=labels if has else None,
            label_names=routing.label_names,
        )

    def batch_labels(self, step: int, batch: int, who: str) -> np.ndarray:
        """[T] the request label of each of a batch's tokens (`label_names`), known before any of
        its gates; a one-line error naming `who` where the routing carries none."""
        if self.labels is None:
            raise TraceError(
                f"{who} needs each request's label (the ESFT trace's task), but this routing has "
                "none (synthetic or live); use the ESFT trace, or another predictor"
            )
        return self.labels(step, batch)

    def at_gate(self, gate_op: int, step: int, moe_idx: int, batch: int) -> GateView:
        key = (step, moe_idx, batch)
        assert key not in self.revealed, f"routing {key} revealed twice"
        self.revealed[key] = gate_op
        return self.source(step, moe_idx, batch)

    def at_micro_gate(
        self, gate_op: int, step: int, moe_idx: int, batch: int, micro: int, rows: np.ndarray
    ) -> GateView:
        """The routing of one micro-batch of a batch (its tokens: `rows` of the batch's `ids`), seen
        at that micro-batch's gate op: the first micro-batch's tokens may be dispatched before the
        second's gate runs (two-batch overlap). The whole batch is still revealed by `at_gate`,
        at the last micro-batch's gate."""
        key = (step, moe_idx, batch, micro)
        assert key not in self.micro_revealed, f"routing {key} revealed twice"
        self.micro_revealed[key] = gate_op
        if self.micro_source is not None:
            view = self.micro_source(*key)
            assert len(view.ids) == len(rows), (
                f"micro-batch {key}: {len(view.ids)} rows, not {len(rows)}"
            )
            return view
        ids = self.source(step, moe_idx, batch).ids[rows]
        counts = np.bincount(ids.ravel().astype(np.int64), minlength=self.n_experts)
        return GateView(ids, counts)

    def peek(self, step: int, moe_idx: int, batch: int) -> GateView:
        """Look at routing before its gate ran: for oracles only (outputs labelled as peeking)."""
        self.peeked = True
        return self.source(step, moe_idx, batch)


BOUND, PEEKS = " (oracle upper bound)", " (peeks at the routing)"  # label suffixes of peeking runs


def peek_label(meta: dict[str, Any]) -> str:
    """What a run's label says about the routing it peeked at (schedule meta `oracle`): an upper
    bound, unless the planner said why it is not one (`not_a_bound`); nothing if it never peeked."""
    if not meta.get("oracle"):
        return ""
    return PEEKS if meta.get("not_a_bound") else BOUND


def peek_suffix(label: str) -> str:
    """The peek suffix (`BOUND` or `PEEKS`) a planner label ends with, else ''."""
    return next((s for s in (BOUND, PEEKS) if label.endswith(s)), "")
