"""The parts of a PPO step that do not depend on how a backend runs its model: one mini-batch's rows turned into
masks, anchors and the aggregation denominator; one micro-batch's loss; and a step's `train/*` metrics.

TorchTrainer and MegatronRank both call these, so the two backends train the same objective and report the same
metrics by construction; each backend only supplies `token_logprobs` (its forward pass) and its optimizer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.trainer.loss import PolicyLoss, ppo_clip_loss
from stages.trainer.settings import PolicySettings

NEEDED_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "response_mask", "advantage")
TokenLogprobs = Callable[[list, list], tuple[torch.Tensor, torch.Tensor]]  # (prompts, responses) -> (B, T) x 2


@dataclass
class Minibatch:
    """One optimizer update's rows: `masks` are the trained tokens (after any rejection), `old` the PPO anchors."""

    rows: dict[str, list]
    masks: list[np.ndarray]
    old: list
    denominator: float  # the whole mini-batch's tokens (token-mean) or sequences: micro-batches sum to its mean
    is_weights: torch.Tensor | None = None  # (B, T) rollout-correction weights, None without `rollout_is`

    @classmethod
    def of(
        cls,
        rows: dict[str, list],
        agg: str,
        anchor: list | None = None,
        masks: list | None = None,
        is_weights: torch.Tensor | None = None,
    ) -> Minibatch:
        missing = [c for c in NEEDED_COLUMNS if c not in rows]
        if missing:
            raise KeyError(f"the trainer needs columns {missing}")
        masks = masks if masks is not None else [np.asarray(m, dtype=np.float32) for m in rows["response_mask"]]
        tokens = float(sum(m.sum() for m in masks))
        denominator = max(tokens, 1.0) if agg == "token-mean" else float(len(rows["response_ids"]))
        return cls(rows, masks, anchor if anchor is not None else rows["response_logprobs"], denominator, is_weights)

    @property
    def num_tokens(self) -> float:
        return float(sum(m.sum() for m in self.masks))

    def slices(self, micro: int) -> list[slice]:
        return [slice(lo, lo + micro) for lo in range(0, len(self.rows["response_ids"]), micro)]

    def loss(self, token_logprobs: TokenLogprobs, sl: slice, policy: PolicySettings, device="cpu") -> PolicyLoss:
        """The PPO loss of micro-batch `sl`, already divided by the mini-batch's denominator."""
        rows = self.rows
        logp, valid = token_logprobs(rows["prompt_ids"][sl], rows["response_ids"][sl])  # (B, T) x 2
        width = logp.shape[1]
        old = pad_rows([np.asarray(x, np.float32) for x in self.old[sl]], width).to(device)
        mask = valid * pad_rows(self.masks[sl], width).to(device)
        adv = torch.tensor(np.asarray(rows["advantage"][sl], np.float32), device=device)
        w = None if self.is_weights is None else self.is_weights[sl, :width].to(device)
        clip = (policy.clip_ratio_low, policy.clip_ratio_high)
        return ppo_clip_loss(logp, old, adv, mask, *clip, policy.loss_agg_mode, self.denominator, w)


@dataclass
class StepTotals:
    """Sums over a step's mini-batches, turned into the `train/*` metrics both backends report."""

    started: float = field(default_factory=time.monotonic)
    updates: int = 0
    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("loss", "grad_norm", "clipped"), 0.0))
    token_sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("ratio", "kl", "tokens"), 0.0))

    def add_micro(self, res: PolicyLoss) -> None:
        self.sums["loss"] += res.loss.detach().item()
        self.sums["clipped"] += res.clipped_tokens
        self.token_sums["ratio"] += res.ratio_sum
        self.token_sums["kl"] += res.kl_sum

    def add_update(self, num_tokens: float, grad_norm: float) -> None:
        self.updates += 1
        self.token_sums["tokens"] += num_tokens
        self.sums["grad_norm"] += grad_norm

    def metrics(self) -> dict[str, float]:
        n, tokens = max(self.updates, 1), max(self.token_sums["tokens"], 1.0)
        return {
            "train/loss": self.sums["loss"] / n,
            "train/grad_norm": self.sums["grad_norm"] / n,
            "train/pg_clipfrac": self.sums["clipped"] / tokens,
            "train/ratio_mean": self.token_sums["ratio"] / tokens,
            "train/ppo_kl": self.token_sums["kl"] / tokens,
            "train/num_tokens": float(self.token_sums["tokens"]),
            "timing/train_s": time.monotonic() - self.started,
        }


def pad_rows(rows: list[np.ndarray], width: int) -> torch.Tensor:
    """Right-pad ragged rows with zeros into a (B, width) float tensor."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row[:width])
    return out
