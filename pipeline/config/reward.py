"""The `reward.*` section of the run configuration (verl's `reward.*`): the reward manager, its keywords and the
custom reward function; the reward sources beyond a rule or a function (a discriminative reward model, a remote
reward service); and what a failed score makes of its sample (stages/reward_sources.py says how they combine). Part
of schema.py's RunConfig.

verl's spellings where verl has them: `reward.reward_model.enable`, `reward.reward_model.model_path` (verl 0.9.1;
its legacy `reward_model.model.path` and the `reward.reward_model.model.path` form are accepted, REWARD_ALIASES),
`micro_batch_size_per_gpu` and `max_length` of verl's earlier reward-model worker, and `max_concurrent` of verl's
rate-limited reward manager. verl has no failure policy: `reward.on_error` is ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stages.reward_sources import OnError

# verl's spellings of these keys (pipeline/config/load.py translates them).
REWARD_ALIASES = {
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.micro_batch_size_per_gpu": "reward.reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length": "reward.reward_model.max_length",
    "reward.reward_model.model.path": "reward.reward_model.model_path",
}


@dataclass
class RewardModelConfig:
    """verl's `reward.reward_model.*`: a discriminative reward model (an HF sequence-classification model) scoring every
    response in an actor stage of its own (stages/reward_model.py)."""

    enable: bool = False
    """Score responses with the model at model_path. Without a custom reward function its score is the reward (as in
    verl); with one, the function gets it in extra_info['reward_scores']['reward_model'] and combines."""
    model_path: str = ""
    """HF model directory of an AutoModelForSequenceClassification and its own tokenizer; the score is the last logit.
    The prompt and response are rendered with that tokenizer's chat template (as a user and an assistant message)."""
    micro_batch_size_per_gpu: int = 8
    """Responses per forward pass (on a CPU too)."""
    max_length: int | None = None
    """Tokens of prompt + response the model takes; a longer input is that sample's scoring error (never cut: a cut
    answer would be scored as another answer). None: the model's max_position_embeddings."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights' dtype; bfloat16 halves the memory on a GPU."""
    num_replicas: int = 1
    """Actors of the reward-model stage, each with a copy of the model."""
    gpus_per_replica: float = 1.0
    """GPUs each replica asks Ray for on a cluster that has GPUs (a fraction shares one); none on a CPU cluster."""


@dataclass
class JudgeConfig:
    """A generative judge (an LLM judge, verl's GenRM): a frozen model served by a vLLM engine of its own in an actor
    stage (stages/judge.py), the judge's prompt and the reading of its verdict from the user's file. verl calls its
    GenRM from the custom reward function; here the judge is a stage and its score reaches the function in
    extra_info['reward_scores']['judge'] (or, alone, is the reward)."""

    enable: bool = False
    """Judge every response."""
    model_path: str = ""
    """HF model directory of the judge (a causal LM and its tokenizer); empty: the policy's starting weights (the
    warm start's, when there is one). Weight syncs never reach it."""
    path: str = ""
    """Python file (also file://, pkg://) defining judge_prompt(prompt, response, ground_truth, data_source) -> str
    or chat messages, and judge_score(verdict, prompt, response, ground_truth, data_source) -> number."""
    max_tokens: int = 64
    """Tokens of a verdict."""
    temperature: float = 0.0
    """The judge's sampling temperature; 0: greedy, the same verdict for the same prompt."""
    max_model_len: int = 512
    """The judge engine's context: its prompt and verdict together."""
    kv_cache_gb: float | None = None
    """The judge engine's KV cache on a CPU (rollout.kv_cache_gb's meaning)."""
    num_replicas: int = 1
    """Actors of the judge stage, each with an engine."""
    gpus_per_replica: float = 1.0
    """GPUs each replica asks Ray for on a cluster that has GPUs; none on a CPU cluster."""


@dataclass
class RemoteRewardConfig:
    """An HTTP reward service (stages/remote_reward.py): one JSON request per response, a score back."""

    url: str = ""
    """The service's http(s) URL; empty: no service. It must answer at start (a GET gets any answer but 404)."""
    max_concurrent: int = 8
    """Requests in flight at once, per stage actor (verl's rate-limited manager's cap)."""
    timeout_s: float = 30.0
    """A request with no answer after this long is cut and counts as a failed attempt."""
    max_retries: int = 3
    """Further attempts of a request after a timeout, a connection error, HTTP 429 or 5xx (a 4xx other than 429, or
    an answer that is not a score, is not retried)."""
    backoff_s: float = 0.5
    """Wait before the first retry of a request, doubling each time (at most 30 s)."""


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
    """verl's `reward.*`: the reward manager, its keywords and the custom reward function; the reward sources beside
    them and the failure policy."""

    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    """Which reward manager (verl's older `reward_model.reward_manager` names it too)."""
    reward_kwargs: RewardKwargsConfig = field(default_factory=RewardKwargsConfig)
    """The manager's keywords (verl's older `reward_model.reward_kwargs`)."""
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """A user's scoring function (verl's older top-level `custom_reward_function`)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """The discriminative reward model (verl's keys)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The generative judge."""
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    """The remote reward service."""
    on_error: OnError = "mask"
    """What a sample whose reward failed becomes: 'zero' (reward 0, trained as a wrong answer: it biases its group's
    baseline), 'retry' (each failed source is called again, up to max_attempts calls, then masked), 'mask' (left out
    of the loss and of its group's statistics) or 'drop_group' (its whole group left out, and its place refilled by
    another prompt through the gate: needs rollout.prompts_per_call=1)."""
    max_attempts: int = 3
    """on_error=retry: calls of a failed source per sample, the first included."""
    retry_backoff_s: float = 1.0
    """on_error=retry: wait before the second call, doubling each time (at most 30 s)."""


def reward_checks(reward: RewardConfig, custom_function: bool, score_in_engine: bool | None) -> list[tuple[bool, str]]:
    """The cross-field rules of `reward.*`: (holds, message naming the key and the fix)."""
    rm, remote, judge = reward.reward_model, reward.remote, reward.judge
    scorers = [
        name for name, on in (("reward_model", rm.enable), ("judge", judge.enable), ("remote", remote.url)) if on
    ]
    return [
        (not rm.enable or bool(rm.model_path), "reward.reward_model.enable needs reward.reward_model.model_path"),
        (rm.micro_batch_size_per_gpu >= 1, "reward.reward_model.micro_batch_size_per_gpu must be >= 1"),
        (rm.max_length is None or rm.max_length >= 2, "reward.reward_model.max_length must be null or >= 2"),
        (rm.num_replicas >= 1, "reward.reward_model.num_replicas must be >= 1"),
        (rm.gpus_per_replica >= 0, "reward.reward_model.gpus_per_replica must be >= 0"),
        (
            not (rm.enable and score_in_engine),
            "rollout.score_in_engine leaves no place for the reward model's stage between generation and scoring: "
            "set rollout.score_in_engine=false (or leave it null), or reward.reward_model.enable=false",
        ),
        (
            not remote.url or remote.url.startswith(("http://", "https://")),
            f"reward.remote.url {remote.url!r} must be an http:// or https:// URL",
        ),
        (remote.max_concurrent >= 1, "reward.remote.max_concurrent must be >= 1"),
        (remote.timeout_s > 0, "reward.remote.timeout_s must be > 0"),
        (remote.max_retries >= 0, "reward.remote.max_retries must be >= 0 (0: one attempt)"),
        (remote.backoff_s >= 0, "reward.remote.backoff_s must be >= 0"),
        (
            not judge.enable or bool(judge.path),
            "reward.judge.enable needs reward.judge.path (judge_prompt, judge_score)",
        ),
        (judge.max_tokens >= 1, "reward.judge.max_tokens must be >= 1"),
        (judge.max_model_len > judge.max_tokens, "reward.judge.max_model_len must exceed reward.judge.max_tokens"),
        (judge.temperature >= 0, "reward.judge.temperature must be >= 0 (0: greedy)"),
        (judge.num_replicas >= 1, "reward.judge.num_replicas must be >= 1"),
        (judge.gpus_per_replica >= 0, "reward.judge.gpus_per_replica must be >= 0"),
        (
            not (judge.enable and score_in_engine),
            "rollout.score_in_engine leaves no place for the judge's stage between generation and scoring: set "
            "rollout.score_in_engine=false (or leave it null), or reward.judge.enable=false",
        ),
        (
            custom_function or len(scorers) < 2,
            f"{' and '.join(scorers)} each give a score and nothing combines them: set "
            "reward.custom_reward_function.path to a function that reads extra_info['reward_scores'], or use one "
            "of them",
        ),
        (reward.max_attempts >= 1, "reward.max_attempts must be >= 1 (1: no retry)"),
        (reward.retry_backoff_s >= 0, "reward.retry_backoff_s must be >= 0"),
    ]


def check_reward_sources(reward: RewardConfig) -> None:
    """What the run's reward sources need before anything starts: a reward-model directory that holds a
    sequence-classification model and its tokenizer, a remote service that answers. One ConfigError otherwise."""
    from pipeline.config.schema import ConfigError  # here: schema.py imports this module
    from stages.remote_reward import check_reachable
    from stages.reward_model import check_model_dir

    problem = check_model_dir(reward.reward_model.model_path) if reward.reward_model.enable else None
    if problem is None and reward.judge.enable:
        problem = check_judge(reward.judge)
    if problem is None and reward.remote.url:
        problem = check_reachable(reward.remote.url, min(reward.remote.timeout_s, 10.0))
    if problem:
        raise ConfigError(problem)


def check_judge(judge: JudgeConfig) -> str | None:
    """None if the judge's file defines both functions and its model directory (when named) holds a model and a
    tokenizer, else why not."""
    from stages.judge import judge_functions

    try:
        judge_functions(judge.path)
    except ValueError as err:
        return str(err)
    if not judge.model_path:
        return None
    directory = Path(judge.model_path).expanduser()
    if not (directory / "config.json").is_file():
        return f"reward.judge.model_path {judge.model_path!r} has no config.json: point it at an HF model directory"
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return f"reward.judge.model_path {judge.model_path!r} has no tokenizer: save the judge's tokenizer beside it"
    return None
