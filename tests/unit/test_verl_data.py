"""verl's RL data format read as it is: chat templates, the fallback without one, and every bad-input message."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.tasks.source import PromptDataError, load_prompts

# A ChatML template, as Qwen's: enough to see the roles and the generation prompt in the rendered text.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = "Mia buys 3 pens at $2 each. How much does she spend?"


def verl_row(question: str = QUESTION, truth="6", **overrides) -> dict:
    row = {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": question}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }
    return {**row, **overrides}


def write(tmp_path, rows: list[dict], suffix: str = "parquet"):
    path = tmp_path / f"prompts.{suffix}"
    if suffix == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pipeline.tasks.embedded import build_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(out, seed=0)
    return out


@pytest.fixture
def plain(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert not tokenizer.chat_template  # the embedded tokenizer has none: the fallback path
    return tokenizer


@pytest.fixture
def chat(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    tokenizer.chat_template = CHATML
    return tokenizer


def error(tmp_path, rows, tokenizer, suffix="parquet", max_prompt_length=512) -> str:
    path = write(tmp_path, rows, suffix)
    with pytest.raises(PromptDataError) as info:
        load_prompts(str(path), tokenizer, max_prompt_length)
    message = str(info.value)
    assert str(path) in message
    return message


def test_chat_template_renders_the_messages(tmp_path, chat):
    rows = [verl_row(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])]
    table = load_prompts(str(write(tmp_path, rows)), chat, 512)
    text = table.column("prompt_text")[0].as_py()
    assert text == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    # The template wrote the markup: tokenizing adds nothing more.
    assert table.column("prompt_ids")[0].as_py() == chat(text, add_special_tokens=False)["input_ids"]
    assert table.column("ground_truth").to_pylist() == ["6"]
    assert table.column("data_source").to_pylist() == ["openai/gsm8k"]
    assert table.column_names == ["prompt_text", "prompt_ids", "ground_truth", "data_source", "agent_name", "row"]
    assert table.column("agent_name").to_pylist() == ["single_turn_agent"]  # no agent_name column: the default


def test_without_chat_template_the_contents_are_joined(tmp_path, plain):
    rows = [verl_row(prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])]
    table = load_prompts(str(write(tmp_path, rows)), plain, 512)
    text = table.column("prompt_text")[0].as_py()
    assert text == f"Be brief.\n{QUESTION}"
    ids = table.column("prompt_ids")[0].as_py()
    assert ids == plain(text, add_special_tokens=False)["input_ids"] and plain.decode(ids) == text


def test_jsonl_and_numbers_as_ground_truth(tmp_path, plain):
    rows = [verl_row(truth=6), verl_row(truth=-3)]
    table = load_prompts(str(write(tmp_path, rows, "jsonl")), plain, 512)
    assert table.column("ground_truth").to_pylist() == ["6", "-3"]
    # Mixed with a fraction the column is float: integral values keep their integer spelling.
    table = load_prompts(str(write(tmp_path, [*rows, verl_row(truth=2.5)], "jsonl")), plain, 512)
    assert table.column("ground_truth").to_pylist() == ["6", "-3", "2.5"]


def test_extra_columns_and_missing_extra_info_are_fine(tmp_path, plain):
    rows = [{k: v for k, v in verl_row().items() if k != "extra_info"}]
    assert load_prompts(str(write(tmp_path, rows)), plain, 512).num_rows == 1


def test_flat_format_still_reads_and_takes_numbers(tmp_path, plain):
    rows = [{"prompt_text": "reverse: a b =", "ground_truth": 7, "data_source": "reverse"}]
    table = load_prompts(str(write(tmp_path, rows, "jsonl")), plain, 64)
    assert table.column("prompt_text").to_pylist() == ["reverse: a b ="]
    assert table.column("ground_truth").to_pylist() == ["7"]


@pytest.mark.parametrize(
    ("drop", "missing"), [("reward_model", "['reward_model']"), ("data_source", "['data_source']")]
)
def test_missing_verl_column_says_what_each_format_needs(tmp_path, plain, drop, missing):
    rows = [{k: v for k, v in verl_row().items() if k != drop}]
    message = error(tmp_path, rows, plain)
    assert f"lacks column(s) {missing}" in message
    assert "['prompt', 'data_source', 'reward_model']" in message  # verl format
    assert "['prompt_text', 'ground_truth', 'data_source']" in message  # flat format


def test_neither_format_names_both(tmp_path, plain):
    message = error(tmp_path, [{"question": QUESTION, "answer": "6"}], plain)
    assert "prompt_text" in message and "reward_model" in message and "'ground_truth'" in message


# (rows, bad row, column named, words of the fix); rows whose bad value changes the column's type are all bad.
BAD_ROWS = {
    "prompt is a string": ([verl_row(prompt=QUESTION)], 0, "'prompt'", "list of chat messages"),
    "prompt is empty": ([verl_row(), verl_row(prompt=[])], 1, "'prompt'", "list of chat messages"),
    "message without content": (
        [verl_row(), verl_row(prompt=[{"role": "user"}])],
        1,
        "'prompt', message 0 needs a string 'content'",
        "fix or drop that row",
    ),
    "content is not a string": (
        [verl_row(prompt=[{"role": "user", "content": ["a", "b"]}])],
        0,
        "'prompt', message 0 needs a string 'content'",
        "list of chat messages",
    ),
    "message without role": (
        [verl_row(), verl_row(prompt=[{"role": "user", "content": "hi"}, {"content": QUESTION}])],
        1,
        "'prompt', message 1 needs a string 'role'",
        "fix or drop that row",
    ),
    "message is not a dict": ([verl_row(prompt=["hello"])], 0, "'prompt', message 0", "list of chat messages"),
    "all contents empty": ([verl_row(), verl_row(question=" ")], 1, "'prompt' has no text", "Fix or drop"),
    "reward_model without ground_truth": (
        [verl_row(reward_model={"style": "rule"})],
        0,
        "'reward_model' must be a struct with a 'ground_truth' field",
        "Add the ground truth",
    ),
    "ground_truth null": ([verl_row(), verl_row(truth=None)], 1, "'reward_model'", "Add the ground truth"),
    "reward_model null": ([verl_row(), verl_row(reward_model=None)], 1, "'reward_model'", "Add the ground truth"),
    "ground_truth a list": ([verl_row(truth=["6"])], 0, "field 'ground_truth' must be a string or a number", "Fix"),
    "ground_truth a bool": ([verl_row(truth=True)], 0, "field 'ground_truth' must be a string or a number", "Fix"),
    "data_source empty": ([verl_row(), verl_row(data_source="")], 1, "'data_source'", "Fix or drop"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
@pytest.mark.parametrize("suffix", ["parquet", "jsonl"])
def test_bad_row_names_file_row_column_and_fix(tmp_path, plain, case, suffix):
    rows, bad, column, fix = BAD_ROWS[case]
    message = error(tmp_path, rows, plain, suffix)
    assert f"row {bad}:" in message and column in message and fix in message, message


def test_bad_row_message_stays_short(tmp_path, plain):
    message = error(tmp_path, [verl_row(prompt="x" * 5000)], plain)
    assert len(message) < 600


def test_template_that_rejects_the_messages_is_a_row_error(tmp_path, chat):
    chat.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
        "{% endif %}" + CHATML
    )
    rows = [verl_row(), verl_row(prompt=[{"role": "assistant", "content": "6"}])]
    message = error(tmp_path, rows, chat)
    assert "row 1:" in message and "'prompt'" in message and "first message must be from the user" in message


def test_prompt_longer_than_the_limit_names_the_row(tmp_path, chat):
    message = error(tmp_path, [verl_row(), verl_row(question=QUESTION * 10)], chat, max_prompt_length=128)
    assert "row 1:" in message and "data.max_prompt_length=128" in message


# --- verl's data keys (PromptOptions) -------------------------------------------------------------------------------
def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_truncation_keeps_the_end_the_start_or_both_ends(tmp_path, plain):
    from pipeline.tasks.source import PromptOptions, truncate

    # by hand on ten token ids, a limit of 5: left keeps the last 5, right the first 5, middle the first 2 and last 3
    ten = list(range(10))
    assert truncate(ten, 5, "left") == [5, 6, 7, 8, 9] and truncate(ten, 5, "right") == [0, 1, 2, 3, 4]
    assert truncate(ten, 5, "middle") == [0, 1, 7, 8, 9] and truncate(ten, 12, "left") == ten
    path = str(write(tmp_path, [verl_row(), verl_row("short")]))
    full = _ids(plain, QUESTION)
    limit = len(full) - 3
    table = load_prompts(path, plain, limit, options=PromptOptions(truncation="left"))
    assert table["prompt_ids"].to_pylist()[0] == full[-limit:]
    assert table["prompt_text"].to_pylist()[0] == plain.decode(full[-limit:])  # the text of what the model gets
    assert table["prompt_ids"].to_pylist()[1] == _ids(plain, "short")  # a short one is left alone
    with pytest.raises(PromptDataError, match=r"more than data.max_prompt_length.*data.truncation"):
        load_prompts(path, plain, limit)  # 'error', the default, refuses it


def test_filter_overlong_prompts_drops_them_when_the_file_opens(tmp_path, plain):
    from pipeline.tasks.source import PromptFile, PromptOptions

    path = str(write(tmp_path, [verl_row(), verl_row("short", truth="1"), verl_row(QUESTION + " twice")]))
    prompts = PromptFile(
        path, plain, len(_ids(plain, "short")), "single_turn_agent", PromptOptions(filter_overlong=True)
    )
    assert (prompts.num_rows, prompts.filtered) == (1, 2)
    assert prompts.checked([0])["ground_truth"].to_pylist() == ["1"]
    with pytest.raises(PromptDataError, match="leaves none"):
        PromptFile(path, plain, 1, "single_turn_agent", PromptOptions(filter_overlong=True))


def test_prompt_key_and_chat_template_kwargs(tmp_path, chat):
    from pipeline.tasks.source import PromptOptions

    row = verl_row()
    row["question"] = row.pop("prompt")
    path = str(write(tmp_path, [row]))
    chat.chat_template = CHATML + "{% if thinking %}<think>{% endif %}"
    options = PromptOptions(prompt_key="question", chat_template_kwargs={"thinking": True})
    text = load_prompts(path, chat, 512, options=options)["prompt_text"].to_pylist()[0]
    assert QUESTION in text and text.endswith("<|im_start|>assistant\n<think>")
    assert (
        not load_prompts(path, chat, 512, options=PromptOptions(prompt_key="question"))["prompt_text"][0]
        .as_py()
        .endswith("<think>")
    )
    with pytest.raises(PromptDataError, match=r"lacks column"):
        load_prompts(path, chat, 512)  # without prompt_key the file has neither format's columns
    with pytest.raises(PromptDataError, match=r"no column data.prompt_key='messages'"):
        load_prompts(path, chat, 512, options=PromptOptions(prompt_key="messages"))


def test_shuffle_false_keeps_the_files_order():
    from pipeline.tasks.admission import AdmissionOrder

    order = AdmissionOrder(4, 10, seed=0, shuffle=False)
    assert [rows.tolist() for _, rows in order.epochs()] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1]]
    shuffled = [rows.tolist() for _, rows in AdmissionOrder(4, 8, seed=0).epochs()]
    assert shuffled != [[0, 1, 2, 3], [0, 1, 2, 3]]
