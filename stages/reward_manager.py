"""verl's reward managers by `reward.reward_manager.name`: what a sample's reward and reward_extra_info are made of
once its scorer (the built-in verifier of its data source, or the custom reward function) has answered.

- `naive`: the score is the reward. reward_extra_info: a dict result's keys other than `score`, or `{"acc": score}`
  for a number (verl's naive manager records the score as `acc`, which DAPO's filter and the metrics read).
- `dapo`: naive, plus DAPO's overlong reward shaping when `reward.reward_kwargs.overlong_buffer_cfg.enable`: a
  response of L tokens gets `min(0, -(L - (max_resp_len - len)) / len * penalty_factor)` added, so the last `len`
  tokens before `max_resp_len` cost linearly more; with `overlong_buffer_cfg.log` reward_extra_info also holds
  `overlong_reward` and `overlong` (whether it paid).
- `gdpo`: naive, keeping a dict result's `score` in reward_extra_info too (the components the gdpo advantage
  estimator normalises apart are the dict's numbers, `algorithm.gdpo_reward_keys`).
- `prime` and `remote`: verl's other managers of rule rewards. Both score each sample as naive does (prime in a pool
  of processes with a timeout, remote in Ray workers), which is how the Reward stage scores under every manager:
  worker processes, a timeout per sample. prime zeroes a whole batch on a global timeout; here only the sample.
verl's `batch` (one call of the function on lists) and `rate_limited` (a throttle for remote scoring APIs) change how
the user's function is called, not what a rule reward is; they are refused with that reason (`REFUSED`).

A sample whose scoring failed keeps reward 0 and its reward_error, unshaped. Pure Python: the Reward stage runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MANAGERS = ("naive", "dapo", "gdpo", "prime", "remote")
REFUSED = {
    "batch": "it calls the reward function once with lists of samples; asyncrl scores each sample in a worker "
    "process with its own timeout (use naive, and a function of one sample)",
    "rate_limited": "it throttles calls to a remote scoring API (requests and tokens per minute); asyncrl has no "
    "such throttle (use naive: stages.reward.num_workers bounds the concurrent calls)",
}


@dataclass(frozen=True)
class OverlongBuffer:
    """verl's `reward.reward_kwargs.overlong_buffer_cfg` (dapo manager)."""

    enable: bool = False
    len: int = 0  # the buffer: the last `len` tokens before max_resp_len
    penalty_factor: float = 1.0  # the penalty at max_resp_len
    log: bool = False  # record overlong_reward and overlong in reward_extra_info


@dataclass(frozen=True)
class RewardManager:
    name: str = "naive"
    overlong: OverlongBuffer = field(default_factory=OverlongBuffer)
    max_resp_len: int | None = None  # the response length the buffer ends at (dapo)

    def __post_init__(self) -> None:
        check_manager(self.name)
        if self.shapes_length and (self.max_resp_len is None or not 0 < self.overlong.len <= self.max_resp_len):
            raise ValueError(
                f"the dapo manager's overlong buffer needs 0 < reward.reward_kwargs.overlong_buffer_cfg.len <= "
                f"max_resp_len, not len={self.overlong.len}, max_resp_len={self.max_resp_len}"
            )

    @property
    def shapes_length(self) -> bool:
        """Whether the reward depends on the response's length (the Reward stage then reads num_tokens)."""
        return self.name == "dapo" and self.overlong.enable

    def shape(self, score: float, error: str | None, extra: str | None, num_tokens: int | None) -> tuple:
        """(reward, reward_error, reward_extra_info as JSON text) of a scored sample; `extra` is the scorer's
        reward_extra_info JSON (a dict result's other keys) or None."""
        if error is not None:
            return score, error, extra
        info: dict[str, Any] = json.loads(extra) if extra is not None else {"acc": score}
        if self.name == "gdpo" and extra is not None:
            info = {"score": score, **info}
        if self.shapes_length:
            expected = self.max_resp_len - self.overlong.len
            penalty = min(-(num_tokens - expected) / self.overlong.len * self.overlong.penalty_factor, 0.0)
            score += penalty
            if self.overlong.log:
                info |= {"overlong_reward": penalty, "overlong": penalty < 0}
        return score, None, json.dumps(info)


def check_manager(name: str) -> None:
    """ValueError naming why a manager is refused, or the valid names."""
    if name in REFUSED:
        raise ValueError(f"reward.reward_manager.name={name} is not supported: {REFUSED[name]}")
    if name not in MANAGERS:
        raise ValueError(f"reward.reward_manager.name={name!r}: expected one of {', '.join(MANAGERS)}")
