"""The control channel inside the VersionClock: messages posted for some replicas, read by every replica in order,
and the acknowledgements the driver waits for (stages/control.py holds the message and acknowledgement types).

A message waits only for the acknowledgements of the replicas it was posted to that are still alive, in the same
generation (not restarted since): a dead replica never holds up a sync, and a restarted one reads only the messages
posted after it registered.
"""

from __future__ import annotations

import asyncio
import time

from pipeline.replicas import Replicas
from stages.control import Ack, Message, Posted


class Channel:
    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        self.messages: list[Posted] = []
        self.acks: dict[int, dict[int, Ack]] = {}  # seq -> replica -> its acknowledgement
        self.targets: dict[int, dict[int, int]] = {}  # seq -> replica -> its generation when the message was posted
        self.changed = asyncio.Condition()

    @property
    def last_seq(self) -> int:
        return len(self.messages)

    async def post(self, message: Message, to: list[int] | None = None) -> int:
        """Post `message` to the replicas `to` (default: every live one); returns its sequence number."""
        async with self.changed:
            seq = len(self.messages) + 1
            targets = sorted(self.replicas.live()) if to is None else sorted(to)
            self.messages.append(Posted(seq, tuple(targets), message))
            self.acks[seq] = {}
            self.targets[seq] = {r: self.replicas.members[r].generation for r in targets}
            self.changed.notify_all()
        return seq

    async def next_message(self, after_seq: int) -> Posted:
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.messages) > after_seq)
            return self.messages[after_seq]

    async def ack(self, seq: int, replica: int, ack: Ack) -> None:
        async with self.changed:
            self.acks[seq][replica] = ack
            self.changed.notify_all()

    async def wait_acks(self, seq: int, timeout_s: float) -> list[Ack]:
        """The acknowledgements of message `seq` once every target has acknowledged it or died."""
        deadline = time.monotonic() + timeout_s
        while (acks := self.acks_if_complete(seq)) is None:
            if time.monotonic() > deadline:
                missing = sorted(set(self.targets[seq]) - set(self.acks[seq]))
                raise TimeoutError(f"replicas {missing} did not acknowledge message {seq} within {timeout_s:.0f}s")
            async with self.changed:
                try:  # woken by an ack; else, once a second, look for targets that died
                    await asyncio.wait_for(self.changed.wait(), 1.0)
                except TimeoutError:
                    pass
        return acks

    def acks_if_complete(self, seq: int) -> list[Ack] | None:
        """The acknowledgements of message `seq` if every target that is still alive has sent one, else None."""
        acks, targets = self.acks[seq], self.targets[seq]
        waiting = [r for r in targets if r not in acks and self.replicas.alive(r, targets[r])]
        return None if waiting else [acks[r] for r in sorted(acks)]
