"""The synthetic GSM8K set: deterministic, answers right by recomputation, verl's schema, committed files current."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.tasks.gsm8k_synth import INSTRUCTION, TEMPLATES, make_splits, write_splits
from pipeline.tasks.source import load_prompts
from stages.math_verifier import score_math
from stages.verifiers import VERIFIERS

COMMITTED = Path(__file__).resolve().parents[2] / "data" / "gsm8k_synth"

# Each template's answer from its numbers, written independently of the generator.
RECOMPUTE = {
    "shopping": lambda count, price, extra: count * price + extra,
    "change": lambda bill, count, price: bill - count * price,
    "sharing": lambda total, friends: total / friends,
    "rate_time": lambda speed, hours: speed * hours,
    "reading": lambda per_day, pages: pages / per_day,
    "more_than": lambda has, more: 2 * has + more,
}


@pytest.fixture(scope="module")
def splits():
    return make_splits(300, 100, seed=5)


def test_same_seed_same_rows(splits):
    assert make_splits(300, 100, seed=5) == splits
    assert make_splits(300, 100, seed=6) != splits


def test_answers_recompute_from_the_numbers(splits):
    for row in splits["train"] + splits["test"]:
        info = row["extra_info"]
        answer = RECOMPUTE[info["template"]](*info["numbers"])
        assert answer == int(answer) > 0  # grade-school answers: whole and positive
        assert row["reward_model"]["ground_truth"] == str(int(answer))
        assert all(str(n) in info["question"] for n in info["numbers"])


def test_every_template_is_used_and_splits_are_disjoint(splits):
    assert {r["extra_info"]["template"] for r in splits["train"]} == set(TEMPLATES) == set(RECOMPUTE)
    questions = [r["extra_info"]["question"] for r in splits["train"] + splits["test"]]
    assert len(set(questions)) == len(questions)
    assert [r["extra_info"]["index"] for r in splits["test"]] == list(range(100))
    assert {r["extra_info"]["split"] for r in splits["test"]} == {"test"}


def test_rows_have_verls_schema(splits):
    row = splits["train"][0]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": row["extra_info"]["question"] + INSTRUCTION}]
    assert INSTRUCTION == ' Let\'s think step by step and output the final answer after "####".'
    assert row["reward_model"]["style"] == "rule"


def test_worked_solutions_score_one(splits):
    for row in splits["train"]:
        solution, truth = row["extra_info"]["answer"], row["reward_model"]["ground_truth"]
        assert solution.endswith(f"\n#### {truth}")
        assert VERIFIERS[row["data_source"]](solution, truth) == 1.0
        assert score_math(solution.replace(f"#### {truth}", f"#### {int(truth) + 1}"), truth) == 0.0


def test_written_file_types(tmp_path):
    schema = pq.read_schema(write_splits(tmp_path, 4, 2, seed=0)["train"])
    assert schema.field("prompt").type == pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    assert schema.field("reward_model").type == pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
    assert schema.field("data_source").type == pa.string()
    info = schema.field("extra_info").type
    assert info.field("split").type == pa.string() and info.field("index").type == pa.int64()


def test_committed_files_are_the_generators_output(tmp_path):
    fresh = write_splits(tmp_path, 200, 50, seed=0)  # the command in the module docstring
    for split, path in fresh.items():
        assert pq.read_table(COMMITTED / f"{split}.parquet").equals(pq.read_table(path)), split
        assert (COMMITTED / f"{split}.parquet").stat().st_size < 64 * 1024


def test_committed_prompts_fit_the_embedded_model(tmp_path):
    from pipeline.tasks.embedded import MAX_POSITIONS, build_tokenizer

    tokenizer = build_tokenizer(tmp_path, seed=0)
    # The embedded tokenizer has no chat template and learned no English merges: about one token per character,
    # still short enough for a 128-token prompt limit and a response within 256 positions.
    for split in ("train", "test"):
        prompts = load_prompts(str(COMMITTED / f"{split}.parquet"), tokenizer, max_prompt_length=128)
        longest = max(len(ids) for ids in prompts.column("prompt_ids").to_pylist())
        assert longest <= 128 < MAX_POSITIONS
        text = prompts.column("prompt_text")[0].as_py()
        assert tokenizer.decode(prompts.column("prompt_ids")[0].as_py()) == text and text.endswith(INSTRUCTION)
