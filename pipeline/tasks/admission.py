"""The run's admission order, laid out as the stream consumes it: epochs of the prompt file, each freshly shuffled.

The data repeats over epochs until `rollout.total_rollout_steps` prompts have been laid out; epoch e is the file's
rows in the order `np.random.default_rng(seed + e).permutation(num_rows)`, the last epoch cut short. Every admission
gets a unique `prompt_id`, 'e<epoch>-<row:06d>', so the audit can match every admission to its consumption and a
resumed run (`skip`: the ids its checkpoint's ledger holds) lays out the same order without them.

Nothing here grows with total_rollout_steps: an epoch's permutation is drawn when the layout reaches it, and rows are
validated and tokenized (`PromptFile.checked`) a chunk at a time, when the chunk is read. What the driver holds is
the prompt file (its needed columns) and the ids to skip. For Ray Data's read task (pipeline/tasks/prompt_input.py),
`super_chunks` joins whole blocks into pieces of a given byte size and `paced` draws the next piece only as the gate
admits the previous ones.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipeline.tasks.source import PromptFile
from schemas import END_OF_STREAM
from schemas.sample import PROMPT_COLUMNS

# Rows validated and tokenized at a time (rounded to whole blocks).
CHUNK_ROWS = 1024

_ID = re.compile(r"e(\d+)-(\d+)")


def prompt_id(epoch: int, row: int) -> str:
    return f"e{epoch}-{row:06d}"


@dataclass(frozen=True)
class AdmissionOrder:
    """Which row of the file each admission takes, epoch after epoch, without the `skip`ped prompt ids."""

    num_rows: int
    total: int  # admissions laid out before `skip` is taken away: rollout.total_rollout_steps
    seed: int
    skip: frozenset[str] = frozenset()
    shuffle: bool = True  # false: every epoch in the file's order (verl's data.shuffle)
    _skipped: dict[int, np.ndarray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_epoch: dict[int, list[int]] = {}
        for pid in self.skip:
            match = _ID.fullmatch(pid)
            # Only ids this layout can produce; anything else could not have been laid out here either.
            if match and prompt_id(int(match[1]), int(match[2])) == pid:
                by_epoch.setdefault(int(match[1]), []).append(int(match[2]))
        object.__setattr__(self, "_skipped", {e: np.array(rows, np.int64) for e, rows in by_epoch.items()})

    def epochs(self) -> Iterator[tuple[int, np.ndarray]]:
        """(epoch, its rows in admission order), each epoch's shuffle drawn when it is reached."""
        laid_out, epoch = 0, 0
        while laid_out < self.total:
            rows = np.random.default_rng(self.seed + epoch).permutation(self.num_rows) if self.shuffle else None
            order = (rows if rows is not None else np.arange(self.num_rows))[: self.total - laid_out]
            laid_out += len(order)
            if epoch in self._skipped:
                order = order[~np.isin(order, self._skipped[epoch])]
            yield epoch, order
            epoch += 1

    def chunks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(epochs, rows): the order in pieces of exactly `size` admissions, the last one shorter."""
        epochs, rows, held = [], [], 0
        for epoch, order in self.epochs():
            while len(order):
                take = order[: size - held]
                epochs.append(np.full(len(take), epoch, np.int64))
                rows.append(take)
                held, order = held + len(take), order[len(take) :]
                if held == size:
                    yield np.concatenate(epochs), np.concatenate(rows)
                    epochs, rows, held = [], [], 0
        if held:
            yield np.concatenate(epochs), np.concatenate(rows)


@dataclass
class PromptSource:
    """The stream's prompts: checked rows in admission order, in blocks of `block_rows`, then the end marker.

    `chunks` yields whole blocks' worth of rows at a time (a multiple of `block_rows`, the last chunk shorter);
    cutting them into blocks of `block_rows` gives `blocks`, the stream's input. The end marker (a block whose one
    row has prompt_id END_OF_STREAM) comes after every prompt: the gate keeps the stream open on it until the trainer
    is done (stages/gate.py).
    """

    prompts: PromptFile
    order: AdmissionOrder
    block_rows: int

    def chunks(self) -> Iterator[pa.Table]:
        size = self.block_rows * max(1, CHUNK_ROWS // self.block_rows)
        for epochs, rows in self.order.chunks(size):
            ids = [prompt_id(e, r) for e, r in zip(epochs.tolist(), rows.tolist(), strict=True)]
            yield self.prompts.checked(rows).add_column(0, "prompt_id", pa.array(ids, pa.string()))

    def blocks(self) -> Iterator[pa.Table]:
        for chunk in self.chunks():
            for start in range(0, chunk.num_rows, self.block_rows):
                yield chunk.slice(start, self.block_rows)
        yield end_block()


def super_chunks(chunks: Iterator[pa.Table], min_bytes: int, block_rows: int) -> Iterator[pa.Table]:
    """The chunks' rows joined in whole blocks of `block_rows` until a join holds more than `min_bytes`, so each
    join passes that size by less than one block (the last join may hold less)."""
    held: list[pa.Table] = []
    size = 0
    for chunk in chunks:
        for start in range(0, chunk.num_rows, block_rows):
            block = chunk.slice(start, block_rows)
            held.append(block)
            size += block.nbytes
            if size > min_bytes:
                yield pa.concat_tables(held).combine_chunks()
                held, size = [], 0
    if held:
        yield pa.concat_tables(held).combine_chunks()


def paced(tables: Iterator[pa.Table], admitted: Callable[[], int], poll_s: float = 0.2) -> Iterator[pa.Table]:
    """`tables`, the next one drawn (laid out, validated, tokenized) only once every row but the last table's has
    been admitted: at most two tables ahead of the gate, and the next one made while the gate takes the last one.

    `admitted()`: prompts of this source admitted so far."""
    laid_out, slack = 0, 0
    while True:
        while laid_out - admitted() > slack:
            time.sleep(poll_s)
        table = next(tables, None)
        if table is None:
            return
        yield table
        laid_out, slack = laid_out + table.num_rows, table.num_rows


def end_block() -> pa.Table:
    """The stream's last block: one row, prompt_id END_OF_STREAM, every other column null."""
    return pa.table(
        {c.name: pa.array([END_OF_STREAM if c.name == "prompt_id" else None], c.type) for c in PROMPT_COLUMNS}
    )
