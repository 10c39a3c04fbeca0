"""The learning-rate schedule: verl's `actor.optim.*` keys and the rate they give each trainer step.

verl computes the schedule in two places with two key families, and both are accepted here:
- its FSDP engine (`lr_scheduler_type` constant/cosine, `min_lr_ratio`, `num_cycles`, a LambdaLR stepped once per
  trainer step from step 0): warmup `lr * k / W` for k < W, then constant, or cosine
  `max(m, (1 - m) / 2 * cos(2 pi c p) + (1 + m) / 2) * lr` with p the progress after warmup, m `min_lr_ratio`, c
  `num_cycles`;
- its Megatron engine (`lr_decay_style` constant/linear/cosine, `lr_decay_steps`, `min_lr`, `lr_warmup_init`):
  warmup `init + (lr - init) * k / W` up to k = W, then `min + (lr - min) * coeff(p)` until `lr_decay_steps`
  (linear `1 - p`, cosine `(1 + cos(pi p)) / 2`), `min_lr` after it.
With num_cycles 0.5 the two cosines are the same curve; `min_lr` (absolute) and `min_lr_ratio` (of `lr`) say the
same thing in two ways, so giving both is an error. The warmup is `lr_warmup_steps` when > 0, else
`int(lr_warmup_steps_ratio * decay steps)`, as in both of verl's engines.

One difference on purpose: verl's fully_async trainer sets the schedule's total to its number of weight syncs
(`total_rollout_steps / (required_samples * trigger_parameter_sync_step)`) but steps it once per trainer step, so
with `trigger_parameter_sync_step > 1` its cosine reaches the end early and (in the FSDP form) climbs again. Here
the total is the run's trainer steps, and past the end of the decay the rate stays at its minimum.

Pure data and arithmetic: loading a config imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DecayStyle = Literal["constant", "cosine", "linear"]


@dataclass
class OptimSettings:
    """verl's `actor.optim.*` besides `lr`, `weight_decay` and `clip_grad` (those are actor.lr, actor.weight_decay and
    actor.grad_clip): the schedule of the learning rate over the run's trainer steps, and AdamW's betas."""

    lr_warmup_steps: int = -1
    """Steps of linear warmup; <= 0 means lr_warmup_steps_ratio decides."""
    lr_warmup_steps_ratio: float = 0.0
    """Warmup as a share of the decay steps, when lr_warmup_steps <= 0."""
    lr_warmup_init: float = 0.0
    """The rate warmup starts from (verl's Megatron key; its FSDP warmup starts from 0)."""
    lr_decay_style: DecayStyle = "constant"
    """After warmup: 'constant', 'cosine' or 'linear' (verl's FSDP spells it lr_scheduler_type or warmup_style)."""
    lr_decay_steps: int | None = None
    """Steps over which the rate decays, warmup included; null: the run's trainer steps."""
    min_lr_ratio: float | None = None
    """The floor of the decay as a share of lr (verl's FSDP key); null: min_lr, else 0."""
    min_lr: float | None = None
    """The floor of the decay as a rate (verl's Megatron key); give it or min_lr_ratio, not both."""
    num_cycles: float = 0.5
    """Cosine waves over the decay (verl's FSDP key); 0.5 goes from lr down to the floor once."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    optimizer: Literal["AdamW", "adam"] = "AdamW"
    """The optimizer: AdamW (verl's FSDP name) or adam (its Megatron name for the same decoupled-decay Adam)."""
    total_training_steps: int = -1
    """Trainer steps of the run: set by the run (rollout.total_rollout_steps // prompts per step); a value here is
    used only where the run does not set it (tests)."""

    def __post_init__(self) -> None:
        key = "actor.optim"
        if self.min_lr is not None and self.min_lr_ratio is not None:
            raise ValueError(f"{key}.min_lr and {key}.min_lr_ratio both set the floor of the decay: give one")
        if self.min_lr_ratio is not None and not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"{key}.min_lr_ratio must be in [0, 1], not {self.min_lr_ratio}")
        if not 0.0 <= self.lr_warmup_steps_ratio <= 1.0:
            raise ValueError(f"{key}.lr_warmup_steps_ratio must be in [0, 1], not {self.lr_warmup_steps_ratio}")
        if self.lr_decay_steps is not None and self.lr_decay_steps < 1:
            raise ValueError(f"{key}.lr_decay_steps must be >= 1 or null, not {self.lr_decay_steps}")
        if self.num_cycles <= 0:
            raise ValueError(f"{key}.num_cycles must be > 0, not {self.num_cycles}")

    def decay_steps(self) -> int:
        return self.lr_decay_steps if self.lr_decay_steps is not None else max(self.total_training_steps, 1)

    def warmup_steps(self) -> int:
        if self.lr_warmup_steps > 0:
            return self.lr_warmup_steps
        return int(self.lr_warmup_steps_ratio * self.decay_steps())

    def lr_at(self, step: int, lr: float) -> float:
        """The rate of trainer step `step` (0 for the first update of the run) for a peak rate `lr`."""
        warmup, decay = self.warmup_steps(), self.decay_steps()
        floor = self.min_lr if self.min_lr is not None else lr * (self.min_lr_ratio or 0.0)
        if step < warmup:
            return self.lr_warmup_init + (lr - self.lr_warmup_init) * step / warmup
        if self.lr_decay_style == "constant":
            return lr
        progress = (step - warmup) / max(1, decay - warmup)
        if progress > 1.0:
            return floor
        if self.lr_decay_style == "linear":
            return floor + (lr - floor) * (1.0 - progress)
        ratio = floor / lr if lr > 0 else 0.0
        wave = math.cos(math.pi * 2.0 * self.num_cycles * progress)
        return lr * max(ratio, (1.0 - ratio) * 0.5 * wave + (1.0 + ratio) * 0.5)


STEP_KEY = "lr_step"  # the schedule's position, kept in the optimizer's param groups so that checkpoints carry it


def apply_lr(optimizer, settings: OptimSettings, lr: float) -> float:
    """Set every param group's rate for the trainer step about to run and advance the schedule by one; returns the
    rate (verl's actor/lr). The position lives in the param groups (`lr_step`), which an optimizer's state_dict
    saves and loads, so a resumed run continues the schedule where its checkpoint left it."""
    step = int(optimizer.param_groups[0].get(STEP_KEY, 0))
    rate = settings.lr_at(step, lr)
    for group in optimizer.param_groups:
        group["lr"] = rate
        group[STEP_KEY] = step + 1
    return rate
