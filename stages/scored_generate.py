"""ScoredGenerate: the Generate stage with the stream's scoring stages run inside its actor (rollout.score_in_engine).

Input columns:  the generate class's (stages.generate.VLLMGenerate or a swapped one)
Output columns: stages.handoff.SplitTokens's (the light columns + schemas.TOKEN_TABLE_COLUMNS)

Left to Ray Data, a generated block waits for the scheduling loop to hand it to the split stage's actors (reward,
advantage and sample log fused in): one more hop per block, a good part of a prompt's way from admission to the
trainer on short steps (docs/benchmarks.md, "Pipeline overhead"). Here the engine's actor scores, logs and splits
the block itself, so the block leaves the engine ready for the driver.

A table put by this actor would live only as long as its process, which a dead engine takes down (Ray restarts
the replica and runs its calls again). So the tables go to a TokenTables of the engine's node, which puts them
itself and outlives the engine (`TokenTables.own`): what a dead replica leaves behind is only its unfinished calls,
which Ray Data runs again on the restarted replica, and a call that died after logging its block logs it again under
the same name (stages.sample_log.block_name), replacing the first shard. A reference model needs a stage between
generation and scoring, so with one the stream scores in stages (pipeline/config: RunConfig.scores_in_engine).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any

import pyarrow as pa


class ScoredGenerate:
    def __init__(
        self,
        generate: tuple[type, dict[str, Any]],
        scoring: list[Callable[[pa.Table], pa.Table]],
        owners: dict[str, Any],
    ) -> None:
        """`generate`: the generate stage's class and keywords; `scoring`: the stream's stages after it, in order
        (reward, advantage, sample log), as the callables Ray Data would run; `owners`: TokenTables.owners."""
        import ray

        from stages.handoff import SplitTokens

        cls, kwargs = generate
        self.generate = cls(**kwargs)
        node = ray.get_runtime_context().get_node_id()
        owner = owners.get(node) or next(iter(owners.values()))  # a node that joined later: the driver's
        self.scoring = [*scoring, SplitTokens(owner, owned_by_tables=True)]
        # One block at a time, as in the stage it replaces: the reward stage's worker pool serves one caller.
        self.one_block = threading.Lock()

    async def __call__(self, batch: pa.Table) -> pa.Table:
        out = self.generate(batch)
        if inspect.isawaitable(out):
            out = await out
        # In a thread: a reward function may take seconds, and the engine's calls and syncs go on meanwhile.
        return await asyncio.to_thread(self._score, out)

    def _score(self, block: pa.Table) -> pa.Table:
        with self.one_block:
            for stage in self.scoring:
                block = stage(block)
        return block
