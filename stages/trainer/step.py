"""The parts of a PPO step that do not depend on how a backend runs its model: one mini-batch's rows turned into
masks, anchors, advantages and the aggregation counts; one micro-batch's objective; and a step's metrics.

The objective is verl's actor loss: policy loss - entropy_coeff * entropy + kl_loss_coef * KL(current || ref),
the three aggregated alike (stages/trainer/loss.py) with the whole mini-batch's denominators, so the micro-batches'
gradients add up to the mini-batch's. TorchTrainer and MegatronRank both call these, so the two backends train the
same objective and report the same metrics by construction; each backend only supplies `token_logprobs` (its
forward pass) and its optimizer.

Metrics, under verl's names, over a step of one or more mini-batches (one optimizer update each):
- actor/pg_loss, actor/entropy, actor/kl_loss: each mini-batch's aggregated value (the sum of its micro-batches'
  shares), averaged over the step's mini-batches (verl's legacy actor sums them; one mini-batch per step agrees);
- actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl (mean of old - new logprob, the log-ratio clamped),
  train/ratio_mean: token-weighted over all the step's trained tokens, not a mean of micro-batch means;
- actor/grad_norm: the pre-clip norm, averaged over the step's updates; actor/kl_coef when the KL loss is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.trainer.kl import kl_penalty
from stages.trainer.loss import AggCounts, PolicyLoss, TokenLogprobs, agg_loss, ppo_clip_loss
from stages.trainer.settings import PolicySettings

NEEDED_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "response_mask")


@dataclass
class MicroLoss:
    total: torch.Tensor  # what the backend backpropagates: pg - entropy_coeff * entropy + kl_coef * kl
    pg: PolicyLoss
    entropy: float  # this micro-batch's share of the mini-batch's aggregated entropy
    kl: float  # its share of the aggregated KL loss (0 when the KL loss is off)


@dataclass
class Minibatch:
    """One optimizer update's rows: `masks` are the trained tokens (after any rejection), `old` the PPO anchors."""

    rows: dict[str, list]
    masks: list[np.ndarray]
    old: list
    counts: AggCounts  # the whole mini-batch's: every micro-batch divides by them
    is_weights: torch.Tensor | None = None  # (B, T) rollout-correction weights, None without `rollout_is`

    @classmethod
    def of(
        cls,
        rows: dict[str, list],
        policy: PolicySettings,
        anchor: list | None = None,
        masks: list | None = None,
        is_weights: torch.Tensor | None = None,
        counts: AggCounts | None = None,
    ) -> Minibatch:
        """`counts`: the aggregation's counts when they span more than these rows (data-parallel ranks pass the
        global ones and dp_size); by default this mini-batch's own."""
        missing = [c for c in NEEDED_COLUMNS if c not in rows]
        if "token_advantages" not in rows and "advantage" not in rows:
            missing.append("token_advantages (or advantage)")
        if missing:
            raise KeyError(f"the trainer needs columns {missing}")
        if policy.use_kl_loss:
            _check_ref_logprobs(rows)
        masks = masks if masks is not None else [np.asarray(m, dtype=np.float32) for m in rows["response_mask"]]
        if counts is None:
            width = max((len(r) for r in rows["response_ids"]), default=1)  # verl's null: the padded width
            counts = AggCounts(
                tokens=float(sum(m.sum() for m in masks)),
                sequences=float(len(rows["response_ids"])),
                scale_factor=float(policy.loss_scale_factor or width),
            )
        return cls(rows, masks, anchor if anchor is not None else rows["response_logprobs"], counts, is_weights)

    def slices(self, micro: int) -> list[slice]:
        return [slice(lo, lo + micro) for lo in range(0, len(self.rows["response_ids"]), micro)]

    def loss(self, token_logprobs: TokenLogprobs, sl: slice, policy: PolicySettings, device="cpu") -> MicroLoss:
        """Micro-batch `sl`'s share of the mini-batch's objective."""
        rows = self.rows
        fwd = token_logprobs(rows["prompt_ids"][sl], rows["response_ids"][sl], entropy=True)  # (B, T) each
        width = fwd.logp.shape[1]
        old = self._pad(self.old[sl], width, device)
        mask = fwd.mask * self._pad(self.masks[sl], width, device)
        w = None if self.is_weights is None else self.is_weights[sl, :width].to(device)
        agg, den = policy.loss_agg_mode, self.counts.denominator(policy.loss_agg_mode)
        clip = (policy.clip_low, policy.clip_high)
        pg = ppo_clip_loss(
            fwd.logp, old, self._advantages(sl, width, device), mask, *clip, agg, den, w, clip_c=policy.clip_ratio_c
        )
        entropy = agg_loss(fwd.entropy, mask, agg, den)
        total = pg.loss - policy.entropy_coeff * entropy if policy.entropy_coeff else pg.loss
        kl = torch.zeros(())
        if policy.use_kl_loss:
            ref = self._pad(rows["ref_logprobs"][sl], width, device)
            kl = agg_loss(kl_penalty(fwd.logp, ref, policy.kl_loss_type), mask, agg, den)
            total = total + policy.kl_loss_coef * kl
        return MicroLoss(total, pg, entropy=float(entropy.detach()), kl=float(kl.detach()))

    def _advantages(self, sl: slice, width: int, device) -> torch.Tensor:
        """(B, T) per-token advantages; a scalar `advantage` broadcast over the response when the batch has no
        `token_advantages` (sample logs written before the column, hand-built batches)."""
        if "token_advantages" in self.rows:
            return self._pad(self.rows["token_advantages"][sl], width, device)
        adv = torch.tensor(np.asarray(self.rows["advantage"][sl], np.float32), device=device)
        return adv[:, None].expand(-1, width)

    @staticmethod
    def _pad(rows: list, width: int, device) -> torch.Tensor:
        return pad_rows([np.asarray(x, np.float32) for x in rows], width).to(device)


def _check_ref_logprobs(rows: dict[str, list]) -> None:
    lacking = len(rows["response_ids"]) if "ref_logprobs" not in rows else sum(r is None for r in rows["ref_logprobs"])
    if lacking:
        raise KeyError(
            f"actor.use_kl_loss needs the ref_logprobs column (each response token's logprob under the reference "
            f"policy), and {lacking} of {len(rows['response_ids'])} rows of this mini-batch lack it: add the "
            "stage that writes it (stages.ref_logprob.RefLogprob) or set actor.use_kl_loss=false"
        )


@dataclass
class StepTotals:
    """Sums over a step's mini-batches, turned into the metrics both backends report (see the module docstring)."""

    policy: PolicySettings
    started: float = field(default_factory=time.monotonic)
    updates: int = 0
    shares: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("pg", "entropy", "kl", "grad_norm"), 0.0))
    token_sums: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("clipped", "dual_clipped", "kl", "ratio", "tokens"), 0.0)
    )

    def add_micro(self, res: MicroLoss) -> None:
        self.shares["pg"] += res.pg.loss.detach().item()
        self.shares["entropy"] += res.entropy
        self.shares["kl"] += res.kl
        for key, value in (
            ("clipped", res.pg.clipped_tokens),
            ("dual_clipped", res.pg.dual_clipped_tokens),
            ("kl", res.pg.kl_sum),
            ("ratio", res.pg.ratio_sum),
            ("tokens", res.pg.tokens),
        ):
            self.token_sums[key] += value

    def add_update(self, grad_norm: float) -> None:
        self.updates += 1
        self.shares["grad_norm"] += grad_norm

    def metrics(self) -> dict[str, float]:
        n, tokens = max(self.updates, 1), max(self.token_sums["tokens"], 1.0)
        out = {
            "actor/pg_loss": self.shares["pg"] / n,
            "actor/entropy": self.shares["entropy"] / n,
            "actor/kl_loss": self.shares["kl"] / n,
            "actor/grad_norm": self.shares["grad_norm"] / n,
            "actor/pg_clipfrac": self.token_sums["clipped"] / tokens,
            "actor/pg_clipfrac_lower": self.token_sums["dual_clipped"] / tokens,
            "actor/ppo_kl": self.token_sums["kl"] / tokens,
            "train/ratio_mean": self.token_sums["ratio"] / tokens,
            "train/num_tokens": float(self.token_sums["tokens"]),
            "timing/train_s": time.monotonic() - self.started,
        }
        if self.policy.use_kl_loss:
            out["actor/kl_coef"] = self.policy.kl_loss_coef
        return out


def pad_rows(rows: list[np.ndarray], width: int) -> torch.Tensor:
    """Right-pad ragged rows with zeros into a (B, width) float tensor."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row[:width])
    return out
