"""TrainerBackend: what the driver (pipeline/run.py, pipeline/sync.py, pipeline/checkpoint.py) calls on a trainer.

TorchTrainer, FSDPTrainer (the torch backend at fsdp_size > 1), MegatronTrainer and SimTrainer each run in one Ray
actor and answer these calls, the weight-sync ones through one shared implementation (stages/trainer/weight_sync.py's
SendsWeights); a backend that holds no weights (sim) has no `logprobs`, `save_checkpoint` or
`set_weight` and is never asked for them (the config refuses checkpoints with it).
tests/unit/test_trainer_backend.py checks every backend against this.
"""

from __future__ import annotations

from typing import Protocol

from stages.handoff import StepRows
from stages.transports import GroupAddress, WeightMeta


class TrainerBackend(Protocol):
    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        """One trainer step: an optimizer update per mini-batch (column -> list of rows); returns its metrics. The
        driver sends a StepRows (stages/handoff.py), whose per-token columns the trainer fetches itself."""

    def open_weight_sync(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        """Start the trainer's half of the weight-sync group; returns what the engines need to join it."""

    def wait_weight_sync(self) -> None:
        """Block until every engine has joined the group."""

    def weight_meta(self) -> WeightMeta:
        """HF names, shapes and dtypes of the tensors `push_weights` sends, in order."""

    def push_weights(self) -> dict[str, float]:
        """Broadcast the weights to the engines (push mode); returns sync/* metrics."""

    def publish_weights(self, url: str) -> dict[str, float]:
        """Write the weights as one safetensors file at `url` (pull mode); returns sync/* metrics."""


class WeightedBackend(TrainerBackend, Protocol):
    """A backend with real weights: checkpoints, logprobs for proximal anchors and tests."""

    def logprobs(self, prompts: list, responses: list) -> list[list[float]]:
        """Response-token logprobs under the current weights."""

    def save_checkpoint(self, url: str) -> float:
        """Write `url`/model (an HF directory) and `url`/optimizer.pt; returns seconds taken."""

    def set_weight(self, name: str, value: float) -> None:
        """Fill the parameter with this HF name with a constant (tests)."""
