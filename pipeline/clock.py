"""VersionClock: the one control actor of a run.

It holds the current weight version and verl's staleness counter, hands out admission permits to the
StalenessGate, relays control messages (process-group set-up, weight syncs) from the trainer to every Generate
replica, and keeps the admission ledger the audit reads. It is an asyncio actor: a gate waiting for permits is a
suspended coroutine, so the clock keeps answering the trainer and the engines meanwhile. It needs no CPU
(num_cpus=0), which keeps it out of the 2-core deadlock where every CPU is held by a waiting actor.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from stages.staleness import StalenessBudget


class VersionClock:
    def __init__(
        self, budget: StalenessBudget, num_replicas: int, version: int = 0, prior: list[tuple[str, int, float]] = ()
    ) -> None:
        """`version` and `prior` (admissions of prompts consumed before a checkpoint) continue a resumed run."""
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
        self.newest: tuple[int, str] = (version, "")  # pull mode: the newest published version and its file
        self._changed = asyncio.Condition()
        self._replicas = 0
        self._messages: list[dict[str, Any]] = []
        self._acks: dict[int, dict[int, dict[str, Any]]] = {}  # seq -> replica -> ack payload

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
    async def pause_admission(self) -> None:
        async with self._changed:
            self.paused = True

    async def finish_sync(self, new_version: int) -> None:
        """Advance the version; the counter restarts at the prompts still outstanding (verl's rule)."""
        async with self._changed:
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
        return self.newest

    # --- control channel to the Generate replicas -------------------------------------------------------
    async def register_replica(self) -> int:
        self._replicas += 1
        return self._replicas - 1

    async def wait_replicas(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while self._replicas < self.num_replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return self._replicas

    async def post(self, message: dict[str, Any]) -> int:
        """Post a control message to every replica; returns its sequence number."""
        async with self._changed:
            seq = len(self._messages) + 1
            self._messages.append({**message, "seq": seq})
            self._acks[seq] = {}
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
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self._acks[seq]) >= self.num_replicas), timeout_s)
            return [self._acks[seq][r] for r in sorted(self._acks[seq])]

    async def acks_if_complete(self, seq: int) -> list[dict[str, Any]] | None:
        """Every replica's acknowledgement of message `seq` if all are in, else None (never waits)."""
        acks = self._acks[seq]
        return [acks[r] for r in sorted(acks)] if len(acks) >= self.num_replicas else None

    async def close(self) -> None:
        """The trainer is done: release the end-of-stream marker held by the gate."""
        async with self._changed:
            self.closed = True
            self._changed.notify_all()

    async def wait_closed(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.closed)

    # --- reporting -------------------------------------------------------------------------------------------
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
