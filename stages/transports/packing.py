"""Small tensors packed into one flat buffer per broadcast, cut the same way on both sides.

A broadcast costs a round trip whatever its size, so the broadcast transport sends small tensors (norms, biases, a
small model's everything) together and each large one alone, as it is, with no extra copy. The sender groups its
tensors and the receivers their tensors' (shape, dtype) with one function, `packed`, so both cut the stream alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch

# Tensors under PACK_BELOW bytes travel packed, up to PACK_BYTES per broadcast, each at an offset of a multiple of
# ALIGN (every dtype's element size divides it, so a slice of the buffer is viewed as the tensor in place).
PACK_BELOW, PACK_BYTES, ALIGN = 1 << 20, 16 << 20, 64
T = TypeVar("T")


def packed(items: Iterable[T], nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """`items` in order, as the groups one broadcast carries each: a run of small items (under PACK_BELOW bytes)
    together while their aligned layout fits PACK_BYTES, every larger item alone."""
    group: list[T] = []
    size = 0
    for item in items:
        n = nbytes(item)
        if group and (n >= PACK_BELOW or aligned(size) + n > PACK_BYTES):
            yield group
            group, size = [], 0
        if n >= PACK_BELOW:
            yield [item]
            continue
        group.append(item)
        size = aligned(size) + n
    if group:
        yield group


def aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Each packed tensor's offset in the buffer, and the buffer's size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(aligned(end))
        end = offsets[-1] + n
    return offsets, end


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def size_of(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty(0, dtype=dtype).element_size()


def pack(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """One flat byte buffer holding `tensors` at their `layout` offsets."""
    sizes = [nbytes(t) for t in tensors]
    offsets, total = layout(sizes)
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    for tensor, offset, n in zip(tensors, offsets, sizes, strict=True):
        flat[offset : offset + n].copy_(tensor.reshape(-1).view(torch.uint8))
    return flat


def unpack(flat: torch.Tensor, shapes: list[list[int]], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
    """The tensors `pack` laid out in `flat`: views of it, no copy."""
    sizes = [size_of(shape, d) for shape, d in zip(shapes, dtypes, strict=True)]
    offsets, _ = layout(sizes)
    return [
        flat[offset : offset + n].view(d).view(shape)
        for offset, n, shape, d in zip(offsets, sizes, shapes, dtypes, strict=True)
    ]
