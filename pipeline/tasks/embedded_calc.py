"""The embedded multi-turn task: multiplication that the tiny model can only answer by calling the calculator.

`calc: 347 * 29 =` -> the model writes a Hermes tool call, the `tool_agent` loop runs it and appends the result,
and the model copies that result as its answer:

    <tool_call>{"name": "calculator", "arguments": {"expression": "347 * 29"}}</tool_call><eos>
    <tool_response>10063</tool_response> 10063<eos>

A 0.47M-parameter model cannot multiply a 3-digit by a 2-digit number in its head, but both halves of the
demonstration are copies (the expression from the prompt, the digits from the tool's result), which a 2-layer
model learns as it learns the reversal task. The verifier (`calc` in stages/verifiers.py) pays 1.0 for the exact
product after a tool response and nothing else: no partial credit, which the policy learned to farm by guessing
leading digits without the tool. Rows carry `agent_name: tool_agent`: the loop is chosen per sample by the data.

The tokenizer is trained on whole demonstrations, so the call's fixed parts (`<tool_call>{"`, `calculator`, ...)
become a handful of tokens; digits stay one token each (Qwen2's pre-tokenizer splits them), which keeps copying a
token-by-token lookup. The warm start (pipeline/tasks/warmstart.py) trains on the demonstration with the tool's result
masked out, as the RL loss masks it.

Room for RL comes from label smoothing, as in the reversal task, but far less of it (conf/multi_turn.yaml: 0.05, not
0.5): a usable response needs about 35 sampled tokens right in a row (the call's JSON, the expression, the copied
digits, EOS), so per-token mass 0.5 off the right token leaves almost no well-formed call (measured: reward 0.00 for
the first 10 steps). With 0.05 and 400 steps at lr 3e-3 (measured on 16 held-out prompts): greedy answers 16/16
right, sampled ones 0.20 (29% well-formed calls); RL concentrates the mass.
"""

from __future__ import annotations

import json
import random

DATA_SOURCE = "calc"
AGENT_NAME = "tool_agent"
PROMPT_PREFIX = "calc:"


def tool_call_text(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(call)}</tool_call>"


def make_rows(num: int, seed: int) -> list[dict]:
    """`num` prompts `calc: A * B =` (A in 100..999, B in 10..99) with the product as ground truth."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        rows.append(
            {
                "prompt_text": f"{PROMPT_PREFIX} {a} * {b} =",
                "ground_truth": str(a * b),
                "data_source": DATA_SOURCE,
                "agent_name": AGENT_NAME,
            }
        )
    return rows


def expression_of(prompt_text: str) -> str:
    return prompt_text.removeprefix(PROMPT_PREFIX).removesuffix("=").strip()


def demonstration(row: dict) -> list[tuple[str | None, bool]]:
    """The ideal response as (text, trained) pieces; None is the EOS token. The tool's result is not trained on."""
    from stages.agents.tool_agent import TOOL_RESPONSE

    return [
        (tool_call_text(expression_of(row["prompt_text"])), True),
        (None, True),
        (TOOL_RESPONSE.format(row["ground_truth"]), False),
        (" " + row["ground_truth"], True),
        (None, True),
    ]


def corpus(num: int, seed: int) -> list[str]:
    """Tokenizer training text: prompts with their whole demonstrations."""
    return [
        row["prompt_text"] + "".join(text for text, _ in demonstration(row) if text is not None)
        for row in make_rows(num, seed)
    ]
