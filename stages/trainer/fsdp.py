"""One data-parallel rank of the torch trainer: its process group, its FSDP2-sharded model, and its parameters and
optimizer state moved between the sharded and the full (HF, single-process) form.

A TorchTrainer built with a `DPRank` of size > 1 joins a torch.distributed world at rank 0's address (gloo on CPU,
NCCL on GPU; stages/trainer/ranks.py says where the ranks run and meet), shards its HF model with
`torch.distributed.fsdp.fully_shard` (FSDP2: every decoder layer one unit, the root the embeddings, final norm and
head), and trains its share of each mini-batch (stages/trainer/fsdp_backend.py
splits them). FSDP's gradient reduction is a plain sum (divide factor 1): each rank's loss is already divided by the
WHOLE mini-batch's denominators, so the ranks' gradients add up to the single-process gradient in every
loss_agg_mode, the seq-mean-token-sum-norm included (verl scales that one by the DP size instead).

Every rank computes on the GPU it sees, else on the CPU (stages/trainer/precision.py); the group is NCCL on GPUs, gloo
on CPU. With bf16 compute FSDP2 gathers the parameters in bf16 and reduces the gradients in fp32 (its
MixedPrecisionPolicy, verl's settings), the sharded fp32 parameters staying the master weights.

FSDP2 runs on CPU over gloo in torch 2.13 (its all-gather and reduce-scatter have gloo kernels); tests/distributed
runs it there. A DPRank of size 1 with `fsdp=True` is a one-rank world: the sharded code on one device (the GPU
check, bench/gpu_check, runs it on CUDA over NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.trainer.loss import AggCounts
from stages.trainer.ranks import LOOPBACK, join_world


@dataclass(frozen=True)
class DPRank:
    """This process's place among the trainer's data-parallel ranks; size 1 is one process with no group."""

    rank: int = 0
    size: int = 1
    port: int = 0  # rank 0's rendezvous
    host: str = LOOPBACK  # where it listens: loopback on one node, rank 0's node address across nodes
    fsdp: bool = False  # shard with FSDP2 even as the only rank (a one-rank world)

    @property
    def sharded(self) -> bool:
        """Whether this rank joins a process group and shards its model."""
        return self.size > 1 or self.fsdp


@dataclass
class Share:
    """One rank's rows of one mini-batch, with what it needs to compute its part of the whole mini-batch's loss."""

    rows: dict[str, list]  # column -> this rank's rows, in the mini-batch's order
    anchor: list | None  # their proximal logprobs (None: the behaviour ones)
    masks: list | None  # their rejection-masked token masks (None: response_mask)
    is_weights: torch.Tensor | None  # (b, T) their rollout-correction weights
    counts: AggCounts  # the WHOLE mini-batch's: every rank divides by them
    micro_batches: int  # passes every rank runs for it (the same on all: each is a collective)


def join(dp: DPRank, device: torch.device) -> None:
    """Join the data-parallel world of a sharded rank computing on `device` (nothing to join unsharded)."""
    if dp.sharded:
        join_world("nccl" if device.type == "cuda" else "gloo", dp.host, dp.port, dp.rank, dp.size)


def shard_model(
    model: torch.nn.Module, dp: DPRank, device: torch.device, param_dtype: torch.dtype, reduce_dtype: torch.dtype
) -> None:
    """FSDP2 over the data-parallel world: each decoder layer a unit, the root the rest; gradients summed. The
    parameters are gathered in `param_dtype` and the gradients reduced in `reduce_dtype` (no cast when both are the
    weights' own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dp.size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # embeddings, final norm and the head (tied or not) share the root's unit
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():  # set per unit: the calls do not recurse
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # else a PREMUL_SUM op, which gloo lacks


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one gathered from every rank (a collective), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (its storage: writes reach the parameter), a plain one as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def shard_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A full tensor of `param`'s shape laid out as `param` is (this rank's chunk, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor) or value.shape != param.shape:
        return value
    return distribute_tensor(value.detach().to(param.device), param.device_mesh, param.placements, src_data_rank=None)


def gathered_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict | None:
    """The optimizer's state_dict with every sharded tensor gathered, on CPU: the layout a single-process trainer
    saves, so a checkpoint resumes at any number of ranks. Every rank must call it (the gathers are collectives);
    only a rank with `keep` holds the result, one tensor at a time on the others."""
    state = optimizer.state_dict()
    out: dict[int, dict] = {}
    for index, entry in state["state"].items():  # the same order on every rank: the parameters'
        gathered = {key: full(value).cpu() if torch.is_tensor(value) else value for key, value in entry.items()}
        if keep:
            out[index] = gathered
    return {"state": out, "param_groups": state["param_groups"]} if keep else None


def sharded_optimizer_state(state: dict, params: list[torch.Tensor]) -> dict:
    """A gathered (single-process) optimizer state_dict laid out as these sharded parameters are."""
    entries = {
        index: {key: shard_like(value, params[index]) if torch.is_tensor(value) else value for key, value in s.items()}
        for index, s in state["state"].items()
    }
    return {"state": entries, "param_groups": state["param_groups"]}
