"""VersionClock's admission counter follows verl: restart at the unconsumed prompts after each sync."""

import asyncio

import pytest

from pipeline.clock import VersionClock
from stages.control import Done, PushWeights
from stages.staleness import StalenessBudget
from stages.transports import WeightMeta


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    """Let every task this loop can run take its turn: a waiter still pending afterwards is blocked, not late (no
    other thread or process is involved, so there is nothing to wait for but the loop's own ready queue)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_admission_budget_and_reset_at_sync():
    async def scenario():
        clock = VersionClock(StalenessBudget(0.5, 1, 1, 4), num_replicas=1)  # B = 6 per version
        v, got = await clock.acquire([f"p{i}" for i in range(10)])
        assert (v, got) == (0, [f"p{i}" for i in range(6)])
        waiter = asyncio.create_task(clock.acquire(["p6", "p7"]))
        await settle()
        assert not waiter.done()  # budget spent: the gate blocks
        await clock.consumed(["p0", "p1", "p2", "p3"])
        await settle()
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
        await settle()
        assert not waiter.done()
        await clock.finish_sync(1)
        assert await asyncio.wait_for(waiter, 1) == (1, ["a"])

    run(scenario())


def test_step_done_consumes_and_reports_in_one_call():
    async def scenario():
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=1)
        await clock.acquire(["a", "b", "c"])
        stats, faults = await clock.step_done(["a", "b"], faults_after=0)
        assert stats["outstanding"] == 1 and stats["admitted_total"] == 3  # counted after the consumption
        assert faults["events"] == [] and faults["replicas"] == []
        assert await clock.pause_admission() == {}  # the live replicas the sync goes to: none registered here
        with pytest.raises(ValueError, match="consumed twice"):
            await clock.step_done(["a"], faults_after=0)

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


META = WeightMeta(("w",), ((2,),), ("float32",))


class FakeRay:
    """Ray's restart counts of the replicas' actors, as the clock reads them (-1: dead for good)."""

    def __init__(self, monkeypatch) -> None:
        self.restarts: dict[str, int] = {}
        monkeypatch.setattr("pipeline.replicas.actor_restarts", lambda actor_id: self.restarts.get(actor_id, 0))


def test_a_message_waits_only_for_replicas_that_are_alive(monkeypatch):
    ray_state = FakeRay(monkeypatch)

    async def scenario():
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=2)
        assert (await clock.register_replica("a")).replica == 0
        assert (await clock.register_replica("b")).replica == 1
        seq = await clock.post(PushWeights(1, META))
        await clock.ack(seq, 0, Done(0))
        assert await clock.acks_if_complete(seq) is None  # b is alive and has not answered
        ray_state.restarts["b"] = 1  # b died: Ray counts the restart before the new process exists
        assert await asyncio.wait_for(clock.wait_acks(seq, 30), 5) == [Done(0)]
        assert await clock.members() == {0: 0}
        later = await clock.post(PushWeights(2, META))
        posted = await clock.next_message(later - 1)
        assert posted.to == (0,) and posted.message == PushWeights(2, META)  # a dead replica is not a target

    run(scenario())


def test_a_restarted_replica_keeps_its_index_and_its_prompts_are_counted_once(monkeypatch):
    ray_state = FakeRay(monkeypatch)

    async def scenario():
        clock = VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=2, max_restarts=1)
        assert await clock.reserve_replica("a") == 0
        await clock.register_replica("a", pid=10)
        await clock.register_replica("b", pid=11)
        await clock.generating(0, ["p1", "p2"])
        await clock.generated(0, ["p1"])
        await clock.finish_sync(3, "/store/snapshot-000003.safetensors")
        ray_state.restarts["a"] = 1
        await clock.replica_failed(0, "its vLLM engine died (EngineDeadError)")
        assert await clock.reserve_replica("a") == 0  # the same actor, restarted: the same replica
        reg = await clock.register_replica("a", pid=12)
        assert (reg.replica, reg.version, reg.url) == (0, 3, "/store/snapshot-000003.safetensors")
        faults = await clock.faults()
        assert faults["fault/engine_restarts"] == 1 and faults["fault/readmitted_prompts"] == 1  # p2 only
        assert faults["events"][0]["cause"] == "its vLLM engine died (EngineDeadError)"
        assert await clock.members() == {0: 1, 1: 0}
        ray_state.restarts["b"] = 1  # a second restart is one too many (max_restarts=1)
        with pytest.raises(RuntimeError, match="rollout.engine_max_restarts=1"):
            await clock.register_replica("b", pid=13)

    run(scenario())


def test_prompts_generating_at_once_stay_within_verls_max_concurrent_samples(monkeypatch):
    FakeRay(monkeypatch)

    async def scenario():
        # B = 12 per version; max_concurrent_samples = min(2 replicas x 2, 12) = 4, and the one verl's rollouter holds
        clock = VersionClock(StalenessBudget(0.5, 1, 1, 8, concurrent_samples_per_replica=2, replicas=2), 2)
        await clock.register_replica("a")
        await clock.register_replica("b")
        assert (await clock.acquire([f"p{i}" for i in range(8)]))[1] == [f"p{i}" for i in range(5)]
        waiter = asyncio.create_task(clock.acquire(["p5", "p6", "p7"]))
        await settle()
        assert not waiter.done()  # the staleness budget has 7 permits left, the slots none
        await clock.generated(0, ["p0", "p1"])  # handed on: two places free
        assert (await asyncio.wait_for(waiter, 1))[1] == ["p5", "p6"]
        await clock.consumed(["p2"])  # trained before its replica's message arrived: its place frees too
        await clock.generated(1, ["p2", "p3"])  # the late message frees p3 alone
        assert (await clock.stats())["in_flight"] == 3  # p4, p5, p6
        assert (await clock.acquire(["p7", "p8", "p9"]))[1] == ["p7", "p8"]

    run(scenario())


def test_verls_max_concurrent_samples_is_capped_by_the_version_budget():
    assert StalenessBudget(0.5, 1, 1, 8, 16, 1).max_concurrent_samples == 12  # min(16, B = 12)
    assert StalenessBudget(0.5, 1, 1, 8, 2, 3).max_concurrent_samples == 6
    assert StalenessBudget(0.5, 1, 1, 8, 2, 3).concurrency_permits(5) == 2  # 6 + the held one - 5
    assert StalenessBudget(0.5, 1, 1, 8, 2, 3).concurrency_permits(9) == 0
