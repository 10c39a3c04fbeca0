"""Verifiers: pure-python scorers mapping (response_text, ground_truth) to a reward in [0, 1].

`VERIFIERS[data_source]` is what the Reward stage calls for each sample. A verifier must be total: any input
(empty, malformed, not even a string) gets a score, never an exception, because one bad sample must not
fail a whole block of the stream. No torch here: the Reward stage runs on plain CPU workers.
"""

from __future__ import annotations

from collections.abc import Callable

from stages.math_verifier import score_math

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
