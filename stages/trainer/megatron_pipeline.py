"""Pipeline parallelism in the Megatron trainer: which layers a stage holds, and megatron's own schedule driving a
step or a forward pass.

Stages. `pipeline_model_parallel_size` (PP) splits the layers evenly (PP must divide the layer count): stage p
builds a GPTModel of layers [p L / PP, (p + 1) L / PP) with the embedding on the first stage and the final norm and
output layer on the last. megatron numbers a stage's modules from 0 (`decoder.layers.{local}`); `Stage` renames
them with the global layer index, so the HF conversion (stages/trainer/megatron_convert.py) sees the whole model's
names. A tied embedding has a copy on the last stage (megatron's `shared` output-layer weight): it is loaded with
the embedding, megatron's embedding-group all-reduce of the two gradients keeps it equal, and it is not exported
(the first stage's embedding gives both HF names, as at PP = 1).

Schedule. The micro-batches go through `get_forward_backward_func()` (1F1B without interleaving at PP > 1) with
`variable_seq_lengths`: each micro-batch is padded only to its own width, so the stages exchange shapes first.
Every stage builds the same inputs; the last turns its logits into per-token logprobs (and entropy) and computes
the objective (Minibatch.loss), exactly what the hand-written CPU step computes at PP = 1.

On CPU (gloo) the schedule runs with three shims besides the rank's `cpu_shims`, each for one CUDA-only call of
megatron-core 0.16.1:
- pipeline_parallel/p2p_communication.py:242 (`_communicate_shapes`) and :398 call `torch.cuda.synchronize()`:
  a no-op on CPU (`cpu_shims`);
- pipeline_parallel/schedules.py:2138 makes `total_num_tokens` with `device="cuda"`: a TorchFunctionMode maps
  that device to the CPU for the schedule's duration (`cpu_schedule`);
- models/common/language_module/language_module.py:244 moves the tied embedding's copy with `.cuda()` before
  the all-reduce that initialises it: `Tensor.cuda` returns the tensor itself while the model is built
  (`cpu_build`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from stages.trainer.balance import row_tokens
from stages.trainer.step import Minibatch, StepTotals, pick

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
EMBEDDING = "embedding.word_embeddings.weight"


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage: `rank` of `size`, over a model of `num_layers` layers."""

    rank: int
    size: int
    num_layers: int
    tied_embeddings: bool

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def offset(self) -> int:
        return self.rank * self.num_layers // self.size

    def is_tied_copy(self, local: str) -> bool:
        """The last stage's copy of a tied embedding (PP > 1): loaded from the embedding, never exported."""
        return self.tied_embeddings and not self.first and local == "output_layer.weight"

    def global_name(self, local: str) -> str:
        """The whole model's name of a parameter of this stage's GPTModel (the embedding's for a tied copy)."""
        if self.is_tied_copy(local):
            return EMBEDDING
        match = _LAYER.match(local)
        if match is None:
            return local
        return f"decoder.layers.{int(match.group(1)) + self.offset}.{match.group(2)}"

    def holds(self, name: str) -> bool:
        """Whether a whole-model Megatron name is this stage's to train and export."""
        match = _LAYER.match(name)
        if match is not None:
            return self.offset <= int(match.group(1)) < self.offset + self.num_layers // self.size
        return self.first if name == EMBEDDING else self.last


# --- CPU shims ---------------------------------------------------------------------------------------------------
class _CudaDeviceToCpu(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def cpu_schedule(cuda: bool):
    """The context megatron's schedule runs in: on CPU, its tensors asked for on "cuda" are made on the CPU."""
    return contextlib.nullcontext() if cuda else _CudaDeviceToCpu()


def cpu_shims() -> None:
    """megatron-core asks CUDA for its device and RNG even when told to initialise on CPU."""
    from megatron.core import tensor_parallel

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None  # the schedule's p2p calls it (the module docstring)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Activation recompute (tensor_parallel.checkpoint) saves and restores the CUDA RNG state around a layer's second
    # forward; on CPU there is none (the CPU generator is saved beside it, and the model has no dropout).
    tensor_parallel.random._get_cuda_rng_state = lambda *args, **kwargs: None
    tensor_parallel.random._set_cuda_rng_state = lambda *args, **kwargs: None


@contextlib.contextmanager
def cpu_build(cuda: bool) -> Iterator[None]:
    """The context a stage's GPTModel is built in: on CPU, `Tensor.cuda` leaves the tensor where it is."""
    if cuda:
        yield
        return
    move = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = move


# --- schedule ----------------------------------------------------------------------------------------------------
def _run_schedule(rank, forward_step: Callable, num_micro: int, forward_only: bool) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with cpu_schedule(rank.cuda):
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(num_micro)),
            model=[rank.model],
            num_microbatches=num_micro,
            seq_length=0,  # variable_seq_lengths: the stages send each micro-batch's shape first
            micro_batch_size=rank.policy.micro_batch_size,
            forward_only=forward_only,
        )


def scheduled_update(rank, mb: Minibatch, totals: StepTotals) -> None:
    """One optimizer update of MegatronRank `rank` whose micro-batches megatron's schedule drives (any PP, CPU or
    GPU); the last stage adds each micro-batch's loss to `totals`, every stage the update's grad norm."""
    slices = mb.micro_batches(rank.policy)
    rows = mb.rows

    def forward_step(data_iterator, model):
        sl = slices[next(data_iterator)]
        batch = rank.inputs(pick(rows["prompt_ids"], sl), pick(rows["response_ids"], sl))
        output = rank.stage_forward(batch, mb.replay_kwargs(sl, rank.policy).get("routes"))

        def loss_func(logits: torch.Tensor):
            forward = rank.read_logits(logits, batch, entropy=True)
            res = mb.loss(lambda *_, **__: forward, sl, rank.policy, rank.device)
            totals.add_micro(res)
            # (loss, tokens, metrics): with calculate_per_token_loss the schedule leaves the loss as it is, and our
            # loss is already this micro-batch's share of the mini-batch's objective.
            return res.total, torch.ones((), dtype=torch.int), {}

        return output, loss_func

    rank.model.zero_grad_buffer()
    rank.optimizer.zero_grad()
    _run_schedule(rank, forward_step, len(slices), forward_only=False)
    rank.step(totals)


def scheduled_logprobs(rank, prompts: list, responses: list, sum_pi2: bool = False) -> list | None:
    """Each response's token logprobs (with `sum_pi2`: (logprobs, sum pi^2) rows) through the pipeline, a
    micro-batch at a time (cut as the proximal pass says); the last stage's answer, None on the other stages."""
    slices = rank.log_prob_batching.cut(row_tokens({"prompt_ids": prompts, "response_ids": responses}))
    out: list = [None] * len(responses)

    def forward_step(data_iterator, model):
        sl = slices[next(data_iterator)]
        batch = rank.inputs(pick(prompts, sl), pick(responses, sl))
        output = rank.stage_forward(batch, None)

        def collect(logits: torch.Tensor):
            forward = rank.read_logits(logits, batch, sum_pi2=sum_pi2)
            for j, i in enumerate(sl):
                logp = forward.logp[j, : len(responses[i])].tolist()
                out[i] = (logp, forward.sum_pi2[j, : len(responses[i])].tolist()) if sum_pi2 else logp
            return logits.new_zeros(()), torch.ones((), dtype=torch.int), {}

        return output, collect

    _run_schedule(rank, forward_step, len(slices), forward_only=True)
    return out if rank.stage.last else None
