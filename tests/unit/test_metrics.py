"""verl's fully_async/* counters on hand-built batches."""

import pyarrow as pa
import pytest

from pipeline.observe.metrics import FullyAsyncCounters


def batch(rows: list[tuple[str, int, int]]) -> pa.Table:
    """(prompt_id, param_version, param_version_end) per trajectory."""
    return pa.table(
        {
            "prompt_id": [r[0] for r in rows],
            "param_version": [r[1] for r in rows],
            "param_version_end": [r[2] for r in rows],
        }
    )


def test_stale_counts_accumulate_and_partial_counts_reset_at_sync():
    c = FullyAsyncCounters()
    m = c.update(batch([("a", 2, 2), ("a", 1, 2), ("b", 2, 2), ("b", 2, 2)]), version=2)
    assert m["fully_async/count/stale_samples_processed"] == 1  # prompt a has a stale trajectory
    assert m["fully_async/count/stale_trajectory_processed"] == 1
    assert m["fully_async/partial/total_partial_num"] == 1
    assert m["fully_async/partial/partial_ratio"] == pytest.approx(1 / 4)
    assert m["fully_async/partial/max_partial_span"] == 1
    m = c.update(batch([("c", 0, 2), ("c", 2, 2)]), version=2)
    assert m["fully_async/count/stale_samples_processed"] == 2
    assert m["fully_async/partial/total_partial_num"] == 2
    assert m["fully_async/partial/partial_ratio"] == pytest.approx(2 / 6)
    assert m["fully_async/partial/max_partial_span"] == 2
    c.new_window()
    m = c.update(batch([("d", 3, 3)]), version=3)
    assert m["fully_async/partial/total_partial_num"] == 0 and m["fully_async/partial/max_partial_span"] == 0
    assert m["fully_async/count/stale_trajectory_processed"] == 2  # run totals are not reset by a sync


def test_reward_extra_info_numbers_are_averaged_per_key():
    import json

    from pipeline.observe.metrics import reward_extra_metrics

    extras = [
        {"acc": 1.0, "overlong": True, "overlong_reward": -0.5, "source": "math"},
        {"acc": 0.0, "overlong": False, "overlong_reward": 0.0},
        None,  # scoring failed
        {"acc": 1.0, "bad": float("nan")},
    ]
    table = pa.table({"reward_extra_info": [None if e is None else json.dumps(e) for e in extras]})
    assert reward_extra_metrics(table) == {
        "reward_extra/acc/mean": pytest.approx(2 / 3),
        "reward_extra/overlong/mean": 0.5,  # of the samples that have the key
        "reward_extra/overlong_reward/mean": -0.25,
    }
