"""TrainingSink: oldest admissions first, waits only for prompts at risk of the lag bound, exactly once."""

import pyarrow as pa
import pytest

from schemas import SAMPLE_SCHEMA
from stages.sink import TrainingSink
from stages.staleness import StalenessBudget

N = 2  # responses per prompt


def group(pid: str, admitted_version: int, admitted_time: float = 0.0) -> pa.Table:
    row = {name: None for name in SAMPLE_SCHEMA.names}
    rows = []
    for i in range(N):
        rows.append(
            {
                **row,
                "prompt_id": pid,
                "sample_id": f"{pid}/{i}",
                "admitted_version": admitted_version,
                "admitted_time": admitted_time,
                "param_version": admitted_version,
                "reward": 1.0,
                "response_ids": [1, 2],
                "num_tokens": 2,
            }
        )
    return pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)


def sink_over(blocks, outstanding: dict[str, int], s=0.5, k=1, mb=2, tmp_path=None) -> TrainingSink:
    budget = StalenessBudget(s, k, 1, mb)
    return TrainingSink(
        iter(blocks),
        budget,
        N,
        str(tmp_path / "consumed"),
        lambda v: sum(1 for ver in outstanding.values() if ver <= v),
    )


def ids(step) -> list[str]:
    return [g["prompt_id"][0].as_py() for g in step.groups]


def test_waits_for_a_prompt_that_would_exceed_the_bound(tmp_path):
    blocks = [group("B", 1, 2.0), group("C", 1, 3.0), group("A", 0, 1.0)]
    outstanding = {"A": 0, "B": 1, "C": 1}
    sink = sink_over(blocks, outstanding, tmp_path=tmp_path)
    step = sink.next_step(version=1, steps_left_after_this=0)
    assert ids(step) == ["A", "B"]  # A had to come in: at version 2 its lag would be 2 > bound 1
    assert sink.leftover() == ["C"]


def test_does_not_wait_when_nothing_is_at_risk(tmp_path):
    pulled = []

    def blocks():
        for pid in ("B", "C", "D"):
            pulled.append(pid)
            yield group(pid, 1)

    sink = TrainingSink(blocks(), StalenessBudget(0.5, 1, 1, 2), N, str(tmp_path / "c"), lambda v: 0)
    step = sink.next_step(version=1, steps_left_after_this=0)
    assert ids(step) == ["B", "C"]
    assert pulled == ["B", "C"]  # D was not pulled: no waiting beyond what the step needs


def test_backlog_spread_over_remaining_steps(tmp_path):
    # k=2: 3 prompts at risk, 1 step left after this one of 2 prompts -> only 1 due now
    blocks = [group("new1", 1), group("new2", 1), group("old1", 0), group("old2", 0), group("old3", 0)]
    outstanding = {"old1": 0, "old2": 0, "old3": 0, "new1": 1, "new2": 1}
    sink = sink_over(blocks, outstanding, k=2, tmp_path=tmp_path)
    step = sink.next_step(version=1, steps_left_after_this=1)
    assert ids(step) == ["old1", "new1"]


def test_synchronous_mode_trains_everything_of_the_version(tmp_path):
    blocks = [group("A", 0), group("B", 0)]
    sink = sink_over(blocks, {"A": 0, "B": 0}, s=0.0, mb=2, tmp_path=tmp_path)
    assert ids(sink.next_step(0, 0)) == ["A", "B"]


def test_end_of_stream_returns_none_and_reports_leftover(tmp_path):
    sink = sink_over([group("A", 0)], {"A": 0}, tmp_path=tmp_path)
    assert sink.next_step(0, 0) is None
    assert sink.leftover() == ["A"]


def test_a_group_twice_or_incomplete_is_an_error(tmp_path):
    sink = sink_over([group("A", 0), group("A", 0)], {}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="group A"):
        sink.next_step(0, 0)
    half = group("B", 0).slice(0, 1)
    sink = sink_over([half], {}, tmp_path=tmp_path)
    with pytest.raises(ValueError, match="group B arrived with 1 rows"):
        sink.next_step(0, 0)


def test_record_writes_the_consumption_log(tmp_path):
    import pyarrow.parquet as pq

    sink = sink_over([group("A", 0), group("B", 0)], {}, tmp_path=tmp_path)
    step = sink.next_step(0, 0)
    sink.record(step, version=3, step_index=7)
    log = pq.read_table(tmp_path / "consumed" / "step-0000007.parquet")
    assert log["sample_id"].to_pylist() == ["A/0", "A/1", "B/0", "B/1"]
    assert set(log["consumed_version"].to_pylist()) == {3}
    assert step.minibatches(1).resolve()[1]["prompt_id"] == ["B", "B"]


def test_step_transform_runs_over_the_whole_step(tmp_path):
    # reinforce_plus_plus's whitening is over the step's trained tokens, not a block's: groups A (returns 1, 1)
    # and B (returns 0, 0), one token each, arrive in different blocks. Over the step: mean 0.5, unbiased
    # variance 1/3, so (1 - 0.5) / sqrt(1/3 + 1e-8) = 0.866025 and -0.866025; over A alone both would be 0.
    from stages.advantage import whiten_step

    def scored(pid: str, ret: float) -> pa.Table:
        g = group(pid, 0).drop_columns(["response_mask", "token_advantages", "advantage"])
        g = g.append_column("response_mask", pa.array([[1]] * N, pa.list_(pa.int8())))
        g = g.append_column("token_advantages", pa.array([[ret]] * N, pa.list_(pa.float32())))
        return g.append_column("advantage", pa.array([ret] * N, pa.float32()))

    budget = StalenessBudget(0.0, 1, 1, 2)
    sink = TrainingSink(
        iter([scored("A", 1.0), scored("B", 0.0)]), budget, N, str(tmp_path / "c"), lambda v: 0, whiten_step
    )
    step = sink.next_step(version=0, steps_left_after_this=0)
    assert ids(step) == ["A", "B"] and [g.num_rows for g in step.groups] == [N, N]
    h = 0.5 / (1 / 3 + 1e-8) ** 0.5
    rows = step.minibatches(1).resolve()  # on the trainer, which holds the per-token columns
    assert rows[0]["advantage"] + rows[1]["advantage"] == pytest.approx([h, h, -h, -h], abs=1e-6)
    assert [t[0] for t in rows[1]["token_advantages"]] == pytest.approx([-h, -h], abs=1e-6)
    assert rows[1]["trainer_version"] == [0, 0]


def test_a_step_goes_to_the_trainer_as_one_chunk_per_column(tmp_path):
    # Each group is a table of its own; concatenated they would be one chunk per group in every column, which Ray
    # serializes chunk by chunk (ten times slower to send than one chunk).
    sink = sink_over(iter([group("A", 0), group("B", 0), group("C", 0), group("D", 0)]), {}, mb=4, tmp_path=tmp_path)
    step = sink.next_step(0, 0)
    (minibatch,) = step.minibatches(4).minibatches
    assert minibatch.num_rows == 4 * N
    assert {column.num_chunks for column in minibatch.columns} == {1}
    assert minibatch["prompt_id"].to_pylist() == [p for p in "ABCD" for _ in range(N)]  # in the step's order
