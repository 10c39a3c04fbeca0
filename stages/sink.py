"""TrainingSink: turn the stream of scored groups into trainer steps, oldest admission first.

Input columns:  all of schemas.SAMPLE_SCHEMA (complete GRPO groups)
Output:         per step, `require_batches` mini-batches of `ppo_mini_batch_size` groups; a consumption log
                (sample_id, prompt_id, consumed_version, consumed_step, consumed_time) in Parquet

Blocks arrive in completion order, not admission order: a long response admitted early may land after short
ones admitted later. The sink keeps a small buffer of complete groups, trains on the oldest admissions first,
and before the last steps of a version it waits for the outstanding prompts that would otherwise exceed the lag
bound (see stages.staleness). That makes `lag <= ceil(staleness_threshold)` true by construction, and the
audit checks it from the logs. Data never waits in the sink longer than the bound requires.

`step_transform`, when given, is applied to the step's whole table before it is split into mini-batches: the
operations verl runs over a training batch, such as the whitening of reinforce_plus_plus's advantages
(stages.advantage.whiten_step), since a block of the stream holds only some of a step's groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from schemas import CONSUMED_SCHEMA, REQUIRED_COLUMNS, require_columns
from stages.staleness import StalenessBudget


@dataclass
class Step:
    groups: list[pa.Table]  # one table per prompt, oldest admission first
    wait_s: float  # time the sink spent waiting for the stream
    version: int = 0  # the trainer's weight version at this step

    def minibatches(self, size: int) -> list[dict[str, list]]:
        """Column -> rows of each mini-batch, plus `trainer_version` (the step's version, on every row)."""
        tables = [pa.concat_tables(self.groups[i : i + size]) for i in range(0, len(self.groups), size)]
        return [{**t.to_pydict(), "trainer_version": [self.version] * t.num_rows} for t in tables]

    @property
    def table(self) -> pa.Table:
        return pa.concat_tables(self.groups)


class TrainingSink:
    def __init__(
        self,
        blocks: Iterator[pa.Table],
        budget: StalenessBudget,
        group_size: int,
        consumed_path: str,
        outstanding_at_or_before: Callable[[int], int],
        step_transform: Callable[[pa.Table], pa.Table] | None = None,
    ) -> None:
        self.blocks = blocks
        self.step_transform = step_transform
        self.budget = budget
        self.group_size = group_size
        self.consumed_path = consumed_path.rstrip("/")
        self.outstanding_at_or_before = outstanding_at_or_before
        self.buffer: dict[str, pa.Table] = {}
        self.exhausted = False

    def next_step(self, version: int, steps_left_after_this: int) -> Step | None:
        """The next step's groups, or None when the stream ended before a full step."""
        need = self.budget.required_samples
        # Prompts admitted at or before this version would exceed the lag bound after the next sync.
        threshold = version - self.budget.lag_bound
        waited = 0.0
        while True:
            too_old = self.outstanding_at_or_before(threshold) if threshold >= 0 else 0
            due = min(self.budget.must_consume_now(too_old, steps_left_after_this), need)
            old_here = sum(1 for pid in self.buffer if self._age(pid)[0] <= threshold)
            if len(self.buffer) >= need and (old_here >= due or self.exhausted):
                break
            if self.exhausted:
                return None
            t0 = time.monotonic()
            block = next(self.blocks, None)
            waited += time.monotonic() - t0
            if block is None:
                self.exhausted = True
                continue
            self._add(block)
        chosen = sorted(self.buffer, key=self._age)[:need]
        groups = [self.buffer.pop(pid) for pid in chosen]
        if self.step_transform is not None:
            groups = self._transform(groups)
        return Step(groups, waited, version)

    def _transform(self, groups: list[pa.Table]) -> list[pa.Table]:
        """The step's groups after `step_transform` ran over all of them at once, in the same order."""
        table = self.step_transform(pa.concat_tables(groups))
        if table.num_rows != len(groups) * self.group_size:
            raise ValueError(f"step_transform returned {table.num_rows} rows for {len(groups)} groups")
        return [table.slice(i * self.group_size, self.group_size) for i in range(len(groups))]

    def _age(self, prompt_id: str) -> tuple[int, float, str]:
        t = self.buffer[prompt_id]
        return t["admitted_version"][0].as_py(), t["admitted_time"][0].as_py(), prompt_id

    def _add(self, block: pa.Table) -> None:
        require_columns(block, REQUIRED_COLUMNS, "TrainingSink")
        ids = block.column("prompt_id").to_pylist()
        for pid in dict.fromkeys(ids):
            group = block.filter(pc.equal(block["prompt_id"], pid))
            if group.num_rows != self.group_size or pid in self.buffer:
                raise ValueError(f"group {pid} arrived with {group.num_rows} rows (expected {self.group_size}, once)")
            self.buffer[pid] = group

    def record(self, step: Step, version: int, step_index: int) -> None:
        """Append the step's samples to the consumption log."""
        table = step.table
        now = time.time()
        log = pa.table(
            {
                "sample_id": table["sample_id"],
                "prompt_id": table["prompt_id"],
                "consumed_version": pa.array([version] * table.num_rows, pa.int64()),
                "consumed_step": pa.array([step_index] * table.num_rows, pa.int64()),
                "consumed_time": pa.array([now] * table.num_rows, pa.float64()),
            },
            schema=CONSUMED_SCHEMA,
        )
        fs, root = fsspec.core.url_to_fs(self.consumed_path)
        fs.makedirs(root, exist_ok=True)
        with fs.open(f"{root}/step-{step_index:07d}.parquet", "wb") as f:
            pq.write_table(log, f)

    def close(self) -> None:
        """Stop the stream: closing its iterator shuts down Ray Data's executor and the stage actors."""
        close = getattr(self.blocks, "close", None)
        if close is not None:
            close()

    def leftover(self) -> list[str]:
        """Prompts delivered to the sink but never trained on (reported at the end of a run)."""
        return list(self.buffer)
