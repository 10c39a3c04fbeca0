"""VersionClock: the one control actor of a run.

It holds the current weight version and verl's staleness counter and hands out admission permits to the
StalenessGate (this file); it carries the control plane's messages from the driver to the Generate replicas and their
acknowledgements back (pipeline/channel.py, with stages/control.py's types); it keeps the admission ledger the audit
reads; and it supervises the replicas (pipeline/replicas.py): which are members, which prompts each has in flight,
and every restart with its cause. Stages call it through stages.control.ClockLink.

It is an asyncio actor: a gate waiting for permits is a suspended coroutine, so the clock keeps answering the
trainer and the engines meanwhile. It needs no CPU (num_cpus=0): a reserved CPU would be one fewer for the stages,
and on a small machine every CPU held by a waiting actor is a deadlock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pipeline.channel import Channel
from pipeline.observe.rollout_status import StatusLog
from pipeline.observe.utilization import ROLLOUT, Occupancy, RolloutIdle
from pipeline.replicas import Replicas
from stages.control import Ack, Message, Posted, PullWeights, Registration
from stages.staleness import StalenessBudget


class VersionClock:
    def __init__(
        self,
        budget: StalenessBudget,
        num_replicas: int,
        version: int = 0,
        prior: list[tuple[str, int, float]] = (),
        max_restarts: int = 0,
    ) -> None:
        """`version` and `prior` (admissions of prompts consumed before a checkpoint) continue a resumed run;
        `max_restarts`: how many replica restarts the run survives (rollout.engine_max_restarts)."""
        self.budget = budget
        self.num_replicas = num_replicas
        self.version = version
        self.admitted_in_version = 0  # verl's staleness_samples: admitted this version + carried over
        self.carried_over = 0
        self.filtered_in_version = 0  # prompts dynamic sampling filtered this version: each frees its permit
        self.filtered_total = 0
        self.paused = False
        self.closed = False
        self.source_done = False  # the gate admitted the whole source
        # prompt_id -> (admitted_version, admitted_time); a prior entry can never be admitted again
        self.ledger: dict[str, tuple[int, float]] = {pid: (v, t) for pid, v, t in prior}
        self.outstanding: dict[str, int] = {}  # admitted, not yet consumed: prompt_id -> admitted_version
        self.in_flight: set[str] = set()  # admitted, not yet handed on by a replica (verl's active tasks)
        self.occupancy = Occupancy(budget.max_concurrent_samples, time.monotonic())  # of in_flight, per version
        self.rollout_idle = RolloutIdle(time.monotonic())  # verl's rollouter idle ratio, per version
        self.status = StatusLog(budget)  # verl's rollouter counters as each prompt was generated
        self.gate_blocked_s = 0.0
        self.newest: tuple[int, str] = (version, "")  # the newest weights in the store ("" for the model directory)
        self._changed = asyncio.Condition()
        self.replicas = Replicas(max_restarts)
        self.channel = Channel(self.replicas)

    # --- admission (the gate) ---------------------------------------------------------------------------
    async def acquire(self, prompt_ids: list[str]) -> tuple[int, list[str]]:
        """Wait until at least one permit is free, admit as many of `prompt_ids` as permitted, in order: within the
        version's staleness budget and verl's bound on the prompts generating at once."""
        start = time.monotonic()
        async with self._changed:
            await self._changed.wait_for(lambda: not self.paused and self._permits() > 0)
            admitted = prompt_ids[: self._permits()]
            now = time.time()
            for pid in admitted:
                if pid in self.ledger:
                    raise ValueError(f"prompt {pid} was admitted twice; the source emitted a duplicate id")
                self.ledger[pid] = (self.version, now)
                self.outstanding[pid] = self.version
            self.in_flight.update(admitted)
            self.occupancy.change(len(self.in_flight), time.monotonic())
            self.admitted_in_version += len(admitted)
            self._watch_idle()
        self.gate_blocked_s += time.monotonic() - start
        return self.version, admitted

    def _permits(self) -> int:
        return min(self._staleness_permits(), self.budget.concurrency_permits(len(self.in_flight)))

    def _staleness_permits(self) -> int:
        return self.budget.permits(self.admitted_in_version - self.filtered_in_version, self.carried_over)

    def _watch_idle(self) -> None:
        """verl's rollouter is idle while nothing generates and the staleness budget admits nothing more: drained,
        it waits for the sync (its bound on the prompts generating at once is not such a wait)."""
        self.rollout_idle.update(not self.in_flight and self._staleness_permits() <= 0, time.monotonic())

    async def consumed(self, prompt_ids: list[str]) -> None:
        async with self._changed:
            for pid in prompt_ids:
                if self.outstanding.pop(pid, None) is None:
                    raise ValueError(f"prompt {pid} consumed but not outstanding (never admitted or consumed twice)")
            self._handed_on(prompt_ids)  # whichever message came first
            self.status.forget(prompt_ids)

    async def filtered(self, prompt_ids: list[str]) -> int:
        """Dynamic sampling left these prompts' groups out (stages/group_filter.py): they are done, like consumed ones,
        and each frees its permit at once, so the gate admits a prompt in its place. Outstanding prompts never exceed
        max_required_samples still (the permits count admissions less refunds, and consumption refunds nothing until
        the sync), which is what the lag bound rests on (stages/staleness.py). Returns the version it happened in."""
        async with self._changed:
            for pid in prompt_ids:
                if self.outstanding.pop(pid, None) is None:
                    raise ValueError(f"prompt {pid} filtered but not outstanding (never admitted, or done already)")
            self.filtered_in_version += len(prompt_ids)
            self.filtered_total += len(prompt_ids)
            self._handed_on(prompt_ids)  # after the refund: idle only if no permit is left with it
            self.status.forget(prompt_ids)
            return self.version

    async def outstanding_at_or_before(self, version: int) -> int:
        return sum(1 for v in self.outstanding.values() if v <= version)

    # --- syncs ---------------------------------------------------------------------------------------------
    async def pause_admission(self) -> dict[int, int]:
        """Stop admitting until finish_sync; returns the live replicas (`members`), whom the sync goes to."""
        async with self._changed:
            self.paused = True
        return await self.members()

    async def finish_sync(self, new_version: int, snapshot: str | None = None) -> dict[str, float]:
        """Advance the version; the counter restarts at the prompts still outstanding (verl's rule). `snapshot`:
        the version's file in the store, which a restarted replica loads (push mode). Returns the version window's
        rollout utilization and verl's rollouter idle metrics (pipeline/observe/utilization.py)."""
        async with self._changed:
            if snapshot is not None:
                self.newest = (new_version, snapshot)
            self.version = new_version
            self.carried_over = len(self.outstanding)
            self.admitted_in_version = self.filtered_in_version = 0
            self.paused = False
            self._changed.notify_all()
            now = time.monotonic()
            window = {ROLLOUT: self.occupancy.close(now), **self.rollout_idle.close(now)}
            self._watch_idle()  # a budget spent by the carried-over prompts alone is idle from the start
            return window

    async def publish(self, version: int, url: str) -> tuple[int, dict[str, float]]:
        """Pull mode: `version` is in the store at `url`. Admission moves to it at once (verl's counter restarts
        as at a sync) and the replicas are told; returns the message's sequence number and finish_sync's figure."""
        self.newest = (version, url)
        seq = await self.post(PullWeights(version, url))
        return seq, await self.finish_sync(version)

    async def newest_published(self) -> tuple[int, str]:
        """The newest version in the store and its file ("" for the model directory): what a pull loads, and
        what a restarted replica loads (register_replica hands it out too)."""
        return self.newest

    # --- control channel to the Generate replicas -------------------------------------------------------
    async def reserve_replica(self, actor_id: str = "") -> int:
        """The replica index of the actor `actor_id`, before its engine starts (it seeds the engine); the same
        index for the same actor after a restart."""
        return self.replicas.reserve(actor_id)

    async def register_replica(
        self, actor_id: str = "", pid: int = 0, node: str = "", engine_pids: list[int] = ()
    ) -> Registration:
        """A replica is up: its index (the same after a restart), the message to start reading after, and the
        weights to load. Raises once the replicas have restarted more than `max_restarts` times. Nothing here awaits:
        the registration and the channel's last message are read in one step of the actor's loop."""
        restarts = len(self.replicas.events)
        index = self.replicas.register(actor_id, pid, node)
        self.replicas.members[index].engine_pids = list(engine_pids)
        if len(self.replicas.events) > restarts:  # a restart: the version it is about to load
            self.replicas.events[-1]["loaded_version"] = self.newest[0]
        return Registration(index, self.channel.last_seq, *self.newest)

    async def replica_failed(self, replica: int, cause: str) -> None:
        """A replica is about to exit (its engine died): the cause its restart is logged with."""
        self.replicas.causes[replica] = cause

    async def generating(self, replica: int, prompt_ids: list[str]) -> None:
        self.replicas.start(replica, prompt_ids)

    async def generated(self, replica: int, prompt_ids: list[str]) -> None:
        """The replica handed these prompts' samples on: their places among the prompts generating at once free."""
        self.replicas.finish(replica, prompt_ids)
        async with self._changed:
            self._handed_on(prompt_ids)

    def _handed_on(self, prompt_ids: list[str]) -> None:
        """These prompts no longer generate: their places free (the caller holds the condition)."""
        done = [pid for pid in prompt_ids if pid in self.in_flight]
        queued = max(0, len(self.outstanding) - len(self.in_flight))  # generated, not yet consumed
        staleness = self.admitted_in_version - self.filtered_in_version + self.carried_over
        for i, pid in enumerate(done):  # one after the other, as verl's rollouter sees its tasks end
            self.status.handed_on(pid, len(self.in_flight) - i, queued + i, staleness)
        self.rollout_idle.generated += len(done)
        self.in_flight.difference_update(prompt_ids)
        self.occupancy.change(len(self.in_flight), time.monotonic())
        self._watch_idle()
        self._changed.notify_all()

    async def members(self) -> dict[int, int]:
        """Live replicas: index -> generation (which changes at every restart)."""
        return {i: m.generation for i, m in self.replicas.live().items()}

    async def faults(self, after: int = 0) -> dict[str, Any]:
        """Restart counters, the restart events after the first `after`, and who the replicas are now."""
        return {**self.replicas.counters(), "events": self.replicas.events[after:], "replicas": self.replicas.report()}

    async def wait_replicas(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while len(self.replicas.members) < self.num_replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return len(self.replicas.members)

    async def post(self, message: Message, to: list[int] | None = None) -> int:
        """Post a control message to the replicas `to` (default: every live one); returns its sequence number."""
        return await self.channel.post(message, to)

    async def next_message(self, after_seq: int) -> Posted:
        return await self.channel.next_message(after_seq)

    async def ack(self, seq: int, replica: int, ack: Ack) -> None:
        await self.channel.ack(seq, replica, ack)

    async def wait_acks(self, seq: int, timeout_s: float) -> list[Ack]:
        """The acknowledgements of message `seq` once every target has acknowledged it or died."""
        return await self.channel.wait_acks(seq, timeout_s)

    async def acks_if_complete(self, seq: int) -> list[Ack] | None:
        """The acknowledgements of message `seq` if every target that is still alive has sent one, else None."""
        return self.channel.acks_if_complete(seq)

    async def close(self) -> None:
        """The trainer is done: release the end-of-stream marker held by the gate."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def wait_closed(self) -> None:
        """The gate's last call, once it admitted every prompt of the source: nothing more will be admitted (what
        dynamic sampling's sink needs to know that no group is left to come), and the end-of-stream marker stays
        in the gate until the trainer is done."""
        async with self._changed:
            self.source_done = True
            await self._changed.wait_for(lambda: self.closed)

    # --- reporting -------------------------------------------------------------------------------------------
    async def step_done(self, prompt_ids: list[str], faults_after: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The driver's one call after a step: `consumed(prompt_ids)`, then `stats()` with verl's rollout status of
        the step (pipeline/observe/rollout_status.py) and `faults(faults_after)` (a round trip to this actor costs
        milliseconds on a loaded machine, and a short step makes few others)."""
        status = self.status.first_of(prompt_ids)
        await self.consumed(prompt_ids)
        return {**await self.stats(), "rollout_status": status}, await self.faults(faults_after)

    async def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "admitted_total": len(self.ledger),
            "outstanding": len(self.outstanding),
            "in_flight": len(self.in_flight),
            "admitted_in_version": self.admitted_in_version,
            "carried_over": self.carried_over,
            "filtered_total": self.filtered_total,
            "source_done": self.source_done,
            "gate_blocked_s": self.gate_blocked_s,
        }

    async def admissions(self, consumed_only: bool = False) -> list[tuple[str, int, float]]:
        """The ledger; with `consumed_only`, the data cursor of a checkpoint (everything not outstanding)."""
        return [(p, v, t) for p, (v, t) in self.ledger.items() if not (consumed_only and p in self.outstanding)]
