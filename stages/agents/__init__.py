"""Agent loops: how one trajectory is generated, chosen per sample by its `agent_name` column.

A loop drives the Generate stage's engine through the small `AgentEngine` interface below (one engine request, the
weight version loaded now, wait while a sync is under way), so vLLM, weight syncs and partial rollout stay in the
stage and a loop is pure control flow that a fake engine can test. Loops are registered by verl's names:

- `single_turn_agent` (alias `single_turn`): one response to the prompt, exactly the Generate stage's old behaviour;
- `tool_agent`: a multi-turn state machine that parses Hermes tool calls, runs tools and appends their results
  (stages/agents/tool_agent.py).

Resuming after a sync is the same for every loop (`generate_resumable`): a request the engine aborted at a sync
keeps its tokens and is resubmitted as context + partial tokens with the remaining budget; the engine's version
labels say which weights sampled each token.

MoE routes (rollout routing replay): every engine request returns the routes of its whole context, so a trajectory's
routes are always its latest request's, replaced and never appended (a resumed request, a new turn). Routes of tokens
that no request has fed yet (tool results that end a trajectory) come from one more request (`complete_routes`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

# name -> "module:Class"; imported on first use, so reading the names costs nothing (config checks, the source).
_REGISTRY = {
    "single_turn_agent": "stages.agents.single_turn:SingleTurnAgentLoop",
    "single_turn": "stages.agents.single_turn:SingleTurnAgentLoop",
    "tool_agent": "stages.agents.tool_agent:ToolAgentLoop",
}
AGENT_LOOP_NAMES = tuple(_REGISTRY)


class UnknownAgentError(ValueError):
    """An agent_name that no loop is registered under."""


def check_agent_name(name: str, where: str) -> str:
    """`name` if a loop is registered under it; else one error naming the registered loops."""
    if name not in _REGISTRY:
        raise UnknownAgentError(
            f"{where}: unknown agent loop {name!r}; registered: {', '.join(AGENT_LOOP_NAMES)}. Fix the agent_name "
            f"column or rollout.agent.default_agent_loop."
        )
    return name


def agent_loop_class(name: str) -> type:
    module, _, cls = _REGISTRY[check_agent_name(name, "agent loop")].partition(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class Segment:
    """What one engine request produced: tokens, their behaviour logprobs and weight versions, why it ended."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # 'stop', 'length' or 'abort' (a sync interrupted it)
    # The MoE routes of the request's context (its input and tokens but the last), (rows, layers * k) uint8; None
    # without route capture. An aborted request's may stop short, in its prefill.
    routes: np.ndarray | None = None
    routes_version: int = -1  # the weights whose prefill computed `routes` (the request's first token's version)


class AgentEngine(Protocol):
    """What a loop may ask of the Generate stage."""

    tokenizer: Any

    async def segment(self, context: list[int], max_tokens: int, request_id: str) -> Segment:
        """One engine request on `context`; ends early with finish_reason 'abort' when a sync interrupts it."""

    def current_version(self) -> int:
        """The weight version loaded now: the label of tokens the loop appends itself."""

    async def wait_running(self) -> bool:
        """Return once no sync is under way; True if it had to wait for one."""


@dataclass
class Trajectory:
    """The response as it grows. Per-token lists always have the same length (schemas/sample.py)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    num_resumes: int = 0
    finish_reason: str = "stop"
    routes: np.ndarray | None = None  # the latest request's routes (Segment.routes): never appended to
    routes_version: int = -1  # and the version of its prefill (Segment.routes_version)

    @property
    def num_route_rows(self) -> int:
        """Rows of routes the trajectory needs: one per token of prompt + response but the last."""
        return max(len(self.prompt_ids) + len(self.tokens) - 1, 0)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add_generated(self, seg: Segment) -> None:
        self.tokens += seg.tokens
        self.logprobs += seg.logprobs
        self.versions += seg.versions
        self.mask += [1] * len(seg.tokens)
        if seg.routes is not None:  # the request's context is this trajectory's: its routes replace ours
            self.routes, self.routes_version = seg.routes, seg.routes_version

    def add_appended(self, tokens: list[int], version: int) -> None:
        """Tokens the loop wrote (tool results): no loss, logprob 0, the version current now.

        The label never goes below the previous token's, so versions stay non-decreasing along the response even
        when the engine labelled its last tokens with a version the stage has not recorded as loaded yet."""
        label = max([version, *self.versions[-1:]])
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.versions += [label] * len(tokens)
        self.mask += [0] * len(tokens)


async def generate_resumable(
    engine: AgentEngine, context: list[int], max_tokens: int, request_id: str
) -> tuple[Segment, int]:
    """Generate up to `max_tokens` after `context`, resuming each time a sync aborts the request.

    Returns the whole segment (finish_reason 'stop' or 'length') and how many times it was resumed."""
    out = Segment([], [], [], "abort")
    resumes = -1
    while out.finish_reason == "abort":
        resumes += 1
        seg = await engine.segment(context + out.tokens, max_tokens - len(out.tokens), f"{request_id}#{resumes}")
        # The resubmitted request recomputed the whole context: its routes replace the aborted one's.
        out = Segment(out.tokens + seg.tokens, out.logprobs + seg.logprobs, out.versions + seg.versions, "", seg.routes)
        out.finish_reason, out.routes_version = seg.finish_reason, seg.routes_version
    return out, resumes


async def complete_routes(engine: AgentEngine, traj: Trajectory, request_id: str) -> None:
    """Give the trajectory routes for every token but the last, when it has routes at all.

    Tokens the loop appended after its last request (tool results that end it) were never fed to the model: one more
    request on the context without its last token, for one token that is thrown away, computes every row (and fits
    the engine's max_model_len whenever the trajectory does). Its rows come from the weights loaded now."""
    need = traj.num_route_rows
    if traj.routes is None or len(traj.routes) == need:
        return
    if len(traj.routes) > need:
        raise RuntimeError(f"{request_id}: {len(traj.routes)} rows of routes for a context of {need + 1} tokens")
    seg, _ = await generate_resumable(engine, traj.context[:-1], 1, request_id)
    traj.routes, traj.routes_version = seg.routes[:need], seg.routes_version
