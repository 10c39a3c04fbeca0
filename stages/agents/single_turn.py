"""single_turn_agent: one response to the prompt, resumed across syncs; no turns, every token trained."""

from __future__ import annotations

from typing import Any

from stages.agents import AgentEngine, Trajectory, generate_resumable


class SingleTurnAgentLoop:
    def __init__(self, engine: AgentEngine, max_tokens: int, multi_turn: dict[str, Any] | None = None) -> None:
        self.engine, self.max_tokens = engine, max_tokens

    async def run(self, prompt_ids: list[int], sample_id: str) -> Trajectory:
        traj = Trajectory(prompt_ids)
        seg, resumes = await generate_resumable(self.engine, prompt_ids, self.max_tokens, sample_id)
        traj.add_generated(seg)
        traj.num_resumes, traj.finish_reason = resumes, seg.finish_reason
        return traj
