"""GRPOPassKAdvantage (`algorithm.adv_estimator=grpo_passk`): only the best response of a group learns (Pass@k).

Input/output columns: as GRPOAdvantage.

verl's compute_grpo_passk_outcome_advantage: the response with the highest score gets r_max - r_second (divided by
the group's unbiased std + epsilon with algorithm.norm_adv_by_std_in_grpo), every other response 0; ties go to the
first of the group in order, as torch.topk gives them. A group of one is an error (Pass@k compares two).
"""

from __future__ import annotations

import numpy as np

from stages.advantage.base import OutcomeAdvantage


class GRPOPassKAdvantage(OutcomeAdvantage):
    def __init__(
        self,
        group_size: int,
        epsilon: float = 1e-6,
        norm_by_std: bool = True,
        kl_in_reward: bool = False,
        kl_coef: float = 0.001,
        kl_penalty: str = "kl",
    ) -> None:
        if group_size < 2:
            raise ValueError(f"grpo_passk compares two responses per prompt: set rollout.n >= 2, not {group_size}")
        super().__init__(group_size, kl_in_reward, kl_coef, kl_penalty)
        self.epsilon, self.norm_by_std = epsilon, norm_by_std

    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        order = np.argsort(-scores, kind="stable")  # the first of equal scores wins
        best, second = order[0], order[1]
        advantage = scores[best] - scores[second]
        if self.norm_by_std:
            advantage = advantage / (scores.std(ddof=1) + self.epsilon)
        out = np.zeros_like(scores)
        out[best] = advantage
        return out
