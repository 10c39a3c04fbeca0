"""SampleLog: tee every sample, every column, into Parquet shards (any fsspec URL).

Input columns:  all of schemas.SAMPLE_SCHEMA (the optional ones are written as nulls when absent)
Output columns: the input, unchanged

The log is the run's ground truth: the audit proves the staleness bound and exactly-once consumption from it,
and the notebook reads it with pyarrow.dataset. One shard per block, named by its samples (`block_name`), so concurrent
tasks never collide, a block made again after its replica died replaces the first attempt's shard instead of
logging its samples twice, and a crashed run keeps everything it wrote; a shard appears whole or not at all
(`write_shard`).
"""

from __future__ import annotations

import hashlib

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from schemas import REQUIRED_COLUMNS, SAMPLE_SCHEMA, require_columns


class SampleLog:
    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, REQUIRED_COLUMNS, "SampleLog")
        table = batch
        for name in SAMPLE_SCHEMA.names:
            if name not in table.column_names:  # an optional column no stage of this run adds
                table = table.append_column(
                    SAMPLE_SCHEMA.field(name), pa.nulls(table.num_rows, SAMPLE_SCHEMA.field(name).type)
                )
        table = table.select(SAMPLE_SCHEMA.names).cast(SAMPLE_SCHEMA)
        write_shard(table, f"{self.path}/part-{block_name(batch)}.parquet")
        return batch


def block_name(block: pa.Table) -> str:
    """A name for a block's samples: a hash of its sample ids, which a retry of the same prompts makes again."""
    ids = sorted(block["sample_id"].to_pylist())
    return hashlib.blake2b("\n".join(ids).encode(), digest_size=16).hexdigest()


def write_shard(table: pa.Table, url: str) -> None:
    """Write `table` to the Parquet file `url` (any fsspec URL) so that no reader sees it half-written: under a
    temporary name first, which pyarrow.dataset skips (a leading "_") and no "*.parquet" matches, then renamed.
    A process killed mid-write (a run's stage actors torn down when its trainer dies, a SIGKILLed driver) leaves
    only the temporary file; a truncated shard would fail the resume's rewind, the audit and the notebook."""
    fs, path = fsspec.core.url_to_fs(url)
    parent, name = path.rsplit("/", 1)
    fs.makedirs(parent, exist_ok=True)
    staged = f"{parent}/_{name}.tmp"
    with fs.open(staged, "wb") as f:
        pq.write_table(table, f)
    fs.mv(staged, path)
