"""The math verifier on hand-picked answers: markers, normalisation, numbers, and inputs that must not break it."""

import random
import time

import pytest

from stages.math_verifier import extract_answer, score_math
from stages.verifiers import VERIFIERS

RIGHT = [
    ("Natalia sold 48 / 2 = 24 clips in May.\n#### 72", "72"),
    ("#### 72", 72),  # a number as ground truth
    ("The answer is $\\boxed{72}$.", "72"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),  # nested braces, numerically
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
    ("\\boxed{-\\frac{1}{2}}", "-1/2"),
    ("first \\boxed{3}, on second thought \\boxed{4}", "4"),  # the last boxed wins
    ("\\boxed{5} so #### 6", "6"),  # the later marker wins
    ("#### 6\nso \\boxed{5}", "5"),
    ("#### $1,234,567.", "1234567"),  # currency, commas, trailing period
    ("#### 1,000", "1000.00"),
    ("#### -3", "-3"),
    ("#### 3.0", "3"),
    ("#### 1/2", "0.5"),
    ("#### .5", "1/2"),
    ("#### 18 dollars", "18"),
    ("#### 50%", "50"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{18 \\text{ cm}}", "18"),
    ("\\boxed{\\text{(B)}}", "(B)"),  # not a number: compared as normalised strings
    ("\\boxed{2x + 1}", "2x+1"),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
    ("#### 42<|endoftext|>", "42"),
    ("#### 42<|im_end|>\n#### 7", "42"),  # text after the end of turn is not the answer
    ("\\boxed{7}", "\\boxed{7}"),  # a boxed ground truth is unboxed
]

WRONG = [
    ("#### 71", "72"),
    ("\\boxed{\\frac{1}{3}}", "0.33"),
    ("#### 3", "-3"),
    ("\\boxed{4} then \\boxed{3}", "4"),
    ("\\boxed{2x + 2}", "2x+1"),
    ("#### 1e2", "100"),  # exponents are not parsed (see MAX_NUMBER_CHARS)
]

NO_ANSWER = ["The answer is 72.", "72", "", "####", "#### \n72", "\\boxed{72", "\\boxed{}", "<|endoftext|>#### 72"]


@pytest.mark.parametrize(("response", "truth"), RIGHT)
def test_right_answers_score_one(response, truth):
    assert score_math(response, truth) == 1.0


@pytest.mark.parametrize(("response", "truth"), WRONG)
def test_wrong_answers_score_zero(response, truth):
    assert score_math(response, truth) == 0.0


@pytest.mark.parametrize("response", NO_ANSWER)
def test_no_final_answer_scores_zero(response):
    assert score_math(response, "72") == 0.0


def test_extract_answer():
    assert extract_answer("a \\boxed{\\frac{a}{\\sqrt{2}}} b") == "\\frac{a}{\\sqrt{2}}"
    assert extract_answer("#### 12 \nmore text") == "12"
    assert extract_answer("no marker") is None


@pytest.mark.parametrize("bad", [None, 3, 2.5, b"#### 3", ["#### 3"], {"a": 1}, True, "\x00\ufffd"])
def test_any_input_gets_a_score(bad):
    assert score_math(bad, "3") in (0.0, 1.0)
    assert score_math("#### 3", bad) in (0.0, 1.0)


def test_random_text_never_raises():
    rng = random.Random(0)
    alphabet = list("0123456789-+./,$% {}#=abx\\\n") + ["\\boxed{", "\\frac", "####", "<|im_end|>", "\\text{"]
    for _ in range(2000):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        truth = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        assert score_math(response, truth) in (0.0, 1.0)


def test_hostile_input_stays_fast():
    start = time.monotonic()
    assert score_math("\\boxed{" * 20_000 + "1", "1") == 0.0
    assert score_math("#### " + "9" * 100_000, "9") == 0.0
    assert score_math("#### 1" + "0" * 4000 + "/3", "1") == 0.0
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("source", ["gsm8k", "openai/gsm8k", "math", "lighteval/MATH", "math_dapo"])
def test_registered_for_verl_math_sources(source):
    assert VERIFIERS[source] is score_math
