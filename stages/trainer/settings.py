"""What every trainer backend is told about the objective: the PPO loss and optimizer knobs and verl's rollout
correction. One definition, read by the config (its `actor.*` and `algorithm.rollout_correction.*` keys are these
fields) and by TorchTrainer and MegatronRank alike. Pure data: no torch, so loading a config stays cheap.

Each choice is a `Literal`, so omegaconf refuses a value outside it and names the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# stages/trainer/kl.py's KL_TYPES_ALL, spelt out here so loading a config does not import torch (a test pins both).
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"
]
ISLevel = Literal["token", "sequence"]
RSMode = Literal["sequence", "geometric"]


@dataclass
class PolicySettings:
    """The PPO step of both backends (verl's `actor_rollout_ref.actor.*` keys, verl's defaults)."""

    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon; the default of clip_ratio_low and clip_ratio_high."""
    clip_ratio_low: float | None = None
    """PPO lower clip: ratio >= 1 - clip_ratio_low; null means clip_ratio."""
    clip_ratio_high: float | None = None
    """PPO upper clip: ratio <= 1 + clip_ratio_high; null means clip_ratio (DAPO's clip-higher sets it above)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound: a token with a negative advantage loses at most |A| * clip_ratio_c. Must be > 1."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token terms become one loss, over the whole mini-batch: 'token-mean' (sum / trained tokens),
    'seq-mean-token-sum' (sum of each response's token sums / responses), 'seq-mean-token-mean' (sum of each
    response's token means / responses) or 'seq-mean-token-sum-norm' (sum / loss_scale_factor). Responses are
    every row of the mini-batch (ppo_mini_batch_size * rollout.n), fully masked ones included."""
    loss_scale_factor: int | None = None
    """The divisor of 'seq-mean-token-sum-norm'; null means the padded response width (the run passes
    data.max_response_length, so it is the same constant for every micro-batch)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * entropy (aggregated like the loss). actor/entropy is logged anyway."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(current || reference) to the loss; needs the ref_logprobs column."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """Per-token KL estimator (stages/trainer/kl.py); a trailing '+' takes k2's gradient (straight-through)."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    micro_batch_size: int = 32
    """Trajectories per forward/backward pass (gradient accumulation; memory only)."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"actor.clip_ratio_c must be > 1 (the dual-clip bound on |A| * ratio), not {self.clip_ratio_c}"
            )
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"actor.loss_scale_factor must be > 0 or null, not {self.loss_scale_factor}")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass
class CorrectionSettings:
    """verl's `algorithm.rollout_correction.*`: off-policy correction between the engine (behaviour) and the trainer
    (proximal) logprobs; stages/trainer/correction.py applies it."""

    rollout_is: ISLevel | None = None
    """Importance weights proximal / behaviour: 'token', 'sequence' or null (off)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights (TIS)."""
    rollout_rs: RSMode | None = None
    """Reject whole responses by their ratio: 'sequence' (product), 'geometric' (per-token mean) or null (off)."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the accepted ratio (required with rollout_rs)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the accepted ratio; null means 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None
    """Reject a response when any token's ratio falls below this; null is off."""

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        for name, kind in (("rollout_is", ISLevel), ("rollout_rs", RSMode)):  # also when built without omegaconf
            if getattr(self, name) not in (None, *get_args(kind)):
                raise ValueError(f"{key}.{name} must be one of {get_args(kind)} or null, not {getattr(self, name)!r}")
        if self.rollout_rs is not None and self.rollout_rs_threshold is None:
            raise ValueError(f"{key}.rollout_rs needs {key}.rollout_rs_threshold (the upper bound of the ratio)")
        if self.rollout_is_threshold <= 0:
            raise ValueError(f"{key}.rollout_is_threshold must be > 0, not {self.rollout_is_threshold}")

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    @property
    def rs_bounds(self) -> tuple[float, float]:
        upper = float(self.rollout_rs_threshold)
        lower = self.rollout_rs_threshold_lower
        return (1.0 / upper if lower is None else float(lower)), upper  # verl's default lower is 1 / upper
