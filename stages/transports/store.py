"""The parameter store of pull mode: one safetensors file per version at any fsspec URL (shared memory on one node,
an object store across nodes). The trainer writes a version and goes on; each engine worker reads the newest at its
own safe point. A restarted replica in push mode reads the same kind of file (the driver's snapshots)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import fsspec

from stages.transports import loader, named

if TYPE_CHECKING:
    import torch

    from stages.transports import Target, Weights


class StoreSender:
    """Writes the weights as one safetensors file."""

    def send(self, weights: Weights, url: str) -> int:
        """Write every tensor to `url`; returns the file's bytes. safetensors writes one header for all tensors, so
        the file needs them all at once, on CPU; it refuses two names on one storage, so a tied head is written as a
        copy of the embedding."""
        from safetensors.torch import save

        tensors, storages = {}, set()
        for name, t in named(weights):
            t = t.detach().cpu().contiguous()
            storage = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if storage in storages else t
            storages.add(storage)
        blob = save(tensors)
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(blob)
        return len(blob)


class StoreReceiver:
    """Reads a version's file and applies it."""

    def receive(self, url: str, target: Target) -> int:
        """Apply every tensor of the file at `url` to `target`; returns how many."""
        from safetensors.torch import load

        with fsspec.open(url, "rb") as f:
            weights: dict[str, torch.Tensor] = load(f.read())
        loader(target)(iter(weights.items()))
        return len(weights)
