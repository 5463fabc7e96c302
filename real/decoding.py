"""Greedy decoding of one step with a checkpoint's generation settings (core.hf_config's
`Greedy`): transformers' logits processors, in generate()'s order and with its operations, over
the float32 logits, then the argmax. Every executor picks its tokens here.

Usage: `next_tokens(model.greedy, logits, prompt, generated, gen_len)`.
"""

from __future__ import annotations

import torch

from core.errors import ConfigError
from core.hf_config.generation import Greedy


def next_tokens(
    g: Greedy, logits: torch.Tensor, prompt: torch.Tensor, generated: torch.Tensor, gen_len: int
) -> torch.Tensor:
    """The next token of each sequence: logits [B, V] of its last position, prompt [B, P] and
    generated [B, G'] its tokens so far, the run P + gen_len long. Returns [B] int64. Plain
    settings: logits.argmax(-1), whatever their dtype, with nothing else read."""
    if g.forced_bos_refusal and prompt.shape[1] == 1 and not generated.shape[1]:
        raise ConfigError(g.forced_bos_refusal)
    if g.plain:
        return logits.argmax(-1)
    scores = logits.to(torch.float32, copy=True)  # [B, V], as generate() casts them
    seen = torch.cat([prompt, generated], 1).long().to(scores.device)  # [B, N]
    prompt_len = prompt.shape[1]
    cur = seen.shape[1]
    if g.repetition_penalty != 1.0:
        got = scores.gather(1, seen)  # [B, N]
        got = torch.where(got < 0, got * g.repetition_penalty, got / g.repetition_penalty)
        scores = scores.scatter(1, seen, got)
    if g.no_repeat_ngram_size and cur >= g.no_repeat_ngram_size:
        scores = _no_repeat(scores, seen, g.no_repeat_ngram_size)
    for word in g.bad_words_ids:
        *prefix, last = word
        if len(prefix) > cur:
            continue
        hit = torch.ones(len(seen), dtype=torch.bool, device=seen.device)  # [B]
        if prefix:
            hit = (seen[:, cur - len(prefix) :] == seen.new_tensor(prefix)).all(-1)
        scores[hit, last] = -float("inf")
    if g.forced_bos_token_id is not None and cur == 1:
        scores = torch.full_like(scores, -float("inf"))
        scores[:, g.forced_bos_token_id] = 0
    if g.forced_eos_token_id and cur == prompt_len + gen_len - 1:
        scores = torch.full_like(scores, -float("inf"))
        scores[:, list(g.forced_eos_token_id)] = 0
    if g.suppress_tokens:
        scores[:, list(g.suppress_tokens)] = -float("inf")
    begin = prompt_len + (prompt_len == 1 and g.forced_bos_token_id is not None)
    if g.begin_suppress_tokens and cur == begin:
        scores[:, list(g.begin_suppress_tokens)] = -float("inf")
    return scores.argmax(-1)


def _no_repeat(scores: torch.Tensor, seen: torch.Tensor, n: int) -> torch.Tensor:
    """Ban each token that would repeat an n-gram of the sequence: the last token of every
    n-token window of `seen` whose first n-1 tokens are the sequence's last n-1."""
    prefix = seen[:, seen.shape[1] + 1 - n :]  # [B, n-1]
    windows = seen.unfold(1, n, 1)  # [B, W, n]
    matches = (windows[..., :-1] == prefix[:, None]).all(-1)  # [B, W]
    banned = torch.zeros(scores.shape[0], scores.shape[1] + 1, dtype=torch.bool)
    banned = banned.to(scores.device)
    spare = scores.shape[1]  # a window that does not match bans this spare column
    banned.scatter_(1, torch.where(matches, windows[..., -1], spare), True)
    return scores.masked_fill(banned[:, :spare], -float("inf"))
