"""ReinforcePlusPlusAdvantage (`algorithm.adv_estimator=reinforce_plus_plus`): discounted token returns, whitened
over the training step.

Input columns:  response_mask, reward (+ response_logprobs, ref_logprobs with the KL in the reward)
Output columns: input columns + advantage (float32; the first trained token's), token_advantages (list<float32>;
                0 on masked tokens) (+ reward_kl with the KL in the reward)

verl's compute_reinforce_plus_plus_outcome_advantage: from the token-level rewards r (the score on the last token,
minus beta * KL per token with the KL in the reward), walking backwards with a running value that starts at 0,
ret_t = r_t + gamma * run and run = ret_t * mask_t: the running value restarts at every masked token, so an
outcome score reaches back only to the last masked token before it (gamma^(k - t) * score for t <= k). No group
is used. verl whitens the returns over the whole training batch; a block here holds only some of a step's groups,
so this stage writes the masked returns and the training sink whitens the step's table (`whiten_over_step`,
stages.advantage.whiten.whiten_step) before it splits it into mini-batches. The sample log therefore holds the
returns, the trainer the whitened advantages.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stages.advantage.base import AdvantageStage, TokenRewards, first_trained


def discounted_returns(token_rewards: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    """(B, L) returns of (B, L) rewards, the running value reset at masked tokens (verl's recursion)."""
    returns = np.zeros_like(token_rewards)
    run = np.zeros(len(token_rewards), np.float64)
    for t in reversed(range(token_rewards.shape[1])):
        run = token_rewards[:, t] + gamma * run
        returns[:, t] = run
        run = run * mask[:, t]
    return returns


class ReinforcePlusPlusAdvantage(AdvantageStage):
    whiten_over_step = True

    def __init__(
        self,
        group_size: int,
        gamma: float = 1.0,
        kl_in_reward: bool = False,
        kl_coef: float = 0.001,
        kl_penalty: str = "kl",
    ) -> None:
        super().__init__(group_size, kl_in_reward, kl_coef, kl_penalty)
        self.gamma = gamma

    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        token_adv = discounted_returns(rewards.token_rewards, rewards.mask, self.gamma) * rewards.mask
        return token_adv, first_trained(token_adv, rewards.mask)
