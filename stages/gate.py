"""StalenessGate: the backpressure operator that bounds staleness, not bytes.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source
Output columns: input columns + admitted_version (int64), admitted_time (float64)

Ray Data's own backpressure bounds memory: left alone, an endless source runs hundreds of blocks ahead of the
trainer. This stage runs as a single actor whose calls admit one at a time, in the order Ray Data dispatched them
(`Turns`); each call waits on the VersionClock (through stages.control.ClockLink) for permits and yields the rows it
was allowed to admit, so Ray Data stops pulling prompts exactly when verl's rollouter would pause. The end-of-stream
marker's call keeps the stream open until the trainer is done, beside the other calls: a marker that reaches the
gate before the last prompts' block does not hold that block back.

A block is split when only part of it fits the current version's budget: never more than `max_required_samples`
prompts are admitted per version, and never fewer when the trainer needs them. Ray Data hands on what a call yields
only when the call ends: the part of a split block admitted before a sync reaches the engines with the rest, after
the sync (verl counts it as carried over all the same). Dynamic sampling, whose refunds a held part could block,
therefore takes blocks of one prompt (pipeline/config/checks.py).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from schemas import END_OF_STREAM, require_columns
from schemas.sample import GATE_COLUMNS, PROMPT_COLUMNS
from stages import ray_internals
from stages.control import ClockLink, GateClock

_GATE_TYPES = {c.name: c.type for c in GATE_COLUMNS}


class StalenessGate:
    def __init__(self, clock_name: str, namespace: str) -> None:
        self.clock: GateClock = ClockLink(clock_name, namespace)
        self.turns = Turns()

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        require_columns(batch, [c.name for c in PROMPT_COLUMNS], "StalenessGate")
        is_end = pc.equal(batch["prompt_id"], END_OF_STREAM)
        with self.turns.take(ray_internals.map_task_index()):
            yield from self._admit(batch.filter(pc.invert(is_end)))
        if pc.any(is_end).as_py():
            self.clock.wait_closed()  # keep the stream open until the trainer is done, the next call's turn free

    def _admit(self, pending: pa.Table) -> Iterator[pa.Table]:
        while pending.num_rows:
            ids = pending.column("prompt_id").to_pylist()
            version, admitted = self.clock.acquire(ids)
            taken = pending.slice(0, len(admitted))
            times = [time.time()] * len(admitted)
            taken = taken.append_column(
                pa.field("admitted_version", _GATE_TYPES["admitted_version"]),
                pa.array([version] * len(admitted), _GATE_TYPES["admitted_version"]),
            )
            taken = taken.append_column(
                pa.field("admitted_time", _GATE_TYPES["admitted_time"]), pa.array(times, _GATE_TYPES["admitted_time"])
            )
            yield taken
            pending = pending.slice(len(admitted))


class Turns:
    """Calls take their turn in the order Ray Data dispatched them (its task index, 0, 1, 2, ...), one at a time:
    the gate's actor runs two calls at once, so that the end marker's call, which waits for the trainer, never
    holds back a block dispatched before or after it, while blocks are still admitted one by one, in order. A call
    without a task index (outside Ray Data) takes no turn."""

    def __init__(self) -> None:
        self.next = 0
        self.changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, index: int | None) -> Iterator[None]:
        if index is None:
            yield
            return
        with self.changed:
            self.changed.wait_for(lambda: self.next == index)
        try:
            yield
        finally:
            with self.changed:
                self.next += 1
                self.changed.notify_all()
