"""Column declarations for every batch the stream carries: the contracts every layer imports. Imports nothing of
ours."""

from schemas.sample import (
    ADMITTED_SCHEMA,
    COLUMN_DOCS,
    CONSUMED_SCHEMA,
    END_OF_STREAM,
    FILTERED_SCHEMA,
    PER_TOKEN_COLUMNS,
    REQUIRED_COLUMNS,
    SAMPLE_SCHEMA,
    TOKEN_TABLE_COLUMNS,
    MissingColumnsError,
    require_columns,
)

__all__ = [
    "ADMITTED_SCHEMA",
    "COLUMN_DOCS",
    "CONSUMED_SCHEMA",
    "END_OF_STREAM",
    "FILTERED_SCHEMA",
    "PER_TOKEN_COLUMNS",
    "SAMPLE_SCHEMA",
    "TOKEN_TABLE_COLUMNS",
    "REQUIRED_COLUMNS",
    "MissingColumnsError",
    "require_columns",
]
