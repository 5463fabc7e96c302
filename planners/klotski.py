"""`klotski`: the expert-aware multi-batch pipeline of Klotski (ASPLOS'25, klotski.md §1.3).

Per step and layer, over a group of n batches:
1. attention, batch by batch (KV of batch k+1 loads while k computes; k's new KV is stored
   behind it), or, with `attn_batches`, over several batches per op where the KV stays on the
   GPU; meanwhile the weight stream prefetches the gate and the K predicted hot experts
   (`hot_prefetch`; else the whole MoE layer, FlexGen-style);
2. gates, batch by batch, once everything the weight stream prefetched for the layer is in
   (Algorithm 1 syncs the weight stream at each layer boundary); after each gate, its selected
   experts not yet present or in flight are loaded on the `experts` stream in discovery order;
3. experts: with `reorder`, each expert once over all tokens of the group (hot first, then in
   load-issue order), freed after its one use; without, batch by batch in index order, each
   expert freed after its last batch. Meanwhile the next layer's attention weights and batch
   0's KV are prefetched.
Streams: `weights` and `experts` share the h2d link with `kv_load`; `kv_store` uses d2h. Expert
layers on disk are read ahead `disk_window` layers into CPU memory (paper §6.1); where CPU memory
cannot hold that window, expert by expert, as far ahead as CPU room allows.

Params give the paper's ablation steps after "+ multi batches" (conf/planner/klotski_hot.yaml,
klotski.yaml; that step itself is FlexGen's loop, `flexgen`), and the multi-batch step in this
loop (klotski_multi.yaml). `n`: -1 = workload.n_batches, 0 = auto (planners/n_planner.py; the
pipeline calls `choose_n_batches` to size the workload before routing exists), k > 0 = k batches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from core.cost import CostModel
from core.errors import ConfigError, integer_below
from core.hardware import HardwareSpec
from core.planner import PlanContext, Planner
from core.routing import GateView, resolve_source
from core.schedule import ScheduleBuilder
from core.spec import ModelSpec, Workload
from core.types import OpKind, Resource, RoutingSource, Stream, Tensor, Tier
from planners.common import Emitter
from planners.n_planner import N_MAX, NChoice, check_n, placement_for, solve_n
from planners.prefetch import PREDICTORS, ExpertTable, Predictor
from planners.registry import register

# the largest warm-up (`KlotskiParams.warmup_sequences`): a table's counts settle within a few
# hundred sequences, and the synthetic warm-up is drawn whole in memory
MAX_WARMUP_SEQUENCES = 4096
# token positions of a warm-up sequence at most: its counts settle long before, and a prompt of
# millions made the warm-up generate routing for minutes before any check of the run's size
WARMUP_POSITIONS = 1 << 16

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KlotskiParams:
    n: int = -1  # batches per group: -1 = workload.n_batches, 0 = auto (n-planner), k > 0 = k
    hot_prefetch: bool = (
        True  # prefetch gate + K hot experts during attention (False: whole MoE layer)
    )
    reorder: bool = True  # experts once each over the group, hot first, then load-issue order
    hot_k: int = 0  # K hot experts prefetched; 0 = the model's top-k
    predictor: str = "correlation"  # correlation | popularity | none | oracle (upper bound)
    # warm-up routing (paper's pre-run: batch size 8): unevaluated routing when synthetic or when
    # the workload names trace tasks; with no tasks named it is trace sequences from a distant
    # start, which a long run also evaluates (the table's source says so)
    warmup_sequences: int = 8
    disk_window: int = 2  # expert layers kept in CPU memory ahead of the GPU when spilling to disk
    # without that window (CPU memory too small): experts ranked next after the K hot ones, read
    # from disk before the gates so the disk does not wait on them (dropped if no gate chose them)
    disk_speculate: int = 1
    # attention (and the gates after it) over consecutive batches in one op, where a layer's KV
    # stays on the GPU (an offloaded KV is loaded and stored batch by batch): 1 = batch by batch
    # (the paper's loop), k > 1 = spans of k batches at every step, 0 = the planner chooses: the
    # whole group at decode steps where its working set fits the activation room the placement
    # reserves, batch by batch at prefill (a batch's P tokens per sequence already share the
    # weight read)
    attn_batches: int = 1
    # memory for activations: the real executor's buffers (core.spec.activation_bytes: every
    # batch's k expert-output slots, logits, ...), as the benchmarks of real runs set it; else
    # the paper's system's 3 hidden states per prompt token of the group, which the simulated
    # reproductions of its figures assume
    real_activations: bool = False

    def __post_init__(self) -> None:
        if self.predictor not in PREDICTORS:
            raise ConfigError(
                f"planner klotski: planner.params.predictor={self.predictor!r} unknown; "
                f"valid: {', '.join(PREDICTORS)}"
            )
        least = {
            "n": -1,
            "hot_k": 0,
            "warmup_sequences": 1,
            "disk_window": 1,
            "disk_speculate": 0,
            "attn_batches": 0,
        }
        for name, low in least.items():
            if getattr(self, name) < low:
                note = {"n": "-1 = workload.n_batches, 0 = auto"}.get(name, "")
                note = "1 = batch by batch, 0 = auto" if name == "attn_batches" else note
                key = f"planner.params.{name}"
                raise ConfigError(
                    f"planner klotski: {integer_below(key, getattr(self, name), low, note)}; "
                    f"pass {key}={low} or more"
                )
        if self.attn_batches > N_MAX:  # spans past any group: the whole group, said so
            raise ConfigError(
                f"planner klotski: planner.params.attn_batches={self.attn_batches} exceeds "
                f"{N_MAX}, the most "
                "batches a group holds; pass at most the group's n (0 = the planner chooses)"
            )
        if self.warmup_sequences > MAX_WARMUP_SEQUENCES:
            raise ConfigError(
                f"planner klotski: planner.params.warmup_sequences={self.warmup_sequences} is "
                "above "
                f"{MAX_WARMUP_SEQUENCES}: the warm-up table's counts settle long before, and a "
                "larger warm-up only costs time and memory (the paper's is one batch of 8)"
            )


def warmup_table(model: ModelSpec, wl: Workload, sequences: int) -> ExpertTable:
    """Routing counts of a warm-up run on data the evaluation does not use.

    Synthetic: the same generator (same model personality) on sequences past the evaluation's
    (the generator draws each block of sequences from its own stream). Trace: the tasks the
    workload does not name, or, when it names none, sequences from a distant start (may overlap).
    """
    from core.synthetic import CHUNK_SEQS, synthetic_routing
    from core.traces import esft_routing

    cfg = wl.routing
    n_layers = len(model.moe_layers)
    prompt = min(wl.prompt_len, WARMUP_POSITIONS)  # the prompt first, then generated tokens
    gen = max(1, min(wl.gen_len, WARMUP_POSITIONS + 1 - prompt))
    if resolve_source(model, cfg.source) == RoutingSource.TRACE:
        from dataclasses import replace

        held = cfg.tasks
        warm_cfg = (
            replace(cfg, tasks=(), exclude_tasks=(*cfg.exclude_tasks, *held)) if held else cfg
        )
        warm = Workload(sequences, 1, prompt, gen, warm_cfg, wl.seed + 97)
        ids = esft_routing(model, warm).expert_ids
        return ExpertTable.fit(
            ids,
            model.n_experts,
            f"trace warm-up excluding {list(held)}"
            if held
            else "trace warm-up from a distant start (may overlap the evaluated sequences)",
        )
    chunks = -(-wl.n_sequences // CHUNK_SEQS)
    skip = chunks * CHUNK_SEQS
    warm = Workload(sequences, 1, prompt, gen, cfg, wl.seed)
    ids = synthetic_routing(model, warm, first_chunk=chunks).expert_ids
    table = ExpertTable.fit(
        ids, model.n_experts, f"synthetic warm-up, sequences {skip}..{skip + sequences - 1}"
    )
    assert table.shape == (n_layers, model.n_experts)
    return table


@dataclass
class _Layer:
    """Expert bookkeeping of one (step, layer) of the group."""

    loads: dict[int, int | None] = field(default_factory=dict)  # expert -> load op (None: resident)
    order: list[int] = field(default_factory=list)  # hot first, then load-issue order
    hot: list[int] = field(default_factory=list)
    views: list[GateView] = field(default_factory=list)


@register("klotski", KlotskiParams)
class Klotski(Planner):
    def __init__(self, params: KlotskiParams) -> None:
        self.params = params
        # the n-planner's last choice, by what it read (`choose`)
        self._chosen: tuple[tuple[object, ...], NChoice] | None = None
        # warm-up tables by (model, workload): the n-planner's, and the prefetch predictor's,
        # which the pipeline's fit probe and the plan would each build (a Predictor copies its
        # table before it updates it)
        self._tables: dict[tuple[ModelSpec, Workload], ExpertTable] = {}

    # ---- sizing (called by the pipeline before routing exists, and by plan()) ------------------
    def k_hot(self, model: ModelSpec) -> int:
        if self.params.hot_k > model.n_experts:  # it was cut to n_experts without a word
            raise ConfigError(
                f"planner klotski: planner.params.hot_k={self.params.hot_k} exceeds the model's "
                f"{model.n_experts} experts; pass planner.params.hot_k <= {model.n_experts} (0 = "
                "its top-k)"
            )
        # it was cut to the layers without a word (the default's 2 on a one-layer model is fine)
        layers = len(model.moe_layers)
        if self.params.disk_window > max(layers, KlotskiParams.disk_window):
            raise ConfigError(
                f"planner klotski: planner.params.disk_window={self.params.disk_window} exceeds "
                "the model's "
                f"{layers} MoE layers; pass planner.params.disk_window <= {layers}"
            )
        return self.params.hot_k or model.top_k

    def choose(self, model: ModelSpec, hw: HardwareSpec, wl: Workload, cost: CostModel) -> NChoice:
        """The group's n (solved, or the hand-set n checked). Made once per planner for what it
        reads: a run asks its planner to size the workload, to probe the plan's fit and to plan,
        and each choice builds a warm-up routing (0.14 s of the paper workload's). The key is
        compared, not hashed: a HardwareSpec holds dicts."""
        p = self.params
        n = p.n if p.n > 0 else wl.n_batches
        # the warm-up's routing statistics, from sequences past any group the n-planner may
        # choose (the run evaluates that group's); the choice reads no other n of the workload
        warm = wl.with_(n_batches=max(n, N_MAX))
        key = (model, hw, cost.hw, warm, n if p.n else 0)
        if self._chosen is None or self._chosen[0] != key:
            self._chosen = (key, self._choose(model, hw, warm, cost, n))
        return self._chosen[1]

    def _choose(
        self, model: ModelSpec, hw: HardwareSpec, warm: Workload, cost: CostModel, n: int
    ) -> NChoice:
        p = self.params
        table = self._warmup(model, warm)
        shares = table.marginal / np.maximum(table.marginal.sum(1, keepdims=True), 1)
        if p.n == 0:
            return solve_n(
                model, hw, warm, cost, shares, self.k_hot(model), p.disk_window, p.real_activations
            )
        # CapacityError if the hand-set n does not fit
        return check_n(
            model, hw, warm, cost, shares, self.k_hot(model), n, p.disk_window, p.real_activations
        )

    def _warmup(self, model: ModelSpec, wl: Workload) -> ExpertTable:
        if (model, wl) not in self._tables:
            self._tables[model, wl] = warmup_table(model, wl, self.params.warmup_sequences)
        return self._tables[model, wl]

    def choose_n_batches(
        self, model: ModelSpec, hw: HardwareSpec, wl: Workload, cost: CostModel
    ) -> int:
        return self.choose(model, hw, wl, cost).n

    # ---- plan -----------------------------------------------------------------------------
    def plan(self, ctx: PlanContext, out: ScheduleBuilder) -> None:
        m, wl, p = ctx.model, ctx.workload, self.params
        if p.disk_speculate > m.n_experts:  # it was cut by the CPU room without a word
            raise ConfigError(
                f"planner klotski: planner.params.disk_speculate={p.disk_speculate} exceeds the "
                "model's "
                f"{m.n_experts} experts; pass planner.params.disk_speculate <= {m.n_experts}"
            )
        self._check_attn_batches(wl.n_batches)
        choice = self.choose(m, ctx.hardware, wl, ctx.cost)
        placement = placement_for(m, ctx.hardware, wl, p.disk_window, p.real_activations)
        em = Emitter(ctx, out, placement)
        self.em, self.n = em, wl.n_batches
        self.experts_stream = out.stream(Stream.EXPERTS, Resource.H2D)
        table = self._warmup(m, wl) if p.predictor in ("correlation", "popularity") else None
        if table is not None:
            table.check_shape(len(m.moe_layers), m.n_experts, m.name)
        self.predictor = Predictor(p.predictor, table, self.k_hot(m))
        self.disk_reads: dict[tuple[int, int, int], int] = {}
        self.prefetched: list[int] = []  # experts prefetched (for the meta's hit rate)
        self.used_prefetched = 0
        out.meta.update(
            n_batches_shared=wl.n_batches,
            n_plan=choice.meta(),
            predictor=p.predictor,
            predictor_table=table.source if table else "",
            hot_k=self.k_hot(m),
        )
        if choice.n != wl.n_batches:
            out.meta["n_plan"]["note"] = (
                f"workload runs n={wl.n_batches}; the n-planner chose {choice.n}"
            )
        self.last: int | None = None  # the latest compute op (carried across steps)
        for step in range(wl.n_steps):
            self._step(step)
        out.meta["prefetch_used_frac"] = self.used_prefetched / max(len(self.prefetched), 1)

    def _step(self, step: int) -> None:
        em, m, n = self.em, self.em.model, self.n
        layers = list(range(m.n_layers))
        self._disk_readahead(step, 0, upto=self.params.disk_window)
        attn_load = em.load(Tensor.ATTENTION, step, 0)
        kv_next = em.kv_load(step, 0, 0)
        last = self.last
        prev_ids: np.ndarray | None = None
        prev_gates: tuple[int, ...] = ()  # the gates that routed prev_ids
        for layer in layers:
            self._disk_readahead(step, layer + self.params.disk_window, upto=1)
            moe = (
                self._prefetch_moe(step, layer, prev_ids, prev_gates, last)
                if m.is_moe(layer)
                else None
            )
            ffn_load = em.load(Tensor.FFN, step, layer)
            attn_last = None
            for k, span in self._attn_spans(step, layer):  # attention phase
                kv = kv_next
                nk = k + span  # the next span's first batch
                kv_next = em.kv_load(step, layer, nk, deps=(attn_last,)) if nk < n else None
                last = em.attention(
                    step, layer, k, (attn_load, kv, last), last_batch=nk == n, batches=span
                )
                attn_last = last
                em.kv_store(step, layer, k, last)
            if moe is not None:
                last = self._gates(step, layer, moe, last, prev_ids)
                self._drop_unused_reads(step, layer, last)
            # expert phase: the next layer's attention weights and batch 0's KV load meanwhile
            nxt = layer + 1
            attn_load = em.load(Tensor.ATTENTION, step, nxt) if nxt < m.n_layers else None
            head_load = em.load(Tensor.HEAD, step, -1) if nxt == m.n_layers else None
            kv_next = em.kv_load(step, nxt, 0, deps=(last,)) if nxt < m.n_layers else None
            if moe is not None:
                last = self._experts(step, layer, moe, last)
                prev_ids = np.concatenate([v.ids for v in moe.views])
                prev_gates = tuple(dict.fromkeys(em.gate_ops[(step, layer)]))
            for k in range(n):
                last = em.ffn(step, layer, k, (ffn_load, last), last_batch=k == n - 1) or last
        for k in range(n):
            last = em.head(step, k, (head_load, last), last_batch=k == n - 1)
        self.last = last

    def _check_attn_batches(self, n: int) -> None:
        """attn_batches past the group's `n` batches (its spans were cut to the group without a
        word): refused where the user set the group (planner.params.n, or workload.n_batches
        with n=-1); where the n-planner chose it (n=0), cut to it, and the log says so."""
        k = self.params.attn_batches
        if k <= n:
            return
        batches = f"{n} batch{'es' * (n != 1)}"
        if self.params.n != 0:
            raise ConfigError(
                f"planner klotski: planner.params.attn_batches={k} exceeds the group's {batches} "
                f"(planner.params.n, -1 = workload.n_batches); pass at most {n} (0 = the "
                "planner chooses)"
            )
        log.warning(
            "planner klotski: planner.params.attn_batches=%d spans the whole group the n-planner "
            "chose (%s, planner.params.n=0): attention runs over all %d at once",
            k,
            batches,
            n,
        )

    def _attn_spans(self, step: int, layer: int) -> list[tuple[int, int]]:
        """(first batch, batches) of each attention op of the layer, in batch order."""
        em, n, k = self.em, self.n, self.params.attn_batches
        if k == 0:
            k = n if step > 0 and self._group_attention_fits(step) else 1
        if k == 1 or em.kv_offloaded(layer):
            return [(b, 1) for b in range(n)]
        return [(b, min(k, n - b)) for b in range(0, n, k)]

    def _group_attention_fits(self, step: int) -> bool:
        """Does one decode attention over the whole group fit the activation room the placement
        reserves (`placement_for`: 3 hidden states of the group's prompts)? Its working set: q, k,
        v and the output of each sequence's new token, and its scores over the context."""
        m, wl = self.em.model, self.em.ctx.workload
        per_token = 3 * m.hidden_size + m.n_heads * wl.step_context(step)
        need = wl.n_sequences * wl.step_tokens(step) * per_token * m.dtype_bytes
        return need <= 3 * wl.n_sequences * wl.prompt_len * m.hidden_size * m.dtype_bytes

    # ---- MoE layer ----------------------------------------------------------------------------
    def _prefetch_moe(
        self,
        step: int,
        layer: int,
        prev_ids: np.ndarray | None,
        prev_gates: tuple[int, ...],
        after: int | None,
    ) -> _Layer:
        """During attention: the gate + K predicted hot experts (or the whole layer).

        Issued once the previous layer's last expert is done (`after`), which frees the transfer
        space: one layer of experts. Their disk reads (experts on disk, outside the rolling
        window) need only CPU room and what chose them: the gates that routed `prev_ids`.
        """
        em, m, p = self.em, self.em.model, self.params
        st = _Layer()
        st.loads[-1] = em.load(Tensor.GATE, step, layer, deps=(after,))
        # experts on disk that the rolling window did not read ahead (CPU memory too small for it)
        unread = em.tensor_tier(Tensor.EXPERT, layer) == Tier.DISK and not any(
            (step, layer, e) in self.disk_reads for e in range(m.n_experts)
        )
        spec = (
            p.disk_speculate
            if unread and self._cpu_room() >= (p.disk_speculate + 1) * (m.expert_bytes)
            else 0
        )  # a speculative copy held in CPU memory must leave room for one read to go on
        if p.hot_prefetch:
            truth = None
            if self.predictor.oracle:
                mi = m.moe_index(layer)
                truth = np.sum(
                    [em.ctx.routing.peek(step, mi, k).counts for k in range(self.n)], axis=0
                )
            k_hot = self.k_hot(m)
            ranked = self.predictor.predict(m.moe_index(layer), prev_ids, truth, k_hot + spec)
            st.hot, speculative = ranked[:k_hot], ranked[k_hot:]
            want = list(st.hot)
            chosen_by = prev_gates if prev_ids is not None else ()
        else:
            want, speculative, chosen_by = list(range(m.n_experts)), [], ()
        for e in want:
            st.loads[e] = self._load_expert(
                step, layer, e, em.weights, deps=(after,), read_deps=chosen_by
            )
        for e in speculative:  # read behind the hot ones; transferred if a gate chooses it
            self.disk_reads[(step, layer, e)] = self._disk_read(step, layer, e, chosen_by)
        st.order = list(want)
        self.prefetched.extend(st.hot)
        return st

    def _gates(
        self, step: int, layer: int, st: _Layer, last: int | None, prev_ids: np.ndarray | None
    ) -> int | None:
        """Gates batch by batch (or over the attention's spans of batches: one op each, the
        routers back to back as before); a batch's new experts start loading at once, in
        discovery order."""
        em, n = self.em, self.n
        synced = tuple(
            st.loads.values()
        )  # Algorithm 1 syncs the weight stream before the gate layer
        for k, span in self._attn_spans(step, layer):
            last, views = em.gate_span(
                step, layer, k, span, (*synced, last), last_batch=k + span == n
            )
            for view in views:
                st.views.append(view)
                for e in map(int, np.flatnonzero(view.counts)):
                    if e not in st.loads:
                        st.loads[e] = self._load_expert(
                            step, layer, e, self.experts_stream, deps=(last,), read_deps=(last,)
                        )
                        st.order.append(e)
        mi = em.model.moe_index(layer)
        ids = np.concatenate([v.ids for v in st.views])
        self.predictor.observe(
            mi, prev_ids if mi else None, ids
        )  # online update, never written back
        return last

    def _experts(self, step: int, layer: int, st: _Layer, last: int | None) -> int | None:
        em = self.em
        counts = np.stack([v.counts for v in st.views])  # [n, E]
        total = counts.sum(0)
        self.used_prefetched += sum(1 for e in st.hot if total[e])
        for e in st.order:  # prefetched but unused: release at once
            if not total[e]:
                self._release(step, layer, e, (last, st.loads[e]))
        if self.params.reorder:
            for e in st.order:
                if total[e]:
                    last = em.expert(
                        step, layer, -1, e, int(total[e]), (st.loads[e], last), last_use=True
                    )
            return last
        last_batch = {e: int(np.flatnonzero(counts[:, e])[-1]) for e in st.order if total[e]}
        for k in range(self.n):
            for e in map(int, np.flatnonzero(counts[k])):
                last = em.expert(
                    step,
                    layer,
                    k,
                    e,
                    int(counts[k, e]),
                    (st.loads[e], last),
                    last_use=last_batch[e] == k,
                )
        return last

    # ---- expert transfers through the tiers ---------------------------------------------------
    def _load_expert(
        self,
        step: int,
        layer: int,
        e: int,
        stream: str,
        deps: tuple[int | None, ...],
        read_deps: tuple[int | None, ...],
    ) -> int | None:
        """The expert's copy to the GPU after `deps`. From disk, outside the rolling window, its
        read to CPU waits only for `read_deps` (what chose the expert) and CPU room: the disk
        stream runs ahead of the GPU transfers by as many experts as CPU memory holds, in the
        order the transfers are issued, so every copy in CPU memory has its consumer queued
        ahead of any read still waiting for room (no deadlock)."""
        em = self.em
        read = self.disk_reads.pop((step, layer, e), None)
        if read is None and em.tensor_tier(Tensor.EXPERT, layer) == Tier.DISK:
            read = self._disk_read(step, layer, e, read_deps)
        if read is None:
            return em.load(Tensor.EXPERT, step, layer, e, stream=stream, deps=deps)
        nbytes = em.model.expert_bytes
        return em.out.add(
            OpKind.LOAD,
            stream,
            (*deps, read),
            step=step,
            layer=layer,
            expert=e,
            tensor=Tensor.EXPERT,
            nbytes=nbytes,
            src=Tier.CPU,
            dst=Tier.GPU,
            alloc_tier=Tier.GPU,
            alloc_bytes=nbytes,
            free_tier=Tier.CPU,
            free_bytes=nbytes,
        )

    def _disk_read(self, step: int, layer: int, e: int, deps: tuple[int | None, ...]) -> int:
        em, m = self.em, self.em.model
        return em.out.add(
            OpKind.LOAD,
            em.disk,
            deps,
            step=step,
            layer=layer,
            expert=e,
            tensor=Tensor.EXPERT,
            nbytes=m.expert_disk_bytes,  # as the disk holds it; the host the in-memory bytes
            src=Tier.DISK,
            dst=Tier.CPU,
            alloc_tier=Tier.CPU,
            alloc_bytes=m.expert_bytes,
        )

    def _cpu_room(self) -> int:
        """CPU memory the placement leaves for staging disk reads."""
        out = self.em.out
        return out.capacity_bytes[Tier.CPU] - out.resident_bytes[Tier.CPU]

    def _release(self, step: int, layer: int, e: int, deps: tuple[int | None, ...]) -> None:
        self.em.free(Tensor.EXPERT, step, layer, deps, expert=e)

    def _disk_readahead(self, step: int, start: int, upto: int) -> None:
        """Disk -> CPU reads of whole expert layers [start, start+upto) (the rolling window).

        Every expert of a disk layer is read (routing is unknown this early); the copies of
        experts the group does not use are released after the layer's gates.
        """
        em, m = self.em, self.em.model
        window = self.params.disk_window * m.n_experts * m.expert_bytes
        if self._cpu_room() < window:
            # CPU memory cannot hold the window: reading ahead whole layers could fill it with
            # experts that leave only after a gate that waits on a read queued behind them
            # (deadlock). Then each expert is read when its transfer is issued, in that order, as
            # far ahead of the GPU as CPU room allows (`_load_expert`).
            return
        for layer in range(start, min(start + upto, m.n_layers)):
            if not m.is_moe(layer) or em.placement.experts[layer] != Tier.DISK:
                continue
            for e in range(m.n_experts):
                if (step, layer, e) in self.disk_reads:
                    continue
                self.disk_reads[(step, layer, e)] = em.out.add(
                    OpKind.LOAD,
                    em.disk,
                    (),
                    step=step,
                    layer=layer,
                    expert=e,
                    tensor=Tensor.EXPERT,
                    nbytes=m.expert_disk_bytes,
                    src=Tier.DISK,
                    dst=Tier.CPU,
                    alloc_tier=Tier.CPU,
                    alloc_bytes=m.expert_bytes,
                )

    def _drop_unused_reads(self, step: int, layer: int, after: int | None) -> None:
        em = self.em
        for e in range(em.model.n_experts):
            read = self.disk_reads.pop((step, layer, e), None)
            if read is not None:
                em.out.add(
                    OpKind.FREE,
                    em.compute,
                    (read, after),
                    step=step,
                    layer=layer,
                    expert=e,
                    tensor=Tensor.EXPERT,
                    free_tier=Tier.CPU,
                    free_bytes=em.model.expert_bytes,
                )
