"""The control plane: what the driver, the VersionClock (pipeline/clock.py) and the Generate replicas say to each other.

The driver posts a message to the clock for some replicas (`VersionClock.post`); every replica reads the messages
in order (`next_message`), handles those addressed to it one at a time, and answers each with an acknowledgement;
the driver waits for the acknowledgements of the replicas that are still alive (`wait_acks`). Messages and
acknowledgements are small frozen dataclasses, one per kind, so a misspelt kind or a missing field fails where it is
written, and a failure is a type (`Failed`) rather than a key to look for.

Stages reach the clock only through `ClockLink`: the calls a replica makes (`ReplicaClock`) and those the gate makes
(`GateClock`). tests/unit/test_layout.py checks that every one of them exists on the VersionClock with the same
parameters, and that no stage finds the clock's actor any other way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

from stages.transports import GroupAddress, WeightMeta

# --- messages: driver -> replicas -----------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinGroup:
    """Push mode: join the trainer's weight-sync group. Each engine worker takes the rank `ranks[replica]` plus its
    tensor-parallel rank (pipeline/sync.py's group_ranks); a group formed again replaces the one before."""

    address: GroupAddress
    world_size: int
    ranks: dict[int, int]


@dataclass(frozen=True)
class PushWeights:
    """Push mode: pause the engine, receive the trainer's broadcast of `meta` as weight version `version`, resume."""

    version: int
    meta: WeightMeta


@dataclass(frozen=True)
class PullWeights:
    """Pull mode: `version` is in the parameter store at `url`. A replica loads the newest published version (it may
    be newer by then) at its next safe point, unless it holds it already."""

    version: int
    url: str


@dataclass(frozen=True)
class Validate:
    """A validation pass (pipeline/validate.py): `n` responses to each held-out row, sampled at `temperature` and
    `top_p`. The replicas it is posted to share the rows; unless `parallel`, a replica holds its new training requests
    until its share is done. `url`: the version's weight file, for the dedicated validation engine."""

    version: int
    rows: list[dict[str, Any]]
    n: int
    temperature: float
    top_p: float
    parallel: bool
    url: str = ""


Message = JoinGroup | PushWeights | PullWeights | Validate


@dataclass(frozen=True)
class Posted:
    """A message as the clock hands it to the replicas: its sequence number and the replicas it is for."""

    seq: int
    to: tuple[int, ...]
    message: Message


# --- acknowledgements: replica -> driver ------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """Handled, nothing to report: the group joined, or a pulled version already held."""

    replica: int


@dataclass(frozen=True)
class Loaded:
    """A weight version loaded: when, by how many engine workers (one per tensor-parallel rank), how long the engine
    stood still (pause, transfer, resume), and its busy time since the load before (stages.engine_busy's report)."""

    replica: int
    version: int
    loaded_at: float
    engine_ranks: int
    pause_s: float
    transfer_s: float
    resume_s: float
    busy: dict[str, float]

    @property
    def paused_s(self) -> float:
        return self.pause_s + self.transfer_s + self.resume_s


@dataclass(frozen=True)
class Validated:
    """A replica's share of a validation pass: one dict per sample."""

    replica: int
    samples: list[dict[str, Any]]


@dataclass(frozen=True)
class Failed:
    """The message could not be handled (`error` says why). After a failed push the replica stays paused, its weights
    half loaded, until the driver forms the group again and repeats the push; after a failed file load it goes on
    with the weights it had."""

    replica: int
    error: str


Ack = Done | Loaded | Validated | Failed


@dataclass(frozen=True)
class Registration:
    """What the clock tells a replica that (re)joins: its index, the last message before it joined (it reads from the
    next one on: earlier ones were for a process it may replace), and the newest weights, which it loads unless it
    holds them (`url` "" is the model directory)."""

    replica: int
    seq: int
    version: int
    url: str


# --- the clock as the stages see it -------------------------------------------------------------------------------


class ReplicaClock(Protocol):
    """The calls a Generate replica makes on the clock; `actor_id` and `node_id` say who the caller is."""

    actor_id: str
    node_id: str

    def reserve_replica(self, actor_id: str) -> int:
        """The replica index of the caller's actor, before its engine starts; the same after a restart."""

    def register_replica(self, actor_id: str, pid: int, node: str, engine_pids: list[int]) -> Registration:
        """The replica is up (raises once replicas have restarted more than the run allows)."""

    def replica_failed(self, replica: int, cause: str) -> None:
        """The replica is about to exit: the cause its restart is logged with."""

    def generating(self, replica: int, prompt_ids: list[str]) -> None:
        """The replica took these prompts (readmitted if it dies before `generated`); not waited for."""

    def generated(self, replica: int, prompt_ids: list[str]) -> None:
        """The replica handed these prompts' samples on; not waited for."""

    async def next_message(self, after_seq: int) -> Posted:
        """The first message after `after_seq`, once there is one."""

    def ack(self, seq: int, replica: int, ack: Ack) -> None:
        """Acknowledge message `seq`; not waited for."""

    async def newest_published(self) -> tuple[int, str]:
        """The newest weight version in the store and its file."""


class GateClock(Protocol):
    """The calls the StalenessGate makes on the clock."""

    def acquire(self, prompt_ids: list[str]) -> tuple[int, list[str]]:
        """Block until a permit is free; the version admitted at and the prompts admitted, in order."""

    def wait_closed(self) -> None:
        """Block until the trainer is done."""


class ClockLink:
    """The VersionClock's Ray actor, called by name from a stage's process: blocking calls for the stage's own thread,
    awaitables for an event loop, and calls whose answer nobody waits for sent without waiting."""

    def __init__(self, name: str, namespace: str) -> None:
        import ray

        self.actor = ray.get_actor(name, namespace=namespace)
        here = ray.get_runtime_context()
        self.actor_id, self.node_id = here.get_actor_id() or "", here.get_node_id()

    def reserve_replica(self, actor_id: str) -> int:
        return self._get(self.actor.reserve_replica.remote(actor_id))

    def register_replica(self, actor_id: str, pid: int, node: str, engine_pids: list[int]) -> Registration:
        return self._get(self.actor.register_replica.remote(actor_id, pid, node, engine_pids))

    def replica_failed(self, replica: int, cause: str) -> None:
        self._get(self.actor.replica_failed.remote(replica, cause), timeout=10)

    def generating(self, replica: int, prompt_ids: list[str]) -> None:
        self.actor.generating.remote(replica, prompt_ids)

    def generated(self, replica: int, prompt_ids: list[str]) -> None:
        self.actor.generated.remote(replica, prompt_ids)

    async def next_message(self, after_seq: int) -> Posted:
        return await asyncio.wrap_future(self.actor.next_message.remote(after_seq).future())

    def ack(self, seq: int, replica: int, ack: Ack) -> None:
        self.actor.ack.remote(seq, replica, ack)

    async def newest_published(self) -> tuple[int, str]:
        return await asyncio.wrap_future(self.actor.newest_published.remote().future())

    def acquire(self, prompt_ids: list[str]) -> tuple[int, list[str]]:
        return self._get(self.actor.acquire.remote(prompt_ids))

    def wait_closed(self) -> None:
        self._get(self.actor.wait_closed.remote())

    @staticmethod
    def _get(ref, timeout: float | None = None):
        import ray

        return ray.get(ref, timeout=timeout)
