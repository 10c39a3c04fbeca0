"""The hand-off from the stream to the trainer: the driver keeps the light columns, the per-token ones go by reference.

At the seed's scale a step is 2,048 responses of up to 28K tokens, each with its logprobs, token versions, mask,
advantages (and MoE routes): about a gigabyte. The driver needs none of it: the sink's staleness rules, the
consumption log and the step's metrics read scalar columns only. So the stream's last stage (`SplitTokens`, an actor
pool into which Ray Data fuses the reward, advantage and sample-log tasks) puts the per-token columns
(schemas.PER_TOKEN_COLUMNS, with `sample_id` to join them back) into Ray's object store as one table, on its own
node, and sends on the light columns with the table's key. It hands the table's reference to `TokenTables`, a small
actor of the driver's, from which the driver takes it when the light block arrives (`ByReference`, one call per
bundle). A step is sent to the trainer as `StepRows`: each mini-batch's light rows and the references of the tables
holding the rest. The trainer fetches them itself, from the nodes that hold them (`StepRows.resolve`), joins them by
sample_id, and runs the step's transform (reinforce_plus_plus's whitening reads token advantages) over the whole
step, as the sink did when it held everything. A table's object is freed when the driver drops the last group that
refers to it.

The stage is an actor because a table lives as long as the process that put it (its owner) and the references to
it: a task's worker would not keep it, and Ray does not let a task name another owner. Splitting in the stream's
last stage keeps the driver's loop free of a round trip per block (docs/benchmarks.md, "Pipeline overhead").

Ray Data's `iter_batches` would fetch every block whole into the driver; the stream is consumed here through its
bundle iterator instead (`ByReference`, through stages/ray_internals.py), which hands over block references without
fetching them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from schemas import PER_TOKEN_COLUMNS, REQUIRED_COLUMNS, TOKEN_TABLE_COLUMNS, require_columns
from stages import ray_internals
from stages.sample_log import block_name

KEY = "sample_id"  # joins a light row to its per-token columns
TABLE, TABLE_ROWS, TABLE_BYTES = TOKEN_TABLE_COLUMNS  # which per-token table holds a row's columns, its rows, bytes


class TokenTables:
    """Where the split stage leaves each per-token table's reference for the driver to take (a Ray actor, started
    by `start`). An object lives while any process holds its reference, so from the take on, the driver alone
    decides how long the table lives.

    A stage whose process may die before the driver takes its tables (an engine's actor, which Ray restarts: see
    stages/scored_generate.py) hands them to `own` instead, on an actor of its node that outlives it (`owners`)."""

    def __init__(self, registry=None) -> None:
        self.tables: dict[str, list] = {}
        self.registry = registry  # None: this is the driver's; else it owns tables for it on another node

    @staticmethod
    def start(resources: dict[str, float] | None = None):
        import ray

        # No CPU: it answers two short calls per block; a reserved CPU would be one fewer for the stages.
        return ray.remote(TokenTables).options(num_cpus=0, resources=resources or {}).remote()

    @staticmethod
    def owners(tables, marker: str = "") -> dict[str, object]:
        """Node id -> the actor that owns the tables put on that node: `tables` itself on its own node, a
        TokenTables forwarding to it on every other node alive now (with `marker`, only those with that resource:
        where the engines go). `tables` starts them, so they die with it (ByReference.close kills it)."""
        import ray

        return ray.get(tables.start_owners.remote(marker))

    def start_owners(self, marker: str) -> dict[str, object]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        me = ray.get_runtime_context()
        owners = {me.get_node_id(): me.current_actor}
        for node in ray.nodes():
            if node["Alive"] and node["NodeID"] not in owners and (not marker or node["Resources"].get(marker)):
                on_node = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
                actor = ray.remote(TokenTables).options(num_cpus=0, scheduling_strategy=on_node)
                owners[node["NodeID"]] = actor.remote(me.current_actor)  # an actor's actors end with it
        return owners

    def keep(self, key: str, ref: list) -> None:
        self.tables[key] = ref  # in a list: an ObjectRef passed bare would be fetched here

    def own(self, key: str, table: pa.Table) -> None:
        """Put `table` into the object store from this process, so that it outlives the stage that made it."""
        import ray

        ref = [ray.put(table)]
        if self.registry is None:
            self.keep(key, ref)
        else:  # the driver's TokenTables borrows it from here; this actor stays its owner
            ray.get(self.registry.keep.remote(key, ref))

    def take(self, keys: list[str]) -> list[list]:
        missing = [k for k in keys if k not in self.tables]
        if missing:
            raise KeyError(f"per-token tables {missing[:3]} were never kept or were taken already")
        return [self.tables.pop(k) for k in keys]

    def held(self) -> int:
        return len(self.tables)


class SplitTokens:
    """The stream's last stage, an actor that also scores and logs the block: per-token columns to the object store.

    Input columns:  every required column of schemas.SAMPLE_SCHEMA (the optional ones when present)
    Output columns: the input's light columns (all but schemas.PER_TOKEN_COLUMNS) + schemas.TOKEN_TABLE_COLUMNS
    """

    def __init__(self, tables, owned_by_tables: bool = False) -> None:
        """`tables`: a TokenTables actor; `owned_by_tables`: it puts each table (TokenTables.own), not this actor."""
        self.tables = tables
        self.owned_by_tables = owned_by_tables

    def __call__(self, block: pa.Table) -> pa.Table:
        import ray

        require_columns(block, REQUIRED_COLUMNS, "TrainingSink")  # checked whole here; the sink sees light rows
        heavy = [c for c in block.column_names if c in PER_TOKEN_COLUMNS]
        light = block.drop_columns(heavy)
        if block.num_rows == 0:
            key, rows, size = "", 0, 0
        else:
            per_token = block.select([KEY, *heavy])
            # Named by its samples: a block made again after its replica died replaces the first attempt's table.
            key, rows, size = block_name(block), per_token.num_rows, per_token.nbytes
            # Kept before the block goes on, so the driver finds it.
            if self.owned_by_tables:
                ray.get(self.tables.own.remote(key, per_token))
            else:  # this actor stays its owner
                ray.get(self.tables.keep.remote(key, [ray.put(per_token)]))
        n = block.num_rows
        light = light.append_column(TABLE, pa.array([key] * n, pa.string()))
        light = light.append_column(TABLE_ROWS, pa.array([rows] * n, pa.int64()))
        return light.append_column(TABLE_BYTES, pa.array([size] * n, pa.int64()))


@dataclass
class Delivered:
    """One block of the stream as the driver holds it."""

    light: pa.Table
    ref: object = None  # ObjectRef of the per-token table; None: `light` holds every column (tests, tools)
    heavy_bytes: int = 0


class ByReference:
    """Iterate a Ray Data dataset's blocks as `Delivered` (light table + reference), fetching only the light part.
    The dataset's last stage is `SplitTokens(tables)`."""

    def __init__(self, dataset, tables) -> None:
        # The bundle iterator and a way to stop the stream's executor (stages.ray_internals.bundle_iterator).
        self.bundles, self.stop = ray_internals.bundle_iterator(dataset)
        self.tables = tables
        # Ray Data may cut one task's output into several blocks: a table's reference is kept here until every one
        # of its rows has been delivered.
        self.partial: dict[str, tuple[object, int]] = {}  # key -> (reference, rows still to come)
        self.delivered = self._deliver()

    def __iter__(self) -> Iterator[Delivered]:
        return self

    def __next__(self) -> Delivered:
        return next(self.delivered)

    def _deliver(self) -> Iterator[Delivered]:
        import ray

        for bundle in self.bundles:
            blocks = [b for b in ray.get([entry.ref for entry in bundle.blocks]) if b.num_rows]
            for block in blocks:
                require_columns(block, TOKEN_TABLE_COLUMNS, "the hand-off (make stages.handoff.SplitTokens the last)")
            keys = list(
                dict.fromkeys(k for b in blocks for k in b[TABLE].unique().to_pylist() if k not in self.partial)
            )
            if keys:
                taken = ray.get(self.tables.take.remote(keys))
                for key, ref, rows in zip(keys, taken, self._rows(blocks, keys), strict=True):
                    self.partial[key] = (ref[0], rows)
            for block in blocks:
                yield from self._split_by_table(block)

    @staticmethod
    def _rows(blocks: list[pa.Table], keys: list[str]) -> list[int]:
        first = {}
        for b in blocks:
            for key, rows in zip(b[TABLE].to_pylist(), b[TABLE_ROWS].to_pylist(), strict=True):
                first.setdefault(key, rows)
        return [first[k] for k in keys]

    def _split_by_table(self, block: pa.Table) -> Iterator[Delivered]:
        import pyarrow.compute as pc

        keys = block[TABLE].unique().to_pylist()
        for key in keys:
            part = block if len(keys) == 1 else block.filter(pc.equal(block[TABLE], key))
            ref, left = self.partial[key]
            size = part[TABLE_BYTES][0].as_py() * part.num_rows // max(part[TABLE_ROWS][0].as_py(), 1)
            if left <= part.num_rows:
                del self.partial[key]  # every row delivered: the groups hold the reference from here
            else:
                self.partial[key] = (ref, left - part.num_rows)
            yield Delivered(part.drop_columns(list(TOKEN_TABLE_COLUMNS)), ref, size)

    def close(self) -> None:
        """Stop the stream's executor and kill its stage actors. Ray Data's own way for an abandoned iterator
        (force=False) drops the actors' handles and lets each end after its calls, and an engine's actor that
        scores in the engine outlived most short runs that way in one Ray session (its vLLM processes with it,
        spinning: a pytest session slowed down run after run; the call it waits for was not found). Nothing of the
        stream is needed any more: the driver has taken every table it trains on. The tables' actors go too (the
        TokenTables and the owners it started): what they still hold are tables of prompts nothing will train on."""
        import ray

        self.stop()
        ray.kill(self.tables)


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
