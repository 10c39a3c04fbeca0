"""The math verifier is math-verify as verl's math_verify reward calls it: GSM8K- and MATH-style completions with
the verdicts math-verify gives (gold `\\boxed{truth}` read as LaTeX, the response as an expression or LaTeX, sympy
equality at 6 digits), its timeouts reported, and inputs that must not break it."""

import functools
import random
import time

import math_verify.grader
import math_verify.metric
import pytest

from stages.math_verifier import score_math
from stages.verifiers import VERIFIERS

RIGHT = [
    ("Natalia sold 48 / 2 = 24 clips in May.\n#### 72", "72"),  # GSM8K's worked solution: the answer after ####
    ("#### 72", 72),  # a number as ground truth
    ("The answer is $\\boxed{72}$.", "72"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),  # nested braces, numerically
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
    ("\\boxed{\\frac{1}{3}}", "0.333333"),  # equal at math-verify's 6-digit float rounding
    ("#### $1,234,567.", "1234567"),  # currency, thousands commas, trailing period
    ("#### 1,000", "1000.00"),
    ("#### 3.0", "3"),
    ("#### 1/2", "0.5"),
    ("#### 18 dollars", "18"),
    ("#### 50%", "50"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{18 \\text{ cm}}", "18"),
    ("\\boxed{\\text{(B)}}", "(B)"),
    ("\\boxed{2x + 1}", "2x+1"),  # symbolic: sympy says equal
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
    ("\\boxed{7}", "\\boxed{7}"),  # a boxed ground truth
    ("#### 42<|endoftext|>", "42"),
    ("#### 42<|im_end|>\n#### 7", "42"),  # text after the end of turn is not the answer
    # The hand-written verifier this replaces got these wrong:
    ("The answer is \\boxed{\\sqrt{4}}", "2"),  # it compared `\sqrt{4}` and 2 as strings
    ("\\boxed{50\\%}", "50"),  # a percentage is its number ...
    ("\\boxed{50\\%}", "0.5"),  # ... and its fraction; it only dropped the sign
    ("The answer is 72.", "72"),  # no marker: math-verify takes the last number, as verl scores it
]

WRONG = [
    ("#### 71", "72"),
    ("\\boxed{\\frac{1}{3}}", "0.33"),
    ("#### 3", "-3"),
    ("#### -3", "3"),
    ("\\boxed{2x + 2}", "2x+1"),
    ("\\boxed{\\pi}", "3.14159"),  # pi is not its 6-digit rounding
    ("#### 1e2", "100"),  # math-verify reads the 1
    ("\\boxed{5} so #### 6", "6"),  # a \boxed{} outranks a later ####
    ("first \\boxed{3}, on second thought \\boxed{4}", "4"),  # two boxes read as the set {3, 4}
]

NO_ANSWER = ["", "no number here", "####", "\\boxed{72", "\\boxed{}", "<|endoftext|>#### 72"]


@pytest.mark.parametrize(("response", "truth"), RIGHT)
def test_right_answers_score_one(response, truth):
    assert score_math(response, truth) == 1.0


@pytest.mark.parametrize(("response", "truth"), WRONG)
def test_wrong_answers_score_zero(response, truth):
    assert score_math(response, truth) == 0.0


@pytest.mark.parametrize("response", NO_ANSWER)
def test_no_answer_scores_zero(response):
    assert score_math(response, "72") == 0.0


@pytest.mark.parametrize("bad", [None, 3, 2.5, b"#### 3", ["#### 3"], {"a": 1}, True, "\x00\ufffd"])
def test_any_response_gets_a_score(bad):
    assert score_math(bad, "3") in (0.0, 1.0)


@pytest.mark.parametrize("bad", [None, b"3", ["3"], True, ""])
def test_unreadable_ground_truth_is_named(bad):
    # verl scores these 0 silently; here the sample's reward_error names the bad ground truth.
    with pytest.raises(ValueError, match="ground truth"):
        score_math("#### 3", bad)


def test_random_text_never_raises():
    rng = random.Random(0)
    alphabet = list("0123456789-+./,$% {}#=abx\\\n") + ["\\boxed{", "\\frac", "####", "<|im_end|>", "\\text{"]
    for _ in range(300):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert score_math(response, str(rng.randint(0, 99))) in (0.0, 1.0)


def test_a_comparison_past_its_timeout_scores_zero_and_says_so(monkeypatch):
    # A comparison slower than math-verify's limit (1 s here instead of 5, to keep the test short): math-verify's
    # SIGALRM interrupts it and scores the pair a non-match, which verl takes as 0; the 0 is reported as a timeout.
    assert score_math("#### 1/2", "0.5") == 1.0  # right, and math-verify is imported before the clock starts
    monkeypatch.setattr(math_verify.metric, "verify", functools.partial(math_verify.grader.verify, timeout_seconds=1))
    # The fake comparison would take 60 s and then answer "equal": only math-verify's interruption makes it a timeout.
    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", lambda *args: time.sleep(60) or True)
    with pytest.raises(TimeoutError, match="math-verify timed out"):
        score_math("#### 1/2", "0.5")  # equal only as sympy numbers: the string forms differ


@pytest.mark.parametrize("source", ["gsm8k", "openai/gsm8k", "math", "lighteval/MATH", "math_dapo"])
def test_registered_for_verl_math_sources(source):
    assert VERIFIERS[source] is score_math


def test_the_antlr_runtime_is_the_pinned_one_and_reads_a_percentage():
    """The LaTeX parser's verdicts depend on the ANTLR runtime it runs on (pyproject.toml pins 4.13.2 through
    math-verify's extra): with 4.9.3, what verl's installs run, `\\boxed{50\\%}` scores 0 against 50."""
    import importlib.metadata

    assert importlib.metadata.version("antlr4-python3-runtime") == "4.13.2"
    assert score_math("\\boxed{50\\%}", "50") == 1.0
