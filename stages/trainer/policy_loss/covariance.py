"""verl's covariance-based policy losses (the entropy-mechanism paper): tokens whose advantage and logprob move most
together are the ones that collapse the entropy, so a few of them are treated apart.
- `clip_cov`: PPO clip, and a random clip_cov_ratio share of the tokens whose covariance lies in (lb, ub) (among
  those PPO's clip left alone) get no gradient at all;
- `kl_cov`: plain -A r, and the kl_cov_ratio share with the largest covariance also pays ppo_kl_coef * |log r|.
The covariance of a token is (A - mean A) * (log pi - mean log pi), means over the micro-batch's trained tokens; the
shares count at least one token per micro-batch. Neither clamps the log ratio (verl does not). (B, T) tensors."""

from __future__ import annotations

import torch

from stages.trainer.policy_loss.base import LossInputs, PolicyTerms, register_policy_loss
from stages.trainer.settings import PolicySettings


def _covariance(x: LossInputs) -> torch.Tensor:
    """(B, T) (A - mean A) * (log pi - mean log pi) over the trained tokens, detached."""
    logp, adv = x.logp.detach(), x.advantages.detach()
    return (adv - x.masked_mean(adv)) * (logp - x.masked_mean(logp))


@register_policy_loss("clip_cov")
def clip_cov(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    settings = policy.policy_loss
    log_ratio = x.logp - x.old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * torch.clamp(ratio, 1.0 - policy.clip_low, 1.0 + policy.clip_high)
    with torch.no_grad():
        trained = x.mask > 0
        cov = _covariance(x).masked_fill(~trained | (clipped > unclipped), -torch.inf)
        candidates = torch.nonzero((cov < settings.clip_cov_ub) & (cov > settings.clip_cov_lb) & trained)
        quota = max(int(settings.clip_cov_ratio * float(x.mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates), device=candidates.device)[:quota]]
        keep = torch.ones_like(ratio)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    per_token = torch.maximum(unclipped, clipped) * keep
    return PolicyTerms(x.agg(x.weighted(per_token)), clipfrac=(keep == 0).float(), ppo_kl=-log_ratio)


@register_policy_loss("kl_cov")
def kl_cov(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    settings = policy.policy_loss
    log_ratio = x.logp - x.old_logp
    ratio = torch.exp(log_ratio)
    per_token = -x.advantages * ratio
    trained = x.mask > 0
    count = int(trained.sum())
    if count:
        with torch.no_grad():
            cov = _covariance(x)[trained]  # (N,) in the mask's row-major order
            top = torch.topk(cov, max(1, int(count * settings.kl_cov_ratio))).indices
            penalised = torch.zeros(count, dtype=torch.bool, device=ratio.device)
            penalised[top] = True
            chosen = torch.zeros_like(trained)
            chosen[trained] = penalised
        per_token = torch.where(chosen, per_token + settings.ppo_kl_coef * log_ratio.abs(), per_token)
    return PolicyTerms(x.agg(x.weighted(per_token)), ppo_kl=log_ratio.abs())
