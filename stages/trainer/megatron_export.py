"""The Megatron trainer's weights out as the whole model's HF tensors, from a TP x PP grid of ranks.

Each stage's TP ranks gather their shards one bucket at a time (one all_gather per bucket) and convert them to HF
names and layout (stages/trainer/megatron_convert.py). The first stage's first TP rank yields its own buckets, then
receives every later stage's, which that stage's first TP rank sends as one flat byte tensor per bucket: its stream
holds the whole model in the names and order of PP = 1. Every rank learns each stage's parameter list (global
names, local shapes, dtypes) once, when the trainer starts (all_gather_object over the pipeline group), so the
first rank knows the whole model's metadata and what each bucket it receives holds, and every rank cuts the same
buckets. At most one bucket is held at a time: never a second copy of the model.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from stages.trainer.megatron_convert import ModelShape, merge, shard_dim, to_hf
from stages.trainer.megatron_pipeline import EMBEDDING, Stage

Entry = tuple[str, list[int], str]  # a parameter's whole-model name, its local (TP shard) shape, its dtype
_FUSED = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class ModelExport:
    def __init__(
        self,
        params: list[tuple[str, torch.nn.Parameter]],
        shape: ModelShape,
        stage: Stage,
        tp: int,
        tp_rank: int,
        tp_group,
        pp_group,
    ) -> None:
        """`params`: this rank's exported parameters under their whole-model names, in the module's order."""
        self.params, self.shape, self.stage = params, shape, stage
        self.tp, self.tp_rank, self.tp_group, self.pp_group = tp, tp_rank, tp_group, pp_group
        mine: list[Entry] = [(n, list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params]
        self.plans: list[list[Entry]] = [mine]
        if stage.size > 1:
            self.plans = [[] for _ in range(stage.size)]
            dist.all_gather_object(self.plans, mine, group=pp_group)

    def _hf_shapes(self, entry: Entry) -> list[tuple[str, list[int]]]:
        name, local_shape, _ = entry
        full = list(local_shape)
        dim = shard_dim(name)
        if dim is not None:
            full[dim] *= self.tp
        if name in (EMBEDDING, "output_layer.weight"):
            full[0] = self.shape.vocab_size
        return [(hf, list(t.shape)) for hf, t in to_hf(name, torch.empty(full, device="meta"), self.shape)]

    def meta(self) -> dict[str, list]:
        """Names, shapes and dtypes of `stream()`'s tensors, without moving any weight."""
        names, shapes, dtypes = [], [], []
        for plan in self.plans:
            for entry in plan:
                for hf, hf_shape in self._hf_shapes(entry):
                    names.append(hf)
                    shapes.append(hf_shape)
                    dtypes.append(entry[2])
        return {"names": names, "shapes": shapes, "dtypes": dtypes}

    def source(self, hf_name: str) -> str:
        """The whole-model Megatron name of the unfused parameter that exports as `hf_name` (tests fill it)."""
        for plan in self.plans:
            for entry in plan:
                if not entry[0].endswith(_FUSED) and hf_name in [n for n, _ in self._hf_shapes(entry)]:
                    return entry[0]
        raise KeyError(f"no unfused Megatron parameter exports as {hf_name}")

    @staticmethod
    def _buckets(plan: list[Entry], bucket_bytes: int) -> list[list[int]]:
        """Indices into `plan`, cut once a bucket's local shards reach `bucket_bytes`."""
        buckets, bucket, size = [], [], 0
        for i, (_, local_shape, dtype) in enumerate(plan):
            bucket.append(i)
            size += torch.Size(local_shape).numel() * torch.empty((), dtype=_dtype(dtype)).element_size()
            if size >= bucket_bytes:
                buckets.append(bucket)
                bucket, size = [], 0
        return buckets + ([bucket] if bucket else [])

    @torch.no_grad()
    def stream(self, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's HF tensors on the first stage's first TP rank. Every rank of the replica must drain it
        (the gathers and sends are collectives); what the other ranks yield is not the model."""
        for s, plan in enumerate(self.plans):
            for bucket in self._buckets(plan, bucket_bytes):
                if s == self.stage.rank:
                    gathered = self._gather([self.params[i] for i in bucket])
                    if self.stage.first:
                        yield from gathered
                    else:
                        self._send(list(gathered))
                elif self.stage.first and self.tp_rank == 0:
                    yield from self._receive(s, [plan[i] for i in bucket])

    def _gather(self, bucket: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF tensors of a bucket of this stage's parameters: one all_gather over the TP group."""
        if self.tp == 1:
            for name, param in bucket:
                yield from to_hf(name, merge(name, [param.detach()], self.shape), self.shape)
            return
        flat = torch.cat([p.detach().reshape(-1) for _, p in bucket])
        gathered = [torch.empty_like(flat) for _ in range(self.tp)]
        dist.all_gather(gathered, flat, group=self.tp_group)
        offset = 0
        for name, param in bucket:
            n = param.numel()
            if shard_dim(name) is None:  # replicated: every rank holds the same values
                shards = [param.detach()]
            else:
                shards = [g[offset : offset + n].view_as(param) for g in gathered]
            offset += n
            yield from to_hf(name, merge(name, shards, self.shape), self.shape)

    def _send(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if self.tp_rank != 0:
            return
        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in tensors])
        dist.send(flat, dst=dist.get_global_rank(self.pp_group, 0), group=self.pp_group)

    def _receive(self, stage: int, entries: list[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
        parts = [(hf, hf_shape, _dtype(e[2])) for e in entries for hf, hf_shape in self._hf_shapes(e)]
        sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, s, d in parts]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.params[0][1].device)
        dist.recv(flat, src=dist.get_global_rank(self.pp_group, stage), group=self.pp_group)
        for (hf, hf_shape, dtype), chunk in zip(parts, flat.split(sizes), strict=True):
            yield hf, chunk.clone().view(dtype).view(hf_shape)  # the clone aligns the bytes for the dtype
