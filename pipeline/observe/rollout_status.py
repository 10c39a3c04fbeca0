"""verl's per-step rollouter status and sample timings, under verl 0.9.1's names.

verl's rollouter takes a snapshot of its counters each time a prompt's responses finish generating and attaches it to
the sample; the trainer logs the snapshot of its batch's first sample (the one generated first) as
`fully_async/<key>`. The clock keeps the same snapshot per prompt (StatusLog), taken as the prompt is handed on:

- `monitor/active_tasks_size`: prompts admitted and not yet generated, this one included;
- `monitor/queue/mq_queue_size`: prompts generated and not yet taken by the trainer (verl's message queue);
- `count/total_generated_samples`: prompts generated before this one in the run;
- `count/staleness_samples`: the version's staleness counter (admitted this version and carried over, less the
  permits dynamic sampling refunded), which the gate holds under `static/max_required_samples`;
- `count/dropped_stale_samples`: 0 (verl drops a sample when its message queue refuses it; the stream never drops);
- `static/*`: the budget's constants (verl's max_queue_size is max_required_samples).

verl's `monitor/queue/pending_queue_size` (prompts read and waiting to be admitted) is not logged: the prompts ahead of
the gate sit in Ray Data's queues, which the clock does not see.

Per step, from the batch's responses (step_timings): `fully_async/processing_time/{avg,max,min,tp50,tp95,tp99}`, each
response's generation time without its tool calls (verl's `generate_sequences` timer), and
`timing_s/agent_loop/tool_calls/{max,min,mean}`, its tool calls' time (0 for a single-turn response).
"""

from __future__ import annotations

import numpy as np

from stages.staleness import StalenessBudget

PREFIX = "fully_async/"


class StatusLog:
    """The snapshot of each prompt generated and not yet consumed or filtered (the clock keeps one)."""

    def __init__(self, budget: StalenessBudget) -> None:
        self.static = {
            "static/max_required_samples": budget.max_required_samples,
            "static/required_samples": budget.required_samples,
            "static/staleness_threshold": budget.staleness_threshold,
            "static/max_queue_size": budget.max_required_samples,
            "static/max_concurrent_samples": budget.max_concurrent_samples,
        }
        self.generated = 0
        self.snapshots: dict[str, dict[str, float]] = {}

    def handed_on(self, prompt_id: str, active: int, queued: int, staleness: int) -> None:
        """`prompt_id` finished generating while `active` prompts (it included) were generating and `queued` waited
        for the trainer; `staleness`: the version's counter."""
        self.snapshots[prompt_id] = {
            "monitor/active_tasks_size": active,
            "monitor/queue/mq_queue_size": queued,
            "count/total_generated_samples": self.generated,
            "count/staleness_samples": staleness,
            "count/dropped_stale_samples": 0,
        }
        self.generated += 1

    def first_of(self, prompt_ids: list[str]) -> dict[str, float]:
        """The snapshot of the prompt generated first among `prompt_ids` (a step's), under verl's names; the
        prompts' snapshots are dropped. Empty if none was recorded."""
        taken = [self.snapshots.pop(pid) for pid in prompt_ids if pid in self.snapshots]
        if not taken:
            return {}
        first = min(taken, key=lambda s: s["count/total_generated_samples"])
        return {PREFIX + key: float(value) for key, value in {**first, **self.static}.items()}

    def forget(self, prompt_ids: list[str]) -> None:
        for pid in prompt_ids:
            self.snapshots.pop(pid, None)


def step_timings(table) -> dict[str, float]:
    """verl's processing-time and tool-call statistics over a step's responses (the driver's light columns)."""
    total = np.asarray(table["gen_latency_s"].to_pylist(), dtype=float)
    tools = np.asarray(table["tool_latency_s"].to_pylist(), dtype=float)
    generating = total - tools
    out = {
        PREFIX + "processing_time/avg": float(generating.mean()),
        PREFIX + "processing_time/max": float(generating.max()),
        PREFIX + "processing_time/min": float(generating.min()),
    }
    for q in (50, 99, 95):
        out[PREFIX + f"processing_time/tp{q}"] = float(np.percentile(generating, q))
    return out | {
        "timing_s/agent_loop/tool_calls/max": float(tools.max()),
        "timing_s/agent_loop/tool_calls/min": float(tools.min()),
        "timing_s/agent_loop/tool_calls/mean": float(tools.mean()),
    }
