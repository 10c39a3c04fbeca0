"""verl's aggregation of per-token terms into one loss, the entropy of a distribution, and a backend's forward.

- `agg_loss`: the five loss_agg_modes, exactly as verl's `agg_loss` on its engine path (global batch info): each
  micro-batch's sum is divided by the whole mini-batch's denominator (`AggCounts.denominator`), so the
  micro-batches' gradients add up to the mini-batch's. Data-parallel ranks pass global counts and dp_size.
- `entropy_from_logits`: logsumexp(z) - sum softmax(z) * z, also over a vocabulary split across TP ranks.
The policy losses themselves (verl's registry, `actor.policy_loss.loss_mode`) are stages/trainer/policy_loss.

All tensors are (B, T) over response tokens, right-padded; `mask` is 1 on trained tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG_RATIO_CLAMP = 20.0
Reduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class AggCounts:
    """What a mini-batch's aggregation divides by; the same for every micro-batch of it."""

    tokens: float  # trained tokens of the mini-batch (all ranks' with data parallelism)
    sequences: float  # rows of the mini-batch, fully masked ones included (ppo_mini_batch_size * n)
    scale_factor: float  # seq-mean-token-sum-norm's extra divisor
    dp_size: int = 1  # ranks whose gradients are averaged: each rank's share is scaled back up by it

    def denominator(self, mode: str) -> float:
        """verl's agg_loss as one divisor of the mode's sum: token-mean tokens / dp, token-sum 1 / dp, the seq-mean
        modes sequences / dp, seq-mean-token-sum-norm sequences * loss_scale_factor / dp. A fully masked mini-batch
        divides by 1, not 0: its loss is 0 rather than verl's NaN."""
        if mode == "token-mean":
            return max(self.tokens, 1.0) / self.dp_size
        if mode == "token-sum":
            return 1.0 / self.dp_size
        if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
            return max(self.sequences, 1.0) / self.dp_size
        if mode == "seq-mean-token-sum-norm":
            return max(self.sequences, 1.0) * float(self.scale_factor) / self.dp_size
        raise ValueError(f"unknown loss_agg_mode {mode!r}")


def agg_loss(values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float) -> torch.Tensor:
    """Sum of `values` (B, T) over trained tokens, grouped as `mode` says, divided by the mini-batch's
    `denominator` (AggCounts.denominator(mode)). Values off the mask cannot leak, even NaN ones."""
    masked = torch.where(mask > 0, values, torch.zeros_like(values))
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / (mask.sum(-1) + 1e-8)).sum() / denominator  # a fully masked row adds 0
    if mode in ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return masked.sum() / denominator  # the same sum: the modes differ in what the caller divides it by
    raise ValueError(f"unknown loss_agg_mode {mode!r}")


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


def sum_pi2_from_logits(
    logits: torch.Tensor, reduce_max: Reduce | None = None, reduce_sum: Reduce | None = None
) -> torch.Tensor:
    """sum_v p_v^2 (...,) of softmax(logits (..., V)), no graph: sum e^2 / (sum e)^2 with e = exp(z - m), the sums
    all-reduced over a vocabulary split across TP ranks as entropy_from_logits's. -inf logits count as 0."""
    with torch.no_grad():
        shift = logits.amax(-1, keepdim=True)
        if reduce_max is not None:
            shift = reduce_max(shift)
        e = torch.exp(logits - shift)  # exp(-inf) = 0
        total, squares = e.sum(-1), e.pow(2).sum(-1)
        if reduce_sum is not None:
            total, squares = reduce_sum(total), reduce_sum(squares)
        return squares / total.pow(2)


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
    sum_pi2: torch.Tensor | None = None  # (B, T) sum over the vocabulary of each token's squared probabilities


# (prompts, responses, entropy: bool = False[, routes: (B, S, layers * k) LongTensor][, sum_pi2: bool]) -> TokenForward
TokenLogprobs = Callable[..., TokenForward]
