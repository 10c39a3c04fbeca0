"""Which device a trainer computes on and in which precision, under verl's keys.

Device: the GPU whenever the process sees one (Ray gives an actor the GPUs it asked for and hides the others), else
the CPU; a caller may name one (`device="cpu"` on a GPU machine: the GPU check's reference step).

Precision, as verl's FSDP actor keeps it:
- `model_dtype` (`actor.fsdp_config.model_dtype`): the dtype the HF weights are loaded in and the optimizer updates,
  fp32 by default: fp32 master weights, fp32 AdamW state.
- `mixed_precision.param_dtype` (`actor.fsdp_config.mixed_precision.param_dtype`): the dtype the forward and backward
  compute in. bf16 casts the parameters on the fly (FSDP2's MixedPrecisionPolicy when sharded, `torch.autocast`
  around the forward in any case, as verl's forward step does), so the gradients land in the weights' fp32; the
  logits are turned into float32 before any logprob, entropy or loss is computed. Unset (None): bf16 on a GPU, as
  verl's default, and fp32 on CPU: a CPU without AMX (or AVX512-BF16) emulates bf16 matmuls, and on one with it the
  embedded model's matmuls are too small to pay for autocast's casts; wider models gain from bf16 there
  (docs/benchmarks.md, "bf16 on the CPU"), so set it.
- `mixed_precision.reduce_dtype`: the dtype FSDP2 reduces gradients in across ranks (fp32, as verl).

The dataclass is pure data (the config loads it without importing torch); the functions import torch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DTypeName = Literal["fp32", "float32", "bf16", "bfloat16"]
_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}


@dataclass
class MixedPrecision:
    """verl's `actor.fsdp_config.mixed_precision`: the compute and reduction dtypes over fp32 master weights."""

    param_dtype: DTypeName | None = None
    """Dtype of the forward and backward: 'bf16' or 'fp32'; null: bf16 on a GPU, fp32 on CPU."""
    reduce_dtype: DTypeName = "fp32"
    """Dtype FSDP2 reduces gradients in across data-parallel ranks."""
    buffer_dtype: DTypeName = "fp32"
    """Dtype of the model's buffers (rotary frequencies); accepted for verl configs, must stay fp32."""

    def __post_init__(self) -> None:
        if _DTYPES.get(self.buffer_dtype) != "float32":
            raise ValueError(
                f"actor.fsdp_config.mixed_precision.buffer_dtype={self.buffer_dtype}: the buffers stay fp32 (verl's "
                "default); set it to fp32"
            )


def is_bf16(name: str | None) -> bool:
    """Whether `name` is one of verl's spellings of bf16 (None, the device's default, is not)."""
    return _DTYPES.get(name or "") == "bfloat16"


def to_dtype(name: str) -> torch.dtype:
    """A dtype from verl's spellings (fp32/float32, bf16/bfloat16)."""
    import torch

    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(_DTYPES)}")
    return getattr(torch, _DTYPES[name])


def pick_device(device: str | None = None) -> torch.device:
    """`device`, or the GPU this process sees (its current one), else the CPU."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.device(device)
    if out.type == "cuda" and out.index is None:
        out = torch.device("cuda", torch.cuda.current_device())
    return out


def set_threads(torch_threads: int) -> None:
    """The process's intra-op threads: `torch_threads`, or every core it may use when 0 (trainer.torch_threads null
    where the trainer trains alone, pipeline/config/placement.py's trainer_threads)."""
    import os

    import torch

    torch.set_num_threads(torch_threads or len(os.sched_getaffinity(0)))


def compute_dtype(param_dtype: str | None, device: torch.device) -> torch.dtype:
    """The forward's dtype: `param_dtype`, or bf16 on a GPU and fp32 on CPU when it is None."""
    import torch

    if param_dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return to_dtype(param_dtype)


def autocast(device: torch.device, dtype: torch.dtype):
    """The context a forward runs in: autocast to `dtype` when it is lower than fp32, else nothing (verl skips it for
    fp32 too: autocast to fp32 would still change some ops)."""
    import torch

    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
