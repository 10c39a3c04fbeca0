"""Tools a `tool_agent` loop may call, by name. A tool is an async callable: arguments (a dict) -> result text.

A tool signals bad input or a failed run with ToolError; the loop hands the message to the model and records it on
the turn. Any other exception is a bug in the tool, and the loop records it the same way: a tool never fails a run.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Tool = Callable[[dict[str, Any]], Awaitable[str]]
TOOL_NAMES = ("calculator", "python")


class ToolError(Exception):
    """The call could not produce a result; the message says why, for the model and the sample log."""


def make_tools(names: list[str], timeout_s: float = 5.0, memory_mb: int = 256, cpu_s: int = 2) -> dict[str, Tool]:
    """The named tools; the python sandbox gets the limits."""
    from stages.tools.calculator import calculator
    from stages.tools.python_sandbox import PythonSandbox

    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown} in rollout.multi_turn.tools; available: {', '.join(TOOL_NAMES)}")
    built: dict[str, Tool] = {"calculator": calculator}
    if "python" in names:
        built["python"] = PythonSandbox(timeout_s=timeout_s, memory_mb=memory_mb, cpu_s=cpu_s)
    return {n: built[n] for n in names}
