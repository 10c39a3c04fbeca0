"""vLLM worker extension: the engine side of the weight sync.

vLLM loads this class into every engine worker (`worker_extension_cls`), and the Generate stage reaches its
methods through `collective_rpc`. The trainer and the workers share one private process group (created with
vLLM's stateless init, so neither side's global torch.distributed state is touched: Megatron's groups and ours
never collide). The trainer is rank 0 and broadcasts each tensor; a worker receives them lazily inside the
iterator it hands to `reload_weights`, which brackets the copy with vLLM's layerwise reload (CPU linear layers
repack their weights after loading, so a plain `load_weights` after start-up would be wrong). Only one tensor is
in flight at a time: no second copy of the model.

`collective_rpc` arguments travel through msgspec, so names, shapes and dtypes are sent, never tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist


class WeightReceiver:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's."""

    def init_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str) -> None:
        from vllm.distributed.utils import (
            stateless_destroy_torch_distributed_process_group,
            stateless_init_torch_distributed_process_group,
        )

        old = getattr(self, "_weight_group", None)
        if old is not None:  # formed again after a replica restarted: the trainer has left the old one
            self._weight_group = None
            stateless_destroy_torch_distributed_process_group(old)
        # ipc: the group is gloo and carries CUDA IPC handles of the trainer's tensors on this same GPU.
        self._weight_ipc = backend == "ipc"
        self._weight_group = stateless_init_torch_distributed_process_group(
            host,
            port,
            rank,
            world_size,
            backend="gloo" if self._weight_ipc else backend,
            timeout=timedelta(seconds=600),
        )

    def receive_weights(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> int:
        """Receive every named tensor from rank 0 and load it; returns the number of tensors loaded."""
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            if self._weight_ipc:
                yield from self._receive_ipc(names)
                return
            for name, shape, dtype in zip(names, shapes, dtypes, strict=True):
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                dist.broadcast(tensor, group=self._weight_group, group_src=0)
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=stream())
        return len(names)

    def _receive_ipc(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Unverified here (no GPU): map each tensor by its CUDA IPC handle, copy it, then release the trainer's."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from stages.trainer.weight_sync import broadcast_object

        for name in names:
            shared = rebuild_cuda_tensor(*broadcast_object(None, self._weight_group))
            tensor = shared.clone()  # the loader may hold it past the acknowledgement
            del shared
            dist.all_reduce(torch.zeros(1), group=self._weight_group)
            yield name, tensor

    def load_weights_file(self, url: str) -> int:
        """Pull mode: load a version the trainer published as one safetensors file; returns the tensor count."""
        import fsspec
        from safetensors.torch import load

        with fsspec.open(url, "rb") as f:
            weights = load(f.read())
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()))
        return len(weights)

    def weight_checksum(self, name: str) -> float:
        """Sum of one parameter as the engine holds it (tests use it to see a pushed change arrive)."""
        params = dict(self.model_runner.get_model().named_parameters())
        return float(params[name].detach().float().sum())
