"""The prompt source as Ray Data's input: blocks of prompts in admission order, read as the gate admits them, then
the end-of-stream marker (pipeline/stream.py builds the stages after it)."""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray.data import DataContext
from ray.exceptions import UserCodeException

from pipeline.tasks.admission import PromptSource, end_block, paced, super_chunks
from pipeline.tasks.source import PromptDataError
from stages import ray_internals


def prompt_dataset(source: PromptSource, clock: tuple[str, str] | None = None) -> ray.data.Dataset:
    """The source as Ray Data's input: blocks of `block_rows` prompts in admission order, then the end marker.

    Ray Data merges what one task yields into blocks of `target_max_block_size` bytes, so the prompts come out of
    one read task in joins of whole blocks just over that size (`super_chunks`: each leaves the task as it is
    yielded) and a streaming repartition cuts them back into blocks of `block_rows`, where `PromptSource.blocks`
    cuts them. Left alone, Ray Data would read as far ahead as its memory
    budget allows (for a large file, minutes of tokenizing and many thousand blocks); the read task is `paced` by
    the clock's admission count instead, at most two joins ahead of the gate. A second read task, read after the
    first (one at a time), gives the end marker its own block, after every prompt. The read and the cut take no
    CPU: they mostly wait, and a reserved CPU would be one fewer for the stages on a small machine.

    `clock`: the VersionClock's (name, namespace); without one (a benchmark) the read is not paced.
    """
    # Over the target (whatever Ray adds to nbytes), and by less than one block: a task's output of 1.5x the target
    # or more is sliced at arbitrary rows.
    join_bytes = int(1.1 * DataContext.get_current().target_max_block_size)
    datasource = _PromptDatasource(ray.put(source), join_bytes, clock)
    ds = ray.data.read_datasource(datasource, override_num_blocks=2, num_cpus=0, concurrency=1)
    # One task at a time keeps the blocks in order (and the end marker last), num_cpus=0 as above.
    return ray_internals.repartition_in_order(ds, source.block_rows)


class _PromptDatasource(ray.data.Datasource):
    """Two read tasks: the source's prompts, then its end marker. The source travels as one object in the object
    store (it holds the prompt file), not inside each task."""

    def __init__(self, source_ref: ray.ObjectRef, join_bytes: int, clock: tuple[str, str] | None) -> None:
        self.source_ref, self.join_bytes, self.clock = source_ref, join_bytes, clock

    def get_name(self) -> str:
        return "Prompts"

    def estimate_inmemory_data_size(self) -> None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list:
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        ref, join_bytes, clock = self.source_ref, self.join_bytes, self.clock

        def prompts():
            source = ray.get(ref)
            try:
                joins = super_chunks(source.chunks(), join_bytes, source.block_rows)
                yield from paced(joins, _admission_count(clock, source))
            except PromptDataError as err:
                raise BadPromptRow(err.message) from None

        unknown = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(prompts, unknown), ReadTask(lambda: [end_block()], unknown)]


def _admission_count(clock: tuple[str, str] | None, source: PromptSource) -> Callable[[], int]:
    """Prompts of `source` the gate has admitted so far; the clock's ledger also holds a resumed run's prior ones,
    which are the ids the source skips."""
    if clock is None:
        return lambda: 1 << 62
    actor, prior = ray.get_actor(clock[0], namespace=clock[1]), len(source.order.skip)
    return lambda: ray.get(actor.stats.remote())["admitted_total"] - prior


class BadPromptRow(PromptDataError, UserCodeException):
    """A bad row the stream reached. Being a UserCodeException, Ray Data reports it as the data's fault (one line, no
    internal traceback, no advice to file a Ray bug); the driver catches it as the PromptDataError it is."""
