"""RLOOVectorizedAdvantage (`algorithm.adv_estimator=rloo_vectorized`): RLOO as verl's vectorized form computes it.

Input/output columns: as RLOOAdvantage.

verl's compute_rloo_vectorized_outcome_advantage: (n s - sum) / (n - 1), i.e. s - mean(others), for a group of n > 1,
and 0 for a group of one (where verl's `rloo` keeps the raw score: the two keys differ there, as in verl).
"""

from __future__ import annotations

import numpy as np

from stages.advantage.base import OutcomeAdvantage


class RLOOVectorizedAdvantage(OutcomeAdvantage):
    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        n = len(scores)
        if n == 1:
            return np.zeros_like(scores)
        return (n * scores - scores.sum()) / (n - 1)
