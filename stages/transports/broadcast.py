"""Broadcast from rank 0 over a private process group: gloo (CPU tensors; the only transport that runs without a
GPU) or nccl (CUDA tensors, trainer and engines on different GPUs; not run on a GPU in this project's tests).

The trainer is rank 0; every worker of every engine (one per tensor-parallel rank) is a member, receives each tensor
whole and hands it to its loader (vLLM's weight loaders cut a worker's shard from it). Small tensors go packed into
one buffer per broadcast (stages/transports/packing.py), each large one alone: only one large tensor or one buffer
(16 MiB at most) is in flight at a time, so neither side holds a second copy of the model.
"""

from __future__ import annotations

import gc
import threading
import traceback
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from stages.transports import OP_TIMEOUT, GroupAddress, WeightMeta, loader, named
from stages.transports.group import close_group, listen, open_group
from stages.transports.packing import layout, nbytes, pack, packed, size_of, unpack

if TYPE_CHECKING:
    from stages.transports import Target, Weights


class BroadcastSender:
    """Rank 0 of the group: opens it, then broadcasts every push."""

    def __init__(self, backend: str = "gloo", host: str = "127.0.0.1") -> None:
        self.backend, self.host = backend, host
        self.group = None
        self._opener: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        self.close()  # a group formed again (a replica was restarted) replaces the one before
        # Bind the rendezvous store's socket ourselves: TCPStore alone would listen on every interface.
        listener = listen(self.host)
        port = listener.getsockname()[1]
        timeout = timedelta(seconds=connect_timeout_s)

        def join() -> None:
            try:
                group = open_group(self.host, port, 0, world_size, self.backend, timeout, listener)
                group.set_timeout(OP_TIMEOUT)
                self.group = group
            except BaseException as err:  # noqa: BLE001 - re-raised in wait_open, on the caller's thread
                self._error = err

        self._opener, self._error = threading.Thread(target=join, daemon=True), None
        self._opener.start()
        return GroupAddress(self.host, port, self.backend, connect_timeout_s)

    def wait_open(self) -> None:
        if self._opener is None:
            raise RuntimeError("wait_open() before open(): there is no group to wait for")
        self._opener.join()
        if self._error is not None:
            raise RuntimeError(f"weight-sync group failed to form: {self._error}") from self._error

    def send(self, weights: Weights) -> int:
        device = torch.cuda.current_device() if self.backend == "nccl" else "cpu"
        on_device = (t.detach().to(device).contiguous() for _, t in named(weights))
        sent = 0
        try:
            for group in packed(on_device, nbytes):
                dist.broadcast(group[0] if len(group) == 1 else pack(group, device), group=self.group, group_src=0)
                sent += sum(nbytes(t) for t in group)
        except Exception as err:
            self.close_failed(err)
            raise
        return sent

    def close_failed(self, err: BaseException) -> None:
        """Close the group after a collective failed with `err`: the peers still receiving see the group end instead
        of waiting for its timeout. gloo closes its connections, which is what ends their receives, only when the
        group is freed, and the failed collective's frames in `err`'s traceback still hold it (longer still wherever
        the error is kept, as Ray keeps a failed task's, or sits in a reference cycle): those references go now,
        not at some later GC."""
        self.close()
        traceback.clear_frames(err.__traceback__)
        gc.collect()

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)


class BroadcastReceiver:
    """A member of the trainer's group at a rank after 0: receives each push in the order `WeightMeta` gives."""

    def __init__(self, backend: str = "gloo") -> None:
        self.backend = backend
        self.group = None

    def join(self, address: GroupAddress, rank: int, world_size: int) -> None:
        self.close()  # a group formed again after a replica restarted: the trainer has left the old one
        self.group = join_group(address, rank, world_size, self.backend)

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)

    def receive(self, meta: WeightMeta, target: Target) -> int:
        """Receive every tensor lazily, inside the stream `target` consumes (vLLM's reload copies each as it
        arrives); returns the number of tensors."""
        loader(target)(self._stream(meta))
        return len(meta.names)

    def _stream(self, meta: WeightMeta) -> Iterator[tuple[str, torch.Tensor]]:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        entries = [
            (n, list(s), getattr(torch, d)) for n, s, d in zip(meta.names, meta.shapes, meta.dtypes, strict=True)
        ]
        for group in packed(entries, lambda e: size_of(e[1], e[2])):
            if len(group) == 1:
                ((name, shape, dtype),) = group
                tensor = torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, group=self.group, group_src=0)
                yield name, tensor
                continue
            # A buffer of its own per broadcast: the loader may still hold views of the one before.
            _, total = layout([size_of(s, d) for _, s, d in group])
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            dist.broadcast(flat, group=self.group, group_src=0)
            tensors = unpack(flat, [s for _, s, _ in group], [d for _, _, d in group])
            yield from zip([n for n, _, _ in group], tensors, strict=True)


def join_group(address: GroupAddress, rank: int, world_size: int, backend: str):
    """Join the group at `address` as `rank`. A peer that died while joining makes this give up after the address's
    timeout; the driver then offers a new group."""
    timeout = timedelta(seconds=address.connect_timeout_s)
    group = open_group(address.host, address.port, rank, world_size, backend, timeout)
    group.set_timeout(OP_TIMEOUT)
    return group
