"""verl's policy losses built on a response-level ratio or gate: `gspo` (the length-normalised sequence ratio, clipped
as PPO clips), `geo_mean` (GMPO: the geometric mean of clipped token ratios) and `sapo` (a smooth sigmoid gate in place
of the clip). Tensors are (B, T) over response tokens; a response's length is its trained tokens."""

from __future__ import annotations

import torch

from stages.trainer.policy_loss.base import LossInputs, PolicyTerms, register_policy_loss
from stages.trainer.settings import PolicySettings

GSPO_LOG_RATIO_MAX = 10.0  # verl clamps the sequence ratio's log from above only


@register_policy_loss("gspo")
def gspo(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """s_i = exp(mean_t log r_it) per response, taken into each token as sg(s_i) * pi_t / sg(pi_t) (the value is s_i,
    the gradient flows through every token's log pi), then PPO's clip on it; aggregated by loss_agg_mode (verl
    recommends seq-mean-token-mean, GSPO's own)."""
    log_ratio = x.logp - x.old_logp  # (B, T), not clamped: the mean over a response is
    lengths = x.mask.sum(-1).clamp(min=1)
    seq_log_ratio = (log_ratio * x.mask).sum(-1) / lengths  # (B,)
    log_s = (x.logp - x.logp.detach() + seq_log_ratio.detach()[:, None]).clamp(max=GSPO_LOG_RATIO_MAX)
    s = torch.exp(log_s)
    unclipped = -x.advantages * s
    clipped = -x.advantages * torch.clamp(s, 1.0 - policy.clip_low, 1.0 + policy.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    return PolicyTerms(
        x.agg(x.weighted(per_token)),
        clipfrac=(clipped > unclipped).float(),
        clipfrac_lower=torch.zeros_like(s),
        ppo_kl=-log_ratio,
    )


@register_policy_loss("geo_mean")
def geo_mean(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """GMPO: each token's log ratio is clipped to [-low, high] on the side its advantage's sign makes binding, the
    response's ratio is the exp of their mean, its advantage the mean of its tokens', and the loss -A_i * ratio_i
    is averaged over the responses; loss_agg_mode does not apply (as in verl). IS weights enter as their geometric
    mean over the response. verl takes the mean over a micro-batch's rows; here over the mini-batch's, so that
    micro-batches add up (the same with one micro-batch)."""
    log_ratio = x.logp - x.old_logp
    sign = torch.sign(x.advantages)
    clamped = torch.clamp(log_ratio, -policy.clip_low, policy.clip_high)
    binding = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = x.mask.sum(-1) + 1e-8  # (B,)
    ratio = torch.exp((binding * x.mask).sum(-1) / lengths)
    advantage = (x.advantages * x.mask).sum(-1) / lengths
    per_response = -advantage * ratio
    if x.is_weights is not None:
        per_response = per_response * torch.exp((torch.log(x.is_weights + 1e-10) * x.mask).sum(-1) / lengths)
    clipped = (log_ratio != clamped).float()
    return PolicyTerms(
        per_response.sum() / x.counts.denominator("seq-mean-token-sum"),
        clipfrac=clipped * (x.advantages > 0),
        clipfrac_lower=clipped * (x.advantages < 0),
        ppo_kl=-log_ratio,
    )


@register_policy_loss("sapo")
def sapo(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """-f(r) * A with the gate f(r) = sigmoid(tau (r - 1)) * 4 / tau (tau_pos where A > 0, tau_neg elsewhere): the
    gradient fades smoothly as r leaves 1 instead of stopping at a clip. Always aggregated seq-mean-token-mean, as
    verl does whatever loss_agg_mode says."""
    log_ratio = x.log_ratio()
    ratio = torch.exp(log_ratio)
    tau = torch.where(x.advantages > 0, torch.full_like(ratio, policy.tau_pos), torch.full_like(ratio, policy.tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    per_token = -gates * x.advantages
    return PolicyTerms(
        x.agg(x.weighted(per_token), "seq-mean-token-mean"),
        clipfrac=torch.zeros_like(ratio),
        clipfrac_lower=torch.zeros_like(ratio),
        ppo_kl=-log_ratio,
    )
