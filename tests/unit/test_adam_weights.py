"""tests/distributed/adam_weights.py's comparison: a few elements may lie past the tolerance, within what the AdamW
updates can move; more of them, or one moved further, fail."""

import numpy as np
import pytest

from tests.distributed.adam_weights import assert_trained_alike


def _pair(size: int = 20_000):
    rng = np.random.default_rng(0)
    want = rng.normal(size=(size // 100, 100)).astype(np.float32)
    return want.copy(), {"w": want}


def test_within_tolerance_passes():
    got, want = _pair()
    got += 1e-6
    assert_trained_alike({"w": got}, want, atol=2e-5, lr=1e-3, updates=2)


def test_an_element_whose_gradient_rounds_near_zero_may_move_up_to_the_updates():
    got, want = _pair()
    got[3, 7] += 1.5e-3  # at most OUTLIERS x size = 2 elements of 20,000
    got[9, 1] -= 6e-5
    assert_trained_alike({"w": got}, want, atol=2e-5, lr=1e-3, updates=2)


def test_a_row_off_fails():
    got, want = _pair()
    got[5] += 1e-4  # a token's whole row: a layout that misplaced a share of the gradient
    with pytest.raises(AssertionError, match="100 of 20000 elements"):
        assert_trained_alike({"w": got}, want, atol=2e-5, lr=1e-3, updates=2)


def test_one_element_moved_further_than_the_updates_can_fails():
    got, want = _pair()
    got[0, 0] += 5e-3
    with pytest.raises(AssertionError, match="more than 2 AdamW updates"):
        assert_trained_alike({"w": got}, want, atol=2e-5, lr=1e-3, updates=2)


def test_a_missing_tensor_fails():
    got, want = _pair()
    with pytest.raises(AssertionError):
        assert_trained_alike({}, want, atol=2e-5, lr=1e-3, updates=2)
