"""OPOAdvantage (`algorithm.adv_estimator=opo`): the score against its group's length-weighted mean score.

Input/output columns: as GRPOAdvantage.

verl's compute_opo_outcome_advantage (On-Policy RL with Optimal reward baseline): the baseline of a group is
sum(L_i s_i) / sum(L_i), L_i a response's trained tokens, so long responses weigh more; a group of one has baseline 0.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stages.advantage.base import OutcomeAdvantage, TokenRewards


class OPOAdvantage(OutcomeAdvantage):
    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        lengths = rewards.mask.sum(axis=1)  # (B,) trained tokens
        seq_adv = np.zeros(len(rewards.score), np.float64)
        for rows in self.groups(batch):
            scores, weights = rewards.score[rows], lengths[rows]
            baseline = (weights * scores).sum() / weights.sum() if len(rows) > 1 and weights.sum() > 0 else 0.0
            seq_adv[rows] = scores - baseline
        return seq_adv[:, None] * rewards.mask, seq_adv
