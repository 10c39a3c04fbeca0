"""Rollout correction: importance weights and rejection masks between the behaviour and the proximal policy.

Decoupled PPO (Hilton et al.; verl's `compute_prox_log_prob` with rollout correction) separates two policies
that plain PPO conflates when samples are stale or partial:
- the behaviour policy mu, whose logprobs the engine recorded while sampling (possibly several weight versions
  within one response);
- the proximal policy pi_prox: the trainer's weights at the start of the step, recomputed on the same tokens.

The PPO ratio and its clip use pi_theta / pi_prox; the off-policy gap is corrected with log rho = log pi_prox -
log mu. verl does that once per training batch on the driver, so `correct_step` takes a whole step's rows (every
mini-batch together): batch normalisation, the metrics and hence the result do not depend on how the step is cut
into mini-batches.
- IS (`rollout_is`): token weights rho_t, or sequence weights prod_t rho_t on every token; truncated from above at
  `rollout_is_threshold` (TIS: nothing is zeroed, small weights stay), or with a 'lo_hi' threshold zeroed outside
  [lo, hi] (IcePop); detached, optionally divided by their mean. Their statistics are verl's: of the applied
  weights (after truncation; population std), the threshold fractions of the weights before it.
- Rejection (`rollout_rs`, see CorrectionSettings): per-token divergences k1 = -log rho, k2 = (log rho)^2 / 2,
  k3 = rho - 1 - log rho, taken per token or per response (sum, mean, max); rejected tokens leave the mask, their
  IS weights are untouched.
- Metrics are verl's (`rollout_corr/` prefix), off-policy diagnostics included, whatever is configured.
Log ratios are clamped to +-20 before exp, as verl does. Everything is computed in float64, so the metrics of
thousands of near-equal float32 ratios are not rounding noise.

All tensors are (B, T) over response tokens, right-padded; `mask` is 1 on trained tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from stages.trainer.settings import CorrectionSettings

SAFETY_BOUND = 20.0
EPS = 1e-8  # verl's masked-mean denominator guard, kept so the metrics match its values


@dataclass
class StepCorrection:
    masks: list[np.ndarray]  # per row (its response length): the trained-token mask after rejection
    weights: list[np.ndarray] | None  # per row: detached IS weights, 0 on masked tokens; None without `rollout_is`
    metrics: dict[str, float]  # `rollout_corr/*`


def correct_step(
    prox_rows: list, behaviour_rows: list, mask_rows: list, settings: CorrectionSettings
) -> StepCorrection:
    """One step's correction over ragged rows (proximal logprobs, behaviour logprobs, token mask per response)."""
    lengths = [len(m) for m in mask_rows]
    width = max(lengths, default=0)

    def padded(rows: list) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.float64)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            out[i, :n] = torch.as_tensor(np.asarray(row, np.float64)[:n])
        return out

    prox, behaviour, mask = padded(prox_rows), padded(behaviour_rows), padded(mask_rows)
    if not bool((mask > 0).any()):  # nothing to train on; verl raises here, a step of empty responses just passes
        weights = [np.zeros(n, np.float32) for n in lengths] if settings.rollout_is else None
        return StepCorrection([np.asarray(m, np.float32) for m in mask_rows], weights, {})
    new_mask, weights, metrics = correct(prox, behaviour, mask, settings)
    masks = [new_mask[i, :n].numpy().astype(np.float32) for i, n in enumerate(lengths)]
    rows = None if weights is None else [weights[i, :n].numpy().astype(np.float32) for i, n in enumerate(lengths)]
    return StepCorrection(masks, rows, metrics)


def correct_minibatches(
    minibatches: list, anchors: list, settings: CorrectionSettings
) -> tuple[list, dict[str, float]]:
    """The whole step corrected at once, as verl corrects a training batch; then each mini-batch's share: its
    rejection-masked token masks and (B, T) IS weights, right-padded (None without `rollout_is`)."""
    step = correct_step(
        [row for anchor in anchors for row in anchor],
        [row for mb in minibatches for row in mb["response_logprobs"]],
        [row for mb in minibatches for row in mb["response_mask"]],
        settings,
    )
    shares, start = [], 0
    for mb in minibatches:
        share = slice(start, start + len(mb["response_ids"]))
        w = None if step.weights is None else step.weights[share]
        if w is not None:
            padded = torch.zeros(len(w), max(map(len, w), default=0))
            for i, row in enumerate(w):
                padded[i, : len(row)] = torch.as_tensor(row)
            w = padded
        shares.append((step.masks[share], w))
        start = share.stop
    return shares, step.metrics


def correct(
    prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """(B, T) tensors with at least one valid token -> (rejection-masked mask, IS weights or None, metrics)."""
    log_ratio = prox - behaviour
    metrics: dict[str, float] = {}
    weights = None
    if settings.rollout_is is not None:
        weights, is_metrics = is_weights(log_ratio, mask, settings)
        metrics |= is_metrics
    new_mask = mask
    rules = settings.rs_rules()
    if rules or settings.rollout_token_veto_threshold is not None:
        new_mask, rs_metrics = rejection_mask(log_ratio, mask, rules, settings.rollout_token_veto_threshold)
        metrics |= rs_metrics
    metrics |= offpolicy_metrics(prox, behaviour, mask)
    return new_mask, weights, {f"rollout_corr/{k}": v for k, v in metrics.items()}


# --- masked reductions (verl's torch_functional semantics) -----------------------------------------------------------
def _msum(x: torch.Tensor, m: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    x = torch.where(m > 0, x, torch.zeros_like(x))  # values outside the mask never leak, not even inf or nan
    return (x * m).sum() if axis is None else (x * m).sum(axis)


def _mmean(x: torch.Tensor, m: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """A fully masked row gives 0."""
    return _msum(x, m, axis) / ((m.sum() if axis is None else m.sum(axis)) + EPS)


def _masked_max(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(x.masked_fill(m <= 0, -math.inf).max())


def _masked_min(x: torch.Tensor, m: torch.Tensor) -> float:
    return float(x.masked_fill(m <= 0, math.inf).min())


def _std(values: torch.Tensor) -> float:
    """Unbiased, and 0 for a single value."""
    return float(values.std()) if values.numel() > 1 else 0.0


def _clamped_std(x: torch.Tensor, m: torch.Tensor, lo: float, hi: float) -> float:
    """Population, token-weighted std of x clamped to [lo, hi]; 0 on at most one token."""
    if float(m.sum()) <= 1:
        return 0.0
    c = x.clamp(min=lo, max=hi)
    return math.sqrt(max(0.0, float(_mmean(c * c, m) - _mmean(c, m) ** 2)))


# --- importance sampling ---------------------------------------------------------------------------------------------
def is_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, settings: CorrectionSettings
) -> tuple[torch.Tensor, dict[str, float]]:
    """The applied IS weights (truncated, or IcePop-zeroed with a 'lo_hi' threshold; optionally batch-normalised)
    and verl's metrics of them."""
    lo, hi = settings.is_bounds()
    if settings.rollout_is == "token":
        log_w = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
        unit_log = None
    else:
        unit_log = _msum(log_ratio, mask, -1)  # (B,) log prod_t rho_t, fully masked rows 0
        log_w = unit_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)[:, None].expand_as(log_ratio)
    raw = torch.exp(log_w) * mask
    if lo is None:  # TIS: truncated from above, nothing zeroed
        w = raw.clamp(max=hi)
    else:  # IcePop: weights outside [lo, hi] become 0
        w = torch.where((raw >= lo) & (raw <= hi), raw, torch.zeros_like(raw))
    metrics = _is_metrics(w, raw, unit_log, mask, lo, hi)
    if lo is not None:
        metrics["rollout_is_oob_ratio"] = float(_mmean(((raw < lo) | (raw > hi)).to(raw.dtype), mask))
    w = w.detach()
    if settings.rollout_is_batch_normalize:
        if settings.rollout_is == "token":
            mean = _mmean(w, mask)
        else:  # one weight per non-empty response
            rows = (mask.sum(-1) > 0).to(w.dtype)
            mean = (_mmean(w, mask, -1) * rows).sum() / rows.sum().clamp(min=EPS)
        if float(mean) > EPS:
            w = w / mean
        metrics["rollout_is_batch_norm_factor"] = float(mean) if float(mean) > EPS else 1.0
    return w, metrics


def _is_metrics(
    w: torch.Tensor, raw: torch.Tensor, seq_log: torch.Tensor | None, mask: torch.Tensor, lo: float | None, hi: float
) -> dict[str, float]:
    """verl's IS metrics (compute_is_metrics): `w` the applied weights (after truncation or IcePop), `raw` the
    masked weights before it, `seq_log` the (B,) unclamped log weights of sequence IS, whose max/min/fractions run
    over all B rows (a fully masked row counts as weight 1). Mean, std (population), ESS and the per-response
    statistics describe the applied weights; the threshold fractions the raw ones."""
    lower = 1.0 / hi if lo is None else lo
    out = {"rollout_is_mean": float(_mmean(w, mask))}
    if seq_log is None:
        out |= {
            "rollout_is_ratio_fraction_high": float(_mmean((raw > hi).to(w.dtype), mask)),
            "rollout_is_ratio_fraction_low": float(_mmean((raw < lower).to(w.dtype), mask)),
            "rollout_is_max": _masked_max(w, mask),
            "rollout_is_min": _masked_min(w, mask),
        }
    else:
        out |= {
            "rollout_is_ratio_fraction_high": float((seq_log > math.log(hi)).double().mean()),
            "rollout_is_ratio_fraction_low": float((seq_log < math.log(lower)).double().mean()),
            "rollout_is_max": math.exp(min(float(seq_log.max()), SAFETY_BOUND)),
            "rollout_is_min": math.exp(float(seq_log.min())),
        }
    bounded = w.clamp(min=0.0, max=hi)
    mean = _mmean(bounded, mask)
    variance = float(_mmean(bounded * bounded, mask) - mean**2)
    out["rollout_is_std"] = math.sqrt(max(0.0, variance)) if float(mask.sum()) > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / float(_mmean((bounded / (mean + EPS)) ** 2, mask))
    q, q_raw = _mmean(w, mask, -1), _mmean(raw, mask, -1)  # (B,) per-response mean weight, 0 for a masked row
    out |= {
        "rollout_is_seq_mean": float(q.mean()),
        "rollout_is_seq_std": _std(q),
        "rollout_is_seq_max": float(q.max()),
        "rollout_is_seq_min": float(q.min()),
        "rollout_is_seq_max_deviation": float((q - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": float((q_raw > hi).double().mean()),
        "rollout_is_seq_fraction_low": float((q_raw < lower).double().mean()),
    }
    return out


# --- rejection -------------------------------------------------------------------------------------------------------
def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, rules: list[tuple[str, float | None, float]], veto: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """`mask` with every token some rule rejects set to 0, and per-rule plus combined metrics. `rules` are
    CorrectionSettings.rs_rules(); `veto` rejects a response holding any token with rho below it."""
    ell = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token_stats = {"k1": -ell, "k2": 0.5 * ell**2, "k3": torch.exp(ell) - 1.0 - ell}
    valid_rows = mask.sum(-1) > 0  # (B,)
    keep_all = torch.ones_like(mask, dtype=torch.bool)
    metrics: dict[str, float] = {}
    for option, lo, hi in rules:
        keep, option_metrics = _apply_option(option, lo, hi, token_stats[option[-2:]], mask, valid_rows)
        keep_all &= keep
        metrics |= option_metrics
    if veto is not None:
        vetoed = ((log_ratio < math.log(veto)) & (mask > 0)).any(-1)  # (B,)
        keep = (~vetoed)[:, None].expand_as(mask)
        keep_all &= keep
        metrics |= _masked_fractions("token_veto", keep, mask, valid_rows)
    final = keep_all.to(mask.dtype)
    metrics["rollout_rs_masked_fraction"] = float(_mmean(1.0 - final, mask))
    metrics["rollout_rs_seq_masked_fraction"] = float(((~keep_all) & (mask > 0)).any(-1).double().mean())
    return mask * final, metrics


def _apply_option(
    option: str, lo: float | None, hi: float, stat: torch.Tensor, mask: torch.Tensor, valid_rows: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """One rule's keep mask (B, T) and its metrics. k1 bounds are in log space: log lo <= stat <= log hi."""
    k1 = lo is not None
    upper, lower = (math.log(hi), math.log(lo)) if k1 else (hi, 0.0)
    row_stat = None
    if not option.startswith("token"):
        kind = option.split("_")[1]
        if kind == "sum":
            row_stat = _msum(stat, mask, -1)
        elif kind == "mean":
            row_stat = _mmean(stat, mask, -1)
        else:  # max over valid tokens; 0 for an empty row
            row_stat = torch.where(valid_rows, stat.masked_fill(mask <= 0, -math.inf).max(-1).values, 0.0)
        stat = row_stat[:, None].expand_as(mask)
    keep = (stat <= upper) & (stat >= lower) if k1 else stat <= upper
    metrics = _rs_metrics(f"rollout_rs_{option}", stat, row_stat, mask, valid_rows, lower if k1 else None, upper)
    return keep, metrics | _masked_fractions(option, keep, mask, valid_rows)


def _masked_fractions(option: str, keep: torch.Tensor, mask: torch.Tensor, valid_rows: torch.Tensor) -> dict:
    rejected_rows = ((~keep) & (mask > 0)).any(-1)[valid_rows]
    return {
        f"rollout_rs_{option}_masked_fraction": float(_mmean(1.0 - keep.to(mask.dtype), mask)),
        f"rollout_rs_{option}_seq_masked_fraction": float(rejected_rows.double().mean()),
    }


def _rs_metrics(
    prefix: str,
    stat: torch.Tensor,
    row_stat: torch.Tensor | None,
    mask: torch.Tensor,
    valid_rows: torch.Tensor,
    lower: float | None,
    upper: float,
) -> dict[str, float]:
    """verl's per-option statistics. `stat` (B, T) is per token (a row's value broadcast for sequence options);
    `lower` is None for k2/k3, which have no lower bound."""
    rows = (row_stat if row_stat is not None else _mmean(stat, mask, -1))[valid_rows]
    out = {f"{prefix}_mean": float(_mmean(stat, mask))}
    if row_stat is not None:
        out |= {
            f"{prefix}_max": float(rows.max()),
            f"{prefix}_min": float(rows.min()),
            f"{prefix}_fraction_high": float((rows > upper).double().mean()),
            f"{prefix}_fraction_low": float((rows < lower).double().mean()) if lower is not None else 0.0,
        }
    else:
        out |= {
            f"{prefix}_max": _masked_max(stat, mask),
            f"{prefix}_min": _masked_min(stat, mask),
            f"{prefix}_fraction_high": float(_mmean((stat > upper).to(stat.dtype), mask)),
            f"{prefix}_fraction_low": float(_mmean((stat < lower).to(stat.dtype), mask)) if lower is not None else 0.0,
        }
    out[f"{prefix}_std"] = _clamped_std(stat, mask, 0.0 if lower is None else lower, upper)
    out |= {
        f"{prefix}_seq_mean": float(rows.mean()),
        f"{prefix}_seq_std": _std(rows),
        f"{prefix}_seq_max": float(rows.max()),
        f"{prefix}_seq_min": float(rows.min()),
        f"{prefix}_seq_max_deviation": float(rows.abs().max()),
        f"{prefix}_seq_fraction_high": float((rows > upper).double().mean()),
    }
    if lower is not None:
        out[f"{prefix}_seq_fraction_low"] = float((rows < lower).double().mean())
    return out


# --- off-policy diagnostics ------------------------------------------------------------------------------------------
def offpolicy_metrics(prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """KL, perplexities and chi^2 between the engine and the trainer; row means run over all B rows."""
    log_ratio = prox - behaviour
    mean_prox, mean_behaviour = _mmean(prox, mask, -1), _mmean(behaviour, mask, -1)  # (B,)
    diff = mean_behaviour - mean_prox  # log(training ppl / rollout ppl) per response
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    seq_log = _msum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": float(torch.exp(-mean_prox).mean()),
        "training_log_ppl": float((-mean_prox).mean()),
        "kl": float(_mmean(behaviour - prox, mask)),  # KL(mu || pi_prox), k1 estimator
        "k3_kl": float(_mmean(torch.exp(log_ratio) - log_ratio - 1.0, mask)),
        "rollout_ppl": float(torch.exp(-mean_behaviour).mean()),
        "rollout_log_ppl": float((-mean_behaviour).mean()),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(torch.exp(diff).mean()),
        "chi2_token": float(_mmean(rho**2, mask) - 1.0),
        "chi2_seq": float(torch.exp(2.0 * seq_log).mean() - 1.0),
    }
