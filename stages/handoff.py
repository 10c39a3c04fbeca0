"""The hand-off from the stream to the trainer: the driver keeps the light columns, the per-token ones go by reference.

At the seed's scale a step is 2,048 responses of up to 28K tokens, each with its logprobs, token versions, mask,
advantages (and MoE routes): about a gigabyte. The driver needs none of it: the sink's staleness rules, the
consumption log and the step's metrics read scalar columns only. So every block the stream delivers is split by a
Ray task beside it (`split_block`): the scalar columns come to the driver, the per-token columns
(schemas.PER_TOKEN_COLUMNS, with `sample_id` to join them back) stay in Ray's object store as one table, owned by
the driver, which holds only its reference. A step is sent to the trainer as `StepRows`: each mini-batch's light
rows and the references of the tables holding the rest. The trainer fetches them itself, from the nodes that hold
them (`StepRows.resolve`), joins them by sample_id, and runs the step's transform (reinforce_plus_plus's whitening
reads token advantages) over the whole step, as the sink did when it held everything. A table's object is freed when
the driver drops the last group that refers to it.

Ray Data's `iter_batches` would fetch every block whole into the driver; the stream is consumed here through its
bundle iterator instead (`ByReference`), which hands over block references without fetching them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from schemas import PER_TOKEN_COLUMNS, REQUIRED_COLUMNS, require_columns

KEY = "sample_id"  # joins a light row to its per-token columns


def split_block(block: pa.Table) -> tuple[pa.Table, int, pa.Table]:
    """(light columns, bytes of the per-token ones, the per-token ones keyed by sample_id). Runs as a Ray task
    beside the block, so only the light table travels to the driver."""
    require_columns(block, REQUIRED_COLUMNS, "TrainingSink")
    heavy = [c for c in block.column_names if c in PER_TOKEN_COLUMNS]
    per_token = block.select([KEY, *heavy])
    return block.drop_columns(heavy), per_token.nbytes, per_token


@dataclass
class Delivered:
    """One block of the stream as the driver holds it."""

    light: pa.Table
    ref: object = None  # ObjectRef of the per-token table; None: `light` holds every column (tests, tools)
    heavy_bytes: int = 0


class ByReference:
    """Iterate a Ray Data dataset's blocks as `Delivered` (light table + reference), fetching only the light part."""

    def __init__(self, dataset) -> None:
        import ray

        # The bundle iterator with its executor, so that close() can stop the stream (Ray Data's public
        # iter_internal_ref_bundles drops the executor: it would run on until garbage-collected).
        self.bundles, _, self.executor = dataset._execute_to_iterator(capture_executor=False)
        # num_cpus=0: a split is a column selection and a copy into the object store; a task holding a CPU could
        # wait behind the stages on a 2-core box. Ray schedules it where its block is.
        self.split = ray.remote(split_block).options(num_returns=3, num_cpus=0)
        self.delivered = self._deliver()

    def __iter__(self) -> Iterator[Delivered]:
        return self

    def __next__(self) -> Delivered:
        return next(self.delivered)

    def _deliver(self) -> Iterator[Delivered]:
        import ray

        for bundle in self.bundles:
            for entry in bundle.blocks:
                light_ref, size_ref, heavy_ref = self.split.remote(entry.ref)
                light, size = ray.get([light_ref, size_ref])
                yield Delivered(light, heavy_ref, size)

    def close(self) -> None:
        """Stop the stream's executor and its stage actors (as Ray Data does for an iterator it abandons)."""
        if self.executor is not None:
            self.executor.shutdown(force=False)


@dataclass
class StepRows:
    """A step as sent to the trainer: each mini-batch's light rows, the per-token tables they join, the step's
    transform and version. `resolve()` (on the trainer) gives the rows the trainer backends take."""

    minibatches: list[pa.Table]  # light columns (every column when no references)
    refs: list[list] = field(default_factory=list)  # per mini-batch: per-token tables holding its rows
    transform: Callable[[pa.Table], pa.Table] | None = None
    version: int = 0

    def resolve(self) -> list[dict[str, list]]:
        """Column -> rows of each mini-batch, per-token columns joined back, the transform run over the whole step,
        plus `trainer_version` (the step's version, on every row)."""
        tables = self._joined()
        if self.transform is not None:
            whole = self.transform(pa.concat_tables(tables))
            if whole.num_rows != sum(t.num_rows for t in tables):
                raise ValueError(f"the step transform returned {whole.num_rows} rows for {len(tables)} mini-batches")
            tables, start = [], 0
            for n in (t.num_rows for t in self.minibatches):
                tables.append(whole.slice(start, n))
                start += n
        return [{**t.to_pydict(), "trainer_version": [self.version] * t.num_rows} for t in tables]

    def _joined(self) -> list[pa.Table]:
        if not any(self.refs):
            return list(self.minibatches)
        import ray

        unique = list({ref: None for refs in self.refs for ref in refs})
        fetched = dict(zip(unique, ray.get(unique), strict=True))
        out = []
        for light, refs in zip(self.minibatches, self.refs, strict=True):
            heavy = pa.concat_tables([fetched[r] for r in dict.fromkeys(refs)])
            at = {sid: i for i, sid in enumerate(heavy[KEY].to_pylist())}
            missing = [sid for sid in light[KEY].to_pylist() if sid not in at]
            if missing:
                raise KeyError(f"per-token columns of samples {missing[:3]} are missing from the step's tables")
            rows = heavy.take([at[sid] for sid in light[KEY].to_pylist()]).drop_columns([KEY])
            for name in rows.column_names:
                light = light.append_column(rows.schema.field(name), rows[name])
            out.append(light)
        return out


def rows_of(step) -> list[dict[str, list]]:
    """What a trainer backend's train_step takes: the rows of a StepRows, or rows given directly (tests)."""
    return step.resolve() if isinstance(step, StepRows) else step
