"""tool_agent: a multi-turn tool-calling loop, interruptible by a weight sync in every state.

States, as in verl's ToolAgentLoop: PENDING -> GENERATING -> PROCESSING_TOOLS -> GENERATING ... -> TERMINATED.

- GENERATING: one assistant turn, resumed across syncs (an aborted request keeps its tokens and continues with the
  new weights; `generate_resumable`). Its tokens are trained on (response_mask 1). If the turn's text holds Hermes
  tool calls (stages/agents/hermes.py) and the turn limits allow, the loop processes them; otherwise it ends.
- PROCESSING_TOOLS: the turn's first `max_parallel_calls` calls run concurrently as asyncio tasks. A sync does not
  wait for them: the engine pauses and reloads while the tools run, and the loop carries on after both. Each
  result (or error: an unknown tool, malformed JSON, a failed run) is appended as a tool turn,
  `<tool_response>...</tool_response>`, with response_mask 0 (no loss on text the model did not write), logprob 0.0
  and the weight version current when it was appended.
- Between states the loop checks for a sync under way and waits for its end, so it never submits a request or
  appends a result mid-sync (verl could only interrupt in GENERATING).

Without partial rollout the engine drains its requests at a sync, not whole trajectories: a trajectory between two
turns at a sync continues with the new weights (its later tokens say so), within the staleness bound the sink
enforces on its oldest token.

`num_resumes` counts the syncs the trajectory lived through: aborts of its requests plus syncs that happened while
its tools ran or between its turns. Every turn is recorded (`agent_turns`): its token range, and for tool turns the
tool, its arguments, the result, the latency and the error.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from typing import Any

from stages.agents import AgentEngine, Trajectory, generate_resumable
from stages.agents.hermes import ToolCall, parse_tool_calls
from stages.tools import Tool, ToolError, make_tools

TOOL_RESPONSE = "<tool_response>{}</tool_response>"


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    TERMINATED = "terminated"


class ToolAgentLoop:
    def __init__(
        self,
        engine: AgentEngine,
        max_tokens: int,
        multi_turn: dict[str, Any] | None = None,
        tools: dict[str, Tool] | None = None,
    ) -> None:
        """`multi_turn`: rollout.multi_turn as a dict; `tools` overrides the tools it names (tests)."""
        mt = multi_turn or {}
        self.engine, self.max_tokens = engine, max_tokens
        self.max_assistant_turns = mt.get("max_assistant_turns", 4)
        self.max_user_turns = mt.get("max_user_turns", 4)
        self.max_parallel_calls = mt.get("max_parallel_calls", 1)
        self.max_tool_response_length = mt.get("max_tool_response_length", 256)
        self.tools = (
            tools
            if tools is not None
            else make_tools(
                mt.get("tools", ["calculator", "python"]),
                mt.get("sandbox_timeout_s", 5.0),
                mt.get("sandbox_memory_mb", 256),
                mt.get("sandbox_cpu_s", 2),
            )
        )
        self.on_state = None  # test hook: called with each state the loop enters

    async def run(self, prompt_ids: list[int], sample_id: str) -> Trajectory:
        traj = Trajectory(list(prompt_ids))
        run = _Run(traj, sample_id)
        state = AgentState.PENDING
        while state != AgentState.TERMINATED:
            # A sync under way: the state resumes with the new weights (an interruption once the response began).
            if await self.engine.wait_running() and traj.tokens:
                traj.num_resumes += 1
            if self.on_state is not None:
                self.on_state(state)
            if state == AgentState.PENDING:
                state = AgentState.GENERATING
            elif state == AgentState.GENERATING:
                state = await self._generate(run)
            else:
                state = await self._process_tools(run)
        return traj

    def _budget(self, traj: Trajectory) -> int:
        return self.max_tokens - len(traj.tokens)

    async def _generate(self, run: _Run) -> AgentState:
        traj = run.traj
        start, t0 = len(traj.tokens), time.monotonic()
        request = f"{run.sample_id}@t{len(traj.turns)}"
        seg, resumes = await generate_resumable(self.engine, traj.context, self._budget(traj), request)
        traj.add_generated(seg)
        traj.num_resumes += resumes
        traj.finish_reason = seg.finish_reason
        run.assistant_turns += 1
        run.add_turn("assistant", start, latency_s=time.monotonic() - t0)
        if seg.finish_reason == "length" or self._budget(traj) <= 0:
            traj.finish_reason = "length"
            return AgentState.TERMINATED
        text = self.engine.tokenizer.decode(seg.tokens, skip_special_tokens=True)
        parsed = parse_tool_calls(text, self.max_parallel_calls)
        run.calls = parsed.calls
        if not parsed.calls or run.assistant_turns >= self.max_assistant_turns or run.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED
        return AgentState.PROCESSING_TOOLS

    async def _process_tools(self, run: _Run) -> AgentState:
        traj = run.traj
        version_before = self.engine.current_version()
        tasks = [asyncio.create_task(self._call(call)) for call in run.calls]
        results = await asyncio.gather(*tasks)  # a sync may come and go meanwhile; the tools keep running
        if await self.engine.wait_running() or self.engine.current_version() != version_before:
            traj.num_resumes += 1  # this state was interrupted by a sync and resumes with the new weights
        run.user_turns += 1
        for call, (result, error, latency) in zip(run.calls, results, strict=True):
            budget = self._budget(traj)
            text = TOOL_RESPONSE.format(result if error is None else f"error: {error}")
            tokens = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"][: max(budget, 0)]
            start = len(traj.tokens)
            traj.add_appended(tokens, self.engine.current_version())
            arguments = json.dumps(call.arguments) if call.arguments is not None else call.raw
            run.add_turn("tool", start, call.name, arguments, result, latency, error)
        if self._budget(traj) <= 0:
            traj.finish_reason = "length"
            return AgentState.TERMINATED
        return AgentState.GENERATING

    async def _call(self, call: ToolCall) -> tuple[str | None, str | None, float]:
        """(result, error, latency_s) of one call; every failure becomes an error string."""
        t0 = time.monotonic()
        if call.error is not None:
            return None, call.error, 0.0
        tool = self.tools.get(call.name)
        if tool is None:
            return None, f"unknown tool {call.name!r}; available: {', '.join(self.tools)}", 0.0
        try:
            result, error = (await tool(call.arguments))[: self.max_tool_response_length], None
        except ToolError as err:
            result, error = None, str(err)
        except Exception as err:  # noqa: BLE001 - a broken tool marks the turn, never fails the run
            result, error = None, f"tool {call.name!r} raised {type(err).__name__}: {err}"
        return result, error, time.monotonic() - t0


class _Run:
    """Per-trajectory loop state besides the tokens: turn counters, the pending calls, the turn records."""

    def __init__(self, traj: Trajectory, sample_id: str) -> None:
        self.traj, self.sample_id = traj, sample_id
        self.assistant_turns = self.user_turns = 0
        self.calls: list[ToolCall] = []

    def add_turn(
        self,
        role: str,
        start: int,
        tool_name: str | None = None,
        arguments: str | None = None,
        result: str | None = None,
        latency_s: float | None = None,
        error: str | None = None,
    ) -> None:
        self.traj.turns.append(
            {
                "turn": len(self.traj.turns),
                "role": role,
                "token_start": start,
                "token_end": len(self.traj.tokens),
                "tool_name": tool_name,
                "arguments": arguments,
                "result": result,
                "latency_s": latency_s,
                "error": error,
            }
        )
