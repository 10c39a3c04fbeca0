"""Parameter and optimizer offload (verl's `fsdp_config.param_offload`, `optimizer_offload`,
`ref.fsdp_config.param_offload`): the model's parameters and gradients, or the optimizer's state, live in CPU memory
between steps and on the GPU only while a step (or a reference pass) runs, so the GPU memory they take is free for
the rest of the time (a colocated engine, a larger batch).

As verl does for FSDP2, the whole module moves (`module.to`: sharded parameters stay sharded, each rank moving its own
shards; gradients move with their parameters) and the optimizer's per-parameter tensors with it. AdamW's scalar
`step` counts stay on the CPU, where torch keeps them. On a CPU device there is nothing to move and `Offload` does
nothing, so the CPU default pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

CPU = torch.device("cpu")


class Offload:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        device: torch.device,
        params: bool = False,
        optimizer_state: bool = False,
    ) -> None:
        self.model, self.optimizer, self.device = model, optimizer, torch.device(device)
        on_gpu = self.device.type != "cpu"
        self.params, self.optimizer_state = params and on_gpu, optimizer_state and on_gpu and optimizer is not None
        self._depth = 0  # nested blocks (a step's proximal pass inside the step) move once
        self.park()

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within the block, whatever is offloaded is on the device; parked in CPU memory again when the outermost
        block ends."""
        if self._depth == 0:
            self._move(self.device)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.park()

    def park(self) -> None:
        """Move what is offloaded to CPU memory (at start-up, and after each step)."""
        self._move(CPU)

    @torch.no_grad()
    def _move(self, device: torch.device) -> None:
        if self.params:
            self.model.to(device, non_blocking=device.type != "cpu")
        if self.optimizer_state:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.dim() > 0:  # not AdamW's scalar step: torch keeps it on CPU
                        state[key] = value.to(device, non_blocking=device.type != "cpu")
        if device.type == "cpu" and (self.params or self.optimizer_state):
            torch.cuda.synchronize()  # the copies out are done before their memory is reused
            torch.cuda.empty_cache()
