"""Advantage estimators by verl's `algorithm.adv_estimator` names, one stage class each (base.py holds what they
share: the token-level rewards, the KL in the reward, the groups, the output columns).

| adv_estimator                 | class                               | scope                                   |
|-------------------------------|-------------------------------------|-----------------------------------------|
| grpo                          | GRPOAdvantage (grpo.py)             | group                                   |
| rloo                          | RLOOAdvantage (rloo.py)             | group                                   |
| reinforce_plus_plus           | ReinforcePlusPlusAdvantage          | token returns, whitened over the step   |
| reinforce_plus_plus_baseline  | ReinforcePlusPlusBaselineAdvantage  | group baseline, whitened over the step  |
| grpo_vectorized               | GRPOAdvantage (verl's same formula) | group                                   |
| rloo_vectorized               | RLOOVectorizedAdvantage             | group (a group of one: 0)               |
| grpo_passk                    | GRPOPassKAdvantage                  | group (its best response)               |
| opo                           | OPOAdvantage                        | group (length-weighted baseline)        |
| gpg                           | GPGAdvantage                        | group, scaled over the step             |
| gdpo                          | GDPOAdvantage                       | group per reward key, whitened over step |
| optimal_token_baseline        | OptimalTokenBaselineAdvantage       | per token over the group; the trainer   |
|                               | (otb.py)                            | subtracts the baseline                  |
| tir_optimal_token_baseline    | TIROptimalTokenBaselineAdvantage    | the same over trained-token indices     |

verl's other estimators need what the stream does not have (REFUSED_ESTIMATORS says what): a critic (gae), a greedy
baseline rollout (remax). The optimal-token-baseline pair writes the returns, and the trainer subtracts the baseline
after its proximal pass, which has the sum of squared token probabilities the baseline needs (otb.py).

The wiring picks the class from ESTIMATORS unless the config names one with `stages.advantage._target_` (a user's
own estimator wins over `algorithm.adv_estimator`). A class with `whiten_over_step = True` has the training sink
whiten the step's table with whiten_step before it splits it into mini-batches; one with an `over_step` function has
the sink apply that instead.
"""

from __future__ import annotations

from stages.advantage.base import AdvantageStage, OutcomeAdvantage
from stages.advantage.gdpo import GDPOAdvantage
from stages.advantage.gpg import GPGAdvantage
from stages.advantage.grpo import GRPOAdvantage
from stages.advantage.grpo_passk import GRPOPassKAdvantage
from stages.advantage.opo import OPOAdvantage
from stages.advantage.otb import OptimalTokenBaselineAdvantage, TIROptimalTokenBaselineAdvantage
from stages.advantage.reinforce_pp import ReinforcePlusPlusAdvantage
from stages.advantage.reinforce_pp_baseline import ReinforcePlusPlusBaselineAdvantage
from stages.advantage.rloo import RLOOAdvantage
from stages.advantage.rloo_vectorized import RLOOVectorizedAdvantage
from stages.advantage.whiten import whiten_step

ESTIMATORS = {
    "grpo": "stages.advantage.GRPOAdvantage",
    "rloo": "stages.advantage.RLOOAdvantage",
    "reinforce_plus_plus": "stages.advantage.ReinforcePlusPlusAdvantage",
    "reinforce_plus_plus_baseline": "stages.advantage.ReinforcePlusPlusBaselineAdvantage",
    "grpo_vectorized": "stages.advantage.GRPOAdvantage",
    "rloo_vectorized": "stages.advantage.RLOOVectorizedAdvantage",
    "grpo_passk": "stages.advantage.GRPOPassKAdvantage",
    "opo": "stages.advantage.OPOAdvantage",
    "gpg": "stages.advantage.GPGAdvantage",
    "gdpo": "stages.advantage.GDPOAdvantage",
    "optimal_token_baseline": "stages.advantage.OptimalTokenBaselineAdvantage",
    "tir_optimal_token_baseline": "stages.advantage.TIROptimalTokenBaselineAdvantage",
}

__all__ = [
    "ESTIMATORS",
    "AdvantageStage",
    "GDPOAdvantage",
    "GPGAdvantage",
    "GRPOAdvantage",
    "GRPOPassKAdvantage",
    "OPOAdvantage",
    "OptimalTokenBaselineAdvantage",
    "OutcomeAdvantage",
    "RLOOAdvantage",
    "RLOOVectorizedAdvantage",
    "ReinforcePlusPlusAdvantage",
    "ReinforcePlusPlusBaselineAdvantage",
    "TIROptimalTokenBaselineAdvantage",
    "whiten_step",
]
