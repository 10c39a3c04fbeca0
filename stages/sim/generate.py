"""SimGenerate: the Generate stage on a simulated engine that spends time instead of compute.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source, agent_name (optional), admitted_version,
                admitted_time
Output columns: the same as stages.generate.VLLMGenerate (the two are swapped in conf/ with `stages.generate`)

The same replica as the real engine's (stages/replica.py: it registers with the VersionClock, answers the weight
syncs it relays, validates, and at a sync behaves as `pause_mode` says), on stages/engines/sim.py's engine, whose
responses follow the simulated workload (`sim`: stages/sim/workload.py). Token ids are 0 and logprobs 0.0: only
lengths, times and versions mean anything here.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from stages.control import ClockLink
from stages.engines.base import PauseMode, Sampling
from stages.engines.sim import SimEngine, SimSampler
from stages.replica import Replica
from stages.sim.workload import Workload


class SimGenerate:
    def __init__(
        self,
        clock_name: str,
        namespace: str,
        n: int,
        max_tokens: int,
        sim: dict[str, Any],
        pause_mode: str = "wait",
        initial_version: int = 0,
    ) -> None:
        mode = PauseMode.of(pause_mode)
        engine = SimEngine(Workload(**sim), interruptible=mode != PauseMode.WAIT)
        sampler = SimSampler(engine, max_tokens)
        clock = ClockLink(clock_name, namespace)
        self.replica = Replica(
            clock, lambda _: engine, sampler, n, Sampling(), mode, initial_version, stage=type(self).__name__
        )

    async def __call__(self, batch: pa.Table) -> pa.Table:
        return await self.replica.generate(batch)
