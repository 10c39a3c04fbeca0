"""verl's `bypass_mode` policy loss: rollout correction without recomputed proximal logprobs.

In bypass mode the PPO anchor is the engine's behaviour logprobs, so the correction compares the current policy
with the engine directly, inside the loss and per micro-batch, as verl does: stages/trainer/correction.py's IS
weights and rejection mask of (current, detached) against (behaviour). Then by
`algorithm.rollout_correction.loss_type`:
- 'ppo_clip': `vanilla` on the tokens rejection keeps; the IS weights are only measured (the ratio already is
  current / behaviour, and weighting by it again would count it twice);
- 'reinforce': -A * log pi * w on the tokens rejection keeps.
The correction's metrics (`rollout_corr/*`) are averaged over the step's micro-batches."""

from __future__ import annotations

from dataclasses import replace

import torch

from stages.trainer.correction import correct
from stages.trainer.policy_loss.base import LossInputs, PolicyTerms, register_policy_loss
from stages.trainer.policy_loss.clip import vanilla
from stages.trainer.policy_loss.gradient import reinforce
from stages.trainer.settings import CorrectionSettings, PolicySettings


@register_policy_loss("bypass_mode")
def bypass_mode(x: LossInputs, policy: PolicySettings) -> PolicyTerms:
    settings = x.correction or CorrectionSettings()
    mask, weights, metrics = x.mask, None, {}
    if bool((x.mask > 0).any()):
        with torch.no_grad():
            current, behaviour = x.logp.detach().double(), x.old_logp.double()
            corrected, weights, metrics = correct(current, behaviour, x.mask.double(), settings)
        mask = corrected.to(x.mask.dtype)
    inner = x.with_mask(mask)
    if settings.loss_type == "reinforce":
        w = None if weights is None else weights.to(x.logp.dtype)
        terms = reinforce(replace(inner, is_weights=w), policy)
    else:
        terms = vanilla(replace(inner, is_weights=None), policy)
    terms.mask, terms.metrics = mask, terms.metrics | metrics
    return terms
