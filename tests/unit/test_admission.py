"""The lazy admission order: the same prompts, ids, order and blocks as laying every epoch out at once; nothing built
up front grows with total_rollout_steps; bad rows are found up front when Arrow can see them, else when read."""

import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.tasks import admission
from pipeline.tasks.admission import AdmissionOrder, PromptSource, end_block, paced, prompt_id, super_chunks
from pipeline.tasks.source import PromptDataError, PromptFile, load_prompts
from schemas import END_OF_STREAM


class WordTokenizer:
    """One id per word, the word's length: shows which text became which ids, and makes a long row easy to write."""

    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [len(w) for w in text.split()]}


def write(tmp_path, n: int, rows: dict | None = None) -> str:
    """A flat prompt file of n prompts; rows={row: {column: value}} spoils some."""
    table = [
        {"prompt_text": f"add {i} and {i % 7}", "ground_truth": str(i + i % 7), "data_source": "add"} for i in range(n)
    ]
    for i, fix in (rows or {}).items():
        table[i] |= fix
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(table), path)
    return str(path)


def eager_blocks(prompts: pa.Table, total: int, block_rows: int, seed: int, skip: frozenset[str]) -> list[pa.Table]:
    """The layout as it was built before it was lazy: every epoch taken out of the validated table at start."""
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
    return [table.slice(i, block_rows) for i in range(0, table.num_rows, block_rows)] + [end_block()]


def source(
    path: str, total: int, block_rows: int, seed: int = 3, skip: frozenset[str] = frozenset(), whole: bool = False
) -> PromptSource:
    """`whole`: the file checked whole up front (a small file's way); else tokenized as the blocks are read."""
    prompts = PromptFile(path, WordTokenizer(), 16, "single_turn_agent").check_up_front(
        sample_rows=3, whole_file_rows=10**9 if whole else 0
    )
    return PromptSource(prompts, AdmissionOrder(prompts.num_rows, total, seed, skip), block_rows)


@pytest.mark.parametrize("chunk_rows", [5, 2048])  # chunks that cross epochs and blocks; one chunk for it all
@pytest.mark.parametrize(("total", "block_rows"), [(23, 3), (21, 7), (5, 2), (40, 4)])
@pytest.mark.parametrize("skipped", ["none", "some", "all"])
@pytest.mark.parametrize("whole", [False, True])
def test_lazy_blocks_are_the_eager_blocks(tmp_path, monkeypatch, chunk_rows, total, block_rows, skipped, whole):
    monkeypatch.setattr(admission, "CHUNK_ROWS", chunk_rows)
    path = write(tmp_path, 7)
    loaded = load_prompts(path, WordTokenizer(), 16)
    ids = [pid for b in eager_blocks(loaded, total, 1, 3, frozenset())[:-1] for pid in b["prompt_id"].to_pylist()]
    # A skip id this layout cannot produce (another epoch, another spelling) changes nothing, as before.
    skip = {"none": [], "some": [*ids[1::3], "e99-000001", "e0-1", "junk"], "all": ids}[skipped]
    expected = eager_blocks(loaded, total, block_rows, 3, frozenset(skip))
    got = list(source(path, total, block_rows, skip=frozenset(skip), whole=whole).blocks())
    assert [b.num_rows for b in got] == [b.num_rows for b in expected]
    for lazy, eager in zip(got, expected, strict=True):
        assert lazy.equals(eager), (lazy.to_pydict(), eager.to_pydict())


def test_every_admission_once_and_each_epoch_a_permutation(tmp_path):
    path = write(tmp_path, 50)
    blocks = list(source(path, total=1234, block_rows=8).blocks())
    ids = [pid for b in blocks[:-1] for pid in b["prompt_id"].to_pylist()]
    assert len(ids) == 1234 and len(set(ids)) == 1234
    assert blocks[-1]["prompt_id"].to_pylist() == [END_OF_STREAM] and END_OF_STREAM not in ids
    for epoch in range(1234 // 50):
        rows = sorted(int(p.split("-")[1]) for p in ids if p.startswith(f"e{epoch}-"))
        assert rows == list(range(50))
    assert sum(p.startswith(f"e{1234 // 50}-") for p in ids) == 1234 % 50
    # The text of each admission is its row's: ids and rows are not shuffled apart.
    first = blocks[0].to_pylist()[0]
    row = int(first["prompt_id"].split("-")[1])
    assert first["prompt_text"] == f"add {row} and {row % 7}" and first["prompt_ids"] == [3, len(str(row)), 3, 1]


def test_a_resumed_order_lays_out_the_rest_only():
    full = AdmissionOrder(num_rows=10, total=35, seed=0)
    ids = [prompt_id(e, r) for e, rows in full.epochs() for r in rows.tolist()]
    skip = frozenset(ids[:17])
    rest = [prompt_id(e, r) for e, rows in AdmissionOrder(10, 35, 0, skip).epochs() for r in rows.tolist()]
    assert rest == ids[17:]


def test_nothing_built_up_front_grows_with_total(tmp_path):
    path = write(tmp_path, 100)
    small, huge = source(path, total=10**3, block_rows=4), source(path, total=10**9, block_rows=4)
    # What travels to Ray is the file and the layout's parameters, whatever the total.
    assert abs(len(pickle.dumps(huge)) - len(pickle.dumps(small))) < 16
    blocks = huge.blocks()
    first = [next(blocks) for _ in range(3)]
    assert [b.num_rows for b in first] == [4, 4, 4]
    assert first[0]["prompt_id"].to_pylist() == next(small.blocks())["prompt_id"].to_pylist()


def test_a_bad_row_that_only_reading_finds_fails_with_the_row(tmp_path):
    # Too long is found by tokenizing, which waits until the stream reaches the row; the message is the eager one.
    long_text = "word " * 40
    path = write(tmp_path, 3000, rows={2999: {"prompt_text": long_text}})
    with pytest.raises(PromptDataError) as eager:
        load_prompts(path, WordTokenizer(), 16)
    lazy = source(path, total=3000, block_rows=8)  # the check up front passes: the row is beyond its sample
    with pytest.raises(PromptDataError) as info:
        for _ in lazy.blocks():
            pass
    assert str(info.value) == str(eager.value)
    assert f"data file {path}, row 2999: prompt has 40 tokens" in str(info.value)


def test_a_small_file_is_checked_whole_and_travels_without_its_tokenizer(tmp_path):
    path = write(tmp_path, 3000, rows={2999: {"prompt_text": "word " * 40}})
    with pytest.raises(PromptDataError, match="row 2999: prompt has 40 tokens"):  # the defaults: 3,000 rows is small
        PromptFile(path, WordTokenizer(), 16, "single_turn_agent").check_up_front()
    path = write(tmp_path, 50)
    travelled = pickle.loads(pickle.dumps(source(path, total=120, block_rows=8, whole=True)))
    assert travelled.prompts.tokenizer is None  # the read task imports no tokenizer's library
    lazy = source(path, total=120, block_rows=8)
    assert all(a.equals(b) for a, b in zip(travelled.blocks(), lazy.blocks(), strict=True))


@pytest.mark.parametrize(
    ("fix", "message"),
    [
        ({"prompt_text": None}, "column 'prompt_text' must be a non-empty string, got None"),
        ({"data_source": "  "}, "column 'data_source' must be a non-empty string, got '  '"),
        ({"ground_truth": None}, "column 'ground_truth' must be a string or a number, got None"),
    ],
)
def test_nulls_and_blanks_anywhere_are_found_up_front(tmp_path, fix, message):
    path = write(tmp_path, 5000, rows={4321: fix, 4400: {"prompt_text": ""}})
    with pytest.raises(PromptDataError) as info:
        PromptFile(path, WordTokenizer(), 16, "single_turn_agent").check_up_front(sample_rows=10)
    assert str(info.value).startswith(f"data file {path}, row 4321: {message}")


def test_an_unknown_agent_is_reported_at_its_first_row(tmp_path):
    table = pq.read_table(write(tmp_path, 40))
    agents = ["tool_agent" if i % 2 else None for i in range(40)]
    agents[31], agents[17] = "planner", "shouter"
    path = tmp_path / "agents.parquet"
    pq.write_table(table.append_column("agent_name", pa.array(agents, pa.string())), path)
    with pytest.raises(PromptDataError, match=r"row 17, column 'agent_name': unknown agent loop 'shouter'"):
        PromptFile(str(path), WordTokenizer(), 16, "single_turn_agent")
    agents[17] = None
    # Rows 0-30: nulls take the default.
    pq.write_table(table.slice(0, 31).append_column("agent_name", pa.array(agents[:31], pa.string())), path)
    names = PromptFile(str(path), WordTokenizer(), 16, "single_turn_agent").checked(np.arange(4))["agent_name"]
    assert names.to_pylist() == ["single_turn_agent", "tool_agent", "single_turn_agent", "tool_agent"]


def test_only_the_needed_columns_are_kept(tmp_path):
    table = pq.read_table(write(tmp_path, 4)).append_column("extra_info", pa.array(["x" * 1000] * 4))
    path = tmp_path / "extra.parquet"
    pq.write_table(table, path)
    assert PromptFile(str(path), WordTokenizer(), 16, "single_turn_agent").table.column_names == [
        "prompt_text",
        "ground_truth",
        "data_source",
    ]


def test_joins_are_whole_blocks_just_over_the_size():
    chunks = [pa.table({"x": list(range(i * 12, i * 12 + 12))}) for i in range(10)]  # 96 bytes: 3 blocks of 32
    joins = list(super_chunks(iter(chunks), min_bytes=200, block_rows=4))
    assert [j.num_rows for j in joins] == [28] * 4 + [8]  # 7 blocks: 224 bytes, over 200 by less than a block
    assert all(j.column(0).num_chunks == 1 for j in joins)
    assert pa.concat_tables(joins).equals(pa.concat_tables(chunks))


def test_the_read_draws_a_table_only_when_all_but_the_last_are_admitted():
    admitted, seen = 0, []

    def gate() -> int:  # admits 5 more prompts each time it is asked
        nonlocal admitted
        admitted += 5
        return admitted

    def tables():
        for _ in range(6):
            seen.append(admitted)  # what the gate had admitted when the table was drawn
            yield pa.table({"x": list(range(10))})

    assert sum(t.num_rows for t in paced(tables(), gate, poll_s=0)) == 60
    # Table i is drawn at the first count with tables 0..i-2 admitted (10 rows each): the first two at once.
    assert seen == [5, 10, 15, 20, 30, 40]


def test_the_prompt_table_travels_at_its_own_size(tmp_path):
    # Parquet reads a large row group in batches that are slices of one buffer; pickled as they are, each would
    # carry the whole buffer to the read task (a million rows: 8x the table).
    n = 140_000  # two read batches
    path = tmp_path / "one_group.parquet"
    pq.write_table(
        pa.table(
            {"prompt_text": [f"add {i}" for i in range(n)], "ground_truth": ["1"] * n, "data_source": ["add"] * n}
        ),
        path,
    )
    table = PromptFile(str(path), WordTokenizer(), 16, "single_turn_agent").table
    assert len(pickle.dumps(table)) < 1.2 * table.nbytes


@pytest.mark.parametrize(
    ("fix", "message"),
    [
        ({"reward_model": {"style": "rule", "ground_truth": None}}, "column 'reward_model' must be a struct"),
        ({"prompt": []}, "column 'prompt' must be a list of chat messages"),
        ({"data_source": ""}, "column 'data_source' must be a non-empty string"),
    ],
)
def test_verl_rows_are_scanned_up_front_too(tmp_path, fix, message):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"add {i} and 1"}],
            "data_source": "add",
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        }
        for i in range(3000)
    ]
    rows[2500] |= fix
    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(PromptDataError) as info:
        PromptFile(str(path), WordTokenizer(), 16, "single_turn_agent").check_up_front(sample_rows=10)
    assert str(info.value).startswith(f"data file {path}, row 2500: {message}")


def test_cutting_the_joins_gives_the_blocks(tmp_path):
    # What the read task and the streaming repartition do in the stream, without Ray: joins cut into blocks.
    lazy = source(write(tmp_path, 300), total=1000, block_rows=6)
    joins = list(super_chunks(lazy.chunks(), min_bytes=5000, block_rows=6))
    assert len(joins) > 3 and all(j.num_rows % 6 == 0 for j in joins[:-1])
    cut = [j.slice(i, 6) for j in joins for i in range(0, j.num_rows, 6)]
    expected = list(lazy.blocks())[:-1]
    assert len(cut) == len(expected) and all(a.equals(b) for a, b in zip(cut, expected, strict=True))
