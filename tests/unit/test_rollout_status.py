"""verl's per-step rollouter status (its get_statistics snapshot of a batch's first sample, verl 0.9.1's
FullyAsyncRollouter and assemble_batch_from_rollout_samples) and sample timings, worked by hand."""

import asyncio

import pyarrow as pa
import pytest

from pipeline.clock import VersionClock
from pipeline.observe.rollout_status import step_timings
from stages.staleness import StalenessBudget

F = "fully_async/"


def status(row: dict) -> tuple:
    keys = ("active_tasks_size", "queue/mq_queue_size")
    counts = ("total_generated_samples", "staleness_samples", "dropped_stale_samples")
    return tuple(row[F + "monitor/" + k] for k in keys) + tuple(row[F + "count/" + k] for k in counts)


def test_a_step_reports_the_clock_as_its_first_generated_prompt_saw_it():
    async def scenario():
        clock = VersionClock(StalenessBudget(0.5, 1, 1, 4), num_replicas=1)  # B = 6, 4 a step
        clock.replicas.in_flight[0] = set()  # replica 0, registered without Ray (`generated` reports it)
        await clock.acquire(list("abcdef"))
        await clock.generated(0, ["c", "d"])  # c with all 6 generating, nothing queued; then d
        await clock.generated(0, ["a"])
        await clock.generated(0, ["b"])
        stats, _ = await clock.step_done(list("abcd"), faults_after=0)
        row = stats["rollout_status"]
        assert status(row) == (6, 0, 0, 6, 0)  # c's, the first generated of the step
        assert row[F + "static/max_required_samples"] == row[F + "static/max_queue_size"] == 6
        assert row[F + "static/required_samples"] == 4 and row[F + "static/max_concurrent_samples"] == 6
        assert row[F + "static/staleness_threshold"] == 0.5

        await clock.filtered(["e"])  # generated, then left out by dynamic sampling: its permit refunded
        await clock.generated(0, ["f"])  # the 6th generated; nothing else waits for the trainer
        await clock.pause_admission()
        await clock.finish_sync(1)
        stats, _ = await clock.step_done(["f"], faults_after=0)
        assert status(stats["rollout_status"]) == (1, 0, 5, 5, 0)
        assert clock.status.snapshots == {}  # every generated prompt's snapshot went with its step or its filter

        await clock.acquire(list("gh"))
        stats, _ = await clock.step_done(["g"], faults_after=0)  # consumed before its replica's message came
        assert stats["rollout_status"] == {}  # no snapshot: nothing is made up

    asyncio.run(scenario())


def test_step_timings_leave_the_tool_calls_out_of_the_processing_time():
    table = pa.table({"gen_latency_s": [1.0, 2.5, 4.0, 5.0], "tool_latency_s": [0.0, 0.5, 1.0, 0.0]})
    got = step_timings(table)  # generating: 1, 2, 3, 5
    assert got[F + "processing_time/avg"] == pytest.approx(11 / 4)
    assert (got[F + "processing_time/min"], got[F + "processing_time/max"]) == (1.0, 5.0)
    assert got[F + "processing_time/tp50"] == pytest.approx(2.5)  # numpy's linear percentile, as verl's
    assert got[F + "processing_time/tp95"] == pytest.approx(3 + 0.85 * 2)
    assert got[F + "processing_time/tp99"] == pytest.approx(3 + 0.97 * 2)
    tools = [got[f"timing_s/agent_loop/tool_calls/{k}"] for k in ("max", "min", "mean")]
    assert tools == pytest.approx([1.0, 0.0, 0.375])
