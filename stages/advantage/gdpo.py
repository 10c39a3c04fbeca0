"""GDPOAdvantage (`algorithm.adv_estimator=gdpo`): several reward components per sample, each normalised within its
group apart, then summed with weights and whitened over the training step.

Input columns:  prompt_id, reward, response_mask, reward_extra_info (the components, by name)
Output columns: input columns + advantage (float32), token_advantages (list<float32>; 0 on masked tokens)

verl's compute_gdpo_outcome_advantage: for each key k of `algorithm.gdpo_reward_keys` (numbers the reward function
returns in its dict, found here in reward_extra_info), A_k = GRPO's (r_k - mean) / (std + epsilon) over the group
(std unbiased; `norm_adv_by_std_in_grpo=false` keeps r_k - mean; a group of one keeps r_k / (1 + epsilon)); then
A = sum_k w_k A_k with `algorithm.gdpo_reward_weights` (equal weights of 1 without them), broadcast over the trained
tokens and whitened over the whole batch of tokens (the training sink whitens the step, `whiten_over_step`). Without
reward keys the one component is the sample's reward, as in verl. The components are the function's raw numbers:
neither a KL in the reward nor a reward manager's shaping enters them, as in verl.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from schemas import require_columns
from stages.advantage.base import TokenRewards
from stages.advantage.grpo import GRPOAdvantage


class GDPOAdvantage(GRPOAdvantage):
    whiten_over_step = True

    def __init__(
        self,
        group_size: int,
        reward_keys: list[str] | None = None,
        reward_weights: list[float] | None = None,
        epsilon: float = 1e-6,
        norm_by_std: bool = True,
        kl_in_reward: bool = False,
        kl_coef: float = 0.001,
        kl_penalty: str = "kl",
    ) -> None:
        super().__init__(group_size, epsilon, norm_by_std, kl_in_reward, kl_coef, kl_penalty)
        self.reward_keys = list(reward_keys or [])
        weights = [1.0] * len(self.reward_keys) if reward_weights is None else [float(w) for w in reward_weights]
        if self.reward_keys and len(weights) != len(self.reward_keys):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(weights)} weights for {len(self.reward_keys)} "
                f"gdpo_reward_keys {self.reward_keys}: give one weight per key, or none (equal weights)"
            )
        self.reward_weights = weights

    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        if not self.reward_keys:  # verl: the sample's reward is the one component
            return super().estimate(batch, rewards)
        components = self.components(batch, rewards)
        seq_adv = np.zeros(len(rewards.score), np.float64)
        for weight, scores in zip(self.reward_weights, components, strict=True):
            seq_adv += weight * self.per_group(batch, rewards, scores)
        return seq_adv[:, None] * rewards.mask, seq_adv

    def components(self, batch: pa.Table, rewards: TokenRewards) -> list[np.ndarray]:
        """(B,) scores of each reward key, read from reward_extra_info; a sample in the loss without one of them is an
        error naming the key and the keys it has."""
        require_columns(batch, ["reward_extra_info"], "GDPOAdvantage with algorithm.gdpo_reward_keys")
        infos = [json.loads(text) if text else {} for text in batch.column("reward_extra_info").to_pylist()]
        counted = np.ones(len(infos), bool) if rewards.counts is None else rewards.counts
        out = []
        for key in self.reward_keys:
            values = np.zeros(len(infos), np.float64)
            for i, info in enumerate(infos):
                if not counted[i]:
                    continue  # a failed reward: out of the loss, no components
                if not isinstance(info.get(key), bool | int | float):
                    raise ValueError(
                        f"algorithm.gdpo_reward_keys names {key!r}, but the reward of sample "
                        f"{batch.column('prompt_id')[i]} has {sorted(info) or 'no extra info'}: the reward function "
                        "must return a dict with a number under every key of gdpo_reward_keys"
                    )
                values[i] = float(info[key])
            out.append(values)
        return out
