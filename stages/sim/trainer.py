"""SimTrainer: the trainer backend of simulated runs (`trainer.backend: sim`).

It answers the driver exactly as TorchTrainer does (train_step, the weight-sync calls) but spends the time that
stages.sim.workload.Workload gives instead of computing: per mini-batch and per response token for a step, per
sync for a weight push. There are no weights, so there is nothing to checkpoint; its transports (`SimTransfer`)
move nothing and take the workload's transfer time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from stages.handoff import StepRows, rows_of
from stages.sim.workload import Workload
from stages.trainer.weight_sync import SendsWeights
from stages.transports import GroupAddress, WeightMeta

if TYPE_CHECKING:
    from stages.transports import Weights


class SimTrainer(SendsWeights):
    def __init__(self, sim: dict[str, Any]) -> None:
        self.work = Workload(**sim)
        self.sender = self.store = SimTransfer(self.work)

    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        # The rows are fetched before the clock starts: train_s is the modelled compute only (the closed forms the
        # tests check), while the fetch shows in the step's elapsed time, as the stream's other hand-offs do.
        minibatches = rows_of(minibatches)
        start = time.monotonic()
        units = sum(len(ids) for mb in minibatches for ids in mb["response_ids"])
        tokens = units * self.work.token_unit
        time.sleep(self.work.train_s(tokens, len(minibatches)) * self.work.time_scale)
        return {"train/num_tokens": float(tokens), "timing/train_s": time.monotonic() - start}

    def export_weights(self) -> Weights:
        return {}

    def weight_meta(self) -> WeightMeta:
        return WeightMeta((), (), ())


class SimTransfer:
    """The simulated transports of both modes. A push takes the whole sync time, as long as the engines' receive
    (stages/engines/sim.py), which runs at the same time; writing to the store takes the transfer alone, and nothing
    waits for the engines."""

    def __init__(self, work: Workload) -> None:
        self.work = work

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        return GroupAddress("", 0, "sim", connect_timeout_s)

    def wait_open(self) -> None:
        pass

    def send(self, weights: Weights, url: str | None = None) -> int:
        seconds = self.work.sync_time_s() if url is None else self.work.transfer_s()
        time.sleep(seconds * self.work.time_scale)
        return int(self.work.sync_bytes)

    def close(self) -> None:
        pass
