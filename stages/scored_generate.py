"""ScoredGenerate: the Generate stage with the stream's scoring stages run inside its actor (rollout.score_in_engine).

Input columns:  the generate class's (stages.generate.VLLMGenerate or a swapped one)
Output columns: stages.handoff.SplitTokens's (the light columns + schemas.TOKEN_TABLE_COLUMNS)

Left to Ray Data, a generated block waits for the scheduling loop to hand it to the split stage's actors (reward,
advantage and sample log fused in), which costs about 0.05 s per block on 2 cores (bench.overhead): on short steps,
a third of a prompt's way from admission to the trainer. Here the engine's actor scores, logs and splits the block
itself, so the block leaves the engine ready for the driver.

The price is ownership: the per-token tables this actor puts in the object store live as long as its process, and
an engine's death kills it. So the config allows this only where a dead replica ends the run anyway
(rollout.engine_max_restarts=0) and no reference model sits between generation and scoring (pipeline/config).
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
        self, generate: tuple[type, dict[str, Any]], scoring: list[Callable[[pa.Table], pa.Table]], tables: Any
    ) -> None:
        """`generate`: the generate stage's class and keywords; `scoring`: the stream's stages after it, in order
        (reward, advantage, sample log), as the callables Ray Data would run; `tables`: the TokenTables actor."""
        from stages.handoff import SplitTokens

        cls, kwargs = generate
        self.generate = cls(**kwargs)
        self.scoring = [*scoring, SplitTokens(tables)]
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
