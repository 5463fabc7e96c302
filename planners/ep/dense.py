"""Dense work of an expert-parallel run (attention, shared experts or a dense FFN, the head) over
G devices: data-parallel (each GPU its share of the batch's sequences, its own copy of the
weights), tensor-parallel (every GPU every sequence on 1/G of the heads, FFN columns and
vocabulary, then an all-reduce of the partial sums), or on lanes one whole-GPU op. Functions of
an `EPRunner` (`planners.ep.runner`), which emits the rest of the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.shards import kv_shard, shard
from core.spec import ModelSpec
from core.types import Dense, OpKind, Tensor

if TYPE_CHECKING:
    from planners.ep.runner import EPRunner


@dataclass(frozen=True)
class DenseCost:
    """What one device's dense op of a layer costs."""

    tokens: int  # tokens it runs (the head: sequences)
    flops: float
    touch_bytes: float  # weights, KV and activations it reads
    tensor: Tensor  # the weights it reads


def dense_share(r: EPRunner, gpus: int, device: int = 0) -> int:
    """Bytes of the dense weights `device` of `gpus` holds under tensor-parallel dense work, as
    the real run cuts them (real.model's head_shard, ffn_shard, vocab_shard): its contiguous
    shard of the query heads, FFN columns and vocabulary rows, with its GQA kv heads (a kv head
    on every GPU whose query heads read it); the output biases (attention's o, the FFN's down
    projection) on device 0 alone, as the shards' parts are summed; the norms, MLA's q_a and
    kv_a projections, the routers and the embeddings whole. Device 0 holds the most."""
    m = r.ctx.model
    layers = sum(
        _attention_share(m, gpus, device)
        + _ffn_share(m, r.em.tensor_bytes(Tensor.FFN, layer) // m.dtype_bytes, layer, gpus, device)
        + (m.gate_bytes // m.dtype_bytes if m.is_moe(layer) else 0)
        for layer in range(m.n_layers)
    )
    lo, hi = shard(m.vocab_size, gpus, device)
    head = (hi - lo) * m.hidden_size + m.hidden_size  # its rows of lm_head, the final norm
    return (layers + head) * m.dtype_bytes + m.embed_bytes


def _attention_share(m: ModelSpec, gpus: int, device: int) -> int:
    """Parameters of one layer's attention on `device` (`dense_share`)."""
    h = m.hidden_size
    heads = shard(m.n_heads, gpus, device)
    n_q = heads[1] - heads[0]
    o_bias = h if m.attention_bias else 0
    if m.mla:  # MLA: q (or q_b), kv_b and o by heads; q_a and kv_a whole
        from core.hf_config import mla_dims  # (a reader of HF configs: not every run's import)

        dims = mla_dims(m)
        qk, v = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], dims["v_head_dim"]
        rank = dims["kv_lora_rank"]
        per_head = (m.q_lora_rank or h) * qk + rank * (dims["qk_nope_head_dim"] + v) + v * h
        cut = min(m.n_heads * per_head, m.attn_param_count - h - o_bias)  # `attn_params` given
        whole = m.attn_param_count - cut
        return whole - (o_bias if device else 0) + cut * n_q // m.n_heads
    kv = kv_shard(m.n_heads, m.n_kv_heads, heads)
    d = m.head_dim
    extra_q = extra_kv = 0  # per head: Qwen's q/k/v biases, QK-norm's weights, OLMoE's biases
    if m.family == "qwen2_moe" and m.qkv_bias:
        extra_q, extra_kv = d, 2 * d
    elif m.qk_norm:
        extra_q, extra_kv = d, d
    if m.attention_bias:
        extra_q, extra_kv = extra_q + d, extra_kv + 2 * d
    per_q, per_kv = 2 * h * d + extra_q, 2 * h * d + extra_kv  # q rows and o columns; k and v
    whole = m.attn_param_count - m.n_heads * per_q - m.n_kv_heads * per_kv  # norm and o_bias
    return whole - (o_bias if device else 0) + n_q * per_q + (kv[1] - kv[0]) * per_kv


def _ffn_share(m: ModelSpec, params: int, layer: int, gpus: int, device: int) -> int:
    """Parameters on `device` of `layer`'s dense FFN or shared experts, of `params` parameters
    (`dense_share`): its columns of the up and down projections (and of their biases), the down
    projection's bias on device 0, the norm and Qwen's shared gate whole."""
    if not params:
        return 0
    width = m.shared_ffn_size if m.is_moe(layer) else m.dense_ffn_size
    down_bias = m.hidden_size if m.mlp_bias else 0
    per_col = m.ffn_matrices * m.hidden_size + (m.ffn_matrices - 1 if m.mlp_bias else 0)
    lo, hi = shard(width, gpus, device)
    whole = params - width * per_col  # the norm, the down projection's bias, Qwen's gate
    return whole - (down_bias if device else 0) + (hi - lo) * per_col


def dense_cost(r: EPRunner, kind: OpKind, step: int, layer: int, seqs: int) -> DenseCost | None:
    """The cost of one device's `kind` op over `seqs` sequences (None: a layer with no such
    weights, e.g. no shared experts). Tensor-parallel: 1/G of the weights and flops, except
    MLA's kv_a projection (every GPU runs all of it) and GQA's k / v rows (a GPU's kv heads)."""
    m, wl, lay = r.ctx.model, r.ctx.workload, r.layout
    tp = lay.dense == Dense.TENSOR
    part = lay.n_devices if tp else 1  # each op's share of the weights and flops: 1 / part
    # a GPU's KV share under tensor parallelism: its KV heads (MLA's latent: all of it), one
    # of n_kv_heads where the GPUs outnumber them (each kv head held by G / n_kv_heads GPUs)
    kv_part = 1 if not tp or m.kv_dim else min(lay.n_devices, m.n_kv_heads)
    tokens = seqs * wl.step_tokens(step)
    if kind == OpKind.ATTENTION:
        # MLA's kv_a projection makes the latent every head reads: each GPU runs all of it
        whole = m.hidden_size * m.kv_dim if tp and m.kv_dim else 0  # params
        # GQA's k and v projections: each GPU holds and runs its kv heads' rows (1 / kv_part)
        kv_w = 2 * m.hidden_size * m.n_kv_heads * m.head_dim if tp and not m.kv_dim else 0
        ctx_len = (wl.prompt_len + 1) / 2 if step == 0 else wl.step_context(step)
        w_flops, kv_flops = 2 * tokens * whole, 2 * tokens * kv_w
        flops = (
            m.attention_flops(tokens, int(ctx_len), sequences=seqs) - w_flops - kv_flops
        ) / part
        flops += w_flops + kv_flops / kv_part
        kv = seqs * wl.step_context(step) * m.kv_bytes_per_token / kv_part
        w_bytes, kv_bytes = whole * m.dtype_bytes, kv_w * m.dtype_bytes
        touch = (m.attn_bytes - w_bytes - kv_bytes) / part + w_bytes + kv_bytes / kv_part
        return DenseCost(tokens, flops, touch + kv, Tensor.ATTENTION)
    if kind == OpKind.FFN:
        touch = r.em.tensor_bytes(Tensor.FFN, layer) / part
        if not touch:
            return None
        return DenseCost(tokens, m.ffn_flops(tokens, layer) / part, touch, Tensor.FFN)
    return DenseCost(seqs, m.head_flops(seqs) / part, m.head_bytes / part, Tensor.HEAD)


def dense(
    r: EPRunner,
    kind: OpKind,
    step: int,
    layer: int,
    batch: int,
    deps: tuple[int, ...] | list[int],
    reduce: bool = True,
    micro: int = -1,
) -> list[int]:
    """Dense work of one layer. Data-parallel: device d runs attention / FFN / head for its share
    of the batch's sequences, reading its own copy of the weights; on lanes, one whole-GPU op
    over the batch. Tensor-parallel: every device runs every sequence on 1/G of the weights
    (heads, FFN columns, vocabulary), then the partial sums are all-reduced (`reduce`; the
    head's logits all-gathered). Returns the ops the next work waits for (one per device)."""
    wl, lay = r.ctx.workload, r.layout
    ops = []
    for d in range(1 if lay.lanes else lay.n_devices):
        seqs = wl.batch_size if lay.lanes else r.seqs(d, micro)
        cost = dense_cost(r, kind, step, layer, seqs) if seqs else None
        if cost is None:
            continue
        ops.append(
            r.out.add(
                kind,
                r.em.compute if lay.lanes else r.compute[d],
                deps,
                step=step,
                layer=layer,
                batch=batch,
                micro=micro,
                tensor=cost.tensor,
                tokens=cost.tokens,
                flops=cost.flops,
                touch_bytes=cost.touch_bytes,
            )
        )
    if lay.dense != Dense.TENSOR or not reduce or not ops:
        return ops
    return tp_reduce(r, kind, ops, step, layer, batch, micro)


def tp_reduce(
    r: EPRunner, kind: OpKind, ops: list[int], step: int, layer: int, batch: int, micro: int = -1
) -> list[int]:
    """Tensor-parallel dense ops' partial results (of micro-batch `micro`: its sequences'),
    combined over the GPUs: attention's and the FFN's hidden states summed, the head's logits
    gathered."""
    m, wl = r.ctx.model, r.ctx.workload
    seqs = r.seqs(0, micro)
    tokens = seqs * wl.step_tokens(step)
    if kind == OpKind.ATTENTION and m.qk_norm:
        # QK-norm's statistics (a float32 sum of squares of q and of k per token), summed
        # over the GPUs inside attention; charged after it, the same work on the path
        ops = all_reduce(r, ops, tokens * 2 * 4, step, layer, batch, tokens, micro=micro)
    if kind == OpKind.HEAD:  # gather every GPU's slice of the vocabulary (float32 logits)
        return all_reduce(
            r,
            ops,
            seqs * m.vocab_size * 4,
            step,
            layer,
            batch,
            tokens=seqs,
            gather_only=True,
            micro=micro,
        )
    act_bytes = tokens * m.hidden_size * m.dtype_bytes
    return all_reduce(r, ops, act_bytes, step, layer, batch, tokens, micro=micro)


def all_reduce(
    r: EPRunner,
    parts: list[int],
    nbytes: int,
    step: int,
    layer: int,
    batch: int,
    tokens: int,
    gather_only: bool = False,
    micro: int = -1,
) -> list[int]:
    """Sum (or, `gather_only`, concatenate) `nbytes` held by every GPU once `parts` (of
    micro-batch `micro`) are done:
    a reduce-scatter and an all-gather through the NVSwitch, each GPU sending (G-1)/G of the
    bytes in each (NCCL's bandwidth-optimal volume; one link latency per phase). Returns the
    all-gather op of each GPU."""
    g = r.layout.n_devices
    if g == 1:
        return parts
    sent = nbytes * (g - 1) // g
    after: list[int] = list(parts)
    for _ in range(1 if gather_only else 2):
        after = [
            r.out.add(
                OpKind.ALL_REDUCE,
                r.reduce[d],
                tuple(after),
                step=step,
                layer=layer,
                batch=batch,
                micro=micro,
                tensor=Tensor.HIDDEN,
                tokens=tokens,
                nbytes=sent,
            )
            for d in range(g)
        ]
    return after
