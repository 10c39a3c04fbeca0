"""verl's dynamic_resource/* metrics, worked by hand from verl 0.9.1's definitions (FullyAsyncRollouter's
_compute_rollout_resource_utilization, FullyAsyncTrainer's _record_train_resource_utilization and MetricsAggregator's
combination), and the clock's occupancy on a clock whose time the test sets."""

import asyncio
import types

import pytest

import pipeline.clock
from pipeline.clock import VersionClock
from pipeline.observe.utilization import ROLLOUT, Occupancy, ResourceUtilization
from stages.staleness import StalenessBudget

P = "dynamic_resource/"


def test_occupancy_is_the_time_weighted_share_of_the_bound_in_use():
    occ = Occupancy(capacity=4, now=0.0)
    occ.change(2, 1.0)  # 0 active over [0, 1)
    occ.change(6, 3.0)  # 2 over [1, 3)
    occ.change(1, 4.0)  # 6 over [3, 4): counts as 4, verl's min(1, A / S)
    assert occ.close(6.0) == pytest.approx((0 * 1 + 2 * 2 + 4 * 1 + 1 * 2) / (4 * 6))  # 1 over [4, 6)
    assert occ.close(8.0) == pytest.approx(1 / 4)  # the next window starts where the last ended, 1 active
    assert occ.close(8.0) == 0.0  # no time: verl's 0.0


def step(util, train_s, allocated_s, synced, rollout=None, wait_s=0.0):
    metrics = {"timing/train_s": train_s, "trainer/wait_s": wait_s}
    if rollout is not None:
        metrics[ROLLOUT] = rollout
    out = util.step(metrics, allocated_s, synced)
    assert ROLLOUT not in metrics  # logged only in the window's figures
    return out


def test_each_sync_logs_the_steps_aggregated_before_it_as_verl_does():
    util = ResourceUtilization(trainer_devices=2, rollout_devices=1)
    assert step(util, 1.0, 2.0, synced=False, wait_s=0.5) == {}
    # the sync step's own times count in the next window: this one is step 1 alone
    first = step(util, 1.0, 4.0, synced=True, rollout=0.5, wait_s=3.0)
    assert first == pytest.approx(
        {
            P + "train_compute_time_s": 1.0,
            P + "train_allocated_time_s": 2.0,
            P + "train_resource_utilization": 0.5,
            ROLLOUT: 0.5,
            P + "resource_utilization": (2 * 0.5 + 1 * 0.5) / 3,
            "fully_async/trainer/idle_ratio": 0.5 / 2.0,
        }
    )
    assert step(util, 2.0, 2.0, synced=False) == {}
    second = step(util, 0.5, 1.0, synced=True, rollout=1.0)  # steps 2 and 3: 3 s of 6
    assert second[P + "train_resource_utilization"] == pytest.approx(3 / 6)
    assert second["fully_async/trainer/idle_ratio"] == pytest.approx(3.0 / 6)  # steps 2 and 3 waited 3 s of 6
    assert second[P + "resource_utilization"] == pytest.approx((2 * 0.5 + 1 * 1.0) / 3)


def test_the_first_sync_of_a_run_syncing_every_step_logs_nothing():
    util = ResourceUtilization(1, 1)
    assert step(util, 1.0, 2.0, synced=True, rollout=0.3) == {}  # nothing aggregated yet, the rollout's dropped
    assert step(util, 1.0, 4.0, synced=True, rollout=0.7)[P + "resource_utilization"] == pytest.approx(0.6)


def test_the_clock_integrates_the_prompts_generating_between_two_syncs(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(pipeline.clock, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0]))

    async def scenario():
        # B = 8, verl's bound 2 (2 a replica, one replica): 3 admitted at once, the one more verl holds
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4, concurrent_samples_per_replica=2), num_replicas=1)
        now[0] = 1.0
        _, got = await clock.acquire(["a", "b", "c", "d"])
        assert got == ["a", "b", "c"]
        now[0] = 3.0
        await clock.consumed(["a", "b"])  # handed on (a replica's `generated` frees places the same way)
        now[0] = 5.0
        await clock.pause_admission()
        # [0, 1) none, [1, 3) 3 counted as the bound's 2, [3, 5) 1: of 2 over 5 s
        assert await clock.finish_sync(1) == pytest.approx((0 + 2 * 2 + 1 * 2) / (2 * 5))
        now[0] = 7.0
        await clock.filtered(["c"])
        now[0] = 8.0
        seq, rollout = await clock.publish(2, "file:///store/version-000002.safetensors")
        assert rollout == pytest.approx((1 * 2 + 0 * 1) / (2 * 3))

    asyncio.run(scenario())
