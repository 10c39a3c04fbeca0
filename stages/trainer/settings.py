"""What every trainer backend is told about the objective: the PPO loss and optimizer knobs and verl's rollout
correction. One definition, read by the config (its `actor.*` and `algorithm.rollout_correction.*` keys are these
fields) and by TorchTrainer and MegatronRank alike. Pure data: no torch, so loading a config stays cheap.

Each choice is a `Literal`, so omegaconf refuses a value outside it and names the valid ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

LossAggMode = Literal["token-mean", "seq-mean-token-mean"]
ISLevel = Literal["token", "sequence"]
RSMode = Literal["sequence", "geometric"]


@dataclass
class PolicySettings:
    """The PPO step of both backends (verl's `actor_rollout_ref.actor.*` keys)."""

    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio_low: float = 0.2
    """PPO lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.28
    """PPO upper clip: ratio <= 1 + clip_ratio_high."""
    loss_agg_mode: LossAggMode = "token-mean"
    """'token-mean' (every token of the mini-batch weighs the same) or 'seq-mean-token-mean'."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    micro_batch_size: int = 32
    """Trajectories per forward/backward pass (gradient accumulation; memory only)."""


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
