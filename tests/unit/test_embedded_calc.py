"""The embedded multi-turn task: its rows, its verifier, and the warm start's view of a demonstration."""

from __future__ import annotations

import pytest

from pipeline.tasks.embedded import build_embedded
from pipeline.tasks.embedded_calc import demonstration, make_rows, tool_call_text
from pipeline.tasks.warmstart import encode_examples
from stages.agents.hermes import parse_tool_calls
from stages.agents.tool_agent import TOOL_RESPONSE
from stages.verifiers import score_calc


def test_rows_name_the_tool_agent_and_their_product():
    rows = make_rows(50, seed=4)
    assert rows == make_rows(50, seed=4)
    for row in rows:
        a, b = (int(x) for x in row["prompt_text"].removeprefix("calc:").removesuffix("=").split("*"))
        assert row["ground_truth"] == str(a * b) and row["agent_name"] == "tool_agent"


def test_the_demonstrated_call_parses_to_the_prompt_expression():
    row = make_rows(1, seed=0)[0]
    (call,) = parse_tool_calls(tool_call_text("347 * 29"), 1).calls
    assert call.name == "calculator" and call.arguments == {"expression": "347 * 29"}
    assert [trained for _, trained in demonstration(row)] == [True, True, False, True, True]


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        (f"{tool_call_text('347 * 29')}{TOOL_RESPONSE.format('10063')} 10063", 1.0),
        (f"{tool_call_text('347 * 29')}{TOOL_RESPONSE.format('10063')} 10062", 0.0),
        ("10063", 0.0),  # no tool response: a guess, even a right one, earns nothing
        (f"{TOOL_RESPONSE.format('error: x')} 1{TOOL_RESPONSE.format('10063')} 10063<|endoftext|>", 1.0),
        (None, 0.0),
    ],
)
def test_score_calc_pays_only_the_exact_product_after_a_tool_response(text, reward):
    assert score_calc(text, "10063") == reward


def test_warm_start_trains_on_everything_but_the_tool_result(tmp_path):
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, num_prompts=8, seed=0, num_val_prompts=4, task="calc")
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    row = make_rows(1, seed=9)[0]
    ((prompt, response, trained),) = encode_examples(tokenizer, [row])
    result_ids = tokenizer(TOOL_RESPONSE.format(row["ground_truth"]), add_special_tokens=False)["input_ids"]
    untrained = [t for t, keep in zip(response, trained, strict=True) if not keep]
    assert untrained == result_ids
    assert response.count(tokenizer.eos_token_id) == 2 and len(prompt) < 16
