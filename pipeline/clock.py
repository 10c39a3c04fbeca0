"""VersionClock: the one control actor of a run.

It holds the current weight version and verl's staleness counter, hands out admission permits to the
StalenessGate, relays control messages (process-group set-up, weight syncs) from the trainer to every Generate
replica, keeps the admission ledger the audit reads, and supervises the replicas (`Replicas`): which are members,
which prompts each has in flight, and every restart with its cause.

A replica is a Ray Data actor, which Ray restarts when it dies (its process, or its engine, which makes the
replica exit) and whose calls in flight Ray then retries on the restarted actor. The restarted replica registers
again under the same actor id: it keeps its replica index, loads the newest weights from the store, and regenerates
the prompts it had in flight, which the gate admitted once and never admits again. A message waits only for the
acknowledgements of the replicas it was posted to that are still alive: a dead replica never holds up a sync.

It is an asyncio actor: a gate waiting for permits is a suspended coroutine, so the clock keeps answering the
trainer and the engines meanwhile. It needs no CPU (num_cpus=0), which keeps it out of the 2-core deadlock where
every CPU is held by a waiting actor.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

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
        self.paused = False
        self.closed = False
        # prompt_id -> (admitted_version, admitted_time); a prior entry can never be admitted again
        self.ledger: dict[str, tuple[int, float]] = {pid: (v, t) for pid, v, t in prior}
        self.outstanding: dict[str, int] = {}  # admitted, not yet consumed: prompt_id -> admitted_version
        self.gate_blocked_s = 0.0
        self.newest: tuple[int, str] = (version, "")  # the newest weights in the store ("" for the model directory)
        self._changed = asyncio.Condition()
        self.replicas = Replicas(max_restarts)
        self._messages: list[dict[str, Any]] = []
        self._acks: dict[int, dict[int, dict[str, Any]]] = {}  # seq -> replica -> ack payload
        self._targets: dict[int, dict[int, int]] = {}  # seq -> replica -> its generation when the message was posted

    # --- admission (the gate) ---------------------------------------------------------------------------
    async def acquire(self, prompt_ids: list[str]) -> tuple[int, list[str]]:
        """Wait until at least one permit is free, admit as many of `prompt_ids` as permitted, in order."""
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
            self.admitted_in_version += len(admitted)
        self.gate_blocked_s += time.monotonic() - start
        return self.version, admitted

    def _permits(self) -> int:
        return self.budget.permits(self.admitted_in_version, self.carried_over)

    async def consumed(self, prompt_ids: list[str]) -> None:
        async with self._changed:
            for pid in prompt_ids:
                if self.outstanding.pop(pid, None) is None:
                    raise ValueError(f"prompt {pid} consumed but not outstanding (never admitted or consumed twice)")
            self._changed.notify_all()

    async def outstanding_at_or_before(self, version: int) -> int:
        return sum(1 for v in self.outstanding.values() if v <= version)

    # --- syncs ---------------------------------------------------------------------------------------------
    async def pause_admission(self) -> dict[int, int]:
        """Stop admitting until finish_sync; returns the live replicas (`members`), whom the sync goes to."""
        async with self._changed:
            self.paused = True
        return await self.members()

    async def finish_sync(self, new_version: int, snapshot: str | None = None) -> None:
        """Advance the version; the counter restarts at the prompts still outstanding (verl's rule). `snapshot`:
        the version's file in the store, which a restarted replica loads (push mode)."""
        async with self._changed:
            if snapshot is not None:
                self.newest = (new_version, snapshot)
            self.version = new_version
            self.carried_over = len(self.outstanding)
            self.admitted_in_version = 0
            self.paused = False
            self._changed.notify_all()

    async def publish(self, version: int, url: str) -> int:
        """Pull mode: `version` is in the store at `url`. Admission moves to it at once (verl's counter restarts
        as at a sync) and the replicas are told; returns the message's sequence number."""
        self.newest = (version, url)
        seq = await self.post({"kind": "load", "version": version, "url": url})
        await self.finish_sync(version)
        return seq

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
        self, actor_id: str = "", pid: int = 0, node: str = "", engine_pids: tuple[int, ...] = ()
    ) -> dict[str, Any]:
        """A replica is up: its index (the same after a restart), the message to start reading after, and the
        weights to load. Raises once the replicas have restarted more than `max_restarts` times."""
        async with self._changed:
            restarts = len(self.replicas.events)
            index = self.replicas.register(actor_id, pid, node)
            self.replicas.members[index].engine_pids = list(engine_pids)
            if len(self.replicas.events) > restarts:  # a restart: the version it is about to load
                self.replicas.events[-1]["loaded_version"] = self.newest[0]
            self._changed.notify_all()
            return {"replica": index, "seq": len(self._messages), "weights": self.newest}

    async def replica_failed(self, replica: int, cause: str) -> None:
        """A replica is about to exit (its engine died): the cause its restart is logged with."""
        self.replicas.causes[replica] = cause

    async def generating(self, replica: int, prompt_ids: list[str]) -> None:
        self.replicas.start(replica, prompt_ids)

    async def generated(self, replica: int, prompt_ids: list[str]) -> None:
        self.replicas.finish(replica, prompt_ids)

    async def members(self) -> dict[int, int]:
        """Live replicas: index -> generation (which changes at every restart)."""
        return {i: m.generation for i, m in self.replicas.live().items()}

    async def faults(self, after: int = 0) -> dict[str, Any]:
        """Restart counters, the restart events after the first `after`, and who the replicas are now."""
        members = [
            {"replica": i, "pid": m.pid, "engine_pids": m.engine_pids, "node": m.node, "generation": m.generation}
            for i, m in sorted(self.replicas.members.items())
        ]
        return {**self.replicas.counters(), "events": self.replicas.events[after:], "replicas": members}

    async def wait_replicas(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while len(self.replicas.members) < self.num_replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return len(self.replicas.members)

    async def post(self, message: dict[str, Any], to: list[int] | None = None) -> int:
        """Post a control message to the replicas `to` (default: every live one); returns its sequence number."""
        async with self._changed:
            seq = len(self._messages) + 1
            targets = sorted(self.replicas.live()) if to is None else to
            self._messages.append({**message, "seq": seq, "to": targets})
            self._acks[seq] = {}
            self._targets[seq] = {r: self.replicas.members[r].generation for r in targets}
            self._changed.notify_all()
        return seq

    async def next_message(self, after_seq: int) -> dict[str, Any]:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self._messages) > after_seq)
            return self._messages[after_seq]

    async def ack(self, seq: int, replica: int, payload: dict[str, Any]) -> None:
        async with self._changed:
            self._acks[seq][replica] = payload
            self._changed.notify_all()

    async def wait_acks(self, seq: int, timeout_s: float) -> list[dict[str, Any]]:
        """The acknowledgements of message `seq` once every target has acknowledged it or died."""
        deadline = time.monotonic() + timeout_s
        while (acks := await self.acks_if_complete(seq)) is None:
            if time.monotonic() > deadline:
                missing = sorted(set(self._targets[seq]) - set(self._acks[seq]))
                raise TimeoutError(f"replicas {missing} did not acknowledge message {seq} within {timeout_s:.0f}s")
            async with self._changed:
                try:  # woken by an ack; else, once a second, look for targets that died
                    await asyncio.wait_for(self._changed.wait(), 1.0)
                except TimeoutError:
                    pass
        return acks

    async def acks_if_complete(self, seq: int) -> list[dict[str, Any]] | None:
        """The acknowledgements of message `seq` if every target that is still alive has sent one, else None."""
        acks, targets = self._acks[seq], self._targets[seq]
        waiting = [r for r in targets if r not in acks and self.replicas.alive(r, targets[r])]
        return None if waiting else [acks[r] for r in sorted(acks)]

    async def close(self) -> None:
        """The trainer is done: release the end-of-stream marker held by the gate."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def wait_closed(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.closed)

    # --- reporting -------------------------------------------------------------------------------------------
    async def step_done(self, prompt_ids: list[str], faults_after: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The driver's one call after a step: `consumed(prompt_ids)`, then `stats()` and `faults(faults_after)`
        (a round trip to this actor costs milliseconds on a loaded machine, and a short step makes few others)."""
        await self.consumed(prompt_ids)
        return await self.stats(), await self.faults(faults_after)

    async def stats(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "admitted_total": len(self.ledger),
            "outstanding": len(self.outstanding),
            "admitted_in_version": self.admitted_in_version,
            "carried_over": self.carried_over,
            "gate_blocked_s": self.gate_blocked_s,
        }

    async def admissions(self, consumed_only: bool = False) -> list[tuple[str, int, float]]:
        """The ledger; with `consumed_only`, the data cursor of a checkpoint (everything not outstanding)."""
        return [(p, v, t) for p, (v, t) in self.ledger.items() if not (consumed_only and p in self.outstanding)]


@dataclass
class Member:
    actor_id: str
    pid: int
    node: str
    generation: int = 0  # restarts of this replica that registered
    ray_restarts: int = 0  # Ray's restart count of its actor when it registered: a higher count means it died
    engine_pids: list[int] = field(default_factory=list)  # the engine's processes (children of `pid`)


@dataclass
class Replicas:
    """The Generate replicas: who they are, what each has in flight, and their restarts (the clock's state)."""

    max_restarts: int = 0
    indices: dict[str, int] = field(default_factory=dict)  # actor id -> replica index
    members: dict[int, Member] = field(default_factory=dict)
    in_flight: dict[int, set[str]] = field(default_factory=dict)  # replica -> prompt ids it is generating
    causes: dict[int, str] = field(default_factory=dict)  # replica -> why it is about to exit, if it said
    events: list[dict[str, Any]] = field(default_factory=list)  # every restart, in order
    readmitted: int = 0

    def reserve(self, actor_id: str) -> int:
        if not actor_id or actor_id not in self.indices:
            self.indices[actor_id or f"anonymous-{len(self.indices)}"] = len(self.indices)
            return len(self.indices) - 1
        return self.indices[actor_id]

    def register(self, actor_id: str, pid: int, node: str) -> int:
        ray_restarts = actor_restarts(actor_id)
        index = self.indices[actor_id] if actor_id in self.indices else self.reserve(actor_id)
        if index not in self.members:
            self.members[index] = Member(actor_id, pid, node, 0, ray_restarts)
            self.in_flight[index] = set()
            return index
        if len(self.events) >= self.max_restarts:
            raise RuntimeError(
                f"Generate replica {index} died and the replicas have already been restarted {len(self.events)} "
                f"times (rollout.engine_max_restarts={self.max_restarts}); see the run's faults.jsonl for the causes"
            )
        lost = self.in_flight[index]
        old = self.members[index]
        self.members[index] = Member(actor_id, pid, node, old.generation + 1, ray_restarts)
        self.readmitted += len(lost)
        cause = self.causes.pop(index, f"its actor process (pid {old.pid}) died")
        self.events.append(
            {"replica": index, "time": time.time(), "cause": cause, "readmitted_prompts": len(lost), "pid": pid}
        )
        return index

    def start(self, replica: int, prompt_ids: list[str]) -> None:
        self.in_flight[replica].update(prompt_ids)

    def finish(self, replica: int, prompt_ids: list[str]) -> None:
        self.in_flight[replica].difference_update(prompt_ids)

    def alive(self, replica: int, generation: int | None = None) -> bool:
        """Registered, not restarted since `generation`, and its actor alive in Ray's control store."""
        member = self.members.get(replica)
        if member is None or (generation is not None and member.generation != generation):
            return False
        return actor_restarts(member.actor_id) == member.ray_restarts

    def live(self) -> dict[int, Member]:
        return {i: m for i, m in self.members.items() if actor_restarts(m.actor_id) == m.ray_restarts}

    def counters(self) -> dict[str, int]:
        return {"fault/engine_restarts": len(self.events), "fault/readmitted_prompts": self.readmitted}


def actor_restarts(actor_id: str) -> int:
    """How many times Ray has restarted the actor (counted when it dies, before the new process exists), or -1 if
    it is dead for good. A process that registered at count c is alive while the count is still c.

    Read from Ray's control store: the public state API needs the dashboard, which a run does not start. No id (a
    replica outside Ray, in unit tests): 0, always alive."""
    if not actor_id:
        return 0
    from ray._private import state

    info = state.actors(actor_id)
    return -1 if not info or info["State"] == "DEAD" else int(info["NumRestarts"])
