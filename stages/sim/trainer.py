"""SimTrainer: the trainer backend of simulated runs (`trainer.backend: sim`).

It answers the driver exactly as TorchTrainer does (train_step, the weight-sync calls) but spends the time that
stages.sim.workload.Workload gives instead of computing: per mini-batch and per response token for a step, per
sync for a weight push. There are no weights, so there is nothing to checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from stages.handoff import StepRows, rows_of
from stages.sim.workload import Workload


class SimTrainer:
    def __init__(self, sim: dict[str, Any]) -> None:
        self.work = Workload(**sim)

    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        # The rows are fetched before the clock starts: train_s is the modelled compute only (the closed forms the
        # tests check), while the fetch shows in the step's elapsed time, as the stream's other hand-offs do.
        minibatches = rows_of(minibatches)
        start = time.monotonic()
        units = sum(len(ids) for mb in minibatches for ids in mb["response_ids"])
        tokens = units * self.work.token_unit
        time.sleep(self.work.train_s(tokens, len(minibatches)) * self.work.time_scale)
        return {"train/num_tokens": float(tokens), "timing/train_s": time.monotonic() - start}

    def open_weight_sync(self, world_size: int, connect_timeout_s: float = 30.0) -> dict[str, Any]:
        return {"backend": "sim", "world_size": world_size, "connect_timeout_s": connect_timeout_s}

    def wait_weight_sync(self) -> None:
        pass

    def weight_meta(self) -> dict[str, list]:
        return {"names": [], "shapes": [], "dtypes": []}

    def publish_weights(self, url: str) -> dict[str, float]:
        """Pull mode: writing the weights to the store costs the transfer, and nothing waits for the engines."""
        start = time.monotonic()
        time.sleep(self.work.transfer_s() * self.work.time_scale)
        return {"sync/bytes": self.work.sync_bytes, "sync/publish_s": time.monotonic() - start}

    def push_weights(self) -> dict[str, float]:
        """The broadcast: as long as the engines' receive (SimGenerate._sync), which runs at the same time."""
        start = time.monotonic()
        time.sleep(self.work.sync_time_s() * self.work.time_scale)
        return {"sync/bytes": self.work.sync_bytes, "sync/broadcast_s": time.monotonic() - start}
