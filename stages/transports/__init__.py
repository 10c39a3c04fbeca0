"""Weight transports: how a trainer's tensors reach the engines, each a sender/receiver pair in its own file.

- `broadcast.py`: a private process group (`group.py`), trainer at rank 0, every engine worker after it; small
  tensors packed into one buffer per broadcast (`packing.py`), each large one alone. gloo moves CPU tensors and runs
  anywhere; nccl moves CUDA tensors between GPUs.
- `ipc.py`: trainer and engine on one GPU, where NCCL cannot place two ranks: a gloo group carries CUDA IPC handles
  of the trainer's own tensors, and each engine copies them.
- `store.py`: pull mode's parameter store, one safetensors file per version at any fsspec URL.

`weight_sync.backend` chooses the group transport (`make_sender` on the trainer, `make_receiver` in each engine
worker); `weight_sync.mode: pull` uses the store. A pair is usable on its own, without Ray or vLLM: a sender takes
a {name: tensor} dict (or a stream of (name, tensor) pairs, which a trainer exports one gathered tensor at a time),
and a receiver applies what it receives to a model or to a `load_weights(weights)` callable (`loader`).

Every group is private to its transport (`group.py`): it never touches the global torch.distributed state that a
Megatron trainer or an engine owns, and it needs torch alone. The names, shapes and dtypes (`WeightMeta`) travel
beside the tensors, in the control plane's push message: a receiver knows what it receives before the first byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is imported where tensors move, not by every stage that names these types
    import torch

    Named = Iterable[tuple[str, torch.Tensor]]
    Weights = Mapping[str, torch.Tensor] | Named
    Target = torch.nn.Module | Callable[[Iterator[tuple[str, torch.Tensor]]], object]

BACKENDS = ("gloo", "nccl", "ipc")
# How long one collective may wait for a peer, once the group is formed: a receiver joins a push only after its
# engine drained or aborted its requests. Forming the group has its own, short timeout (`connect_timeout_s`).
OP_TIMEOUT = timedelta(seconds=600)


@dataclass(frozen=True)
class WeightMeta:
    """What a push carries, in order: HF names, shapes and dtypes (torch's names without 'torch.')."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError(f"{len(self.names)} names, {len(self.shapes)} shapes and {len(self.dtypes)} dtypes")

    @classmethod
    def of(cls, weights: Weights) -> WeightMeta:
        named = list(weights.items() if isinstance(weights, Mapping) else weights)
        return cls(
            tuple(n for n, _ in named),
            tuple(tuple(t.shape) for _, t in named),
            tuple(str(t.dtype).removeprefix("torch.") for _, t in named),
        )


@dataclass(frozen=True)
class GroupAddress:
    """Where the trainer's group listens, and how to join it: what every engine worker needs."""

    host: str
    port: int
    backend: str  # gloo, nccl, ipc (or sim: a simulated transport joins nothing)
    connect_timeout_s: float = 30.0


class GroupSender(Protocol):
    """The trainer's side of a group transport (rank 0)."""

    def open(self, world_size: int, connect_timeout_s: float = 30.0) -> GroupAddress:
        """Start rank 0's half of the rendezvous; returns what the engines need to join."""

    def wait_open(self) -> None:
        """Block until every engine has joined; raise if one has not within the rendezvous timeout."""

    def send(self, weights: Weights) -> int:
        """Send the tensors in order to every engine; returns the bytes sent. If it fails (an engine died during it),
        the group is closed, which ends the other engines' receives at once, and the next `open` forms a new one."""

    def close(self) -> None:
        """Leave the group, if any."""


class GroupReceiver(Protocol):
    """An engine worker's side of a group transport."""

    def join(self, address: GroupAddress, rank: int, world_size: int) -> None:
        """Join the group at `rank`; a group joined before is left first."""

    def receive(self, meta: WeightMeta, target: Target) -> int:
        """Receive every tensor `meta` names and apply it to `target`; returns how many."""

    def close(self) -> None:
        """Leave the group, if any."""


def make_sender(backend: str = "gloo", host: str = "127.0.0.1") -> GroupSender:
    """The trainer's side of `weight_sync.backend`, listening on `host` (the trainer's node address: the engines may
    run on other nodes); nccl and ipc need CUDA and say so."""
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"weight_sync.backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend != "gloo" and not torch.cuda.is_available():
        raise RuntimeError(
            f"weight_sync.backend={backend} moves CUDA tensors and this trainer sees no GPU: "
            "use weight_sync.backend=gloo on CPU"
        )
    if backend == "ipc":
        from stages.transports.ipc import IpcSender

        return IpcSender(host)
    from stages.transports.broadcast import BroadcastSender

    return BroadcastSender(backend, host)


def make_receiver(backend: str) -> GroupReceiver:
    """An engine worker's side of the transport the trainer's `GroupAddress` names."""
    if backend == "ipc":
        from stages.transports.ipc import IpcReceiver

        return IpcReceiver()
    if backend not in BACKENDS:
        raise ValueError(f"no receiver for weight_sync.backend {backend!r}")
    from stages.transports.broadcast import BroadcastReceiver

    return BroadcastReceiver(backend)


def named(weights: Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs, in order, from a dict or a stream of pairs."""
    yield from weights.items() if isinstance(weights, Mapping) else weights


def loader(target: Target) -> Callable[[Iterator[tuple[str, torch.Tensor]]], object]:
    """A `load_weights(weights)` callable for `target`: the callable itself, or for a model a copy of each tensor into
    the parameter or buffer of its name. The stream is consumed whole either way: its receives are collectives."""
    import torch

    if not isinstance(target, torch.nn.Module):
        return target
    own = target.state_dict(keep_vars=True)

    @torch.no_grad()
    def load(weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        unknown = []
        for name, tensor in weights:
            if name in own:
                own[name].copy_(tensor)
            else:
                unknown.append(name)
        if unknown:
            raise KeyError(f"{type(target).__name__} has no parameter or buffer {unknown[:5]} (received by name)")

    return load
