"""Prompt source: read, validate and tokenize the prompt file once, then lay out the run's admission order.

Everything that can be wrong with the data is found here, before Ray starts, and reported once with the file,
the row, the column and the fix. Two formats are read as they are, told apart by their columns:

- flat: `prompt_text` (string, fed to the model as is), `ground_truth` (string or number), `data_source` (string);
- verl's RL format (what verl's `examples/data_preprocess/*.py` write): `prompt` (a list of chat messages
  {"role", "content"}), `data_source`, `reward_model` (a struct with `ground_truth`, usually `style`); its
  `extra_info` and any other column are ignored. The messages are rendered as verl renders them, with the
  model's chat template and its generation prompt.

Either format may have an `agent_name` column (verl's name for it) choosing the agent loop of each row
(stages/agents); where it is missing or null, `rollout.agent.default_agent_loop` applies. A file with `prompt_text`
is read as flat even if it also has `prompt`. Either way prompts are tokenized without
added special tokens (a chat template writes its own), and a number as ground truth becomes its string.

The stream then repeats the data over epochs (a fresh shuffle per epoch, seeded) until
`rollout.total_rollout_steps` prompts have been laid out, in blocks of `prompts_per_call`; each admission gets a
unique `prompt_id` ('e<epoch>-<row>') so the audit can match every admission to its consumption.
"""

from __future__ import annotations

import math
import reprlib
from pathlib import PurePath
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq

from schemas import END_OF_STREAM
from schemas.sample import PROMPT_COLUMNS
from stages.agents import UnknownAgentError, check_agent_name

REQUIRED = ("prompt_text", "ground_truth", "data_source")
VERL_REQUIRED = ("prompt", "data_source", "reward_model")
MESSAGES_HINT = 'a list of chat messages like [{"role": "user", "content": "..."}]'

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


def _required_columns(table: pa.Table, path: str) -> tuple[str, ...]:
    """The columns of the file's format; a missing one is an error that states what each format needs."""
    names = table.column_names
    required = VERL_REQUIRED if "prompt" in names and "prompt_text" not in names else REQUIRED
    missing = [c for c in required if c not in names]
    if missing:
        raise PromptDataError(
            f"data file {path} lacks column(s) {missing}; it has {names}. Each row needs either {list(REQUIRED)} "
            f"(flat format) or {list(VERL_REQUIRED)} (verl format: 'prompt' is {MESSAGES_HINT}, 'reward_model' "
            f"a struct with 'ground_truth')."
        )
    return required


def _short(value: Any) -> str:
    """A repr short enough for one error line (a whole prompt would drown the message)."""
    short = reprlib.Repr()
    short.maxstring = short.maxother = 60
    return short.repr(value)


def ground_truth_text(value: Any) -> str | None:
    """The ground truth as a string: strings as they are, numbers converted; None for anything else.

    Integral floats lose their `.0`: a column of ints with one null comes back from pandas as floats, and `6.0` is
    not what the data set said."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else str(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _flat_row(row: dict[str, Any], where: str) -> dict[str, str]:
    checked = {**row, "ground_truth": ground_truth_text(row["ground_truth"])}
    for col in REQUIRED:
        if not isinstance(checked[col], str) or (col != "ground_truth" and not checked[col].strip()):
            kind = "a string or a number" if col == "ground_truth" else "a non-empty string"
            raise PromptDataError(
                f"{where}: column {col!r} must be {kind}, got {_short(row[col])}. Fix or drop that row."
            )
    return checked


def render_prompt(messages: list[dict[str, str]], tokenizer) -> str:
    """The prompt text the model sees: its chat template with the generation prompt, when it has one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # No chat template (a base model, or the embedded tokenizer): there is no role markup to apply, so the model
    # sees the message contents alone, one message per line.
    return "\n".join(m["content"] for m in messages)


def _messages(prompt: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(prompt, list) or not prompt:
        raise PromptDataError(
            f"{where}: column 'prompt' must be {MESSAGES_HINT}, got {_short(prompt)}. Fix or drop that row."
        )
    for j, message in enumerate(prompt):
        for key in ("role", "content"):
            value = message.get(key) if isinstance(message, dict) else None
            if not isinstance(value, str) or (key == "role" and not value.strip()):
                raise PromptDataError(
                    f"{where}: column 'prompt', message {j} needs a string {key!r}, got {_short(message)}. "
                    f"'prompt' must be {MESSAGES_HINT}; fix or drop that row."
                )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _verl_row(row: dict[str, Any], where: str, tokenizer) -> dict[str, str]:
    messages = _messages(row["prompt"], where)
    reward_model = row["reward_model"]
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        raise PromptDataError(
            f"{where}: column 'reward_model' must be a struct with a 'ground_truth' field "
            f'(e.g. {{"style": "rule", "ground_truth": "42"}}), got {_short(reward_model)}. Add the ground truth.'
        )
    truth = ground_truth_text(reward_model["ground_truth"])
    if truth is None:
        raise PromptDataError(
            f"{where}: column 'reward_model', field 'ground_truth' must be a string or a number, "
            f"got {_short(reward_model['ground_truth'])}. Fix or drop that row."
        )
    try:
        text = render_prompt(messages, tokenizer)
    except Exception as err:  # noqa: BLE001 - a template's own checks (e.g. role order) reject bad input too
        raise PromptDataError(
            f"{where}: column 'prompt' cannot be rendered with the model's chat template "
            f"({type(err).__name__}: {err}). Fix the roles or their order in that row."
        ) from None
    if not text.strip():
        raise PromptDataError(
            f"{where}: column 'prompt' has no text: every message's 'content' is empty. Fix or drop that row."
        )
    # data_source has the same rule in both formats: check it there.
    return _flat_row({"prompt_text": text, "ground_truth": truth, "data_source": row["data_source"]}, where)


def agent_names(table: pa.Table, path: str, default: str) -> list[str]:
    """Each row's agent loop: its `agent_name` (either format, as verl's agent datasets have it), else `default`."""
    names = table["agent_name"].to_pylist() if "agent_name" in table.column_names else [None] * table.num_rows
    out = []
    for i, name in enumerate(names):
        try:
            out.append(check_agent_name(name or default, f"data file {path}, row {i}, column 'agent_name'"))
        except UnknownAgentError as err:
            raise PromptDataError(str(err)) from None
    return out


def load_prompts(
    path: str, tokenizer, max_prompt_length: int, default_agent_loop: str = "single_turn_agent"
) -> pa.Table:
    """Validated prompts with token ids: prompt_text, prompt_ids, ground_truth, data_source, agent_name, row."""
    table = read_prompt_file(path)
    required = _required_columns(table, path)
    if table.num_rows == 0:
        raise PromptDataError(f"data file {path} has no rows.")
    agents = agent_names(table, path, default_agent_loop)
    rows = []
    for i, row in enumerate(table.select(list(required)).to_pylist()):
        where = f"data file {path}, row {i}"
        rows.append(_verl_row(row, where, tokenizer) if required == VERL_REQUIRED else _flat_row(row, where))
    ids = []
    for i, row in enumerate(rows):
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
            "agent_name": pa.array(agents, pa.string()),
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
