"""Parse Hermes/Qwen tool calls from a model's text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Total, like a verifier: any text gives a result. A call whose body is not a JSON object with a string `name` and an
object `arguments` still comes back, with `error` saying what is wrong, so the loop can tell the model instead of
failing the sample. Calls beyond `max_calls` are dropped (verl's max_parallel_calls).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass
class ToolCall:
    name: str | None
    arguments: dict[str, Any] | None
    raw: str  # the text between the tags
    error: str | None = None  # why the call cannot be run; None when name and arguments are usable


@dataclass
class Parsed:
    content: str  # the text outside the calls
    calls: list[ToolCall]
    dropped: int  # well- or ill-formed calls beyond max_calls


def parse_tool_calls(text: str, max_calls: int) -> Parsed:
    bodies = CALL_RE.findall(text)
    content = CALL_RE.sub("", text).strip()
    calls = [_parse_one(body) for body in bodies[:max_calls]]
    return Parsed(content, calls, max(0, len(bodies) - max_calls))


def _parse_one(body: str) -> ToolCall:
    raw = body.strip()
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        return ToolCall(None, None, raw, f"tool call is not valid JSON ({err.msg} at char {err.pos})")
    if not isinstance(value, dict):
        return ToolCall(None, None, raw, 'tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = value.get("name"), value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, raw, 'tool call needs a string "name"')
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, 'tool call "arguments" must be a JSON object')
    return ToolCall(name, arguments, raw)
