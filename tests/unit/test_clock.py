"""VersionClock's admission counter follows verl: restart at the unconsumed prompts after each sync."""

import asyncio

import pytest

from pipeline.clock import VersionClock
from stages.staleness import StalenessBudget


def run(coro):
    return asyncio.run(coro)


def test_admission_budget_and_reset_at_sync():
    async def scenario():
        clock = VersionClock(StalenessBudget(0.5, 1, 1, 4), num_replicas=1)  # B = 6 per version
        v, got = await clock.acquire([f"p{i}" for i in range(10)])
        assert (v, got) == (0, [f"p{i}" for i in range(6)])
        waiter = asyncio.create_task(clock.acquire(["p6", "p7"]))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # budget spent: the gate blocks
        await clock.consumed(["p0", "p1", "p2", "p3"])
        await asyncio.sleep(0.05)
        assert not waiter.done()  # consumption alone does not refill verl's counter
        await clock.pause_admission()
        await clock.finish_sync(1)  # 2 outstanding carry over: 6 - 2 = 4 permits
        v, got = await asyncio.wait_for(waiter, 1)
        assert (v, got) == (1, ["p6", "p7"])
        stats = await clock.stats()
        assert stats["carried_over"] == 2 and stats["admitted_in_version"] == 2
        v, got = await clock.acquire(["p8", "p9", "p10"])
        assert got == ["p8", "p9"]
        assert await clock.outstanding_at_or_before(0) == 2

    run(scenario())


def test_paused_clock_admits_nothing_until_the_sync_finishes():
    async def scenario():
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=1)
        await clock.pause_admission()
        waiter = asyncio.create_task(clock.acquire(["a"]))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await clock.finish_sync(1)
        assert await asyncio.wait_for(waiter, 1) == (1, ["a"])

    run(scenario())


def test_double_admission_and_double_consumption_are_errors():
    async def scenario():
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=1)
        await clock.acquire(["a"])
        with pytest.raises(ValueError, match="admitted twice"):
            await clock.acquire(["a"])
        await clock.consumed(["a"])
        with pytest.raises(ValueError, match="consumed twice"):
            await clock.consumed(["a"])

    run(scenario())
