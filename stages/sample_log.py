"""SampleLog: tee every sample, every column, into Parquet shards (any fsspec URL).

Input columns:  all of schemas.SAMPLE_SCHEMA (the optional ones are written as nulls when absent)
Output columns: the input, unchanged

The log is the run's ground truth: the audit proves the staleness bound and exactly-once consumption from it,
and the notebook reads it with pyarrow.dataset. One shard per block, named by a uuid, so concurrent tasks never
collide and a crashed run keeps everything it wrote.
"""

from __future__ import annotations

import uuid

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
        fs, root = fsspec.core.url_to_fs(self.path)
        fs.makedirs(root, exist_ok=True)
        with fs.open(f"{root}/part-{uuid.uuid4().hex}.parquet", "wb") as f:
            pq.write_table(table, f)
        return batch
