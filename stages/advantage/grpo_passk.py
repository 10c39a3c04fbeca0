"""GRPOPassKAdvantage (`algorithm.adv_estimator=grpo_passk`): only the best response of a group learns (Pass@k).

Input/output columns: as GRPOAdvantage.

verl's compute_grpo_passk_outcome_advantage: the response with the highest score gets r_max - r_second (divided by
the group's unbiased std + epsilon with algorithm.norm_adv_by_std_in_grpo), every other response 0; ties go to the
first of the group in order, as torch.topk gives them. A group of one is an error (Pass@k compares two).
"""

from __future__ import annotations

import numpy as np

from stages.advantage.grpo import GRPOAdvantage


class GRPOPassKAdvantage(GRPOAdvantage):
    """GRPO's keywords (epsilon, norm_by_std); only group_advantage differs."""

    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        if len(scores) < 2:
            raise ValueError(f"grpo_passk compares two responses per prompt: set rollout.n >= 2, not {len(scores)}")
        order = np.argsort(-scores, kind="stable")  # the first of equal scores wins
        best, second = order[0], order[1]
        advantage = scores[best] - scores[second]
        if self.norm_by_std:
            advantage = advantage / (scores.std(ddof=1) + self.epsilon)
        out = np.zeros_like(scores)
        out[best] = advantage
        return out
