"""PPO-clip policy loss with verl's aggregation modes (GRPO uses it with group-normalised advantages).

All tensors are (B, T) over response tokens, right-padded; `mask` is 1 on trained tokens. Aggregation is over a
whole mini-batch even when it is split into micro-batches: the caller passes the mini-batch's token (or sequence)
count as `denominator`, so accumulated micro-batch gradients equal the full mini-batch gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar, already divided by the mini-batch denominator
    clipped_tokens: float  # tokens whose clipped branch was taken (sum, for clipfrac)
    ratio_sum: float  # sum of the importance ratios over trained tokens
    kl_sum: float  # sum of (old_logp - logp) over trained tokens: the k1 estimate of KL(behaviour || current)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    agg: str,
    denominator: float,
    is_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """`is_weights` (B, T), detached: rollout-correction importance weights on each token's loss (None = 1)."""
    adv = advantages.unsqueeze(-1)  # (B, 1): one advantage per trajectory, broadcast over its tokens
    ratio = torch.exp(logp - old_logp)  # (B, T)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped) * mask  # (B, T)
    if is_weights is not None:
        per_token = per_token * is_weights
    if agg == "token-mean":
        loss = per_token.sum() / denominator
    elif agg == "seq-mean-token-mean":
        loss = (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / denominator
    else:
        raise ValueError(f"unknown loss_agg_mode {agg!r}")
    with torch.no_grad():
        clipped_tokens = float(((clipped > unclipped).float() * mask).sum())
        ratio_sum = float((ratio * mask).sum())
        kl_sum = float(((old_logp - logp) * mask).sum())
    return PolicyLoss(loss, clipped_tokens, ratio_sum, kl_sum)


def micro_batched_logprobs(
    token_logprobs: Callable[[list, list], tuple[torch.Tensor, torch.Tensor]],
    prompts: list,
    responses: list,
    micro: int,
) -> list[list[float]]:
    """Each response's token logprobs, computed `micro` sequences at a time by a backend's `token_logprobs`
    ((B, T) values and mask for a batch of prompts and responses): the proximal anchors of every backend."""
    out: list[list[float]] = []
    for lo in range(0, len(responses), micro):
        part = responses[lo : lo + micro]
        logp, _ = token_logprobs(prompts[lo : lo + micro], part)
        out += [logp[i, : len(r)].tolist() for i, r in enumerate(part)]
    return out
