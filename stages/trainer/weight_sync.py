"""The trainer side of the weight sync: one private process group, trainer at rank 0, engines after it.

`WeightSync` is the swap point between transports, chosen by `weight_sync.backend`:

- `gloo` (BroadcastWeightSync): CPU tensors broadcast over gloo; the only one that runs without a GPU.
- `nccl` (BroadcastWeightSync): the same broadcast with CUDA tensors over NCCL, trainer and engines on different
  GPUs.
- `ipc` (IpcWeightSync): trainer and engine share one GPU, where NCCL cannot place two ranks. The group is gloo
  and carries only CUDA IPC handles, a bucket of them at a time; the engine maps each tensor, copies it and
  acknowledges the bucket before the trainer lets go of it.

Every group is stateless (`stateless_group`): it never touches the global torch.distributed state a Megatron
trainer owns. A gloo group (gloo, and ipc's control group) is built here from torch alone, so the trainer's side and a
receiver need no vLLM (bench/gpu_check runs both on a machine without it); an NCCL group comes from vLLM's stateless
init. Tensors go in the order of `meta()`, and the engines receive them in that same order
(stages/vllm_worker.py). A broadcast costs a round trip whatever its size, so the broadcast transports send small
tensors (norms, biases, a small model's everything) packed into one flat buffer (`packed`, cut the same way on both
sides from the tensors' sizes), and each large one alone, as it is, with no extra copy. The nccl and ipc paths
are written for GPUs and unverified on this project's CPU machines; without CUDA they are refused with a clear
error.
"""

from __future__ import annotations

import gc
import math
import socket
import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Protocol, TypeVar

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl", "ipc")
# How long one collective may wait for a peer, once the group is formed: a receiver joins a push only after its
# engine drained or aborted its requests. Forming the group has its own, short timeout (`connect_timeout_s`).
OP_TIMEOUT = timedelta(seconds=600)
# Tensors under PACK_BELOW bytes travel packed, up to PACK_BYTES per broadcast, each at an offset of a multiple of
# ALIGN (every dtype's element size divides it, so a slice of the buffer is viewed as the tensor in place). A
# 27-tensor model of 1.9 MB (the embedded job's): one broadcast instead of 27.
PACK_BELOW, PACK_BYTES, ALIGN = 1 << 20, 16 << 20, 64
# CUDA IPC sends the handles of up to this many bytes of tensors per round trip (the trainer holds them meanwhile).
IPC_BUCKET_BYTES = 256 << 20
T = TypeVar("T")


def packed(items: Iterable[T], nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """`items` in order, as the groups one broadcast carries each: a run of small items (under PACK_BELOW bytes)
    together while their aligned layout fits PACK_BYTES, every larger item alone. The sender groups its tensors
    and the engines their tensors' (shape, dtype) with this one function, so both cut the stream alike."""
    group: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if group and (n >= PACK_BELOW or aligned(size) + n > PACK_BYTES):
            yield group
            group, size = [], 0
        if n >= PACK_BELOW:
            yield [item]
            continue
        group.append(item)
        size = aligned(size) + n
    if group:
        yield group


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each packed tensor's offset in the buffer, and the buffer's size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(aligned(end))
        end = offsets[-1] + n
    return offsets, end


class WeightSync(Protocol):
    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> dict:
        """Start rank 0's half of the rendezvous; returns what the engines need to join (host, port, backend, the
        rendezvous timeout)."""

    def wait_open(self) -> None:
        """Block until every engine has joined; raise if one has not within the rendezvous timeout."""

    def push(self, tensors: Iterable[torch.Tensor]) -> int:
        """Send tensors to every engine; returns the bytes sent. If it fails (an engine died during it), the group
        is closed, which ends the other engines' receives at once, and the next `open` forms a new one."""


class BroadcastWeightSync:
    """gloo (CPU tensors) or nccl (CUDA tensors; unverified here) broadcast from rank 0."""

    def __init__(self, backend: str = "gloo", host: str = "127.0.0.1") -> None:
        self.backend, self.host = backend, host
        self.group = None
        self._opener: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> dict:
        self.close()  # a group formed again (a replica was restarted) replaces the one before
        # Bind the rendezvous store's socket ourselves: TCPStore alone would listen on every interface.
        listener = socket.create_server((self.host, 0))
        port = listener.getsockname()[1]

        def join() -> None:
            try:
                timeout = timedelta(seconds=connect_timeout_s)
                group = stateless_group(self.host, port, 0, world_size, self.backend, timeout, listen_socket=listener)
                group.set_timeout(OP_TIMEOUT)
                self.group = group
            except BaseException as err:  # noqa: BLE001 - re-raised in wait_open, on the caller's thread
                self._error = err

        self._opener, self._error = threading.Thread(target=join, daemon=True), None
        self._opener.start()
        return {"host": self.host, "port": port, "backend": self.backend, "connect_timeout_s": connect_timeout_s}

    def wait_open(self) -> None:
        assert self._opener is not None, "open() first"
        self._opener.join()
        if self._error is not None:
            raise RuntimeError(f"weight-sync group failed to form: {self._error}") from self._error

    def push(self, tensors: Iterable[torch.Tensor]) -> int:
        device = torch.cuda.current_device() if self.backend == "nccl" else "cpu"
        on_device = (t.detach().to(device).contiguous() for t in tensors)
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
            destroy_group(group)


class IpcWeightSync:
    """CUDA IPC handles over a gloo group, for a trainer and engine on one GPU (bench/gpu_check runs it on one).

    The tensors go in buckets of up to IPC_BUCKET_BYTES: one broadcast carries a bucket's handles, the engine maps
    and copies every tensor of it, waits for its copies to finish and acknowledges; only then may the trainer free
    or change them. One round trip per bucket, not per tensor (a 155M-parameter model's 99 tensors: 6.6 GB/s one
    by one on an H100)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.control = BroadcastWeightSync("gloo", host)  # carries handles and acknowledgements, not weights

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> dict:
        # The engine joins with gloo and receives by IPC.
        return {**self.control.open(world_size, connect_timeout_s), "backend": "ipc"}

    def wait_open(self) -> None:
        self.control.wait_open()

    def push(self, tensors: Iterable[torch.Tensor]) -> int:
        from torch.multiprocessing.reductions import reduce_tensor

        sent = 0
        on_device = (t.detach().to(torch.cuda.current_device()).contiguous() for t in tensors)
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


def buckets(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """`items` in order, in runs of at most `limit` bytes (an item larger than that alone)."""
    bucket: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if bucket and size + n > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += n
    if bucket:
        yield bucket


def stateless_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    listen_socket: socket.socket | None = None,
) -> dist.ProcessGroup:
    """A process group of its own at tcp://host:port, outside torch.distributed's global state. Rank 0 serves the
    rendezvous store, on `listen_socket` when given (bound by the caller: no other process can take the port in
    between). gloo is built here from torch alone, as vLLM's stateless init builds it (the same store prefix, so either
    side may use either); nccl is vLLM's."""
    if backend != "gloo":
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        return stateless_init_torch_distributed_process_group(
            host, port, rank, world_size, backend=backend, listen_socket=listen_socket, timeout=timeout
        )
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    fd = {"master_listen_fd": listen_socket.detach()} if listen_socket is not None else {}
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True, **fd)
    prefixed = dist.PrefixStore(f"tcp://{host}:{port}", store)
    group = dist.ProcessGroup(prefixed, rank, world_size)
    gloo = ProcessGroupGloo(prefixed, rank, world_size, timeout=timeout)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    gloo._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    return group


def destroy_group(group: dist.ProcessGroup) -> None:
    """End a group `stateless_group` made: its connections close, a peer still waiting in it fails at once."""
    if group.group_name:  # registered by name (vLLM's nccl groups are not either)
        from torch.distributed.distributed_c10d import _unregister_process_group

        _unregister_process_group(group.group_name)
    group.shutdown()


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def size_of(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def pack(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """One flat byte buffer holding `tensors` at their `layout` offsets."""
    sizes = [nbytes(t) for t in tensors]
    offsets, total = layout(sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for tensor, offset, n in zip(tensors, offsets, sizes, strict=True):
        flat[offset : offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
    return flat


def unpack(flat: torch.Tensor, shapes: list[list[int]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The tensors `pack` laid out in `flat`: views of it, no copy."""
    sizes = [size_of(shape, d) for shape, d in zip(shapes, dtypes, strict=True)]
    offsets, _ = layout(sizes)
    return [
        flat[offset : offset + n].view(d).view(shape)
        for offset, n, shape, d in zip(offsets, sizes, shapes, dtypes, strict=True)
    ]


def broadcast_object(obj: object, group) -> object:
    """Rank 0's `obj` on every rank of a stateless group, as pickled bytes in two tensor broadcasts (the object
    collectives of torch.distributed expect a group registered with its default world)."""
    import pickle

    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if obj is not None else None
    size = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=0)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, group=group, group_src=0)
    return pickle.loads(payload.numpy().tobytes())


def make_weight_sync(backend: str = "gloo", host: str = "127.0.0.1") -> WeightSync:
    """The trainer side of `weight_sync.backend`, listening on `host` (the trainer's node address: the engines may
    run on other nodes); nccl and ipc need CUDA and say so."""
    if backend not in BACKENDS:
        raise ValueError(f"weight_sync.backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend != "gloo" and not torch.cuda.is_available():
        raise RuntimeError(
            f"weight_sync.backend={backend} moves CUDA tensors and this trainer sees no GPU: "
            "use weight_sync.backend=gloo on CPU"
        )
    return IpcWeightSync(host) if backend == "ipc" else BroadcastWeightSync(backend, host)
