"""ReinforcePlusPlusBaselineAdvantage (`algorithm.adv_estimator=reinforce_plus_plus_baseline`): each sample's
score minus its group's mean, broadcast over its tokens and whitened over the training step.

Input columns:  prompt_id, reward, response_mask (+ response_logprobs, ref_logprobs with the KL in the reward)
Output columns: input columns + advantage (float32), token_advantages (list<float32>; 0 on masked tokens)
                (+ reward_kl with the KL in the reward)

verl's compute_reinforce_plus_plus_baseline_outcome_advantage: a = s - mean of the group (a group of one has mean
0, so it keeps its score), no division by the std; then the masked token advantages are whitened over the whole
training batch. As for ReinforcePlusPlusAdvantage, this stage writes the centred scores and the training sink
whitens the step's table (`whiten_over_step`, stages.advantage.whiten.whiten_step).
"""

from __future__ import annotations

import numpy as np

from stages.advantage.base import OutcomeAdvantage


class ReinforcePlusPlusBaselineAdvantage(OutcomeAdvantage):
    whiten_over_step = True

    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        return scores - (scores.mean() if len(scores) > 1 else 0.0)
