"""Math verifier: verl's `math_verify` reward, scored by the math-verify package as verl calls it.

Used for GSM8K, MATH and DAPO-style data (see VERIFIERS). The ground truth is wrapped in `\\boxed{...}` and
extracted as LaTeX; the response is searched for an answer as a plain expression or as LaTeX (math-verify's own
priorities: `\\boxed{}`, "the final answer is", then the last number-like expression), and the two are compared
symbolically by sympy with 6 digits of float rounding. So `\\sqrt{4}` is 2, `\\frac{1}{2}` is 0.5, `50\\%` is 50
(and 0.5), `#### 1,000` is 1000; math-verify's verdict is the score, 1.0 or 0.0.

Text after a chat special token (`<|endoftext|>`, `<|im_end|>`, ...) is cut first: it is not part of the answer
(verl decodes without special tokens, so its responses end there too).

math-verify bounds its own work with SIGALRM (parsing 5 s, each comparison 5 s, printing 2 s), which only the
main thread of a process may use: the Reward stage runs this in worker processes for that reason. A timeout
scores 0, as in verl; here it also raises TimeoutError, so the sample's reward_error says so instead of passing
for a wrong answer. A ground truth math-verify cannot read raises ValueError naming it (verl scores it 0 silently).
Any other response, of any type, gets 0.0 or 1.0.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from functools import cache

_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")


class _TimeoutLog(logging.Handler):
    """Remembers math-verify's "Timeout during ..." warnings of the current thread: math-verify catches its own
    timeouts inside parse and verify, logs them and goes on with a non-match, so its log is where they show."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.local = threading.local()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Timeout"):
            self.local.seen = [*getattr(self.local, "seen", []), message[:200]]

    def take(self) -> list[str]:
        seen, self.local.seen = getattr(self.local, "seen", []), []
        return seen


@cache
def _metric() -> tuple[Callable, type[BaseException], _TimeoutLog]:
    """verl's math_verify scorer, built once per process (importing math-verify and sympy takes about 0.7 s)."""
    from math_verify.errors import TimeoutException
    from math_verify.metric import math_metric
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig

    verify = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    log = _TimeoutLog()
    logging.getLogger("math_verify").addHandler(log)
    return verify, TimeoutException, log


@cache
def warm() -> None:
    """Once per process: import math-verify and, on a main thread (its timeouts need one), build its LaTeX parser
    by scoring once; about 1 s that processes forked afterwards do not pay."""
    _metric()
    if threading.current_thread() is threading.main_thread():
        score_math("\\boxed{\\frac{1}{2}}", "0.5")


def score_math(response_text: str, ground_truth: str) -> float:
    """math-verify's verdict on the response against `\\boxed{ground_truth}` (see the module docstring)."""
    if not isinstance(response_text, str):
        return 0.0
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, str | int | float):
        raise ValueError(f"ground truth {ground_truth!r} is not a string or a number")
    verify, timeout_exception, log = _metric()
    response = _SPECIAL_TOKEN.split(response_text, 1)[0]
    log.take()
    try:
        score, _ = verify([f"\\boxed{{{ground_truth}}}"], [response])
    except timeout_exception:
        raise TimeoutError("math-verify timed out; scored 0") from None
    except ValueError as err:
        if "No gold targets" in str(err):
            raise ValueError(f"math-verify finds no answer in the ground truth {ground_truth!r}") from None
        raise
    timeouts = log.take()
    if score == 0.0 and timeouts:
        raise TimeoutError(f"math-verify timed out ({timeouts[0]}); scored 0")
    return float(score)
