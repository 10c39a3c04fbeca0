"""verl's policy-gradient losses without a ratio clip: `gpg` (-A log pi), `dro` (-A log pi plus a quadratic penalty on
the log ratio) and REINFORCE with IS weights, which verl registers under no name of its own: its `bypass_mode` loss
uses it when rollout_correction.loss_type is 'reinforce'. Tensors are (B, T) over response tokens."""

from __future__ import annotations

from stages.trainer.policy_loss.base import LossInputs, PolicyTerms, register_policy_loss
from stages.trainer.settings import PolicySettings


@register_policy_loss("gpg")
def gpg(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """-A * log pi; verl reports no metric of it."""
    return PolicyTerms(x.agg(x.weighted(-x.logp * x.advantages)))


@register_policy_loss("dro")
def dro(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """-(A * log pi - beta / 2 * (log pi - log pi_old)^2), beta = actor.policy_loss.dro_beta (no clamp)."""
    beta = policy.policy_loss.dro_beta
    if beta is None or beta <= 0:
        raise ValueError("actor.policy_loss.dro_beta must be > 0 with loss_mode=dro")
    log_ratio = x.logp - x.old_logp
    per_token = -(x.logp * x.advantages - 0.5 * beta * log_ratio.square())
    return PolicyTerms(x.agg(x.weighted(per_token)), ppo_kl=-log_ratio)


def reinforce(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    """-A * log pi * w, w the (detached) IS weights when there are any; ppo_kl is old - current, old being the
    engine's logprobs in bypass mode."""
    per_token = -x.advantages * x.logp
    return PolicyTerms(x.agg(x.weighted(per_token)), ppo_kl=x.old_logp - x.logp)
