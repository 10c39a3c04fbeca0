"""Stages called directly on hand-built batches: no Ray."""

import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from schemas import SAMPLE_SCHEMA, MissingColumnsError
from stages import verifiers
from stages.advantage import GRPOAdvantage
from stages.reward import Reward
from stages.sample_log import SampleLog


def scored(texts: list[str], truth: str = "c b a", source: str = "reverse") -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            "sample_id": [f"p/{i}" for i in range(n)],
            "prompt_id": ["p"] * n,
            "response_text": texts,
            "ground_truth": [truth] * n,
            "data_source": [source] * n,
        }
    )


def test_reward_scores_with_the_verifier():
    out = Reward()(scored(["c b a", "c b", "x"]))
    rewards = out["reward"].to_pylist()
    assert rewards[0] == 1.0 and 0.0 < rewards[1] < 1.0 and rewards[2] == 0.0
    assert out["reward_error"].to_pylist() == [None, None, None]


def test_failing_verifier_marks_the_sample_not_the_run(monkeypatch):
    def broken(response: str, truth: str) -> float:
        if response == "boom":
            raise RuntimeError("parser exploded")
        return 1.0

    def slow(response: str, truth: str) -> float:
        time.sleep(2)
        return 1.0

    monkeypatch.setitem(verifiers.VERIFIERS, "broken", broken)
    monkeypatch.setitem(verifiers.VERIFIERS, "slow", slow)
    monkeypatch.setitem(verifiers.VERIFIERS, "liar", lambda r, t: 7.0)
    batch = pa.concat_tables(
        [
            scored(["boom", "fine"], source="broken"),
            scored(["x"], source="slow"),
            scored(["x"], source="liar"),
            scored(["x"], source="unknown"),
        ]
    )
    out = Reward(timeout_s=0.2)(batch)
    assert out["reward"].to_pylist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    errors = out["reward_error"].to_pylist()
    assert "RuntimeError: parser exploded" in errors[0] and errors[1] is None
    assert "timed out" in errors[2] and "not a float in [0, 1]" in errors[3] and "no verifier" in errors[4]


def test_missing_column_is_named():
    with pytest.raises(MissingColumnsError, match=r"Reward needs column\(s\) \['ground_truth'\]"):
        Reward()(scored(["a"]).drop_columns(["ground_truth"]))


def test_grpo_advantage_by_hand():
    rewards = pa.array([1.0, 0.0, 0.5, 1.0, 1.0, 1.0], pa.float32())
    masks = [[1, 1], [1, 0], [1], [1], [1], [0, 1]]
    batch = pa.table({"prompt_id": ["a", "a", "a", "b", "b", "b"], "reward": rewards, "response_mask": masks})
    out = GRPOAdvantage(group_size=3)(batch)
    adv = out["advantage"].to_numpy()
    r = np.array([1.0, 0.0, 0.5])
    expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    assert np.allclose(adv[:3], expected, atol=1e-6)
    assert np.allclose(adv[3:], 0.0)  # all equal: no signal, no NaN
    per_token = out["token_advantages"].to_pylist()
    assert np.allclose(per_token[1], [adv[1], 0.0]) and np.allclose(per_token[0], [adv[0]] * 2)


def test_grpo_advantage_refuses_a_split_group():
    batch = pa.table(
        {"prompt_id": ["a", "a"], "reward": pa.array([1.0, 0.0], pa.float32()), "response_mask": [[1], [1]]}
    )
    with pytest.raises(ValueError, match="group a has 2 of its 3 responses"):
        GRPOAdvantage(group_size=3)(batch)


def test_sample_log_writes_every_column(tmp_path):
    row = {name: None for name in SAMPLE_SCHEMA.names}
    batch = pa.Table.from_pylist([{**row, "sample_id": "p/0", "token_param_version": [0, 1]}], schema=SAMPLE_SCHEMA)
    assert SampleLog(str(tmp_path / "samples"))(batch) is batch
    shards = list((tmp_path / "samples").iterdir())
    assert len(shards) == 1
    written = pq.read_table(shards[0])
    assert written.schema == SAMPLE_SCHEMA and written["token_param_version"].to_pylist() == [[0, 1]]
