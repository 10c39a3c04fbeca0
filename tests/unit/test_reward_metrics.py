"""Per-source reward metrics (pipeline/observe/reward_metrics.py) on a hand-built step."""

import pyarrow as pa
import pytest

from pipeline.observe.reward_metrics import reward_source_metrics, trained_reward_mean
from stages.reward_sources import record, with_records


def step() -> pa.Table:
    table = pa.table(
        {
            "reward": pa.array([1.0, 0.5, 0.0, 0.0], pa.float32()),
            "reward_status": ["ok", "ok", "masked", "zero"],
        }
    )
    return with_records(
        table,
        [
            {"reward_model": record(0.9, None, 0.2), "custom": record(1.0, None, 1.0)},
            {"reward_model": record(0.4, None, 0.2), "custom": record(0.5, None, 1.0, attempts=2)},
            {"reward_model": record(None, "too long", 0.0)},
            {"reward_model": record(0.1, None, 0.6, attempts=3), "custom": record(None, "raised", 1.0, attempts=3)},
        ],
    )


def test_each_source_has_its_share_errors_retries_and_latency():
    m = reward_source_metrics(step())
    assert m["reward/reward_model/share"] == 0.75  # 3 of the step's 4 samples scored
    assert m["reward/reward_model/error_ratio"] == 0.25
    assert m["reward/reward_model/retries"] == 2.0
    assert m["reward/reward_model/latency_s"] == pytest.approx(0.25)
    assert m["reward/reward_model/latency_max_s"] == pytest.approx(0.6)
    assert m["reward/custom/share"] == 0.5  # worked on 3, scored 2
    assert m["reward/custom/error_ratio"] == pytest.approx(1 / 3)
    assert m["reward/custom/retries"] == 3.0
    assert [m[f"reward/status/{s}_ratio"] for s in ("ok", "zero", "masked", "dropped")] == [0.5, 0.25, 0.25, 0.0]


def test_the_reward_curve_leaves_out_what_the_loss_leaves_out():
    assert trained_reward_mean(step()) == pytest.approx(0.5)  # (1 + 0.5 + 0) / 3: the masked sample is not a score
    assert trained_reward_mean(step().drop_columns(["reward_status"])) == pytest.approx(0.375)
    assert reward_source_metrics(step().drop_columns(["reward_sources"])) == {}
