"""Math verifier: the final answer of a response against the ground truth, numerically when both are numbers.

Used for GSM8K, MATH and DAPO-style data (see VERIFIERS). The answer is the last final-answer marker in the
response: GSM8K's `#### 42` (the rest of that line) or LaTeX's `\\boxed{42}` (braces matched, so
`\\boxed{\\frac{1}{2}}` is whole); when both kinds appear the later one counts, as a model's last word is its
answer. No marker scores 0: guessing the last number in the text would reward responses that never committed.

Both sides are normalised alike: `$`, `%`, thousands commas, `\\text{...}` wrappers, `\\left`/`\\right`, spacing
and a trailing `.` go; `18 dollars` is 18 and `x = 5` is 5. Then they are compared as exact rationals when both
parse as numbers (`0.5` == `1/2` == `\\frac{1}{2}`, `3.0` == `3`, `-3`), else as strings. Exponents and digit
strings over MAX_NUMBER_CHARS are left to the string comparison, so no response can make the scorer build a
10**10**9. A ground truth that is itself boxed (verl's MATH answers can be) is unboxed first.

Text after a chat special token (`<|endoftext|>`, `<|im_end|>`, ...) is ignored: it is not part of the answer.
Like every verifier it is total: any input gets 0.0 or 1.0, never an exception.
"""

from __future__ import annotations

import re
from fractions import Fraction

_SPECIAL_TOKEN = re.compile(r"<\|[A-Za-z0-9_]+\|>")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = "####"
# \frac{a}{b}, \dfrac{a}{b}, and the brace-less \frac12 of single digits.
_FRAC = re.compile(r"\\[dt]?frac(?:\{([^{}]*)\}\{([^{}]*)\}|(\d)(\d))")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
# A number followed by words only: `18 dollars`, `3 apples.`
_UNITS = re.compile(r"(\S+)\s+[A-Za-z][A-Za-z\s.]*")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
# Longer digit strings are not numbers anyone means; comparing them as strings keeps the verifier fast.
MAX_NUMBER_CHARS = 64


def _boxed_answer(text: str) -> tuple[int, str] | None:
    """(position, content) of the last \\boxed{...} whose braces close; None when there is none.

    One pass with a stack of open braces, so nested braces are matched and unclosed ones cost nothing extra."""
    boxes = {m.end() - 1: m.start() for m in _BOXED.finditer(text)}  # its '{' -> where '\\boxed' starts
    stack, last = [], None
    for i, char in enumerate(text):
        if char == "{":
            stack.append(i)
        elif char == "}" and stack:
            opened = stack.pop()
            if opened in boxes and (last is None or boxes[opened] > last[0]):
                last = (boxes[opened], text[opened + 1 : i])
    return last


def _hashes_answer(text: str) -> tuple[int, str] | None:
    """(position, rest of the line) after the last `####`; None when there is none."""
    at = text.rfind(_HASHES)
    if at < 0:
        return None
    return at, text[at + len(_HASHES) :].split("\n", 1)[0]


def extract_answer(response: str) -> str | None:
    """The final answer of a response (see the module docstring), or None when it gives none."""
    response = _SPECIAL_TOKEN.split(response, 1)[0]
    found = [a for a in (_boxed_answer(response), _hashes_answer(response)) if a is not None]
    if not found:
        return None
    answer = max(found)[1].strip()
    return answer or None


def normalize(answer: str) -> str:
    """Drop the markup that does not change a value: currency, thousands commas, units, `x =`, spacing."""
    text = _TEXT.sub(r"\1", answer).replace("\u2212", "-")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\$", "$", "\\%", "%", "^\\circ", "^{\\circ}"):
        text = text.replace(token, "")
    text = _FRAC.sub(lambda m: f"({m[1] if m[3] is None else m[3]})/({m[2] if m[4] is None else m[4]})", text)
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text).strip().rstrip(".")  # thousands commas only
    units = _UNITS.fullmatch(text)
    if units and as_number(units.group(1)) is not None:  # `18 dollars`: the number is the answer
        text = units.group(1)
    name, equals, value = text.partition("=")
    if equals and len(name.strip()) <= 2 and value.strip():  # `x = 5`: the value is the answer
        text = value
    return re.sub(r"\s+", "", text).rstrip(".").lower()


def as_number(text: str) -> Fraction | None:
    """The exact value of `3`, `-3.0`, `.5`, `1/2`, `(1)/(2)` or `-(1)/(2)`; None for anything else."""
    if len(text) > MAX_NUMBER_CHARS:
        return None
    if text.startswith("-("):  # `-\frac{1}{2}` became `-(1)/(2)`
        value = as_number(text[1:])
        return None if value is None else -value
    parts = [p.strip().removeprefix("(").removesuffix(")") for p in text.split("/")]
    if len(parts) > 2 or not all(_NUMBER.fullmatch(p) for p in parts):
        return None
    value = Fraction(parts[0])
    if len(parts) == 2:
        denominator = Fraction(parts[1])
        if denominator == 0:
            return None
        value /= denominator
    return value


def score_math(response_text: str, ground_truth: str) -> float:
    """1.0 when the response's final answer equals the ground truth (see the module docstring), else 0.0."""
    if not isinstance(response_text, str) or isinstance(ground_truth, bool):
        return 0.0
    if not isinstance(ground_truth, str | int | float):
        return 0.0
    answer = extract_answer(response_text)
    truth = str(ground_truth)
    boxed_truth = _boxed_answer(truth)
    if boxed_truth is not None:
        truth = boxed_truth[1]
    if answer is None:
        return 0.0
    got, want = normalize(answer), normalize(truth)
    got_value, want_value = as_number(got), as_number(want)
    if got_value is not None and want_value is not None:
        return float(got_value == want_value)
    return float(got != "" and got == want)
