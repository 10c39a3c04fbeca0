"""The per-token terms of the actor's objective and verl's aggregation of them into one loss.

- `ppo_clip_loss`: verl's "vanilla" policy loss. The log-ratio is clamped to [-20, 20] before exp; the ratio is
  clipped to [1 - clip_low, 1 + clip_high]; on tokens with a negative advantage the loss is also capped at
  |A| * clip_c (dual clip), so a token whose ratio exploded cannot dominate, and its gradient is zero.
- `entropy_from_logits`: logsumexp(z) - sum softmax(z) * z, also over a vocabulary split across TP ranks.
- `agg_loss`: the four loss_agg_modes. Each micro-batch's term is divided by the whole mini-batch's denominator
  (`AggCounts.denominator`: its trained tokens, its rows, or loss_scale_factor), so the micro-batches' gradients
  add up to the mini-batch's, as in verl's engine path. Data-parallel ranks would pass global counts and dp_size.

All tensors are (B, T) over response tokens, right-padded; `mask` is 1 on trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0
SEQ_MODES = ("seq-mean-token-sum", "seq-mean-token-mean")
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AggCounts:
    """What a mini-batch's aggregation divides by; the same for every micro-batch of it."""

    tokens: float  # trained tokens of the mini-batch (all ranks' with data parallelism)
    sequences: float  # rows of the mini-batch, fully masked ones included (ppo_mini_batch_size * n)
    scale_factor: float  # seq-mean-token-sum-norm's divisor
    dp_size: int = 1  # ranks whose gradients are averaged: each rank's share is scaled back up by it

    def denominator(self, mode: str) -> float:
        """A fully masked mini-batch divides by 1, not 0: its loss is 0 rather than verl's NaN."""
        if mode == "token-mean":
            return max(self.tokens, 1.0) / self.dp_size
        if mode in SEQ_MODES:
            return max(self.sequences, 1.0) / self.dp_size
        if mode == "seq-mean-token-sum-norm":
            return float(self.scale_factor)  # verl applies no dp_size factor here
        raise ValueError(f"unknown loss_agg_mode {mode!r}")


def agg_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """Sum of `values` (B, T) over trained tokens, grouped as `mode` says, divided by the mini-batch's
    `denominator` (AggCounts.denominator(mode)). Values off the mask cannot leak, even NaN ones."""
    masked = torch.where(mask > 0, values, torch.zeros_like(values))
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / (mask.sum(-1) + 1e-8)).sum() / denominator  # a fully masked row adds 0
    if mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return masked.sum() / denominator  # the same sum: the modes differ in what the caller divides it by
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


@dataclass
class PolicyLoss:
    loss: torch.Tensor  # scalar: this micro-batch's share of the mini-batch's aggregated policy loss
    clipped_tokens: float  # tokens where the clipped branch is the larger loss (verl's pg_clipfrac numerator)
    dual_clipped_tokens: float  # tokens with A < 0 where the dual clip bound is taken (pg_clipfrac_lower)
    ratio_sum: float  # sum of the (clamped) ratios over trained tokens
    kl_sum: float  # sum of old_logp - logp (clamped) over trained tokens: verl's ppo_kl numerator
    tokens: float  # trained tokens
    per_token: torch.Tensor  # (B, T) detached per-token losses (0 off the mask)


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
    clip_c: float = 3.0,
) -> PolicyLoss:
    """`advantages`: (B, T) per token, or (B,) broadcast over each row. `is_weights` (B, T), detached:
    rollout-correction importance weights on each token's loss (None = 1)."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) or (B, 1)
    log_ratio = torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # (B, T)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_max = torch.maximum(unclipped, clipped)
    dual_bound = -adv * clip_c
    per_token = torch.where(adv < 0, torch.minimum(dual_bound, clip_max), clip_max)  # (B, T)
    if is_weights is not None:
        per_token = per_token * is_weights
    loss = agg_loss(per_token, mask, agg, denominator)
    with torch.no_grad():
        on = mask > 0
        return PolicyLoss(
            loss,
            clipped_tokens=float(((clipped > unclipped) & on).sum()),
            dual_clipped_tokens=float(((clip_max > dual_bound) & (adv < 0) & on).sum()),
            ratio_sum=float(ratio[on].sum()),
            kl_sum=float(-log_ratio[on].sum()),
            tokens=float(on.sum()),
            per_token=torch.where(on, per_token, torch.zeros_like(per_token)).detach(),
        )


def entropy_from_logits(
    logits: torch.Tensor, grad: bool = True, reduce_max: Reduce | None = None, reduce_sum: Reduce | None = None
) -> torch.Tensor:
    """Entropy (...,) of softmax(logits (..., V)): logsumexp(z) - sum p z = log S - sum e (z - m) / S, with
    m the max logit, e = exp(z - m), S = sum e. Over a vocabulary split across TP ranks, `reduce_max` all-reduces
    m and `reduce_sum` the two sums (forward all-reduce, backward identity: megatron's convention for a loss every
    rank holds). `grad=False` keeps no graph (the entropy only logged, not in the loss). -inf logits (padded
    vocabulary rows) count as probability 0."""
    with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
        shift = logits.detach().amax(-1, keepdim=True)  # the entropy does not depend on it: no gradient needed
        if reduce_max is not None:
            shift = reduce_max(shift)
        centred = logits - shift
        finite = torch.isfinite(centred)
        centred = torch.where(finite, centred, torch.zeros_like(centred))  # no 0 * inf, in value or gradient
        e = torch.where(finite, torch.exp(centred), torch.zeros_like(centred))
        total, weighted = e.sum(-1), (e * centred).sum(-1)
        if reduce_sum is not None:
            total, weighted = reduce_sum(total), reduce_sum(weighted)
        return torch.log(total) - weighted / total


@dataclass
class TokenForward:
    """A backend's forward pass over a batch of (prompt, response) pairs, on the response tokens."""

    logp: torch.Tensor  # (B, T) logprob of each response token
    mask: torch.Tensor  # (B, T) 1 on real response tokens, 0 on padding
    entropy: torch.Tensor | None = None  # (B, T) entropy of each token's distribution, when asked for
    routes_replayed: float = 0.0  # (token, MoE layer) pairs whose experts were replayed (routes given)
    routes_changed: float = 0.0  # of them, those whose replayed experts differ from the model's own top-k
    # (B, S) per context token: MoE layers replayed, and of them those changed (the two counts above, per token)
    route_maps: tuple[torch.Tensor, torch.Tensor] | None = None


# (prompts, responses, entropy: bool = False[, routes: (B, S, layers * k) LongTensor]) -> TokenForward
TokenLogprobs = Callable[..., TokenForward]
