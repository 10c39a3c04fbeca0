"""GroupFilter: DAPO's dynamic sampling decision for one GRPO group (algorithm.filter_groups).

Input columns:  reward, reward_status, reward_extra_info (a JSON object per sample) of one prompt's group

A group whose metric has the same value for every response has zero advantage under GRPO: it moves no weight. The
training sink (stages/sink.py) asks this filter about every group it receives; a filtered group is logged (the
`filtered/` log, FILTERED_SCHEMA) and never trained, and the clock admits another prompt in its place
(pipeline/clock.py `filtered`), so every step still trains its full batch of groups. As verl's V1 replay buffer
decides it: filtered iff the group has more than one response and the population standard deviation of their
metric values is exactly 0.

The metric, by verl's names: 'reward', 'seq_reward' and 'seq_final_reward' read the sample's reward (the score with
every reward-manager shaping, such as DAPO's overlong penalty; a KL in the reward is paid per token in the trainer,
so seq_final_reward equals it when use_kl_in_reward is off, the only case the config allows); any other name is a
key of the reward function's extra info ('acc' and 'score' with verl's dapo manager). A group with a sample whose
reward failed (reward_status masked or dropped) is left to the reward failure policy, never filtered.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from stages.reward_sources import LEFT_OUT  # the failure policy already keeps these out of the loss

REWARD_METRICS = ("reward", "seq_reward", "seq_final_reward")


class MissingMetricError(ValueError):
    """A group whose samples do not carry the filter's metric: the run cannot decide, and stops naming it."""


class GroupFilter:
    def __init__(self, metric: str) -> None:
        self.metric = metric

    def values(self, group: pa.Table) -> list[float]:
        """The metric of each response of the group."""
        if self.metric in REWARD_METRICS:
            return [float(r) for r in group["reward"].to_pylist()]
        if "reward_extra_info" not in group.column_names:
            raise MissingMetricError(self._missing(group, set()))
        out = []
        for raw in group["reward_extra_info"].to_pylist():
            extra = json.loads(raw) if raw else {}
            if self.metric not in extra:
                raise MissingMetricError(self._missing(group, set(extra)))
            out.append(float(extra[self.metric]))
        return out

    def shared_value(self, group: pa.Table) -> float | None:
        """The value every response shares when the group carries no signal (filter it), else None (train it)."""
        if group.num_rows < 2:
            return None
        if "reward_status" in group.column_names and any(s in LEFT_OUT for s in group["reward_status"].to_pylist()):
            return None
        values = self.values(group)
        return float(values[0]) if float(np.std(values)) == 0.0 else None

    def _missing(self, group: pa.Table, keys: set[str]) -> str:
        pid = group["prompt_id"][0].as_py()
        return (
            f"algorithm.filter_groups.metric={self.metric!r} is not in the reward function's extra info of group "
            f"{pid} (its keys: {sorted(keys) or 'none'}): return it from the reward function's dict, or filter on "
            "metric=seq_reward"
        )
