"""The replica protocol (stages/replica.py), driven through the real VersionClock without Ray or vLLM: generation,
syncs in every pause mode with requests in flight, a validation pass, failed loads, joining the weight group. Every
test runs twice: on a hand-written token engine (`FakeEngine`, which follows vLLM's pause semantics) and on the
simulated engine (stages/engines/sim.py) that simulated runs use. What is asserted holds for any engine: no token is
lost or generated twice, each token carries the version that sampled it, and the acknowledgements say what happened.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pytest

from pipeline.clock import VersionClock
from stages.agents import Segment
from stages.control import Done, Failed, JoinGroup, Loaded, Posted, PushWeights, Registration, Validate, Validated
from stages.engine_busy import EngineBusy
from stages.engines.base import PauseMode, Sampling
from stages.engines.sim import SimEngine, SimSampler
from stages.replica import OUT_COLUMNS, AgentSampler, Replica
from stages.sim.workload import Workload
from stages.staleness import StalenessBudget
from stages.transports import GroupAddress, WeightMeta

LENGTH = 6  # tokens per response, for both engines
HOLD = 2  # the fake engine's requests stop after this many tokens until released
META = WeightMeta(("w",), ((2,),), ("float32",))
ENGINES = ("fake", "sim")


class LocalClock:
    """The real VersionClock on an event loop of its own thread, called as a replica calls it through ClockLink
    (stages.control.ReplicaClock) and as the driver does (`call`)."""

    actor_id, node_id = "replica-a", "node-1"

    def __init__(self, clock: VersionClock) -> None:
        self.clock = clock
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def call(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _await(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def reserve_replica(self, actor_id: str) -> int:
        return self.call(self.clock.reserve_replica(actor_id))

    def register_replica(self, actor_id: str, pid: int, node: str, engine_pids: list[int]) -> Registration:
        return self.call(self.clock.register_replica(actor_id, pid, node, engine_pids))

    def replica_failed(self, replica: int, cause: str) -> None:
        self.call(self.clock.replica_failed(replica, cause))

    def generating(self, replica: int, prompt_ids: list[str]) -> None:
        self.call(self.clock.generating(replica, prompt_ids))

    def generated(self, replica: int, prompt_ids: list[str]) -> None:
        self.call(self.clock.generated(replica, prompt_ids))

    async def next_message(self, after_seq: int) -> Posted:
        return await self._await(self.clock.next_message(after_seq))

    def ack(self, seq: int, replica: int, ack) -> None:
        self.call(self.clock.ack(seq, replica, ack))

    async def newest_published(self) -> tuple[int, str]:
        return await self._await(self.clock.newest_published())

    def post(self, message) -> list:
        """Post to every live replica and return the acknowledgements."""
        return self.call(self.clock.wait_acks(self.call(self.clock.post(message)), 30))


class FakeEngine:
    """A token engine in a few lines, with vLLM's pause semantics: a request emits one token at a time (ids 1..,
    logprob -0.5), each labelled with the version loaded when it was emitted, up to max_tokens (finish 'length').
    Until released, a request stops after HOLD tokens: the moment a test posts its sync. `wait` drains the requests
    in flight (new ones queue), `abort` ends them with 'abort', `keep` freezes them until `resume`."""

    name = "fake"

    def __init__(self) -> None:
        self.joined: list[tuple[GroupAddress, int, int]] = []

    async def start(self, version: int) -> None:
        self.version, self.busy = version, EngineBusy()
        self.state = asyncio.Condition()
        self.paused, self.mode, self.released = False, PauseMode.WAIT, False
        self.in_flight, self.at_hold = 0, 0

    async def generate(self, prompt: list[int], max_tokens: int, request_id: str, sampling: Sampling) -> Segment:
        tokens, versions, finish = [], [], "length"
        async with self.state:
            await self.state.wait_for(lambda: not self.paused)  # a request that arrives during a swap queues
            self.in_flight += 1
        self.busy.request_started()
        try:
            while len(tokens) < max_tokens:
                async with self.state:
                    await self.state.wait_for(lambda: self._aborting() or self._may_emit(len(tokens)))
                    if self._aborting():
                        finish = "abort"
                        break
                    tokens.append(len(tokens) + 1)
                    versions.append(self.version)
                    self.at_hold += len(tokens) == HOLD
                    self.state.notify_all()
                await asyncio.sleep(0)  # let the other requests and the control loop run
        finally:
            self.busy.request_finished()
            async with self.state:
                self.in_flight -= 1
                self.state.notify_all()
        return Segment(tokens, [-0.5] * len(tokens), versions, finish, None, versions[0] if versions else self.version)

    def _aborting(self) -> bool:
        return self.paused and self.mode == PauseMode.ABORT

    def _may_emit(self, emitted: int) -> bool:
        return (not self.paused or self.mode == PauseMode.WAIT) and (self.released or emitted < HOLD)

    async def pause(self, mode: PauseMode) -> None:
        async with self.state:
            self.paused, self.mode = True, mode
            self.state.notify_all()
            if mode != PauseMode.KEEP:  # abort: the aborted requests end at once
                await self.state.wait_for(lambda: self.in_flight == 0)
        self.busy.pause()

    async def load(self, weights, version: int) -> int:
        self.version = version
        return 1

    async def resume(self) -> None:
        async with self.state:
            self.paused = False
            self.state.notify_all()
        self.busy.resume()

    async def join(self, group: GroupAddress, rank: int, world_size: int) -> None:
        self.joined.append((group, rank, world_size))

    async def watch(self) -> str:
        await asyncio.Event().wait()
        return ""

    def died(self, err: BaseException) -> bool:
        return False

    def processes(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        pass

    # the test's handles
    async def wait_held(self, requests: int) -> None:
        async with self.state:
            await self.state.wait_for(lambda: self.at_hold >= requests)

    async def release(self) -> None:
        async with self.state:
            self.released = True
            self.state.notify_all()


class FailingLoads:
    """Either engine, whose next `failures` loads fail as a broken transfer does."""

    def __init__(self, engine) -> None:
        self.engine, self.failures = engine, 0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    async def load(self, weights, version: int) -> int:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("the transfer broke")
        return await self.engine.load(weights, version)


class Tokenizer:
    def __len__(self) -> int:
        return 100

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


@dataclass
class Setup:
    kind: str
    replica: Replica
    engine: FailingLoads
    clock: LocalClock

    def in_flight(self, requests: int) -> None:
        """Block until `requests` requests are generating (the fake's have stopped at their hold)."""
        inner = self.engine.engine
        if self.kind == "fake":
            self.replica.run(inner.wait_held(requests))
            return

        async def decoding() -> None:
            async with inner.state:
                await inner.state.wait_for(lambda: inner.decoding >= requests)

        self.replica.run(decoding())

    def release(self) -> None:
        if self.kind == "fake":
            self.replica.run(self.engine.engine.release())


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr("pipeline.replicas.actor_restarts", lambda actor_id: 0)  # no Ray: every replica is alive
    made: list[Setup] = []

    def make(kind: str, mode: PauseMode = PauseMode.WAIT) -> Setup:
        clock = LocalClock(VersionClock(StalenessBudget(1.0, 1, 1, 4), num_replicas=1))
        if kind == "fake":
            engine, sampler, tokenizer = (
                FailingLoads(FakeEngine()),
                AgentSampler("single_turn_agent", LENGTH),
                Tokenizer(),
            )
        else:  # a response decodes for about a second: long enough for a sync to land in it
            work = Workload(time_scale=0.2, length_mean=LENGTH, decode_s_per_token=1.0, slots=64)
            engine, tokenizer = FailingLoads(SimEngine(work, interruptible=mode != PauseMode.WAIT)), None
            sampler = SimSampler(engine, LENGTH)
        exits: list[int] = []
        replica = Replica(clock, lambda _: engine, sampler, 2, Sampling(), mode, 0, tokenizer, exit=exits.append)
        made.append(Setup(kind, replica, engine, clock))
        return made[-1]

    yield make
    for setup in made:
        for loop in (setup.replica.loop, setup.clock.loop):
            asyncio.run_coroutine_threadsafe(_cancel_all(), loop).result(timeout=30)
            loop.call_soon_threadsafe(loop.stop)


async def _cancel_all() -> None:
    """End every task of this loop but the caller: the replica's control loop and watchdog, the clock's waits."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def batch(prompt_ids: list[str], version: int = 0) -> pa.Table:
    n = len(prompt_ids)
    return pa.table(
        {
            "prompt_id": prompt_ids,
            "prompt_text": ["x"] * n,
            "prompt_ids": pa.array([[5, 6, 7]] * n, pa.list_(pa.int32())),
            "ground_truth": [""] * n,
            "data_source": ["d"] * n,
            "admitted_version": pa.array([version] * n, pa.int64()),
            "admitted_time": [time.time()] * n,
        }
    )


def whole(rows: list[dict]) -> None:
    """Every response has all its tokens once, each per-token column as long, versions never going down."""
    for row in rows:
        versions = row["token_param_version"]
        assert row["num_tokens"] == LENGTH == len(row["response_ids"]) == len(versions), row["sample_id"]
        assert len(row["response_logprobs"]) == len(row["response_mask"]) == LENGTH
        assert versions == sorted(versions), row["sample_id"]
        assert (row["param_version"], row["param_version_end"]) == (versions[0], versions[-1])


@pytest.mark.parametrize("kind", ENGINES)
def test_a_replica_registers_and_generates_each_prompts_group(make, kind):
    s = make(kind)
    s.release()
    out = asyncio.run(s.replica.generate(batch(["p0", "p1"])))
    assert out.column_names == OUT_COLUMNS
    rows = out.to_pylist()
    assert [r["sample_id"] for r in rows] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    whole(rows)
    assert all(set(r["token_param_version"]) == {0} and r["replica"] == 0 for r in rows)
    faults = s.clock.call(s.clock.clock.faults())
    assert faults["replicas"][0]["node"] == "node-1"
    assert s.clock.clock.replicas.in_flight[0] == set()  # generating, then generated: nothing to readmit


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("mode", list(PauseMode))
def test_a_sync_with_requests_in_flight_loses_no_token_and_labels_each(make, kind, mode):
    s = make(kind, mode)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(asyncio.run, s.replica.generate(batch(["p0", "p1"])))
        s.in_flight(4)  # 2 prompts x 2 responses
        if mode == PauseMode.WAIT:
            s.release()  # the sync waits for the requests in flight: they must be able to finish
        with ThreadPoolExecutor(1) as driver:
            acked = driver.submit(s.clock.post, PushWeights(1, META))
            (ack,) = acked.result(timeout=60)
        assert isinstance(ack, Loaded) and (ack.replica, ack.version, ack.engine_ranks) == (0, 1, 1)
        assert min(ack.pause_s, ack.transfer_s, ack.resume_s) >= 0 and set(ack.busy) == {"busy_s", "window_s"}
        s.release()
        rows = pending.result(timeout=60).to_pylist()
    whole(rows)
    if mode == PauseMode.WAIT:  # in flight at the sync: finished with the old weights
        assert all(set(r["token_param_version"]) == {0} for r in rows)
    else:  # interrupted: continued with the new weights
        assert all(r["token_param_version"][-1] == 1 for r in rows)
    if mode == PauseMode.ABORT:
        assert all(r["num_resumes"] >= 1 for r in rows)
    after = asyncio.run(s.replica.generate(batch(["p2"], version=1))).to_pylist()
    whole(after)
    assert all(set(r["token_param_version"]) == {1} for r in after)


@pytest.mark.parametrize("kind", ENGINES)
def test_a_validation_pass_generates_every_row_with_one_version_and_lets_training_go_on(make, kind):
    s = make(kind)
    s.release()
    rows = [{"prompt_id": f"v{i}", "prompt_ids": [5, 6], "ground_truth": "g", "data_source": "d"} for i in range(3)]
    (ack,) = s.clock.post(Validate(0, rows, n=2, temperature=0.0, top_p=1.0, parallel=False))
    assert isinstance(ack, Validated) and ack.replica == 0
    assert [x["sample_id"] for x in ack.samples] == [f"val-0/v{i}/{j}" for i in range(3) for j in range(2)]
    assert all(x["num_tokens"] == LENGTH and set(x["token_param_version"]) == {0} for x in ack.samples)
    assert s.replica.holding == 0  # the training requests it held may start
    whole(asyncio.run(s.replica.generate(batch(["p0"]))).to_pylist())


@pytest.mark.parametrize("kind", ENGINES)
def test_a_failed_load_is_acknowledged_as_failed_and_the_replica_goes_on(make, kind):
    s = make(kind, PauseMode.ABORT)
    s.release()
    s.engine.failures = 1  # a pulled file that cannot be loaded: the old weights stay, and so does generation
    seq, _ = s.clock.call(s.clock.clock.publish(1, "file:///store/version-000001.safetensors"))
    (ack,) = s.clock.call(s.clock.clock.wait_acks(seq, 30))
    assert isinstance(ack, Failed) and "the transfer broke" in ack.error
    assert s.replica.loaded == 0 and s.replica.running.is_set()
    assert {
        v for r in asyncio.run(s.replica.generate(batch(["p0"]))).to_pylist() for v in r["token_param_version"]
    } == {0}

    s.engine.failures = 1  # a broken push: paused, weights half loaded, until the driver repeats it
    (ack,) = s.clock.post(PushWeights(2, META))
    assert isinstance(ack, Failed) and s.replica.loaded == 0 and not s.replica.running.is_set()
    (ack,) = s.clock.post(PushWeights(2, META))
    assert isinstance(ack, Loaded) and ack.version == 2 and s.replica.running.is_set()
    rows = asyncio.run(s.replica.generate(batch(["p1"], version=2))).to_pylist()
    assert {v for r in rows for v in r["token_param_version"]} == {2}


@pytest.mark.parametrize("kind", ENGINES)
def test_joining_the_weight_group_takes_this_replicas_rank(make, kind):
    s = make(kind)
    address = GroupAddress("127.0.0.1", 1234, "gloo", 5.0)
    (ack,) = s.clock.post(JoinGroup(address, world_size=3, ranks={0: 2}))
    assert ack == Done(0)
    if kind == "fake":
        assert s.engine.engine.joined == [(address, 2, 3)]
