"""The audit's account of reward failures (pipeline/observe/reward_audit.py) on sample logs made by the reward step and
the advantage stage, and on logs broken on purpose."""

import pyarrow as pa

from pipeline.observe.reward_audit import reward_failures
from stages.advantage import GRPOAdvantage
from stages.reward_sources import RewardSources
from tests.unit.test_reward_sources import FakeRule, block, block2


def logged(on_error: str) -> pa.Table:
    return GRPOAdvantage(group_size=3)(RewardSources(FakeRule(), on_error=on_error)(block2()))


def test_every_policy_accounts_for_its_failures():
    for on_error, counts in [
        ("zero", "1 of 6 samples failed to score (5 ok, 1 zero)"),
        ("mask", "1 of 6 samples failed to score (1 masked, 5 ok)"),
        ("drop_group", "1 of 6 samples failed to score (3 dropped, 3 ok)"),
    ]:
        ok, detail = reward_failures(logged(on_error))
        assert ok, detail
        assert detail.startswith(counts), detail
    ok, detail = reward_failures(
        GRPOAdvantage(group_size=1)(RewardSources(FakeRule(), on_error="retry", backoff_s=0)(block([None])))
    )
    assert ok and detail.endswith("retries: 2 rule"), detail


def test_a_masked_sample_left_in_the_loss_fails_the_audit():
    table = logged("mask")
    i = table.schema.get_field_index("response_mask")
    table = table.set_column(i, table.field(i), pa.array([[1, 1, 1]] * 6, pa.list_(pa.int8())))
    ok, detail = reward_failures(table)
    assert not ok and "masked but still in the loss" in detail


def test_an_error_marked_ok_fails_the_audit():
    table = logged("mask")
    i = table.schema.get_field_index("reward_status")
    table = table.set_column(i, table.field(i), pa.array(["ok"] * 6))
    ok, detail = reward_failures(table)
    assert not ok and "an error but status ok" in detail


def test_a_group_dropped_in_part_fails_the_audit():
    table = logged("drop_group")
    i = table.schema.get_field_index("reward_status")
    table = table.set_column(i, table.field(i), pa.array(["dropped", "ok", "dropped", "ok", "ok", "ok"]))
    ok, detail = reward_failures(table)
    assert not ok
    assert reward_failures(table.drop_columns(["reward_status"])) is None


def test_the_audit_recomputes_reward_mean_as_the_trainer_logs_it():
    """reward/mean is over the loss's samples (pipeline/observe/reward_metrics.py): the audit's recomputation leaves
    masked and dropped samples out too, so a run with scorer failures passes, and a row that counts them fails."""
    from pipeline.observe.audit_derived import step_values
    from pipeline.observe.reward_metrics import trained_reward_mean

    for on_error in ("mask", "drop_group"):
        table = logged(on_error)
        rows = [r | {"num_tokens": 3, "finish_reason": "stop", "param_version": 0} for r in table.to_pylist()]
        want = step_values(rows, 0)["reward/mean"]
        assert want == trained_reward_mean(table)
        # a failed sample's reward does not enter it; counted in, it would move the mean
        failed = [r | {"reward": 100.0} if r["reward_status"] != "ok" else r for r in rows]
        assert step_values(failed, 0)["reward/mean"] == want
        counted = [r | {"reward_status": "ok"} for r in failed]
        assert step_values(counted, 0)["reward/mean"] > want + 10
