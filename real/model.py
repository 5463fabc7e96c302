"""One MoE decoder in PyTorch, split into the pieces a schedule runs separately.

`Model` holds hyperparameters and the RoPE config.json sets (plain, linear, dynamic, YaRN, llama3);
its methods are pure functions of explicit weights (one unit's dict, see
real.checkpoint.unit_layout), so an executor passes weights from wherever it put them.
`reference_generate` is the plain in-memory forward every executor is compared against.
`head_shard`, `ffn_shard` and `vocab_shard` cut a unit's weights into a tensor-parallel rank's
share. RoPE and
the attention variants (GQA, MLA) are in real/attention.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from core import shards
from core.hf_config import hf_runtime, mla_dims
from core.hf_config.generation import Greedy, read_generation
from core.routing import Routing
from core.spec import ModelSpec
from core.types import Activation, Tensor
from real.activations import ACTIVATIONS
from real.attention import Rope, Weights, gqa, mla, rms_norm, rotary_dim
from real.checkpoint import Unit, hf_config, load_units, torch_dtype
from real.decoding import next_tokens
from real.reference_notes import warn_where_references_differ
from real.routers import sigmoid_route, softmax_top_k

# Shape legend: B batch, S tokens per sequence this step, T = B*S tokens, H hidden, V vocab,
# Hq query heads, Hkv key/value heads, D head dim, M cache length, E experts, k top-k,
# L MoE layers, N routing-trace positions. MLA (DeepSeek-V2): C latent (kv_lora_rank),
# R RoPE part of a query/key head (qk_rope), Dn its other part (qk_nope), Dv value head dim.
#
# Reference: transformers 5.24's classes, bit for bit where the order of ops allows, with two
# exceptions, both DeepSeek-V2 fields transformers' class drops and DeepSeek's own
# modeling_deepseek.py honours (as moepipe does): norm_topk_prob: true renormalises the top-k
# router weights, and moe_layer_freq > 1 leaves layers between MoE layers dense. V2 and V2-Lite
# ship false and 1, where the two agree; Model.from_checkpoint warns where they disagree.
# DeepSeek-V3 follows transformers there too: its moe_layer_freq is ignored, with a warning, as
# are a scoring_func or topk_method other than the only ones DeepSeek's V3 code implements.
# Substitution (documented, deliberate): Switch runs as a causal decoder with RoPE and 1/sqrt(D)
# scaling instead of T5's relative position buckets, and without expert capacity dropping.


@dataclass(frozen=True)
class KVCache:
    """Preallocated per-layer caches, every tensor with the cache position on dim 2 (the real
    executor's host copy alone is position-major: `Executor._host_kv`).

    GQA: (keys, values), [B, Hkv, M, D] each. MLA (DeepSeek-V2): (latent [B, 1, M, C], RoPE'd
    shared key [B, 1, M, R]), C + R = spec.kv_dim. Executors copy and slice them all alike.
    """

    layers: tuple[tuple[torch.Tensor, ...], ...]  # [decoder layer][tensor]

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        batch: int,
        max_len: int,
        device: str | torch.device = "cpu",
        kv_heads: int | None = None,
    ) -> KVCache:
        """kv_heads: the GQA key/value heads to hold, all by default (a `head_shard` holds fewer);
        MLA's latent is shared by every head, so its cache is whole either way."""
        if spec.mla:
            m = mla_dims(spec)
            shapes = [(batch, 1, max_len, d) for d in (m["kv_lora_rank"], m["qk_rope_head_dim"])]
        else:
            heads = spec.n_kv_heads if kv_heads is None else kv_heads
            shapes = [(batch, heads, max_len, spec.head_dim)] * 2
        dtype = torch_dtype(spec)
        return cls(
            tuple(
                tuple(torch.zeros(shape, dtype=dtype, device=device) for shape in shapes)
                for _ in range(spec.n_layers)
            )
        )

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> KVCache:
        """The cache with `fn` applied to every tensor (a batch slice, pinning, ...)."""
        return KVCache(tuple(tuple(fn(t) for t in layer) for layer in self.layers))


@dataclass(frozen=True)
class Model:
    spec: ModelSpec
    # Renormalise the top-k router weights to sum to 1 (config.json norm_topk_prob; Mixtral's
    # softmax over the chosen logits always sums to 1).
    renormalize: bool = False
    # RoPE frequencies and scales from config.json (Rope.from_config); None (as in Model(spec)):
    # plain RoPE of spec.rope_theta, filled in at construction
    rope: Rope | None = None
    # DeepSeek-V2: the routed experts' weights times this where they are not renormalised
    # (config.json routed_scaling_factor; 1.0 in DeepSeek-V2-Lite)
    routed_scaling: float = 1.0
    # Sliding-window attention (config.json sliding_window): a query sees the latest this many
    # positions, itself included; None: every earlier position
    sliding_window: int | None = None
    # OLMoE's clip_qkv: q, k and v clamped to [-clip_qkv, clip_qkv] after QK-norm; None: no clamp
    clip_qkv: float | None = None
    # The layers with the sliding window (Qwen2-MoE's layer_types); None: every layer (Mixtral)
    sliding_layers: tuple[int, ...] | None = None
    # DeepSeek-V2's group_limited_greedy (n_group, topk_group), and V3's; None: plain top-k
    expert_groups: tuple[int, int] | None = None
    # generation_config.json's settings greedy decoding applies (real.decoding); default: argmax
    greedy: Greedy = Greedy()
    # config.json's hidden_act (Switch: dense_act_fn), the FFNs' activation, a key of
    # ACTIVATIONS; "": the spec's activation (silu gated, relu ungated)
    hidden_act: str = ""
    # DeepSeek-V3's sigmoid router and MLA's RoPE layout (core.hf_config.HFRuntime's)
    sigmoid_router: bool = False
    mla_rope: str = "pairs"

    def __post_init__(self) -> None:
        if not self.hidden_act:
            relu = self.spec.activation == Activation.RELU
            object.__setattr__(self, "hidden_act", "relu" if relu else "silu")
        if self.rope is None:  # Model(spec), as calibration and some tests build it
            object.__setattr__(
                self, "rope", Rope.plain(rotary_dim(self.spec), self.spec.rope_theta)
            )

    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, spec: ModelSpec) -> Model:
        """The model config.json describes: its RoPE, routing, sliding windows and clip_qkv
        (core.hf_config.hf_runtime, which refuses in one line what is not implemented)."""
        cfg = hf_config(ckpt_dir)
        run = hf_runtime(cfg, spec)  # its refusals (an odd rotary dim, ...) before RoPE's
        rope = Rope.from_config(cfg, spec)
        warn_where_references_differ(cfg, spec, run.renormalize)
        return cls(
            spec,
            run.renormalize,
            rope,
            run.routed_scaling,
            run.sliding_window,
            run.clip_qkv,
            run.sliding_layers,
            run.expert_groups,
            read_generation(ckpt_dir, spec.vocab_size),
            run.hidden_act,
            run.sigmoid_router,
            run.mla_rope,
        )

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, None where it sees every earlier position."""
        if self.sliding_layers is not None and layer not in self.sliding_layers:
            return None
        return self.sliding_window

    @property
    def float32_combine(self) -> bool:
        """Weigh the routed experts' outputs and sum them in float32, rounding once (pass it to
        `moe_output`): DeepSeek-V2 and Mixtral, whose transformers routers give float32 weights
        that promote the products; Qwen2-MoE's and OLMoE's round their weights to the
        activations' dtype first."""
        return self.spec.mla or self.spec.family == "mixtral"

    @property
    def float32_logits(self) -> bool:
        """Router logits in float32: DeepSeek-V2's (HF keeps its gate in float32), and Switch's
        (HF's Top1Router casts its input and classifier to float32, then rounds the
        probabilities to the activations')."""
        return self.spec.mla or self.spec.family == "switch_transformers"

    def clamp_overflow(self, hidden: torch.Tensor) -> torch.Tensor:
        """Switch in float16, as transformers' SwitchTransformersBlock after each residual add
        (its attention's, its FFN's or MoE's), op for op: hidden [..., H] clamped to +-(float16's
        max - 1000) where any of its values is infinite, else to +-max (finite values kept).
        transformers tests the block's whole batch [B, S, H]; the reference forward passes the
        same, an executor's op its sequences, which differ only where one sequence overflows
        and another holds a value within 1000 of the max. Others: `hidden` itself."""
        if self.spec.family != "switch_transformers" or hidden.dtype != torch.float16:
            return hidden
        big = torch.finfo(hidden.dtype).max
        clamp_value = torch.where(torch.isinf(hidden).any(), big - 1000, big)
        return torch.clamp(hidden, min=-clamp_value, max=clamp_value)

    # ---- pieces ---------------------------------------------------------------------------
    def embed(self, w: Weights, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> hidden [B, S, H]."""
        return F.embedding(tokens, w["embed"])

    def attention(
        self, layer: int, w: Weights, hidden: torch.Tensor, kv: KVCache, positions: torch.Tensor
    ) -> torch.Tensor:
        """Input norm + causal self-attention (GQA, or MLA for DeepSeek-V2) + residual; writes
        this step's cache entries into `kv` at `positions` [S] (consecutive).
        hidden [B, S, H] -> [B, S, H]."""
        return self.clamp_overflow(hidden + self.attention_part(layer, w, hidden, kv, positions))

    def attention_part(
        self,
        layer: int,
        w: Weights,
        hidden: torch.Tensor,
        kv: KVCache,
        positions: torch.Tensor,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`attention` without the residual, over the heads `w` holds: all of them, or a
        `head_shard` (with a cache of its kv heads), whose part is its heads through their
        columns of o, so the parts of all shards sum to the whole. reduce: sums a tensor over
        the shards, for QK-norm's statistics (needed only where a shard has QK-norm).
        hidden [B, S, H] -> [B, S, H]."""
        x = rms_norm(hidden, w["input_norm"], self.spec.rms_norm_eps)  # [B, S, H]
        assert int(positions[-1]) + 1 - int(positions[0]) == x.shape[1], (
            "positions must be consecutive"
        )
        assert self.rope is not None  # set by __post_init__
        cache, window = kv.layers[layer], self.window(layer)
        if self.spec.mla:
            out = mla(self.spec, self.rope, w, x, cache, positions, window, self.mla_rope)
        else:
            out = gqa(self.spec, self.rope, w, x, cache, positions, window, self.clip_qkv, reduce)
        return F.linear(out, w["o"], w.get("o_bias"))  # o_bias: attention_bias, on one shard

    def gate(
        self,
        layer: int,
        w: Weights,
        hidden: torch.Tensor,
        forced_ids: torch.Tensor | None = None,
        forced_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-attention norm + router of an MoE layer.

        hidden [B, S, H] -> (normed [T, H], topk_ids [T, k] int64, topk_weights [T, k] float32).
        Live: the router's own top-k. Replay: `forced_ids` [T, k] are used; `forced_weights`
        [T, k] too when given, else the router's probabilities at the forced ids.
        """
        assert self.spec.is_moe(layer), f"layer {layer} has no gate"
        x = rms_norm(hidden, w["post_norm"], self.spec.rms_norm_eps).flatten(0, 1)  # [T, H]
        if self.float32_logits:
            logits = F.linear(x.float(), w["router"].float())  # [T, E]
        else:
            logits = F.linear(x, w["router"]).float()
        if self.spec.family == "switch_transformers":
            # HF's Top1Router rounds the float32 probabilities to the activations' dtype, then
            # takes their argmax (ties in that dtype go to the lower expert) and its probability
            probs = torch.softmax(logits, dim=-1).to(hidden.dtype)
            ids = (
                probs.argmax(-1, keepdim=True)
                if forced_ids is None
                else forced_ids.to(logits.device).long()
            )
            if forced_weights is not None:
                return x, ids, forced_weights.to(logits.device).float()
            return x, ids, probs.gather(-1, ids).float()
        if self.sigmoid_router:  # DeepSeek-V3's
            assert self.expert_groups is not None  # hf_runtime gives V3 its groups always
            args = (self.spec.top_k, self.expert_groups, forced_ids)
            ids, weights = sigmoid_route(
                logits, w["router_bias"], *args, self.renormalize, self.routed_scaling
            )
            if forced_weights is not None:
                weights = forced_weights.to(logits.device).float()
            return x, ids, weights
        if forced_ids is None:
            ids, probs = softmax_top_k(logits, self.spec.top_k, self.expert_groups)
        else:
            ids, probs = forced_ids.to(logits.device).long(), torch.softmax(logits, dim=-1)
        if forced_weights is not None:
            return x, ids, forced_weights.to(logits.device).float()
        if self.spec.family == "mixtral":  # HF's MixtralTopKRouter: top-k probs over their sum
            top = probs.gather(-1, ids)  # [T, k]
            return x, ids, top / top.sum(-1, keepdim=True)
        weights = probs.gather(-1, ids)  # [T, k]
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        elif self.routed_scaling != 1.0:  # DeepSeek's MoEGate: scaled where not renormalised
            weights = weights * self.routed_scaling
        return x, ids, weights

    def expert(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """One routed expert over some tokens: x [n, H] -> [n, H]."""
        return self._ffn(w, x)

    def shared_ffn(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        """Shared experts of an MoE layer (Qwen: times a sigmoid gate): normed [T, H] -> [T, H]."""
        y = self._ffn(w, x)
        if "shared_gate" in w:
            y = torch.sigmoid(F.linear(x, w["shared_gate"])) * y  # [T, 1] * [T, H]
        return y

    def dense_ffn(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """Post-attention norm + dense FFN + residual of a non-MoE layer: [B, S, H] -> [B, S, H]."""
        return self.clamp_overflow(hidden + self.dense_ffn_part(w, hidden))

    def dense_ffn_part(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """`dense_ffn` without the residual, over the FFN columns `w` holds (all, or an
        `ffn_shard`, whose parts sum to the whole): [B, S, H] -> [B, S, H]."""
        return self._ffn(w, rms_norm(hidden, w["post_norm"], self.spec.rms_norm_eps))

    def head(self, w: Weights, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on each sequence's last token: [B, S, H] -> fp32 logits [B, V]."""
        x = rms_norm(hidden[:, -1], w["norm"], self.spec.rms_norm_eps)  # [B, H]
        return F.linear(x, w["lm_head"]).float()

    def _ffn(self, w: Weights, x: torch.Tensor) -> torch.Tensor:
        act = ACTIVATIONS[self.hidden_act]  # Switch: its dense_act_fn (T5's DenseActDense)
        if self.spec.activation == Activation.RELU:
            return F.linear(act(F.linear(x, w["wi"])), w["wo"])
        up = F.linear(x, w["w3"], w.get("w3_bias"))  # biases: DeepSeek-V2's mlp_bias
        return F.linear(act(F.linear(x, w["w1"], w.get("w1_bias"))) * up, w["w2"], w.get("w2_bias"))


# ---- tensor-parallel shares of a unit's weights (views; parts computed with them sum to the whole)


def kv_shard(spec: ModelSpec, heads: tuple[int, int]) -> tuple[int, int]:
    """The GQA key/value heads [lo, hi) that query heads `heads` read (`core.shards.kv_shard`)."""
    return shards.kv_shard(spec.n_heads, spec.n_kv_heads, heads)


def head_shard(spec: ModelSpec, w: Weights, heads: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Attention weights of query heads [lo, hi): their rows of q (and biases, and of OLMoE's
    QK-norm weights; Qwen3-MoE's, of one head, whole), of k and v their `kv_shard`'s, of kv_b
    (and q_b) for MLA, their columns of o. MLA's kv_a and its norm make the latent every head
    reads, and q_a and its norm the query's, so they stay whole (computed on every shard)."""
    lo, hi = heads
    if spec.mla:
        m = mla_dims(spec)
        qk, kvb, dv = (
            m["qk_nope_head_dim"] + m["qk_rope_head_dim"],
            m["qk_nope_head_dim"] + m["v_head_dim"],
            m["v_head_dim"],
        )
        q, kv_b, o = slice(lo * qk, hi * qk), slice(lo * kvb, hi * kvb), slice(lo * dv, hi * dv)
        q_key = "q" if "q" in w else "q_b"
        out = dict(w, **{q_key: w[q_key][q]}, kv_b=w["kv_b"][kv_b], o=w["o"][:, o])
        return _bias_once(out, "o_bias", lo)
    d, (kv_lo, kv_hi) = spec.head_dim, kv_shard(spec, heads)
    q, kv = slice(lo * d, hi * d), slice(kv_lo * d, kv_hi * d)
    out = dict(w, q=w["q"][q], k=w["k"][kv], v=w["v"][kv], o=w["o"][:, q])
    cut = (("q_bias", q), ("k_bias", kv), ("v_bias", kv), ("q_norm", q), ("k_norm", kv))
    for key, rows in cut:
        if key in w and not (spec.head_qk_norm and key.endswith("_norm")):  # [D]: every head's
            out[key] = w[key][rows]
    return _bias_once(out, "o_bias", lo)


def _bias_once(w: dict[str, torch.Tensor], key: str, lo: int) -> dict[str, torch.Tensor]:
    """A shard's weights with the output bias `key` kept by the shard from column 0 only: the
    shards' parts are summed, so the bias is added once, as in the whole."""
    if lo:
        w.pop(key, None)
    return w


def ffn_shard(w: Weights, cols: tuple[int, int]) -> dict[str, torch.Tensor]:
    """FFN weights of intermediate columns [lo, hi): the up-projections' rows, the
    down-projection's columns (mlp_bias: the up-projections' bias rows, the down-projection's
    bias on the first shard). Norms and Qwen's shared gate (a per-token scalar, so it scales each
    part as it scales the sum) stay whole."""
    lo, hi = cols
    up, down = ("w1", "w3", "wi", "w1_bias", "w3_bias"), ("w2", "wo")
    out = {k: t[lo:hi] if k in up else t[:, lo:hi] if k in down else t for k, t in w.items()}
    return _bias_once(out, "w2_bias", lo)


def vocab_shard(w: Weights, rows: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Head weights of vocabulary rows [lo, hi): their rows of the LM head; the final norm whole.
    A shard's logits are those rows' columns of the whole's."""
    lo, hi = rows
    return dict(w, lm_head=w["lm_head"][lo:hi])


# ---- combining routed experts (order-independent, so any schedule gives identical bits) ------


def expert_tokens(topk_ids: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (token, slot) pairs chose expert e: topk_ids [T, k] -> (rows [n], slots [n])."""
    rows, slots = (topk_ids == e).nonzero(as_tuple=True)
    return rows, slots


def new_slots(normed: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-(token, slot) expert outputs to fill: [T, k, H] zeros."""
    return normed.new_zeros(normed.shape[0], top_k, normed.shape[1])


def put_expert(
    slots: torch.Tensor, rows: torch.Tensor, slot: torch.Tensor, y: torch.Tensor
) -> None:
    """Store one expert's outputs y [n, H] at its (token, slot) pairs. Each pair has one writer."""
    slots[rows, slot] = y.to(slots.device)


def moe_output(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None,
    float32_combine: bool = False,
) -> torch.Tensor:
    """hidden [B, S, H] + sum_k weight * slots[:, k] (+ shared [T, H]) -> [B, S, H].

    float32_combine (Model.float32_combine): weigh and sum in float32, rounding once at the end.
    """
    return hidden + moe_part(slots, topk_weights, shared, float32_combine).view_as(hidden)


def moe_part(
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None,
    float32_combine: bool = False,
) -> torch.Tensor:
    """`moe_output` without the residual: slots [T, k, H] -> [T, H]. With some slots left zero
    and the shared experts an `ffn_shard`'s, a part that other ranks' parts sum up with."""
    if float32_combine:
        routed = (slots * topk_weights.float()[..., None]).sum(1).to(slots.dtype)  # [T, H]
    else:
        routed = (slots * topk_weights.to(slots.dtype)[..., None]).sum(1)
    if shared is not None:
        routed = routed + shared
    return routed


# ---- the in-memory reference --------------------------------------------------------------


def forward_step(
    model: Model,
    units: Mapping[Unit, Weights],
    tokens: torch.Tensor,
    kv: KVCache,
    start: int,
    forced: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward pass over tokens [B, S] at positions start..start+S-1.

    forced: (ids, weights) [B, S, L, k] to replay. Returns (logits [B, V], the routing used:
    ids [B, S, L, k] int64 and weights [B, S, L, k] float32).
    """
    s = model.spec
    b, n = tokens.shape
    positions = torch.arange(start, start + n)
    hidden = model.embed(units[Unit(Tensor.EMBED)], tokens)  # [B, S, H]
    used_ids, used_w = [], []
    for layer in range(s.n_layers):
        hidden = model.attention(layer, units[Unit(Tensor.ATTENTION, layer)], hidden, kv, positions)
        if not s.is_moe(layer):
            hidden = model.dense_ffn(units[Unit(Tensor.FFN, layer)], hidden)
            continue
        fi = fw = None
        if forced is not None:
            m = s.moe_index(layer)
            fi, fw = forced[0][:, :, m].reshape(b * n, -1), forced[1][:, :, m].reshape(b * n, -1)
        normed, ids, weights = model.gate(layer, units[Unit(Tensor.GATE, layer)], hidden, fi, fw)
        slots = new_slots(normed, s.top_k)
        for e in range(s.n_experts):
            rows, slot = expert_tokens(ids, e)
            if len(rows):
                y = model.expert(units[Unit(Tensor.EXPERT, layer, e)], normed[rows])  # [n, H]
                put_expert(slots, rows, slot, y)
        shared = None
        if s.shared_ffn_size:
            shared = model.shared_ffn(units[Unit(Tensor.FFN, layer)], normed)
        hidden = model.clamp_overflow(
            moe_output(hidden, slots, weights, shared, model.float32_combine)
        )
        used_ids.append(ids.view(b, n, -1))
        used_w.append(weights.view(b, n, -1))
    logits = model.head(units[Unit(Tensor.HEAD)], hidden)
    if not used_ids:  # a dense model (no MoE layer): a routing of 0 layers
        none = (b, n, 0, s.top_k)
        return logits, torch.zeros(none, dtype=torch.long), torch.zeros(none)
    return logits, torch.stack(used_ids, dim=2), torch.stack(used_w, dim=2)


def _generate(
    ckpt_dir: str | Path,
    prompt_tokens: torch.Tensor,
    gen_len: int,
    forced_routing: Routing | None,
    dtype: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Routing]:
    spec, units = load_units(ckpt_dir, dtype)
    model = Model.from_checkpoint(ckpt_dir, spec)
    b, p = prompt_tokens.shape
    kv = KVCache.allocate(spec, b, p + gen_len)
    forced_ids = forced_w = None
    if forced_routing is not None:
        forced_ids = torch.from_numpy(forced_routing.expert_ids[:b].astype("int64"))  # [B, N, L, k]
        forced_w = torch.from_numpy(forced_routing.gate_weights[:b])
    tokens, ids, ws = [], [], []
    step_in, start = prompt_tokens.long(), 0
    with torch.inference_mode():
        for _ in range(gen_len):
            n = step_in.shape[1]
            forced = None
            if forced_ids is not None and forced_w is not None:
                forced = (forced_ids[:, start : start + n], forced_w[:, start : start + n])
            logits, step_ids, step_w = forward_step(model, units, step_in, kv, start, forced)
            ids.append(step_ids)
            ws.append(step_w)
            so_far = torch.stack(tokens, 1) if tokens else prompt_tokens[:, :0]  # [B, G']
            next_tok = next_tokens(model.greedy, logits, prompt_tokens, so_far, gen_len)  # [B]
            tokens.append(next_tok)
            start += n
            step_in = next_tok[:, None]
    routing = Routing(
        torch.cat(ids, 1).numpy().astype("int16"),
        torch.cat(ws, 1).numpy(),
        spec.n_experts,
        f"live routing of {ckpt_dir}",
        fields={"source": "live", "checkpoint": str(ckpt_dir)},
    )
    return torch.stack(tokens, dim=1), logits, routing


def reference_generate(
    ckpt_dir: str | Path,
    prompt_tokens: torch.Tensor,
    gen_len: int,
    forced_routing: Routing | None = None,
    dtype: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding with every weight in RAM: step 0 prefills prompt_tokens [B, P] and emits the
    first token, then gen_len-1 decode steps. Returns (tokens [B, gen_len], last logits [B, V]).
    Every sequence runs gen_len steps past any eos token: transformers' generate(do_sample=False,
    max_new_tokens=gen_len, eos_token_id=None), with the logits processors the checkpoint's
    generation_config.json (or config.json) asks for (core.hf_config.generation).

    forced_routing replays a trace (expert_ids/gate_weights [>=B, >=P+gen_len-1, L, k]) instead
    of the router's own choice. dtype: the compute dtype (float32, bfloat16, float16; None or
    "auto": the saved one), the weights upcast or rounded to it as they load (transformers'
    dtype=...).
    """
    tokens, logits, _ = _generate(ckpt_dir, prompt_tokens, gen_len, forced_routing, dtype)
    return tokens, logits


def live_routing(
    ckpt_dir: str | Path, prompt_tokens: torch.Tensor, gen_len: int, dtype: str | None = None
) -> Routing:
    """The routing reference_generate chooses itself ([B, P+gen_len-1, L, k]), e.g. to replay."""
    return _generate(ckpt_dir, prompt_tokens, gen_len, None, dtype)[2]
