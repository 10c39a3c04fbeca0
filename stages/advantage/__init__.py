"""Advantage estimators by verl's `algorithm.adv_estimator` names, one stage class each (base.py holds what they
share: the token-level rewards, the KL in the reward, the groups, the output columns).

| adv_estimator                 | class                               | scope                                   |
|-------------------------------|-------------------------------------|-----------------------------------------|
| grpo                          | GRPOAdvantage (grpo.py)             | group                                   |
| rloo                          | RLOOAdvantage (rloo.py)             | group                                   |
| reinforce_plus_plus           | ReinforcePlusPlusAdvantage          | token returns, whitened over the step   |
| reinforce_plus_plus_baseline  | ReinforcePlusPlusBaselineAdvantage  | group baseline, whitened over the step  |

The wiring picks the class from ESTIMATORS unless the config names one with `stages.advantage._target_` (a user's
own estimator wins over `algorithm.adv_estimator`). A class with `whiten_over_step = True` has the training sink
whiten the step's table with whiten_step before it splits it into mini-batches.
"""

from __future__ import annotations

from stages.advantage.base import AdvantageStage, OutcomeAdvantage
from stages.advantage.grpo import GRPOAdvantage
from stages.advantage.reinforce_pp import ReinforcePlusPlusAdvantage
from stages.advantage.reinforce_pp_baseline import ReinforcePlusPlusBaselineAdvantage
from stages.advantage.rloo import RLOOAdvantage
from stages.advantage.whiten import whiten_step

ESTIMATORS = {
    "grpo": "stages.advantage.GRPOAdvantage",
    "rloo": "stages.advantage.RLOOAdvantage",
    "reinforce_plus_plus": "stages.advantage.ReinforcePlusPlusAdvantage",
    "reinforce_plus_plus_baseline": "stages.advantage.ReinforcePlusPlusBaselineAdvantage",
}

__all__ = [
    "ESTIMATORS",
    "AdvantageStage",
    "GRPOAdvantage",
    "OutcomeAdvantage",
    "RLOOAdvantage",
    "ReinforcePlusPlusAdvantage",
    "ReinforcePlusPlusBaselineAdvantage",
    "whiten_step",
]
