"""CUDA IPC for a trainer and an engine on one GPU, where NCCL cannot place two ranks. The pair runs on its own, with
torch alone (a {name: tensor} dict in, a model or `load_weights` callable out): tests/gpu/test_transports_gpu.py
drives it between two processes on one GPU (it passed on an H100 before tensors went in buckets; the bucketed exchange
passed bench/gpu_check's transport row there). Inside vLLM's workers it has not run on a GPU.

The group is gloo and carries only handles and acknowledgements: for each bucket of tensors (up to IPC_BUCKET_BYTES)
the sender broadcasts picklable CUDA IPC handles of its own memory (`reduce_tensor`), every receiver maps that memory
(`rebuild_cuda_tensor`), copies it, waits for the copies and lets go, and an all-reduce tells the sender that every
receiver is done with the bucket, so no receiver reads memory the trainer has already reused.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from stages.transports import GroupAddress, WeightMeta, loader, named
from stages.transports.broadcast import BroadcastSender, join_group
from stages.transports.group import close_group
from stages.transports.packing import nbytes

if TYPE_CHECKING:
    from stages.transports import Target, Weights

# The sender shares the handles of up to this many bytes of tensors per round trip (it holds them meanwhile): one
# round trip per tensor is far slower on a model of many tensors (docs/benchmarks.md, the GPU check).
IPC_BUCKET_BYTES = 256 << 20
T = TypeVar("T")


class IpcSender:
    """Rank 0: a gloo group for the handles (BroadcastSender's), CUDA memory shared through them."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.control = BroadcastSender("gloo", host)  # carries handles and acknowledgements, not weights

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        address = self.control.open(world_size, connect_timeout_s)
        return GroupAddress(address.host, address.port, "ipc", connect_timeout_s)  # receivers join with gloo

    def wait_open(self) -> None:
        self.control.wait_open()

    def send(self, weights: Weights) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        sent = 0
        on_device = (t.detach().to(torch.cuda.current_device()).contiguous() for _, t in named(weights))
        try:
            for bucket in buckets(on_device, nbytes, IPC_BUCKET_BYTES):
                # picklable handles: the engine maps the same memory; the bucket's tensors live until acknowledged
                broadcast_object([reduce_tensor(t)[1] for t in bucket], self.control.group)
                dist.all_reduce(torch.zeros(1), group=self.control.group)  # every engine copied them
                sent += sum(nbytes(t) for t in bucket)
        except Exception as err:
            self.control.close_failed(err)
            raise
        return sent

    def close(self) -> None:
        self.control.close()


class IpcReceiver:
    """A receiver on the trainer's GPU: maps each tensor by its handle, copies it, acknowledges."""

    def __init__(self) -> None:
        self.group = None

    def join(self, address: GroupAddress, rank: int, world_size: int) -> None:
        self.close()
        self.group = join_group(address, rank, world_size, "gloo")

    def close(self) -> None:
        if self.group is not None:
            group, self.group = self.group, None
            close_group(group)

    def receive(self, meta: WeightMeta, target: Target) -> int:
        loader(target)(self._stream(meta))
        return len(meta.names)

    def _stream(self, meta: WeightMeta) -> Iterator[tuple[str, torch.Tensor]]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        received = 0
        while received < len(meta.names):
            handles = broadcast_object(None, self.group)
            copies = [rebuild_cuda_tensor(*args).clone() for args in handles]  # the loader may hold them past the ack
            torch.cuda.current_stream().synchronize()  # the copies are done before the trainer may change the source
            dist.all_reduce(torch.zeros(1), group=self.group)
            start, received = received, received + len(copies)
            yield from zip(meta.names[start:received], copies, strict=True)


def buckets(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """`items` in order, in runs of at most `limit` bytes (an item larger than that alone)."""
    bucket: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if bucket and total + n > limit:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += n
    if bucket:
        yield bucket


def broadcast_object(obj: object, group) -> object:
    """Rank 0's `obj` on every rank of a stateless group, as pickled bytes in two tensor broadcasts (the object
    collectives of torch.distributed expect a group registered with its default world)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if obj is not None else None
    size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=0)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, group=group, group_src=0)
    return pickle.loads(payload.numpy().tobytes())
