"""verl's optimal token baseline (`algorithm.adv_estimator=optimal_token_baseline`, and its multi-turn form
`tir_optimal_token_baseline`), computed in two halves: the returns in the stream, the baseline in the trainer.

Input columns:  response_mask, reward (+ response_logprobs, ref_logprobs with the KL in the reward)
Output columns: input columns + advantage (float32; the first trained token's), token_advantages (list<float32>:
                the returns G_t, 0 on masked tokens) (+ reward_kl with the KL in the reward)

verl's compute_optimal_token_baseline_advantage gives every token its own baseline, B_t = sum_i G_it W_it /
(sum_i W_it + 1e-8) over the prompt's group, where G_t is the reward-to-go of the token-level rewards (the score on
the last token, minus the KL per token with the KL in the reward) and W_t = sum_{j <= t} w_j the path's cumulated
variance proxy, w_j = 1 - 2 pi_j + sum_v pi_v^2, pi from the proximal logprobs (the trainer's, before the step's
first update), and w scaled by the squared rollout IS weight when rollout correction weighs. The advantage is
(G_t - B_t) on the trained tokens. A group of one keeps its returns (baseline 0). With handle_zero_tail (verl's
default), the baseline of a group's single longest response is 0 past the second longest. The plain form sums over
the responses at the same position t of the (right-padded) response; the `tir_` form first closes the gaps of
each response's mask (tool tokens in a multi-turn response) and sums at the same trained-token index, over the
group's responses that have trained tokens.

sum_v pi_v^2 needs the full distribution at every response token, which only the trainer's forward pass has. So
this stage writes the returns G (the sample log holds them, and the audit recomputes them), and the trainer, after
its proximal pass (which computes sum pi^2 beside the logprobs, verl's calculate_sum_pi_squared) and rollout
correction, replaces them with G - B (`subtract_baseline`). The mask is the trainer's after rejection sampling, as
verl's; the returns are the stream's, over the engine's mask: the two differ only where a rejected token carries a
reward (verl drops it from the returns, here it stays in the earlier tokens' returns).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from stages.advantage.base import AdvantageStage, TokenRewards, first_trained

if TYPE_CHECKING:
    import torch

EPS = 1e-8  # verl's epsilon in the baseline's denominator
BASELINES = {"optimal_token_baseline": "otb", "tir_optimal_token_baseline": "tir"}


class OptimalTokenBaselineAdvantage(AdvantageStage):
    """The stream's half of both forms: the returns. The trainer subtracts the form's baseline, which it knows from
    algorithm.adv_estimator (BASELINES, pipeline/trainer_launch.py)."""

    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        masked = rewards.token_rewards * rewards.mask
        returns = np.flip(np.cumsum(np.flip(masked, 1), 1), 1) * rewards.mask
        return returns, first_trained(returns, rewards.mask)


class TIROptimalTokenBaselineAdvantage(OptimalTokenBaselineAdvantage):
    """The multi-turn form's stream half: the same returns."""


def subtract_baseline(
    kind: str,
    groups: list[str],
    returns: list,
    masks: list,
    old_logprobs: list,
    sum_pi2: list,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
) -> list[np.ndarray]:
    """The trainer's half: each row's advantages (G - B) * mask, from ragged rows of returns, trained-token masks,
    proximal logprobs and sum pi^2; `groups`: each row's prompt; `is_weights`: (B, T') rollout IS weights, right-
    padded, or None; `kind`: 'otb' or 'tir'."""
    import torch  # the trainer's half: only where the trainer runs

    lengths = [len(r) for r in returns]
    g, m, lp, s = (_pad(rows, lengths) for rows in (returns, masks, old_logprobs, sum_pi2))
    w = 1.0 - 2.0 * torch.exp(lp) + s
    if is_weights is not None:
        w = w * is_weights[:, : w.shape[1]].float() ** 2
    cum_w = (w * m).cumsum(dim=-1)
    g = g * m
    members: dict[str, list[int]] = defaultdict(list)
    for i, pid in enumerate(groups):
        members[pid].append(i)
    if kind == "otb":
        adv = (g - _position_baselines(g, cum_w, m, members.values(), handle_zero_tail)) * m
    elif kind == "tir":
        adv = _tir_advantages(g, cum_w, m, members.values(), handle_zero_tail)
    else:
        raise ValueError(f"unknown trainer baseline {kind!r}: expected 'otb' or 'tir'")
    return [adv[i, :n].numpy() for i, n in enumerate(lengths)]


def _position_baselines(g, cum_w, m, members, handle_zero_tail: bool) -> torch.Tensor:
    """verl's plain form: B_t over the group's responses at response position t."""
    import torch

    baselines = torch.zeros_like(g)
    for rows in members:
        if len(rows) == 1:
            continue
        idx = torch.tensor(rows)
        num = (g[idx] * cum_w[idx] * m[idx]).sum(dim=0)
        baselines[idx] = (num / ((cum_w[idx] * m[idx]).sum(dim=0) + EPS)).expand(len(rows), -1)
        if handle_zero_tail:
            _zero_tail(baselines, rows, m[idx].sum(dim=-1))
    return baselines


def _tir_advantages(g, cum_w, m, members, handle_zero_tail: bool) -> torch.Tensor:
    """verl's multi-turn form: each response's trained tokens closed up, B_j at trained-token index j."""
    import torch

    trained = m.bool()
    lengths = m.sum(dim=-1).long()
    width = int(lengths.max()) if len(lengths) else 0
    closed_g, closed_w = torch.zeros(len(g), width), torch.zeros(len(g), width)
    for i in range(len(g)):
        closed_g[i, : lengths[i]], closed_w[i, : lengths[i]] = g[i, trained[i]], cum_w[i, trained[i]]
    baselines = torch.zeros_like(closed_g)
    for rows in members:
        rows = [i for i in rows if lengths[i] > 0]
        if len(rows) < 2:
            continue
        idx = torch.tensor(rows)
        baselines[idx] = (closed_g[idx] * closed_w[idx]).sum(dim=0) / (closed_w[idx].sum(dim=0) + EPS)
        if handle_zero_tail:
            _zero_tail(baselines, rows, lengths[idx])
    closed = closed_g - baselines
    adv = torch.zeros_like(g)
    for i in range(len(g)):
        adv[i, trained[i]] = closed[i, : lengths[i]]
    return adv * m


def _zero_tail(baselines: torch.Tensor, rows: list[int], lengths: torch.Tensor) -> None:
    """The group's single longest response gets baseline 0 past the second longest (verl's handle_zero_tail)."""
    import torch

    ordered = torch.sort(lengths).values
    longest, second = int(ordered[-1]), int(ordered[-2])
    at_max = (lengths == longest).nonzero(as_tuple=True)[0]
    if at_max.numel() == 1 and longest > second:
        baselines[rows[int(at_max[0])], second:] = 0.0


def _pad(rows: list, lengths: list[int]) -> torch.Tensor:
    import torch

    out = torch.zeros(len(rows), max(lengths, default=0))
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        out[i, :n] = torch.as_tensor(np.asarray(row, np.float32)[:n])
    return out
