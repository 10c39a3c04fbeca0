"""The `reward.*` section of the run configuration (verl's `reward.*`): the reward manager, its keywords and the
custom reward function. Part of schema.py's RunConfig."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class CustomRewardFunctionConfig:
    """verl's `reward.custom_reward_function.*`: a user's function scores every sample instead of the built-in
    verifiers (verl's older top-level `custom_reward_function.*` is the same section)."""

    path: str = ""
    """Python file defining the function (also `file://<path>`, or `pkg://<module>`); empty: the built-in verifier
    of each sample's data_source. Loaded and checked when the config loads."""
    name: str = "compute_score"
    """The function, called as name(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
    **reward_kwargs); it returns a number (bool, int, float) or a dict with a 'score' key, whose other keys are
    logged as the sample's reward_extra_info."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keywords of every call; they win over the ones above, as in verl."""


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping (verl's `reward.reward_kwargs.overlong_buffer_cfg`, dapo manager)."""

    enable: bool = False
    """Add min(0, -(L - (max_resp_len - len)) / len * penalty_factor) to the reward of a response of L tokens."""
    len: int = 0
    """The buffer: the last `len` tokens before max_resp_len, over which the penalty grows to penalty_factor."""
    penalty_factor: float = 1.0
    """The penalty of a response of max_resp_len tokens."""
    log: bool = False
    """Record overlong_reward and overlong (whether it paid) in each sample's reward_extra_info."""


@dataclass
class RewardKwargsConfig:
    """verl's `reward.reward_kwargs`: the reward manager's own keywords (the function's are
    custom_reward_function.reward_kwargs)."""

    overlong_buffer_cfg: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """dapo: the overlong buffer."""
    max_resp_len: int | None = None
    """dapo: the response length the buffer ends at; null: data.max_response_length (verl requires it)."""


@dataclass
class RewardModuleConfig:
    path: str | None = None
    """verl's reward manager class of the user's own (source=importlib): not supported, must stay null."""
    name: str = "custom_reward_manager"
    """Its class name (verl's key; unused here)."""


@dataclass
class RewardManagerConfig:
    name: str = "naive"
    """verl's reward manager (stages/reward_manager.py): 'naive' (the score), 'dapo' (naive plus the overlong
    buffer), 'prime' or 'remote' (scored as naive); 'batch', 'rate_limited', 'gdpo' are refused with the reason."""
    source: Literal["register"] = "register"
    """verl's 'register' (a manager by name); 'importlib' (a manager class of the user's) is not supported: a custom
    reward function scores any way it likes."""
    module: RewardModuleConfig = field(default_factory=RewardModuleConfig)
    """verl's importlib module of a manager class (must stay null)."""


@dataclass
class RewardConfig:
    """verl's `reward.*`: the reward manager, its keywords and the custom reward function."""

    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    """Which reward manager (verl's older `reward_model.reward_manager` names it too)."""
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    """The manager's keywords (verl's older `reward_model.reward_kwargs`)."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A user's scoring function (verl's older top-level `custom_reward_function`)."""
