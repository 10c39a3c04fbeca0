"""calculator: arithmetic on numbers, evaluated from the expression's syntax tree (no eval).

Arguments: {"expression": "347 * 29"}. Numbers, + - * / // % **, unary signs and parentheses; nothing else parses.
Exponents and results are bounded so that no expression can take long or allocate much.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from stages.tools import ToolError

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64
MAX_ABS = 10**30
MAX_CHARS = 200


def evaluate(expression: str) -> int | float:
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError('calculator needs {"expression": "<arithmetic>"}')
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        if isinstance(value, complex) or (isinstance(value, float) and not math.isfinite(value)):
            raise ToolError("the result is not a finite real number")
        if abs(value) > MAX_ABS:
            raise ToolError(f"the result is larger than {MAX_ABS:.0e}")
        return value
    raise ToolError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


async def calculator(arguments: dict[str, Any]) -> str:
    return format_number(evaluate(arguments.get("expression")))
