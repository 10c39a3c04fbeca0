"""Prompt files: read one, check what can be checked in seconds, validate and tokenize rows when they are used.

Bad data is reported once with the file, the row, the column and the fix. Before the run spends anything (the warm
start, the stream; Ray starts meanwhile) `PromptFile` reads the file and checks that it exists and parses, has its
format's columns and rows, that every agent_name is a registered loop, and, with Arrow's kernels over every row, that
no row has a null, an empty string, an empty message list or a column of a type the rules refuse; the first
`SAMPLE_ROWS` rows are then validated and tokenized in full (every row of a file of at most `WHOLE_FILE_ROWS`). That
takes seconds for a million rows, where tokenizing them all takes minutes. The other rows are validated and tokenized
by `PromptFile.checked` when the stream reaches them (pipeline/tasks/admission.py), with the same rules and messages:
a row that only tokenizing can find bad (too long, a chat template that refuses it) stops the run there, naming the
file and the row.

Two formats are read as they are, told apart by their columns:

- flat: `prompt_text` (string, fed to the model as is), `ground_truth` (string or number), `data_source` (string);
- verl's RL format (what verl's `examples/data_preprocess/*.py` write): `prompt` (a list of chat messages
  {"role", "content"}), `data_source`, `reward_model` (a struct with `ground_truth`, usually `style`); its
  `extra_info` and any other column are ignored (and not kept in memory). The messages are rendered as verl renders
  them, with the model's chat template and its generation prompt.

verl's data keys shape the reading (`PromptOptions`): `data.prompt_key` names the messages column of the verl format,
`data.apply_chat_template_kwargs` go to the chat template, `data.truncation` cuts a prompt longer than
data.max_prompt_length ('left' keeps its end, 'right' its start, 'middle' both ends) instead of refusing it ('error'),
and `data.filter_overlong_prompts` drops such prompts when the file is opened, as verl's dataset does (this tokenizes
every row up front).

Either format may have an `agent_name` column (verl's name for it) choosing the agent loop of each row
(stages/agents); where it is missing or null, `rollout.agent.default_agent_loop` applies. A file with `prompt_text`
is read as flat even if it also has `prompt`. Either way prompts are tokenized without
added special tokens (a chat template writes its own), and a number as ground truth becomes its string.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj
import pyarrow.parquet as pq

from schemas.sample import PROMPT_COLUMNS
from stages.agents import AGENT_LOOP_NAMES, UnknownAgentError, check_agent_name

REQUIRED = ("prompt_text", "ground_truth", "data_source")
VERL_REQUIRED = ("prompt", "data_source", "reward_model")
SAMPLE_ROWS = 1000  # rows validated and tokenized before the run starts; the others when the stream reaches them
WHOLE_FILE_ROWS = 10_000  # a file of at most this many rows is validated and tokenized whole before the run starts
MESSAGES_HINT = 'a list of chat messages like [{"role": "user", "content": "..."}]'

_TYPES = {c.name: c.type for c in PROMPT_COLUMNS}


class PromptDataError(ValueError):
    """The prompt file is missing or malformed; the message names the file, the row and the fix."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # str() says this whatever is appended to args on the way up: Ray Data adds its retry advice to an error
        # raised in a read task (a row the stream reached), which here is not transient.
        self.message = message

    def __str__(self) -> str:
        return self.message


def check_prompt_file(path: str) -> tuple[Any, str, str]:
    """That a prompt file exists and has a suffix it can be read by, in milliseconds, before anything slow starts:
    its filesystem, its path there and its suffix."""
    fs, root = fsspec.core.url_to_fs(path)
    if not fs.exists(root):
        raise PromptDataError(
            f"data file {path} does not exist. Set data.train_files to a parquet or jsonl file "
            f"(or 'embedded' for the built-in task)."
        )
    suffix = PurePath(root).suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise PromptDataError(f"data file {path} has suffix {suffix!r}; use .parquet or .jsonl")
    return fs, root, suffix


def read_prompt_file(path: str) -> pa.Table:
    fs, root, suffix = check_prompt_file(path)
    with fs.open(root, "rb") as f:
        try:
            if suffix == ".parquet":
                return pq.read_table(f)
            return pj.read_json(f)
        except (pa.ArrowInvalid, OSError) as err:
            raise PromptDataError(f"data file {path} cannot be read as {suffix[1:]}: {err}") from None


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


@dataclass(frozen=True)
class PromptOptions:
    """verl's data keys that shape how prompts are read (see the module docstring)."""

    prompt_key: str = "prompt"
    truncation: str = "error"  # 'error', 'left', 'right' or 'middle'
    filter_overlong: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


def truncate(tokens: list[int], limit: int, how: str) -> list[int]:
    """verl's truncation of a prompt longer than `limit` tokens: 'left' keeps the last `limit`, 'right' the first,
    'middle' the first limit // 2 and the last limit - limit // 2."""
    if len(tokens) <= limit or how == "error":
        return tokens
    if how == "left":
        return tokens[-limit:]
    if how == "right":
        return tokens[:limit]
    head = limit // 2
    return tokens[:head] + tokens[len(tokens) - (limit - head) :]


def render_prompt(messages: list[dict[str, str]], tokenizer, **template_kwargs: Any) -> str:
    """The prompt text the model sees: its chat template with the generation prompt, when it has one
    (`template_kwargs`: data.apply_chat_template_kwargs, e.g. a template's thinking switch)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
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


def _verl_row(row: dict[str, Any], where: str, tokenizer, template_kwargs: dict[str, Any]) -> dict[str, str]:
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
        text = render_prompt(messages, tokenizer, **template_kwargs)
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


class PromptFile:
    """A prompt file read into memory as it is (only the columns its format uses); rows are validated and tokenized
    when `checked` asks for them, so a file of millions of rows opens in seconds and a run pays for the rows it uses.

    `table` keeps the file's own columns: the required ones of its format and `agent_name` when present.
    """

    def __init__(
        self,
        path: str,
        tokenizer,
        max_prompt_length: int,
        default_agent_loop: str,
        options: PromptOptions | None = None,
    ) -> None:
        self.options = options or PromptOptions()
        table = _with_prompt_key(read_prompt_file(path), self.options.prompt_key, path)
        self.required = _required_columns(table, path)
        if table.num_rows == 0:
            raise PromptDataError(f"data file {path} has no rows.")
        keep = [*self.required, *(["agent_name"] if "agent_name" in table.column_names else [])]
        # One chunk per column: a parquet file's row groups come back as slices of shared buffers, and a slice
        # pickles (to the read task, through Ray's object store) with its whole buffer, 8x the table for 8 groups.
        self.table = table.select(keep).combine_chunks()
        self.path, self.tokenizer = path, tokenizer
        self.tokenized: pa.Table | None = None  # every row checked (`check_up_front` on a small file)
        self.max_prompt_length, self.default_agent_loop = max_prompt_length, default_agent_loop
        self._check_agent_names()
        self.filtered = self._filter_overlong() if self.options.filter_overlong else 0

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def check_up_front(self, sample_rows: int = SAMPLE_ROWS, whole_file_rows: int = WHOLE_FILE_ROWS) -> PromptFile:
        """What can be checked in seconds whatever the file's size, before anything is spent on the run: every row
        Arrow's kernels find suspect (a null, an empty string, a column of the wrong type) goes through the row
        rules, and the first `sample_rows` rows are validated and tokenized in full. A file of at most
        `whole_file_rows` rows is validated and tokenized whole: its rows are then served from that table, and the
        file travels to the stream's read task without its tokenizer (no transformers import there). Returns self."""
        whole = self.num_rows <= whole_file_rows
        sample = np.arange(self.num_rows if whole else min(sample_rows, self.num_rows))
        self._rule_checked(np.union1d(sample, _suspect_rows(self.table, self.required)))
        checked = self.checked(sample)
        if whole:
            self.tokenized = checked
        return self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if self.tokenized is not None:  # every row is in it: nothing left to tokenize
            state["tokenizer"] = None
        return state

    def checked(self, rows: np.ndarray) -> pa.Table:
        """The rows (numbers in the file), in this order, validated and tokenized: prompt_text, prompt_ids,
        ground_truth, data_source, agent_name. A bad row raises PromptDataError naming the file and the row."""
        rows = np.asarray(rows, np.int64)
        if self.tokenized is not None:
            return self.tokenized.take(pa.array(rows, pa.int64()))
        checked = self._rule_checked(rows)
        ids = []
        for i, row in zip(rows.tolist(), checked, strict=True):
            tokens = self.tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
            if len(tokens) > self.max_prompt_length and self.options.truncation == "error":
                raise PromptDataError(
                    f"data file {self.path}, row {i}: prompt has {len(tokens)} tokens, more than "
                    f"data.max_prompt_length={self.max_prompt_length}. Raise the limit, shorten it, or set "
                    "data.truncation (left, right, middle) or data.filter_overlong_prompts=true."
                )
            if len(tokens) > self.max_prompt_length:
                tokens = truncate(tokens, self.max_prompt_length, self.options.truncation)
                row["prompt_text"] = self.tokenizer.decode(tokens)  # the text of what the model is fed
            ids.append(tokens)
        return pa.table(
            {
                "prompt_text": pa.array([r["prompt_text"] for r in checked], pa.string()),
                "prompt_ids": pa.array(ids, _TYPES["prompt_ids"]),
                "ground_truth": pa.array([r["ground_truth"] for r in checked], pa.string()),
                "data_source": pa.array([r["data_source"] for r in checked], pa.string()),
                "agent_name": pa.array(self._agent_names(rows), pa.string()),
            }
        )

    def _rule_checked(self, rows: np.ndarray) -> list[dict[str, str]]:
        values = self.table.select(list(self.required)).take(pa.array(rows, pa.int64())).to_pylist()
        out = []
        for i, row in zip(rows.tolist(), values, strict=True):
            where = f"data file {self.path}, row {i}"
            if self.required == VERL_REQUIRED:
                out.append(_verl_row(row, where, self.tokenizer, self.options.chat_template_kwargs))
            else:
                out.append(_flat_row(row, where))
        return out

    def _filter_overlong(self) -> int:
        """verl's filter_overlong_prompts: every row tokenized now, those longer than data.max_prompt_length
        dropped from the file's rows (so a row's number is its place among the kept ones). Returns how many."""
        rows = np.arange(self.num_rows)
        texts = [r["prompt_text"] for r in self._rule_checked(rows)]
        lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        keep = np.flatnonzero(np.asarray(lengths) <= self.max_prompt_length)
        if len(keep) == 0:
            raise PromptDataError(
                f"data file {self.path}: every prompt is longer than data.max_prompt_length={self.max_prompt_length}"
                ", so data.filter_overlong_prompts leaves none. Raise the limit."
            )
        self.table = self.table.take(pa.array(keep, pa.int64())).combine_chunks()
        return len(rows) - len(keep)

    def _agent_names(self, rows: np.ndarray) -> list[str]:
        if "agent_name" not in self.table.column_names:
            return [self.default_agent_loop] * len(rows)
        names = self.table["agent_name"].take(pa.array(rows, pa.int64())).to_pylist()
        return [name or self.default_agent_loop for name in names]

    def _check_agent_names(self) -> None:
        """Each distinct agent_name once (the default where it is null or empty); a bad one is reported at its first
        row, as a row-by-row pass would report it."""
        has = "agent_name" in self.table.column_names
        names = self.table["agent_name"] if has else pa.chunked_array([pa.nulls(self.num_rows)])
        bad = [v for v in pc.unique(names).to_pylist() if (v or self.default_agent_loop) not in AGENT_LOOP_NAMES]
        if not bad:
            return
        first = min(_first_row(names, v) for v in bad)
        try:
            check_agent_name(
                names[first].as_py() or self.default_agent_loop,
                f"data file {self.path}, row {first}, column 'agent_name'",
            )
        except UnknownAgentError as err:
            raise PromptDataError(str(err)) from None


def _with_prompt_key(table: pa.Table, key: str, path: str) -> pa.Table:
    """The verl format's messages column under its usual name, `prompt`, when data.prompt_key names another."""
    if key == "prompt":
        return table
    if key not in table.column_names:
        raise PromptDataError(
            f"data file {path} has no column data.prompt_key={key!r}; it has {table.column_names}. Set "
            "data.prompt_key to the column of chat messages."
        )
    kept = [c for c in table.column_names if c != "prompt"]
    return table.select(kept).rename_columns(["prompt" if c == key else c for c in kept])


def _first_row(column: pa.ChunkedArray, value: Any) -> int:
    if value is None:
        return int(np.argmax(pc.is_null(column).to_numpy(zero_copy_only=False)))
    return pc.index(column, value).as_py()


def _suspect_rows(table: pa.Table, required: tuple[str, ...]) -> np.ndarray:
    """Rows that may break a row rule, found with Arrow's kernels over the whole file in milliseconds: nulls, empty or
    blank strings, an empty message list, a number that is not finite, a column of a type no rule accepts. The row
    rules have the last word (and the exact message); what they reject that these miss is caught when the stream
    reaches the row."""
    suspect = np.zeros(table.num_rows, bool)
    for name in required:
        column = table[name]
        if name == "ground_truth":
            suspect |= _not_truth(column)
        elif name == "reward_model":
            has_truth = pa.types.is_struct(column.type) and column.type.get_field_index("ground_truth") >= 0
            suspect |= _not_truth(pc.struct_field(column, "ground_truth")) if has_truth else True
        elif name == "prompt":
            is_list = pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
            suspect |= _flags(pc.equal(pc.list_value_length(column), 0)) if is_list else True
        else:  # prompt_text, data_source: non-empty strings
            is_text = pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
            suspect |= _flags(pc.equal(pc.utf8_trim_whitespace(column), "")) if is_text else True
    return np.flatnonzero(suspect)


def _not_truth(column: pa.ChunkedArray) -> np.ndarray | bool:
    """Where a ground truth cannot be a string: null, a float that is not finite, a type that is neither."""
    t = column.type
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t):
        return _flags(pc.is_null(column))
    if pa.types.is_floating(t):
        return _flags(pc.invert(pc.is_finite(column)))
    return True


def _flags(mask: pa.ChunkedArray) -> np.ndarray:
    """A boolean mask as numpy, null (a null input) counting as suspect."""
    return pc.fill_null(mask, True).to_numpy(zero_copy_only=False)


def load_prompts(
    path: str,
    tokenizer,
    max_prompt_length: int,
    default_agent_loop: str = "single_turn_agent",
    options: PromptOptions | None = None,
) -> pa.Table:
    """Every row validated and tokenized at once (held-out prompts, tests): prompt_text, prompt_ids, ground_truth,
    data_source, agent_name, row."""
    prompts = PromptFile(path, tokenizer, max_prompt_length, default_agent_loop, options)
    rows = np.arange(prompts.num_rows)
    return prompts.checked(rows).append_column("row", pa.array(rows, pa.int64()))
