"""The Generate replicas as the VersionClock supervises them: who they are, what each has in flight, every restart.

A replica is a Ray Data actor, which Ray restarts when it dies (its process, or its engine, which makes the
replica exit) and whose calls in flight Ray then retries on the restarted actor. The restarted replica registers
again under the same actor id: it keeps its replica index, loads the newest weights from the store, and regenerates
the prompts it had in flight, which the gate admitted once and never admits again. Whether a replica is alive is
read from Ray's restart count of its actor (`actor_restarts`): a process that registered at count c is alive while
the count is still c.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from stages import ray_internals


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
    """The replicas' membership, in-flight prompts and restarts (the clock's state)."""

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
        """The replica index of a replica that is up; a known one that registers again has restarted. Raises once
        the replicas have restarted `max_restarts` times."""
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

    def report(self) -> list[dict[str, Any]]:
        """Who the replicas are now, for processes.json."""
        return [
            {"replica": i, "pid": m.pid, "engine_pids": m.engine_pids, "node": m.node, "generation": m.generation}
            for i, m in sorted(self.members.items())
        ]


def actor_restarts(actor_id: str) -> int:
    """How many times Ray has restarted the actor (counted when it dies, before the new process exists), or -1 if
    it is dead for good. No id (a replica outside Ray, in unit tests): 0, always alive.

    Read from Ray's control store (stages.ray_internals.actor_state)."""
    if not actor_id:
        return 0
    info = ray_internals.actor_state(actor_id)
    return -1 if info is None or info["State"] == "DEAD" else int(info["NumRestarts"])
