"""RLOOAdvantage (`algorithm.adv_estimator=rloo`): each sample's score against the mean of the others in its group.

Input columns:  prompt_id, reward, response_mask (+ response_logprobs, ref_logprobs with the KL in the reward)
Output columns: input columns + advantage (float32), token_advantages (list<float32>; the advantage on every
                trained token, 0 on masked ones) (+ reward_kl with the KL in the reward)

verl's compute_rloo_outcome_advantage: a = n / (n - 1) * (s - mean), which is s - mean(others), for a group of
n > 1. A group of one keeps its raw score, as that (the `rloo` key's) estimator does; verl's `rloo_vectorized`
gives it 0 instead.
"""

from __future__ import annotations

import numpy as np

from stages.advantage.base import OutcomeAdvantage


class RLOOAdvantage(OutcomeAdvantage):
    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        n = len(scores)
        if n == 1:
            return scores.copy()
        return n / (n - 1) * (scores - scores.mean())
