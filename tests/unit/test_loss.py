"""The actor loss's pieces (stages/trainer/loss.py: aggregation, entropy) against values worked out by hand from
verl's definitions; the policy losses themselves are tests/unit/test_policy_loss.py's."""

import math
import threading

import pytest
import torch

from stages.trainer.loss import AggCounts, agg_loss, entropy_from_logits
from stages.trainer.policy_loss import LossInputs, PolicyLoss
from stages.trainer.policy_loss.clip import vanilla
from stages.trainer.settings import PolicySettings


def test_the_log_ratio_is_clamped_before_exp():
    logp = torch.tensor([[30.0]], dtype=torch.float64, requires_grad=True)  # ratio e^30 would be e^20 after it
    old, adv, mask = torch.zeros(1, 1, dtype=torch.float64), -torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1)
    x = LossInputs(logp, old, adv, mask, AggCounts(1, 1, 1), "token-mean")
    record = PolicyLoss.of(vanilla(x, PolicySettings()), x)
    assert record.loss.item() == pytest.approx(3.0)  # dual clip at c = 3
    assert record.ratio_sum == pytest.approx(math.exp(20.0), rel=1e-5)
    assert record.sums["actor/ppo_kl"] == pytest.approx(-20.0)


# SPEC §2's example: B = 3, L = 4, the last row fully masked; row sums 6 and 11, 17 in all.
X = torch.tensor([[1.0, 2, 3, 4], [5, 6, 0, 0], [7, 8, 9, 10]])
M = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode, counts, expected",
    [
        # token-mean: 17 / T, T = the mini-batch's 5 trained tokens
        ("token-mean", AggCounts(tokens=5, sequences=3, scale_factor=4), 3.4),
        # with 2 data-parallel ranks and T = 10 over both: 17 / 10 * 2 on this rank (verl's engine path)
        ("token-mean", AggCounts(tokens=10, sequences=6, scale_factor=4, dp_size=2), 3.4),
        # seq-mean-*: divided by every row of the mini-batch, the fully masked one included (G = 3)
        ("seq-mean-token-sum", AggCounts(tokens=5, sequences=3, scale_factor=4), 17 / 3),
        ("seq-mean-token-sum", AggCounts(tokens=10, sequences=6, scale_factor=4, dp_size=2), 17 / 6 * 2),
        ("seq-mean-token-mean", AggCounts(tokens=5, sequences=3, scale_factor=4), (6 / 3 + 11 / 2) / 3),
        # token-sum: the sum itself, times dp_size (each rank's share, averaged over the ranks)
        ("token-sum", AggCounts(tokens=5, sequences=3, scale_factor=4), 17.0),
        ("token-sum", AggCounts(tokens=10, sequences=6, scale_factor=4, dp_size=2), 34.0),
        # seq-mean-token-sum-norm: seq-mean-token-sum, then / loss_scale_factor (the padded width 4, or a given 2)
        ("seq-mean-token-sum-norm", AggCounts(tokens=5, sequences=3, scale_factor=4), 17 / 3 / 4),
        ("seq-mean-token-sum-norm", AggCounts(tokens=10, sequences=6, scale_factor=2, dp_size=2), 17 / 6 * 2 / 2),
    ],
)
def test_every_aggregation_mode_with_a_fully_masked_row(mode, counts, expected):
    assert agg_loss(X, M, mode, counts.denominator(mode)).item() == pytest.approx(expected, rel=1e-6)


def test_values_off_the_mask_cannot_leak():
    values = torch.tensor([[1.0, float("nan"), float("inf")]])
    assert agg_loss(values, torch.tensor([[1.0, 0.0, 0.0]]), "token-mean", 1.0).item() == 1.0


def test_an_unknown_aggregation_is_an_error():
    with pytest.raises(ValueError, match="loss_agg_mode 'seq-sum'"):
        AggCounts(1, 1, 1).denominator("seq-sum")
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(X, M, "sum", 1.0)


def test_entropy_from_logits_by_hand():
    # uniform over 4: ln 4; one-hot (the rest -inf, like padded vocabulary rows): 0; [0, ln 3]: p = [1/4, 3/4],
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - 3/4 ln 3.
    logits = torch.tensor([[0.0, 0, 0, 0], [5.0, -math.inf, -math.inf, -math.inf], [0.0, math.log(3), -math.inf, -1e9]])
    expected = [math.log(4), 0.0, math.log(4) - 0.75 * math.log(3)]
    assert entropy_from_logits(logits).tolist() == pytest.approx(expected, abs=1e-6)
    z = logits.clone().requires_grad_()
    entropy_from_logits(z).sum().backward()
    assert torch.isfinite(z.grad).all() and z.grad[1].abs().sum() == 0


class _TwoRankReduce:
    """All-reduce between two threads holding one vocabulary half each (a hand-written stand-in for the TP group):
    forward the reduced value, backward identity, as megatron's reduce_from_tensor_model_parallel_region."""

    def __init__(self) -> None:
        self.barrier, self.slots = threading.Barrier(2), {}

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t.detach()
        self.barrier.wait()
        both = [self.slots[0], self.slots[1]]
        self.barrier.wait()
        return both

    def max(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        return torch.maximum(*self._exchange(rank, t))

    def sum(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        total = sum(self._exchange(rank, t))
        return t + (total - t).detach()


def test_entropy_over_a_vocabulary_split_in_two_equals_the_whole():
    torch.manual_seed(0)
    full = (3 * torch.randn(4, 6)).requires_grad_()
    entropy_from_logits(full).sum().backward()
    reduce, halves, values = _TwoRankReduce(), [], {}

    def rank(r: int) -> None:
        part = full.detach()[:, 3 * r : 3 * r + 3].clone().requires_grad_()
        h = entropy_from_logits(
            part, reduce_max=lambda t: reduce.max(r, t), reduce_sum=lambda t: reduce.sum(r, t)
        )  # (4,), the same on both ranks
        h.sum().backward()
        halves.append((r, part.grad))
        values[r] = h.detach()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = entropy_from_logits(full.detach())
    assert torch.allclose(values[0], expected, atol=1e-6) and torch.allclose(values[1], expected, atol=1e-6)
    for r, grad in halves:
        assert torch.allclose(grad, full.grad[:, 3 * r : 3 * r + 3], atol=1e-6)
