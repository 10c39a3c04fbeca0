"""The trainer's side of the weight sync, one implementation for every trainer backend.

A backend says what its weights are: `export_weights()`, the full HF-named tensors in the order the engines load
them (gathered one at a time from its shards, every rank taking part), and `weight_meta()`, their names, shapes and
dtypes. `SendsWeights` sends that stream: to every engine through the group transport `weight_sync.backend` chose
(push mode), or as one file to the parameter store (pull mode, and push mode's snapshots). The transports themselves
are stages/transports.

It is mixed into each backend's class because the driver calls these methods on the trainer's Ray actor, which
serves the methods of its class.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from stages.transports import GroupAddress, GroupSender, WeightMeta
from stages.transports.store import StoreSender

if TYPE_CHECKING:
    import torch


class SendsWeights:
    """The trainer actor's weight-sync calls (stages/trainer/backend.py). The backend's constructor sets `sender`
    (stages.transports.make_sender); `store` writes pull mode's files."""

    sender: GroupSender
    store = StoreSender()

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The backend's HF-named tensors, in `weight_meta()`'s order (computed without autograd)."""
        raise NotImplementedError

    def weight_meta(self) -> WeightMeta:
        """Names, shapes and dtypes of `export_weights()`, without moving any weight."""
        raise NotImplementedError

    def open_weight_sync(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        return self.sender.open(world_size, connect_timeout_s)

    def wait_weight_sync(self) -> None:
        self.sender.wait_open()

    def push_weights(self) -> dict[str, float]:
        start = time.monotonic()
        sent = self.sender.send(self.export_weights())
        return {"sync/bytes": float(sent), "sync/broadcast_s": time.monotonic() - start}

    def publish_weights(self, url: str) -> dict[str, float]:
        """Write the weights as one safetensors file at `url` (any fsspec URL) for the engines to load."""
        start = time.monotonic()
        sent = self.store.send(self.export_weights(), url)
        return {"sync/bytes": float(sent), "sync/publish_s": time.monotonic() - start}
