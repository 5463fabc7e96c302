"""What an executor holds beside weights and KV cache for a group of sequences
(`activation_bytes`), term by term as real/ops.py keeps it: Klotski's placement reserves it.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.spec import ModelSpec, Workload

EXPERT_ROWS = 8192  # tokens an expert op runs through its FFN at once (real/ops.py chunks so)


@dataclass(frozen=True)
class ActivationBytes:
    """What an executor holds beside weights and KV for a group of sequences, at its largest
    (the prefill: every sequence's prompt at once), term by term as real/ops.py keeps it.
    Klotski's placement reserves `total` on the device where its params ask for the real
    executor's activations (`real_activations`, as the benchmarks of real runs set)."""

    hidden: int  # each batch's hidden state [b, P, H], and the next step's [b, 1, H] beside it
    # each batch's MoE layer between its gate and the ops that add its output (one batch's next
    # layer beside them): normed [T, H], slots [T, k, H], the shared experts' [T, H], and the
    # routing, ids [T, k] int64 and weights [T, k] float32
    gate: int
    logits: int  # [N, V] float32 of every sequence, kept to the run's end, and their copy then
    # one op's temporaries: an expert's gathered input, its copy, its output chunks and their
    # concatenation ([T_e, H] each, at most every token of the group) and one chunk's FFN
    # intermediates; a batch's float32 combine of its slots
    transient: int

    @property
    def total(self) -> int:
        return self.hidden + self.gate + self.logits + self.transient


def activation_bytes(
    model: ModelSpec, wl: Workload, sequences: int | None = None
) -> ActivationBytes:
    """`ActivationBytes` of `sequences` sequences (default: the workload's group) in batches of
    the workload's batch size, at its prompt length."""
    m = model
    seqs = wl.n_sequences if sequences is None else sequences
    d, h, k = m.dtype_bytes, m.hidden_size, m.top_k
    tokens = seqs * wl.prompt_len  # the prefill's
    batch_tokens = min(wl.batch_size, seqs) * wl.prompt_len
    moe = bool(m.moe_layers)
    per_token_gate = (h + k * h + (h if m.shared_ffn_size else 0)) * d + k * (8 + 4)
    ffn = max(m.expert_ffn_size if moe else 0, m.dense_ffn_size)
    chunk = min(tokens, EXPERT_ROWS)
    return ActivationBytes(
        hidden=(tokens + seqs) * h * d,
        gate=(tokens + batch_tokens) * per_token_gate if moe else 0,
        logits=2 * seqs * m.vocab_size * 4,
        transient=4 * tokens * h * d
        + 3 * chunk * ffn * d
        + (2 * batch_tokens * k * h * 4 if moe else 0),
    )
