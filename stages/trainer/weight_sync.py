"""The trainer side of the weight sync: one private process group, trainer at rank 0, engines after it.

`WeightSync` is the swap point between transports: gloo on CPU (here), NCCL on GPUs. Either way the group is
created with vLLM's stateless init, so it never touches the global torch.distributed state a Megatron trainer
owns. Tensors go one at a time, in the order of `meta()`, and the engines receive them in that same order.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist


class WeightSync(Protocol):
    def open(self, world_size: int) -> dict:
        """Start rank 0's half of the rendezvous; returns what the engines need to join (host, port, backend)."""

    def wait_open(self) -> None:
        """Block until every engine has joined."""

    def push(self, tensors: Iterable[torch.Tensor]) -> int:
        """Broadcast tensors to every engine; returns the bytes sent."""


class GlooWeightSync:
    backend = "gloo"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.group = None
        self._opener: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self, world_size: int) -> dict:
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        # Bind the rendezvous store's socket ourselves: TCPStore alone would listen on every interface.
        listener = socket.create_server((self.host, 0))
        port = listener.getsockname()[1]

        def join() -> None:
            try:
                self.group = stateless_init_torch_distributed_process_group(
                    self.host,
                    port,
                    0,
                    world_size,
                    backend=self.backend,
                    listen_socket=listener,
                    timeout=timedelta(seconds=600),
                )
            except BaseException as err:  # noqa: BLE001 - re-raised in wait_open, on the caller's thread
                self._error = err

        self._opener = threading.Thread(target=join, daemon=True)
        self._opener.start()
        return {"host": self.host, "port": port, "backend": self.backend}

    def wait_open(self) -> None:
        assert self._opener is not None, "open() first"
        self._opener.join()
        if self._error is not None:
            raise RuntimeError(f"weight-sync group failed to form: {self._error}") from self._error

    def push(self, tensors: Iterable[torch.Tensor]) -> int:
        sent = 0
        for tensor in tensors:
            tensor = tensor.detach().contiguous()
            dist.broadcast(tensor, group=self.group, group_src=0)
            sent += tensor.numel() * tensor.element_size()
        return sent
