"""The routers `real.model.Model.gate` runs after its logits, as transformers' classes compute
them: softmax top-k (with DeepSeek-V2's expert groups), and DeepSeek-V3's sigmoid router.

Shape legend: T tokens, E experts, G expert groups, k top-k.
"""

from __future__ import annotations

import torch


def softmax_top_k(
    logits: torch.Tensor, k: int, groups: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A softmax router's choice: logits [T, E] -> (expert ids [T, k], probabilities [T, E]).
    With expert groups (n_group G, E / G experts each, topk_group kept), from the kept groups
    of the highest best probability, the others' probabilities zeroed, as transformers'
    DeepseekV2TopkRouter does: a top-k past the kept groups' experts takes experts of weight 0
    there (which, a tie at 0, does not change the layer's output)."""
    probs = torch.softmax(logits, dim=-1)  # [T, E]
    if groups is None:
        return logits.topk(k, dim=-1).indices, probs
    n_group, keep = groups
    best = probs.view(len(probs), n_group, -1).amax(-1)  # [T, G]
    chosen = torch.zeros_like(best, dtype=torch.bool)
    chosen.scatter_(1, best.topk(keep, dim=-1).indices, True)  # [T, G]
    allowed = chosen.repeat_interleave(probs.shape[-1] // n_group, dim=1)  # [T, E]
    kept = probs.masked_fill(~allowed, 0.0)
    return kept.topk(k, dim=-1).indices, kept


def sigmoid_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    groups: tuple[int, int],
    forced_ids: torch.Tensor | None,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router as transformers' DeepseekV3TopkRouter computes it, op for op:
    float32 logits [T, E] -> (ids [T, k], weights [T, k] float32). Scores are the logits'
    sigmoid; the choice adds e_score_correction_bias `bias` [E] to them, keeps the topk_group
    groups whose best two biased scores sum highest and takes the top k there (unsorted, as
    transformers); the weights are the chosen (or `forced_ids`') unbiased scores, divided by
    their sum (+ 1e-20) where `renormalize`, then times `scaling` (routed_scaling_factor)."""
    n_group, keep = groups
    scores = logits.sigmoid()  # [T, E]
    if forced_ids is None:
        choice = scores + bias
        group_scores = choice.view(-1, n_group, choice.shape[-1] // n_group).topk(2, dim=-1)[0]
        group_idx = torch.topk(group_scores.sum(dim=-1), k=keep, dim=-1, sorted=False)[1]
        group_mask = torch.zeros(len(choice), n_group, device=choice.device)  # [T, G]
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, choice.shape[-1] // n_group)
        choice = choice.masked_fill(~score_mask.reshape(-1, choice.shape[-1]).bool(), -torch.inf)
        ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    else:
        ids = forced_ids.to(logits.device).long()
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling
