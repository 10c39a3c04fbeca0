"""GRPOAdvantage (`algorithm.adv_estimator=grpo`): each sample's score against its group's.

Input columns:  prompt_id, reward, response_mask (+ response_logprobs, ref_logprobs with the KL in the reward)
Output columns: input columns + advantage (float32), token_advantages (list<float32>; the advantage on every
                trained token, 0 on masked ones) (+ reward_kl with the KL in the reward)

verl's compute_grpo_outcome_advantage: a = (s - mean) / (std + epsilon) over the `rollout.n` responses to one
prompt, std the unbiased one, epsilon 1e-6; `norm_by_std=False` (algorithm.norm_adv_by_std_in_grpo, Dr.GRPO)
keeps s - mean. A group of one has mean 0 and std 1, so it keeps its own score: s / (1 + epsilon).
"""

from __future__ import annotations

import numpy as np

from stages.advantage.base import OutcomeAdvantage


class GRPOAdvantage(OutcomeAdvantage):
    def __init__(
        self,
        group_size: int,
        epsilon: float = 1e-6,
        norm_by_std: bool = True,
        kl_in_reward: bool = False,
        kl_coef: float = 0.001,
        kl_penalty: str = "kl",
    ) -> None:
        super().__init__(group_size, kl_in_reward, kl_coef, kl_penalty)
        self.epsilon = epsilon
        self.norm_by_std = norm_by_std

    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        if len(scores) == 1:
            mean, std = 0.0, 1.0
        else:
            mean, std = scores.mean(), scores.std(ddof=1)
        centred = scores - mean
        return centred / (std + self.epsilon) if self.norm_by_std else centred
