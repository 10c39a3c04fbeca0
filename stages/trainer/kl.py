"""Per-token KL estimators between the current (or behaviour) policy and the reference policy, by verl's names.

With d = logp - ref_logp on a response token:
- 'kl' / 'k1':          d                                  (unbiased, can be negative)
- 'abs':                |d|
- 'mse' / 'k2':         d^2 / 2
- 'low_var_kl' / 'k3':  exp(-d) + d - 1, the -d clamped to [-20, 20] before exp and the result to [-10, 10]
                        (Schulman's non-negative estimator; verl's default for `kl_loss_type`)
A trailing '+' ('k1+', 'k3+', ...) is the straight-through form: the value of the named estimator with the
gradient of k2 (d / dlogp = d), which is unbiased for the KL's gradient whatever the estimator's value.

verl's own `kl_penalty` passes the '+' name on unchanged and refuses it; here it means what verl documents.
All tensors are (B, T); the caller masks and aggregates.
"""

from __future__ import annotations

import torch

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_TYPES_ALL = KL_TYPES + tuple(t + "+" for t in KL_TYPES)
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of `kind` (one of KL_TYPES_ALL); gradients flow into `logp` only."""
    if kind.endswith("+"):
        value = _forward(logp, ref_logp, kind[:-1])
        k2 = _forward(logp, ref_logp, "k2")
        return k2 - k2.detach() + value.detach()  # value of `kind`, gradient of k2
    return _forward(logp, ref_logp, kind)


def _forward(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    d = logp - ref_logp.detach()
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("mse", "k2"):
        return 0.5 * d.square()
    if kind in ("low_var_kl", "k3"):
        neg = torch.clamp(-d, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(neg) - neg - 1.0, -_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"unknown KL type {kind!r}; valid: {', '.join(KL_TYPES_ALL)}")
