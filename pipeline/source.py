"""Prompt source: read, validate and tokenize the prompt file once, then lay out the run's admission order.

Everything that can be wrong with the data is found here, before Ray starts, and reported once with the file,
the row and the fix. The stream then repeats the data over epochs (a fresh shuffle per epoch, seeded) until
`rollout.total_rollout_steps` prompts have been laid out, in blocks of `prompts_per_call`; each admission gets a
unique `prompt_id` ('e<epoch>-<row>') so the audit can match every admission to its consumption.
"""

from __future__ import annotations

from pathlib import PurePath

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from schemas import END_OF_STREAM
from schemas.sample import PROMPT_COLUMNS

REQUIRED = ("prompt_text", "ground_truth", "data_source")

_TYPES = {c.name: c.type for c in PROMPT_COLUMNS}


class PromptDataError(ValueError):
    """The prompt file is missing or malformed; the message names the file, the row and the fix."""


def read_prompt_file(path: str) -> pa.Table:
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise PromptDataError(
            f"data file {path} does not exist. Set data.train_files to a parquet or jsonl file "
            f"(or 'embedded' for the built-in task)."
        )
    suffix = PurePath(root).suffix.lower()
    with fs.open(root, "rb") as f:
        try:
            if suffix == ".parquet":
                return pq.read_table(f)
            if suffix in (".jsonl", ".json"):
                return pj.read_json(f)
        except (pa.ArrowInvalid, OSError) as err:
            raise PromptDataError(f"data file {path} cannot be read as {suffix[1:]}: {err}") from None
    raise PromptDataError(f"data file {path} has suffix {suffix!r}; use .parquet or .jsonl")


def load_prompts(path: str, tokenizer, max_prompt_length: int) -> pa.Table:
    """Validated prompts with token ids: prompt_text, prompt_ids, ground_truth, data_source, row."""
    table = read_prompt_file(path)
    missing = [c for c in REQUIRED if c not in table.column_names]
    if missing:
        raise PromptDataError(
            f"data file {path} lacks column(s) {missing}; it has {table.column_names}. Each row needs {list(REQUIRED)}."
        )
    if table.num_rows == 0:
        raise PromptDataError(f"data file {path} has no rows.")
    rows = table.select(list(REQUIRED)).to_pylist()
    ids = []
    for i, row in enumerate(rows):
        for col in REQUIRED:
            if not isinstance(row[col], str) or (col != "ground_truth" and not row[col].strip()):
                raise PromptDataError(
                    f"data file {path}, row {i}: column {col!r} must be a non-empty string, "
                    f"got {row[col]!r}. Fix or drop that row."
                )
        tokens = tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
        if len(tokens) > max_prompt_length:
            raise PromptDataError(
                f"data file {path}, row {i}: prompt has {len(tokens)} tokens, more than "
                f"data.max_prompt_length={max_prompt_length}. Raise the limit or shorten it."
            )
        ids.append(tokens)
    return pa.table(
        {
            "prompt_text": pa.array([r["prompt_text"] for r in rows], pa.string()),
            "prompt_ids": pa.array(ids, _TYPES["prompt_ids"]),
            "ground_truth": pa.array([r["ground_truth"] for r in rows], pa.string()),
            "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
            "row": pa.array(range(len(rows)), pa.int64()),
        }
    )


def admission_blocks(
    prompts: pa.Table, total: int, block_rows: int, seed: int, skip: frozenset[str] = frozenset()
) -> list[pa.Table]:
    """The run's prompts in admission order, epoch after epoch, in blocks of `block_rows`, then the end marker.

    `skip`: prompt ids already consumed before a checkpoint; a resumed run lays out the same order without them.
    """
    parts, laid_out, epoch = [], 0, 0
    while laid_out < total:
        order = np.random.default_rng(seed + epoch).permutation(prompts.num_rows)[: total - laid_out]
        part = prompts.take(pa.array(order))
        pids = [f"e{epoch}-{r:06d}" for r in part.column("row").to_pylist()]
        parts.append(part.drop_columns(["row"]).add_column(0, "prompt_id", pa.array(pids, pa.string())))
        laid_out += len(order)
        epoch += 1
    table = pa.concat_tables(parts).combine_chunks()
    if skip:
        table = table.filter(pa.array([pid not in skip for pid in table["prompt_id"].to_pylist()], pa.bool_()))
    end = pa.table(
        {
            name: pa.array([END_OF_STREAM if name == "prompt_id" else None], table.schema.field(name).type)
            for name in table.column_names
        }
    )
    return [table.slice(i, block_rows) for i in range(0, table.num_rows, block_rows)] + [end]
