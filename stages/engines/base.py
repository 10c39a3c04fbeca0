"""Engine: the few calls a Generate replica (stages/replica.py) makes of its inference engine.

Everything else a replica does (membership, the control loop, weight syncs, validation passes, the surface the agent
loops drive) is the same for every engine and lives in the replica. An engine:

- `start(version)`: comes up with the weights it was built from, labelled `version`;
- `generate(prompt, max_tokens, request_id, sampling)`: one request, streamed to its end, as a `Segment` (tokens,
  behaviour logprobs, the weight version of each token, why it ended, and MoE routes when it captures them). Each
  token's version is the engine's label when the token was sampled, so it is exact across a weight swap;
- `pause(mode)` and `resume()`: around a weight swap (`PauseMode` says what happens to requests in flight);
- `join(group, rank, world_size)`: join the trainer's weight-sync group (push mode);
- `load(weights, version)`: load weights through its receiver (a push in flight, or a file in the store) and label
  every token sampled after it `version`;
- `busy`: its busy time (stages/engine_busy.py), measured where its requests run;
- `watch()`, `died(err)`, `processes()`, `shutdown()`: how it fails, and what it runs.

A new engine is one new file with one class answering these calls.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from stages.agents import Segment
from stages.engine_busy import EngineBusy
from stages.transports import GroupAddress, WeightMeta


class PauseMode(enum.StrEnum):
    """What a pause for a weight swap does to the requests in flight."""

    WAIT = "wait"  # they finish with the old weights; new ones queue until the swap is done (verl's default)
    ABORT = "abort"  # each ends at once with finish_reason 'abort', keeping its tokens; resubmitted, KV recomputed
    KEEP = "keep"  # they freeze and continue after the swap over the KV cache the old weights computed

    @classmethod
    def of(cls, value: str) -> PauseMode:
        """`value` as a PauseMode, or one error naming the valid ones."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', not {value!r}") from None


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off (vLLM's spelling)


@dataclass(frozen=True)
class Broadcast:
    """Weights arriving through the trainer's group, in `meta`'s order (push mode)."""

    meta: WeightMeta


@dataclass(frozen=True)
class StoreFile:
    """Weights in one safetensors file at `url` (pull mode, a restart, the dedicated validation engine)."""

    url: str


Weights = Broadcast | StoreFile


class Engine(Protocol):
    name: str  # what errors call it ("vLLM")
    busy: EngineBusy  # created by `start`

    async def start(self, version: int) -> None:
        """Start with the weights the engine was built from, labelled `version`."""

    async def generate(self, prompt: list[int], max_tokens: int, request_id: str, sampling: Sampling) -> Segment:
        """One request on `prompt`; it ends early with finish_reason 'abort' when an abort-mode pause interrupts it,
        and waits (queued or frozen) while the engine is paused otherwise."""

    async def pause(self, mode: PauseMode) -> None:
        """Stop generating as `mode` says; returns once the engine is still (in wait mode: drained)."""

    async def resume(self) -> None:
        """Generate again: queued requests start, frozen ones continue."""

    async def join(self, group: GroupAddress, rank: int, world_size: int) -> None:
        """Join the trainer's weight-sync group, every worker of the engine at `rank` plus its own TP rank."""

    async def load(self, weights: Weights, version: int) -> int:
        """Load `weights` (paused) and label later tokens `version`; returns how many of the engine's workers
        loaded them (one per tensor-parallel rank). Raises, the old weights or half the new ones in place, when the
        transfer fails."""

    async def watch(self) -> str:
        """Return once the engine has died, with the cause; never otherwise."""

    def died(self, err: BaseException) -> bool:
        """Whether `err` means the engine is dead (no later call can succeed)."""

    def processes(self) -> list[int]:
        """The engine's processes, for processes.json."""

    def shutdown(self) -> None:
        """Stop the engine's processes."""
