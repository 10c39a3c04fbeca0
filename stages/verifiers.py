"""What a sample scores: the built-in verifiers by data source, or a user's verl-style reward function.

`VERIFIERS[data_source]` maps (response_text, ground_truth) to a reward in [0, 1]: `reverse` and `calc` for the
embedded tasks, math-verify (stages/math_verifier.py) for verl's math data sources. A custom reward function
(verl's `custom_reward_function`) replaces that routing for every sample: it is called as verl calls it,
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=..., **reward_kwargs)`, and returns
a number or a dict with a `score` key, whose other keys become the sample's reward_extra_info. Its
`extra_info["reward_scores"]` holds the scores of the model sources that ran before it (stages/reward_sources.py):
`{"reward_model": 0.83}`, for a function that combines a reward model with a rule.

`score_sample` turns any failure of either kind (an exception, a non-number, NaN or inf, a built-in verifier's
value outside [0, 1]) into reward 0 and a reason, because one bad sample must not fail a whole block of the stream.
No torch here: the Reward stage runs on plain CPU workers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
from collections.abc import Callable
from typing import Any

from stages.math_verifier import score_math
from stages.user_code import UserCodeError, load_user_module

# The embedded tokenizer's EOS text; engines usually strip it, but a decode with special tokens keeps it.
EOS_TEXTS = ("<|endoftext|>",)


def _items(text: str) -> list[str]:
    """Whitespace-separated items, with any EOS text (and what follows it) cut off."""
    for eos in EOS_TEXTS:
        text = text.split(eos, 1)[0]
    return text.split()


def score_reverse(response_text: str, ground_truth: str) -> float:
    """Score a reversed letter list: 1.0 for an exact match, else partial credit for the correct prefix.

    The partial credit is len(longest common prefix) / max(len(response), len(truth)) over the items, so a
    response earns for each leading letter it gets right, and loses for padding a correct answer with extra
    letters (dividing by the longer list). That dense signal gives GRPO groups reward variance long before
    the model gets whole lists right. Empty responses and non-string inputs score 0.0.
    """
    if not isinstance(response_text, str) or not isinstance(ground_truth, str):
        return 0.0
    response, truth = _items(response_text), _items(ground_truth)
    if not response or not truth:
        return 0.0
    if response == truth:
        return 1.0
    prefix = 0
    for got, want in zip(response, truth, strict=False):
        if got != want:
            break
        prefix += 1
    # A strict prefix or extension of the truth is not a match, so this stays below 1.0.
    return prefix / max(len(response), len(truth))


def score_calc(response_text: str, ground_truth: str) -> float:
    """Score the embedded multi-turn task (pipeline/tasks/embedded_calc.py): 1.0 when the number after the last tool
    response is the product, else 0.0.

    Only an answer given after a tool response counts, and only an exact one: with credit for leading digits, the
    measured policy learned to skip the tool and guess the first digits of the product (a 0.6 for '111' against
    11187), which is exactly what the task must not reward."""
    if (
        not isinstance(response_text, str)
        or not isinstance(ground_truth, str)
        or "</tool_response>" not in response_text
    ):
        return 0.0
    answer = _items(response_text.rsplit("</tool_response>", 1)[-1])
    return 1.0 if answer and answer[0] == ground_truth.strip() else 0.0


# The math sets under the data_source names verl's preprocessing scripts write.
MATH_SOURCES = ("gsm8k", "openai/gsm8k", "math", "lighteval/MATH", "math_dapo")

VERIFIERS: dict[str, Callable[[str, str], float]] = {"reverse": score_reverse, "calc": score_calc} | dict.fromkeys(
    MATH_SOURCES, score_math
)

# The keywords verl passes to a custom reward function (verl/workers/reward_manager/naive.py).
SCORE_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
_CALL = "compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"


class RewardFunctionError(ValueError):
    """A custom reward function cannot be loaded, or cannot be called as verl calls it."""


def load_score_function(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """The function `name` of the Python file `path` (verl's forms: a path, `file://<path>`, `pkg://<module>`)."""
    try:
        module = load_user_module(path, "custom_reward_function.path")
    except UserCodeError as err:
        raise RewardFunctionError(str(err)) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise RewardFunctionError(
            f"custom_reward_function.path {path!r} defines no function {name!r}: define it, or set "
            "custom_reward_function.name to the one it has."
        )
    return function


def check_score_signature(
    function: Callable[..., Any], name: str, reward_kwargs: dict[str, Any], path: str = ""
) -> None:
    """Raise RewardFunctionError unless `function` takes verl's keywords plus `reward_kwargs`."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: only a call can tell
        return
    try:
        signature.bind(**dict.fromkeys(SCORE_KEYWORDS), **reward_kwargs)
    except TypeError as err:
        extra = f" with custom_reward_function.reward_kwargs {sorted(reward_kwargs)}" if reward_kwargs else ""
        raise RewardFunctionError(
            f"custom reward function {name}{signature}{f' in {path}' if path else ''} cannot be called as "
            f"{_CALL}{extra} ({err}). Define it as "
            f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs)."
        ) from None


def score_sample(
    row: dict[str, Any], custom: Callable[..., Any] | None = None, reward_kwargs: dict[str, Any] | None = None
) -> tuple[float, str | None, str | None]:
    """(reward, reward_error, reward_extra_info) of one sample: a row with response_text, ground_truth and
    data_source (and agent_turns, when present, for the custom function's extra_info)."""
    source = row["data_source"]
    if custom is None:
        verifier = VERIFIERS.get(source)
        if verifier is None:
            return 0.0, f"no verifier for data_source {source!r}; known: {sorted(VERIFIERS)}", None
        who = f"verifier {source!r}"
        value = _call(who, verifier, row["response_text"], row["ground_truth"])
    else:
        who = f"custom reward function {getattr(custom, '__name__', 'compute_score')}"
        call = {
            "data_source": source,
            "solution_str": row["response_text"],
            "ground_truth": row["ground_truth"],
            "extra_info": {
                "num_turns": _num_turns(row.get("agent_turns")),
                "rollout_reward_scores": {},
                "reward_scores": {name: r["score"] for name, r in row.get("reward_sources") or []},
            },
        }
        value = _call(who, custom, **{**call, **(reward_kwargs or {})})  # verl: the configured keywords win
    if isinstance(value, _Failed):
        return 0.0, value.reason, None
    extra = None
    if custom is not None and isinstance(value, dict):
        if "score" not in value:
            return 0.0, f"{who} returned a dict without a 'score' key: {list(value)}", None
        extra = json.dumps({k: v for k, v in value.items() if k != "score"}, default=_jsonable)
        value = value["score"]
    if isinstance(value, str | bytes) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return 0.0, f"{who} returned {value!r}, not a finite number", extra
    if custom is None and not 0.0 <= value <= 1.0:
        return 0.0, f"{who} returned {value!r}, not a float in [0, 1]", None
    return float(value), None, extra


class _Failed:
    def __init__(self, reason: str) -> None:
        self.reason = reason


def _call(who: str, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The function's value (awaited when it is a coroutine, as verl allows), or _Failed with the reason."""
    try:
        value = function(*args, **kwargs)
        return asyncio.run(value) if inspect.iscoroutine(value) else value
    except Exception as err:  # noqa: BLE001 - any scorer failure marks the sample, never the run
        return _Failed(f"{who} raised {type(err).__name__}: {err}"[:2000])


def _num_turns(agent_turns: list[dict] | None) -> int:
    """verl's num_turns: the prompt, each assistant turn and each round of tool results (2 for a single turn)."""
    if not agent_turns:
        return 2
    roles = [t["role"] for t in agent_turns]
    tool_rounds = sum(1 for i, r in enumerate(roles) if r == "tool" and (i == 0 or roles[i - 1] != "tool"))
    return 1 + roles.count("assistant") + tool_rounds


def _jsonable(value: Any) -> Any:
    """numpy scalars and arrays as their Python values; anything else JSON cannot hold as its repr."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return repr(value)
