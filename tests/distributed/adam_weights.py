"""Weights after AdamW updates, compared between layouts that sum the same gradients in another order.

AdamW divides each element's first moment by the root of its second, so an element whose gradient is within float32
rounding of zero (of the order of its eps, 1e-8) moves by anything up to the learning rate, decided by the gradient's
last bits, which another summation order (data-parallel shards, packing, tensor-parallel pieces) changes. Every other
element moves by the learning rate times a ratio that rounding barely shifts. Two layouts' weights therefore agree
within `atol` but at a few such elements per tensor, while a layout that loses, doubles or misplaces a share of a
gradient moves whole rows. Seen on one machine, at the same elements in every run: one of 37,248 in an embedding and
one of 49,152 in an MLP projection, the latter moved 1.02e-3 by one layout's two updates and 1.08e-3 by the other's,
where the tensor's median element moved 1.66e-3 (a step whose gradient was near zero).
"""

from __future__ import annotations

import numpy as np

OUTLIERS = 1e-4  # the share of a tensor's elements that may lie past `atol` (at least one)


def assert_trained_alike(got: dict, want: dict, atol: float, lr: float, updates: int) -> None:
    """`got` and `want` (name -> array) within `atol`, but at most max(1, OUTLIERS x size) elements of each tensor,
    and those within what `updates` AdamW updates at `lr` can move two copies apart."""
    assert set(got) == set(want)
    for name, value in want.items():
        diff = np.abs(np.asarray(got[name], np.float64) - value)
        far, allowed = int((diff > atol).sum()), max(1, int(OUTLIERS * value.size))
        worst = float(diff.max(initial=0.0))
        assert far <= allowed, f"{name}: {far} of {value.size} elements differ by more than {atol} (max {worst:.3g})"
        assert worst <= 2 * updates * lr, f"{name}: {worst:.3g} apart, more than {updates} AdamW updates at lr {lr}"
