"""verl's token-ratio policy losses: `vanilla` (PPO clip with dual clip), `dppo_tv` and `dppo_kl` (a trust region
on the probability rather than the ratio, with a truncated IS weight), and `cispo` (a clipped, detached IS weight on
plain policy-gradient terms). Each is verl's formula; the log-ratio is clamped to +-20 before exp, as verl does.
Advantages, ratios and masks are (B, T); `x.weighted` applies decoupled rollout correction's IS weights, as verl
multiplies every loss by them before aggregating."""

from __future__ import annotations

import torch

from stages.trainer.policy_loss.base import LossInputs, PolicyTerms, register_policy_loss
from stages.trainer.settings import PolicySettings


@register_policy_loss("vanilla")
def vanilla(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """max(-A r, -A clip(r, 1 - low, 1 + high)); on tokens with A < 0 also at most -A * clip_ratio_c (dual clip,
    so a token whose ratio exploded cannot dominate, and its gradient is zero)."""
    adv, log_ratio = x.advantages, x.log_ratio()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - policy.clip_low, 1.0 + policy.clip_high)
    clip_max = torch.maximum(unclipped, clipped)
    bound = -adv * policy.clip_ratio_c
    per_token = torch.where(adv < 0, torch.minimum(bound, clip_max), clip_max)
    return PolicyTerms(
        x.agg(x.weighted(per_token)),
        clipfrac=(clipped > unclipped).float(),
        clipfrac_lower=((clip_max > bound) & (adv < 0)).float(),
        ppo_kl=-log_ratio,
    )


def _dppo(x: LossInputs, policy: PolicySettings, valid: torch.Tensor) -> PolicyTerms:
    """-A * sg(min(r, clip_ratio_c)) * log pi on the tokens `valid` keeps (the divergence's trust region)."""
    log_ratio = x.log_ratio()
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=policy.clip_ratio_c).detach()
    valid = valid.detach().float()
    per_token = -x.advantages * truncated * x.logp * valid
    return PolicyTerms(
        x.agg(x.weighted(per_token)),
        clipfrac=1.0 - valid,
        clipfrac_lower=(ratio > policy.clip_ratio_c).float() * valid,
        ppo_kl=-log_ratio,
    )


@register_policy_loss("dppo_tv")
def dppo_tv(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """DPPO-Binary-TV: a token trains while p - p_old <= clip_ratio_high (A > 0) or >= -clip_ratio_low (A <= 0);
    clip_ratio* are bounds on the probability's change here, not on the ratio."""
    change = torch.exp(x.logp) - torch.exp(x.old_logp)
    valid = torch.where(x.advantages > 0, change <= policy.clip_high, change >= -policy.clip_low)
    return _dppo(x, policy, valid)


@register_policy_loss("dppo_kl")
def dppo_kl(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """DPPO-Binary-KL: the binary KL between Bernoulli(p_old) and Bernoulli(p) of each token bounds the update
    (clip_ratio_high for A > 0, clip_ratio_low otherwise); a step that moves p back towards p_old always trains."""
    prob, old = torch.exp(x.logp), torch.exp(x.old_logp)
    binary_kl = old * (x.old_logp - x.logp) + (1.0 - old) * torch.log((1.0 - old + 1e-8) / (1.0 - prob + 1e-8))
    up = (binary_kl <= policy.clip_high) | (prob <= old)
    down = (binary_kl <= policy.clip_low) | (prob >= old)
    return _dppo(x, policy, torch.where(x.advantages > 0, up, down))


@register_policy_loss("cispo")
def cispo(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """-sg(clip(r, 1 - low, 1 + high)) * A * log pi: every token keeps a gradient, through log pi only."""
    log_ratio = x.log_ratio()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - policy.clip_low, 1.0 + policy.clip_high).detach()
    per_token = -clipped * x.advantages * x.logp
    return PolicyTerms(
        x.agg(x.weighted(per_token)),
        clipfrac=(ratio != clipped).float(),
        clipfrac_lower=torch.zeros_like(ratio),
        ppo_kl=-log_ratio,
    )
