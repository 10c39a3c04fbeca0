"""TrainingSink: turn the stream of scored groups into trainer steps, oldest admission first.

Input columns:  all of schemas.SAMPLE_SCHEMA (complete GRPO groups)
Output:         per step, `require_batches` mini-batches of `ppo_mini_batch_size` groups; a consumption log
                (sample_id, prompt_id, consumed_version, consumed_step, consumed_time) in Parquet; with dynamic
                sampling, a filter log (schemas.FILTERED_SCHEMA) of the groups it left out

Blocks arrive in completion order, not admission order: a long response admitted early may land after short
ones admitted later. The sink keeps a small buffer of complete groups, trains on the oldest admissions first,
and before the last steps of a version it waits for the outstanding prompts that would otherwise exceed the lag
bound (see stages.staleness). That makes `lag <= ceil(staleness_threshold)` true by construction, and the
audit checks it from the logs. Data never waits in the sink longer than the bound requires.

With dynamic sampling (algorithm.filter_groups, stages.group_filter) a group without signal never enters the buffer:
the clock hears of it at once and admits a prompt in its place, and its rows go to the filter log with the step
being filled, so every step still trains `required_samples` groups. A group the reward step dropped
(reward.on_error=drop_group: one of its samples failed to score) is left out and refilled the same way.

Blocks arrive as stages.handoff.Delivered: the scalar columns, and a reference to the per-token ones, which stay in
Ray's object store until the trainer fetches them (a plain table holding every column is taken too). A step goes to
the trainer as stages.handoff.StepRows, and `step_transform`, when given, runs there over the step's whole table
before it is split into mini-batches: the operations verl runs over a training batch, such as the whitening of
reinforce_plus_plus's advantages (stages.advantage.whiten_step), since a block of the stream holds only some of a
step's groups.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from schemas import CONSUMED_SCHEMA, FILTERED_SCHEMA, PER_TOKEN_COLUMNS, REQUIRED_COLUMNS, require_columns
from stages.group_filter import GroupFilter
from stages.handoff import Delivered, StepRows
from stages.reward_sources import DROPPED
from stages.sample_log import write_shard
from stages.staleness import StalenessBudget

LIGHT_REQUIRED = tuple(c for c in REQUIRED_COLUMNS if c not in PER_TOKEN_COLUMNS)
FLAT_REASON, DROPPED_REASON = "flat", "reward_failed"  # the filter log's filtered_reason


@dataclass
class Step:
    groups: list[pa.Table]  # one table per prompt, oldest admission first (the columns the driver holds)
    wait_s: float  # time the sink spent waiting for the stream
    version: int = 0  # the trainer's weight version at this step
    refs: list = field(default_factory=list)  # per group: the reference of its per-token columns (or None)
    transform: Callable[[pa.Table], pa.Table] | None = None
    heavy_bytes: int = 0  # the per-token columns' size, left in the object store
    filtered_groups: int | None = None  # groups dynamic sampling left out while this step filled (None: it is off)
    dropped_groups: int | None = None  # groups left out for a failed reward while it filled (None: not drop_group)

    def minibatches(self, size: int) -> StepRows:
        """The step as the trainer takes it: mini-batches of `size` groups."""
        starts = range(0, len(self.groups), size)
        refs = [[r for r in self.refs[i : i + size] if r is not None] for i in starts] if self.refs else []
        # One chunk per column: Ray serializes an Arrow table chunk by chunk, and a mini-batch of 8 groups (8 chunks
        # per column) took 17 ms to send against 1.6 ms combined (docs/benchmarks.md, "Sending the step").
        tables = [pa.concat_tables(self.groups[i : i + size]).combine_chunks() for i in starts]
        return StepRows(tables, refs, self.transform, self.version)

    @property
    def table(self) -> pa.Table:
        return pa.concat_tables(self.groups)

    @property
    def driver_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


class TrainingSink:
    def __init__(
        self,
        blocks: Iterator[Delivered | pa.Table],
        budget: StalenessBudget,
        group_size: int,
        consumed_path: str,
        outstanding_at_or_before: Callable[[int], int],
        step_transform: Callable[[pa.Table], pa.Table] | None = None,
        dynamic_sampling: DynamicSampling | None = None,
    ) -> None:
        self.blocks = blocks
        self.sampling = dynamic_sampling
        self.step_transform = step_transform
        self.budget = budget
        self.group_size = group_size
        self.consumed_path = consumed_path.rstrip("/")
        self.outstanding_at_or_before = outstanding_at_or_before
        self.buffer: dict[str, pa.Table] = {}
        self.refs: dict[str, tuple[object, int]] = {}  # prompt_id -> (per-token table's reference, its bytes)
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
            if self.exhausted or (self.sampling is not None and self.sampling.drained(len(self.buffer))):
                return None  # with dynamic sampling the source can run dry before the stream ends: no group to come
            t0 = time.monotonic()
            block = next(self.blocks, None)
            waited += time.monotonic() - t0
            if block is None:
                self.exhausted = True
                continue
            self._add(block)
        chosen = sorted(self.buffer, key=self._age)[:need]
        groups = [self.buffer.pop(pid) for pid in chosen]
        refs = [self.refs.pop(pid) for pid in chosen]
        heavy = sum(size for _, size in refs)
        filtered, dropped = self.sampling.step_filled() if self.sampling else (None, None)
        return Step(groups, waited, version, [ref for ref, _ in refs], self.step_transform, heavy, filtered, dropped)

    def _age(self, prompt_id: str) -> tuple[int, float, str]:
        t = self.buffer[prompt_id]
        return t["admitted_version"][0].as_py(), t["admitted_time"][0].as_py(), prompt_id

    def _add(self, delivered: Delivered | pa.Table) -> None:
        if isinstance(delivered, pa.Table):
            delivered = Delivered(delivered)
        block = delivered.light
        # A split block was checked whole beside its data (stages.handoff.SplitTokens).
        require_columns(block, REQUIRED_COLUMNS if delivered.ref is None else LIGHT_REQUIRED, "TrainingSink")
        ids = block.column("prompt_id").to_pylist()
        for pid in dict.fromkeys(ids):
            group = block.filter(pc.equal(block["prompt_id"], pid))
            if group.num_rows != self.group_size or pid in self.buffer:
                raise ValueError(f"group {pid} arrived with {group.num_rows} rows (expected {self.group_size}, once)")
            if self.sampling is not None and self.sampling.leaves_out(group):
                continue
            self.buffer[pid] = group
            self.refs[pid] = (delivered.ref, delivered.heavy_bytes * group.num_rows // max(block.num_rows, 1))

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
        write_shard(log, f"{self.consumed_path}/step-{step_index:07d}.parquet")
        if self.sampling is not None:
            self.sampling.write(step_index)

    def finish(self) -> None:
        """Write what dynamic sampling filtered after the last step (while a step filled that was never trained)."""
        if self.sampling is not None:
            self.sampling.write(self.sampling.step + 1)

    def close(self) -> None:
        """Stop the stream: closing its iterator shuts down Ray Data's executor and the stage actors."""
        close = getattr(self.blocks, "close", None)
        if close is not None:
            close()

    def leftover(self) -> list[str]:
        """Prompts delivered to the sink but never trained on (reported at the end of a run)."""
        return list(self.buffer)


class FilterCapError(RuntimeError):
    """Dynamic sampling filtered more groups than algorithm.filter_groups.max_num_gen_batches allows for one step."""


class DynamicSampling:
    """The sink's part of DAPO's dynamic sampling and of the refill of dropped groups: decide each group (a flat one
    by stages.group_filter, when a filter is given; one the reward step dropped, when `drop_failed`), tell the clock
    of the ones left out (`on_filtered(prompt_ids)` returns the clock's version), and keep their rows for the filter
    log, which `write(step)` appends as the shard of the step they were left out while filling."""

    def __init__(
        self,
        group_filter: GroupFilter | None,
        on_filtered: Callable[[list[str]], int],
        path: str,
        max_per_step: int = 0,
        start_step: int = 0,
        drained: Callable[[int], bool] = lambda buffered: False,
        drop_failed: bool = False,
    ) -> None:
        """`drained(buffered)`: whether the gate admitted the whole source and every prompt not yet trained or
        filtered is among the `buffered` groups the sink holds (no group is left to come). `max_per_step` caps the
        flat groups one step may filter (0: no cap); dropped groups are not capped: the source running dry ends
        a run whose every group fails."""
        self.filter, self.on_filtered, self.path = group_filter, on_filtered, path.rstrip("/")
        self.drained, self.drop_failed = drained, drop_failed
        self.max_per_step = max_per_step
        self.step = start_step  # the last step written (a resumed run's checkpoint step before the first)
        self.pending: list[pa.Table] = []
        self.since_step = 0  # flat groups filtered while the current step fills
        self.dropped_since_step = 0  # dropped groups left out while it fills

    def leaves_out(self, group: pa.Table) -> bool:
        reason, value = self._reason(group)
        if reason is None:
            return False
        version = self.on_filtered([group["prompt_id"][0].as_py()])
        n = group.num_rows
        columns = {
            "sample_id": group["sample_id"],
            "prompt_id": group["prompt_id"],
            "filtered_version": pa.array([version] * n, pa.int64()),
            "filtered_step": pa.array([0] * n, pa.int64()),  # set when written: the step being filled
            "filtered_value": pa.array([value] * n, pa.float64()),
            "filtered_reason": pa.array([reason] * n, pa.string()),
        }
        self.pending.append(pa.table(columns, schema=FILTERED_SCHEMA))
        if reason == DROPPED_REASON:
            self.dropped_since_step += 1
            return True
        self.since_step += 1
        if self.max_per_step and self.since_step > self.max_per_step:
            raise FilterCapError(
                f"dynamic sampling filtered {self.since_step} groups while one step filled, more than "
                f"algorithm.filter_groups.max_num_gen_batches allows ({self.max_per_step} groups): every group's "
                f"{self.filter.metric} is the same, so the data are too easy or too hard for the policy; raise "
                "max_num_gen_batches, or set it to 0 for no cap"
            )
        return True

    def _reason(self, group: pa.Table) -> tuple[str | None, float | None]:
        """Why `group` is left out (and the flat metric's value), or (None, None) to train it."""
        statuses = group["reward_status"].to_pylist() if "reward_status" in group.column_names else []
        if self.drop_failed and DROPPED in statuses:
            return DROPPED_REASON, None
        value = None if self.filter is None else self.filter.shared_value(group)
        return (None, None) if value is None else (FLAT_REASON, value)

    def step_filled(self) -> tuple[int | None, int | None]:
        """Flat groups filtered and dropped groups left out while the step just filled (None for what is off); the
        counts restart."""
        flat, dropped = self.since_step, self.dropped_since_step
        self.since_step = self.dropped_since_step = 0
        return (flat if self.filter is not None else None), (dropped if self.drop_failed else None)

    def write(self, step: int) -> None:
        self.step = step
        if not self.pending:
            return
        table = pa.concat_tables(self.pending)
        i = FILTERED_SCHEMA.get_field_index("filtered_step")
        table = table.set_column(i, FILTERED_SCHEMA.field(i), pa.array([step] * table.num_rows, pa.int64()))
        write_shard(table, f"{self.path}/step-{step:07d}.parquet")
        self.pending = []
