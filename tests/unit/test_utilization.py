"""verl's dynamic_resource/* metrics, worked by hand from verl 0.9.1's definitions (FullyAsyncRollouter's
_compute_rollout_resource_utilization, FullyAsyncTrainer's _record_train_resource_utilization and MetricsAggregator's
combination), verl's rollouter idle ratio (FullyAsyncRollouter's reset_staleness and _processor_worker), and the
clock's figures on a clock whose time the test sets."""

import asyncio
import types

import pytest

import pipeline.clock
from pipeline.clock import VersionClock
from pipeline.observe.utilization import ROLLOUT, ROLLOUTER, Occupancy, ResourceUtilization, RolloutIdle
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
        assert (await clock.finish_sync(1))[ROLLOUT] == pytest.approx((0 + 2 * 2 + 1 * 2) / (2 * 5))
        now[0] = 7.0
        await clock.filtered(["c"])
        now[0] = 8.0
        seq, window = await clock.publish(2, "file:///store/version-000002.safetensors")
        assert window[ROLLOUT] == pytest.approx((1 * 2 + 0 * 1) / (2 * 3))

    asyncio.run(scenario())


def idle(window: dict) -> tuple[float, float, float, float]:
    names = ("active_time", "version_time", "idle_ratio", "step_generated_samples")
    return tuple(window[ROLLOUTER + n] for n in names)


def test_the_rollouter_is_active_until_the_last_time_it_went_idle_in_the_window():
    watch = RolloutIdle(now=10.0)
    watch.update(False, 11.0)
    watch.update(True, 14.0)  # idle at 14, busy again at 15 (a refund), idle again from 17
    watch.update(False, 15.0)
    watch.update(True, 17.0)
    watch.update(True, 18.0)  # still the stretch from 17
    watch.generated = 5
    assert idle(watch.close(20.0)) == pytest.approx((7.0, 10.0, 0.3, 5.0))  # verl: 1 - (17 - 10) / (20 - 10)
    assert idle(watch.close(24.0)) == pytest.approx((4.0, 4.0, 0.0, 0.0))  # never idle: active the whole window
    watch.update(True, 24.0)  # idle from the window's start (verl's processor notices it a moment after it)
    assert idle(watch.close(26.0)) == pytest.approx((0.0, 2.0, 1.0, 0.0))
    assert idle(watch.close(26.0))[1:3] == (1e-6, 0.0)  # an empty window: verl's floor of 1e-6 s


def test_the_clock_is_idle_once_nothing_generates_and_the_staleness_budget_is_spent(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(pipeline.clock, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=lambda: now[0]))

    async def scenario():
        clock = VersionClock(StalenessBudget(0.5, 1, 1, 4), num_replicas=1)  # B = 6 a version, verl's bound 6
        clock.replicas.in_flight[0] = set()  # replica 0, registered without Ray (`generated` reports it)

        async def at(t, call, *args):
            now[0] = t
            return await call(*args)

        await at(1.0, clock.acquire, list("abcdef"))  # the budget spent, 6 generating
        await at(2.0, clock.generated, 0, list("abcd"))
        await at(4.0, clock.generated, 0, list("ef"))  # drained: idle from 4
        await at(5.0, clock.consumed, list("abcdef"))
        await at(5.5, clock.pause_admission)
        assert idle(await at(6.0, clock.finish_sync, 1)) == pytest.approx((4.0, 6.0, 1 / 3, 6.0))

        await at(7.0, clock.acquire, list("ghijkl"))
        await at(8.0, clock.consumed, list("ghijk"))  # handed on by the consumption, as by `generated`
        await at(8.5, clock.filtered, ["l"])  # drained, but the filtered prompt's permit is refunded: not idle
        await at(9.0, clock.acquire, ["m", "n"])  # the refunded permit: m only
        await at(10.0, clock.consumed, ["m"])  # idle from 10
        _, window = await at(12.0, clock.publish, 2, "file:///store/version-000002.safetensors")
        assert idle(window) == pytest.approx((4.0, 6.0, 1 / 3, 7.0))

        await at(13.0, clock.acquire, list("nopqrs"))  # still generating at the sync: 6 carried over, no permit
        await at(14.0, clock.pause_admission)
        assert idle(await at(16.0, clock.finish_sync, 3)) == pytest.approx((4.0, 4.0, 0.0, 0.0))
        await at(17.0, clock.generated, 0, list("nopqrs"))  # generated, not yet consumed: idle from 17
        await at(18.0, clock.pause_admission)
        assert idle(await at(20.0, clock.finish_sync, 4)) == pytest.approx((1.0, 4.0, 0.75, 6.0))
        # The 6 outstanding carry over again and spend the budget with nothing generating: idle from the start.
        assert idle(await at(22.0, clock.finish_sync, 5)) == pytest.approx((0.0, 2.0, 1.0, 0.0))
        await at(23.0, clock.consumed, list("nopqrs"))

    asyncio.run(scenario())
