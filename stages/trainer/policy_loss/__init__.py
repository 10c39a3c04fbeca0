"""verl's policy losses, one small function each, by `actor.policy_loss.loss_mode` (base.py says what a loss takes
and returns, and how a user's file adds one):

- clip.py: vanilla, dppo_tv, dppo_kl, cispo
- sequence.py: gspo, geo_mean, sapo
- gradient.py: gpg, dro (and REINFORCE, which bypass_mode uses)
- covariance.py: clip_cov, kl_cov
- bypass.py: bypass_mode
"""

from stages.trainer.policy_loss import bypass, clip, covariance, gradient, sequence  # noqa: F401 - they register
from stages.trainer.policy_loss.base import (
    POLICY_LOSSES,
    LossInputs,
    PolicyLoss,
    PolicyLossFn,
    PolicyTerms,
    policy_loss_fn,
    register_policy_loss,
)

__all__ = [
    "POLICY_LOSSES",
    "LossInputs",
    "PolicyLoss",
    "PolicyLossFn",
    "PolicyTerms",
    "policy_loss_fn",
    "register_policy_loss",
]
