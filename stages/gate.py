"""StalenessGate: the backpressure operator that bounds staleness, not bytes.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source
Output columns: input columns + admitted_version (int64), admitted_time (float64)

Ray Data's own backpressure bounds memory: left alone, an endless source runs hundreds of blocks ahead of the
trainer. This stage runs as a single actor that takes one call at a time; each call waits on the VersionClock
(through stages.control.ClockLink) for permits and yields the rows it was allowed to admit, so Ray Data stops pulling
prompts exactly when verl's rollouter would pause. A block is split when only part of it fits the current version's
budget: never more than `max_required_samples` prompts are admitted per version, and never fewer when the trainer
needs them. Ray Data hands on what a call yields only when the call ends: the part of a split block admitted before
a sync reaches the engines with the rest, after the sync (verl counts it as carried over all the same). Dynamic
sampling, whose refunds a held part could block, therefore takes blocks of one prompt (pipeline/config/checks.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from schemas import END_OF_STREAM, require_columns
from schemas.sample import GATE_COLUMNS, PROMPT_COLUMNS
from stages.control import ClockLink, GateClock

_GATE_TYPES = {c.name: c.type for c in GATE_COLUMNS}


class StalenessGate:
    def __init__(self, clock_name: str, namespace: str) -> None:
        self.clock: GateClock = ClockLink(clock_name, namespace)

    def __call__(self, batch: pa.Table) -> Iterator[pa.Table]:
        require_columns(batch, [c.name for c in PROMPT_COLUMNS], "StalenessGate")
        is_end = pc.equal(batch["prompt_id"], END_OF_STREAM)
        pending = batch.filter(pc.invert(is_end))
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
        if pc.any(is_end).as_py():
            self.clock.wait_closed()  # keep the stream open until the trainer is done
