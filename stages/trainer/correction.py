"""Rollout correction: importance weights and rejection masks between the behaviour and the proximal policy.

Decoupled PPO (Hilton et al.; verl's `compute_prox_log_prob` with rollout correction) separates two policies
that plain PPO conflates when samples are stale or partial:
- the behaviour policy mu, whose logprobs the engine recorded while sampling (possibly several weight versions
  within one response);
- the proximal policy pi_prox: the trainer's weights at the start of the step, recomputed on the same tokens.

The PPO ratio and its clip use pi_theta / pi_prox (the trust region is around weights the trainer actually
has), and the off-policy gap is corrected by an importance weight w = pi_prox / mu, detached:
- `rollout_is: token`: w_t = pi_prox(y_t) / mu(y_t) per token;
- `rollout_is: sequence`: w = prod_t pi_prox(y_t) / mu(y_t) for the whole response, on every token;
- either way truncated from above at `rollout_is_threshold` (TIS), so one unlikely sample cannot dominate.
Rejection masks drop whole responses whose ratio says they came from too different a policy:
- `rollout_rs: sequence`: prod_t ratio outside [lower, upper];  `geometric`: exp(mean_t log ratio) outside it;
- `rollout_token_veto_threshold`: any single token ratio below it.
Log ratios are clamped to +-20 before exp, as verl does, so weights stay finite in float32.

All tensors are (B, T) over response tokens, right-padded; `mask` is 1 on trained tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stages.trainer.settings import CorrectionSettings

LOG_RATIO_CLAMP = 20.0


@dataclass
class Correction:
    weights: torch.Tensor  # (B, T) detached importance weights; 1 where no IS is configured
    mask: torch.Tensor  # (B, T) the trained-token mask after rejection
    stats: dict[str, float]  # sums and counts; `finalize_stats` turns a step's sums into metrics


def rollout_correction(
    prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> Correction:
    log_ratio = torch.clamp(prox_logp - behaviour_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) * mask  # (B, T)
    tokens = mask.sum(-1)  # (B,)
    seq_log_ratio = log_ratio.sum(-1)  # (B,)
    keep = _accepted(log_ratio, seq_log_ratio, tokens, mask, settings)  # (B,) bool
    weights = torch.ones_like(prox_logp)
    raw_units = torch.exp(log_ratio[mask > 0])  # token-level ratios: the metrics' units unless IS is sequence-level
    if settings.rollout_is == "token":
        weights = torch.exp(log_ratio).clamp(max=settings.rollout_is_threshold)
    elif settings.rollout_is == "sequence":
        raw_units = torch.exp(torch.clamp(seq_log_ratio[tokens > 0], -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        seq_w = torch.exp(torch.clamp(seq_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights = seq_w.clamp(max=settings.rollout_is_threshold)[:, None].expand_as(prox_logp).clone()
    new_mask = mask * keep[:, None].to(mask.dtype)
    return Correction(weights.detach() * mask, new_mask, _stats(raw_units, log_ratio, mask, keep, tokens, settings))


def _accepted(log_ratio, seq_log_ratio, tokens, mask, settings: CorrectionSettings) -> torch.Tensor:
    keep = torch.ones(log_ratio.shape[0], dtype=torch.bool)
    if settings.rollout_rs is not None:
        lower, upper = settings.rs_bounds
        stat = seq_log_ratio if settings.rollout_rs == "sequence" else seq_log_ratio / tokens.clamp(min=1)
        keep &= (stat <= math.log(upper)) & (stat >= math.log(lower))
    if settings.rollout_token_veto_threshold is not None:
        vetoed = ((log_ratio < math.log(settings.rollout_token_veto_threshold)) & (mask > 0)).any(-1)
        keep &= ~vetoed
    return keep


def _stats(raw_units, log_ratio, mask, keep, tokens, settings: CorrectionSettings) -> dict[str, float]:
    """Sums over this micro/mini-batch; the IS statistics are over the units IS weighs (tokens or sequences).
    In float64: thousands of float32 terms would leave ESS a rounding error above its bound of 1."""
    raw_units, log_ratio, mask = raw_units.double(), log_ratio.double(), mask.double()
    truncated = raw_units.clamp(max=settings.rollout_is_threshold)
    ratio = torch.exp(log_ratio) * mask
    return {
        "is_count": float(raw_units.numel()),
        "is_sum": float(raw_units.sum()),
        "is_sq_sum": float((raw_units**2).sum()),
        "is_max": float(raw_units.max()) if raw_units.numel() else 0.0,
        "is_clipped": float((raw_units > settings.rollout_is_threshold).sum()),
        "is_trunc_sum": float(truncated.sum()),
        "is_trunc_sq_sum": float((truncated**2).sum()),
        "tokens": float(mask.sum()),
        "kl_k1_sum": float((-log_ratio * mask).sum()),  # E_mu[log mu - log pi_prox]: KL(mu || pi_prox)
        "kl_k3_sum": float(((ratio - 1.0 - log_ratio) * mask).sum()),  # the nonnegative k3 estimator of it
        "rs_masked_tokens": float((mask * (~keep)[:, None].to(mask.dtype)).sum()),
        "sequences": float((tokens > 0).sum()),
        "rs_masked_sequences": float(((~keep) & (tokens > 0)).sum()),
    }


def merge_stats(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    for key, value in part.items():
        total[key] = max(total.get(key, 0.0), value) if key == "is_max" else total.get(key, 0.0) + value
    return total


def finalize_stats(s: dict[str, float]) -> dict[str, float]:
    """verl-style metric names; ESS is the normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1]."""
    n, tokens, seqs = max(s["is_count"], 1.0), max(s["tokens"], 1.0), max(s["sequences"], 1.0)
    mean = s["is_sum"] / n
    return {
        "rollout_corr/rollout_is_mean": mean,
        "rollout_corr/rollout_is_max": s["is_max"],
        "rollout_corr/rollout_is_std": math.sqrt(max(s["is_sq_sum"] / n - mean**2, 0.0)),
        "rollout_corr/rollout_is_clipped_fraction": s["is_clipped"] / n,
        # <= 1 by Cauchy-Schwarz; min() only removes what rounding leaves above it
        "rollout_corr/rollout_is_eff_sample_size": min(
            1.0, s["is_trunc_sum"] ** 2 / max(n * s["is_trunc_sq_sum"], 1e-30)
        ),
        "rollout_corr/kl": s["kl_k1_sum"] / tokens,
        "rollout_corr/k3_kl": s["kl_k3_sum"] / tokens,
        "rollout_corr/rollout_rs_masked_fraction": s["rs_masked_tokens"] / tokens,
        "rollout_corr/rollout_rs_masked_seq_fraction": s["rs_masked_sequences"] / seqs,
    }
