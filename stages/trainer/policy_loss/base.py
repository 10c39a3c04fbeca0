"""What a policy loss takes and returns, and the registry `actor.policy_loss.loss_mode` names a loss in.

A loss is a function `(x: LossInputs, policy: PolicySettings) -> PolicyTerms` over one micro-batch: `x` holds the
current logprobs (with their graph), the PPO anchor (behaviour or proximal logprobs), the advantages, the trained
tokens' mask and the mini-batch's aggregation counts, so that `x.agg` divides by what verl's agg_loss divides by
and the micro-batches' gradients add up to the mini-batch's. It returns its scalar share of the mini-batch's loss
and, per token, what verl's metrics of that loss average: `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`,
`actor/ppo_kl` (None where verl's loss reports no such metric).

`register_policy_loss(name)` adds a loss, as verl's decorator of the same name does; a user's file named by
`actor.policy_loss.path` may call it, or define a function named as its loss_mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from stages.trainer.loss import LOG_RATIO_CLAMP, AggCounts, agg_loss
from stages.trainer.settings import CorrectionSettings, PolicyLossSettings
from stages.user_code import UserCodeError, load_user_module

if TYPE_CHECKING:
    from stages.trainer.settings import PolicySettings


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch, every tensor (B, T) over response tokens, right-padded."""

    logp: torch.Tensor  # the current policy's logprobs, with their graph
    old_logp: torch.Tensor  # the PPO anchor: the engine's behaviour logprobs, or the proximal ones
    advantages: torch.Tensor
    mask: torch.Tensor  # 1 on trained tokens
    counts: AggCounts  # the whole mini-batch's
    agg_mode: str  # actor.loss_agg_mode
    is_weights: torch.Tensor | None = None  # decoupled rollout correction's detached IS weights, None without
    correction: CorrectionSettings | None = None  # bypass mode's correction, computed inside the loss

    def agg(self, values: torch.Tensor, mode: str | None = None) -> torch.Tensor:
        """verl's agg_loss of `values` over this micro-batch's trained tokens with the mini-batch's denominator."""
        mode = mode or self.agg_mode
        return agg_loss(values, self.mask, mode, self.counts.denominator(mode))

    def weighted(self, per_token: torch.Tensor) -> torch.Tensor:
        """verl's `pg_losses * rollout_is_weights` when decoupled rollout correction weighs the tokens."""
        return per_token if self.is_weights is None else per_token * self.is_weights

    def log_ratio(self, clamp: bool = True) -> torch.Tensor:
        """log(pi / pi_old), clamped to +-20 before any exp, as most of verl's losses do."""
        log_ratio = self.logp - self.old_logp
        return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else log_ratio

    def masked_mean(self, values: torch.Tensor) -> torch.Tensor:
        """verl's masked_mean over this micro-batch's trained tokens (for statistics, not the loss)."""
        return (values * self.mask).sum() / (self.mask.sum() + 1e-8)

    def with_mask(self, mask: torch.Tensor) -> LossInputs:
        return replace(self, mask=mask)


@dataclass
class PolicyTerms:
    loss: torch.Tensor  # scalar: this micro-batch's share of the mini-batch's policy loss
    clipfrac: torch.Tensor | None = None  # (B, T) 0/1 per token: actor/pg_clipfrac's numerator
    clipfrac_lower: torch.Tensor | None = None  # (B, T): actor/pg_clipfrac_lower's numerator
    ppo_kl: torch.Tensor | None = None  # (B, T): what actor/ppo_kl averages over trained tokens
    mask: torch.Tensor | None = None  # the tokens the loss trained on, when it changed them (bypass rejection)
    metrics: dict[str, float] = field(default_factory=dict)  # more of the loss's metrics, per micro-batch


PolicyLossFn = Callable[[LossInputs, "PolicySettings"], PolicyTerms]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: the function is the policy loss `actor.policy_loss.loss_mode=name`."""

    def decorator(function: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = function
        return function

    return decorator


def policy_loss_fn(settings: PolicyLossSettings) -> PolicyLossFn:
    """The loss `settings.loss_mode` names: a registered one (after loading `settings.path`, whose registrations
    count), or a function of that name in `settings.path`. ValueError names the key and the choices."""
    module = None
    if settings.path:
        try:
            module = load_user_module(settings.path, "actor.policy_loss.path")
        except UserCodeError as err:
            raise ValueError(str(err)) from None
    function = POLICY_LOSSES.get(settings.loss_mode) or getattr(module, settings.loss_mode, None)
    if not callable(function):
        where = f" nor does {settings.path!r} define it" if settings.path else ""
        raise ValueError(
            f"actor.policy_loss.loss_mode={settings.loss_mode!r} is not a registered policy loss{where}: "
            f"registered are {', '.join(sorted(POLICY_LOSSES))}"
        )
    return function


@dataclass
class PolicyLoss:
    """One micro-batch's policy loss and what the step's metrics add up from it."""

    loss: torch.Tensor  # scalar, with its graph
    tokens: float  # tokens the loss trained on (after bypass rejection)
    ratio_sum: float  # sum of exp(clamped log ratio) over them: train/ratio_mean's numerator
    sums: dict[str, float]  # actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl numerators the loss reports
    metrics: dict[str, float]  # the loss's other metrics (averaged over micro-batches)

    @classmethod
    def of(cls, terms: PolicyTerms, x: LossInputs) -> PolicyLoss:
        with torch.no_grad():
            on = (terms.mask if terms.mask is not None else x.mask) > 0
            named = (
                ("actor/pg_clipfrac", terms.clipfrac),
                ("actor/pg_clipfrac_lower", terms.clipfrac_lower),
                ("actor/ppo_kl", terms.ppo_kl),
            )
            sums = {name: float(t[on].sum()) for name, t in named if t is not None}
            ratio_sum = float(torch.exp(x.log_ratio())[on].sum())
        return cls(terms.loss, float(on.sum()), ratio_sum, sums, dict(terms.metrics))
