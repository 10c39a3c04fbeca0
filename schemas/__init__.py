"""Column declarations for every batch the stream carries."""

from schemas.sample import (
    ADMITTED_SCHEMA,
    COLUMN_DOCS,
    CONSUMED_SCHEMA,
    END_OF_STREAM,
    SAMPLE_SCHEMA,
    MissingColumnsError,
    require_columns,
)

__all__ = [
    "ADMITTED_SCHEMA",
    "COLUMN_DOCS",
    "CONSUMED_SCHEMA",
    "END_OF_STREAM",
    "SAMPLE_SCHEMA",
    "MissingColumnsError",
    "require_columns",
]
