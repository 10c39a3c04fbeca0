"""PPO-clip loss against values computed by hand."""

import math

import pytest
import torch

from stages.trainer.loss import ppo_clip_loss


def test_on_policy_token_mean_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    out = ppo_clip_loss(logp, logp.detach(), adv, mask, 0.2, 0.28, "token-mean", denominator=3.0)
    # ratio == 1 everywhere: loss = -(1 + 1 - 2) / 3
    assert out.loss.item() == pytest.approx(0.0)
    out.loss.backward()
    # d loss / d logp = -A * ratio / 3 on trained tokens, 0 on padding
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [2 / 3, 0.0, 0.0]]))
    assert out.clipped_tokens == 0
    assert out.ratio_sum == pytest.approx(3.0)


def test_clipping_by_hand():
    old = torch.tensor([[0.0, 0.0]])
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]])  # ratios 1.5 and 0.5
    mask = torch.ones(1, 2)
    pos = ppo_clip_loss(logp, old, torch.tensor([2.0]), mask, 0.2, 0.28, "token-mean", 2.0)
    # A>0: min(1.5, 1.28) * 2 = 2.56 ; min(0.5, 0.8) * 2 = 1.0 -> loss = -(2.56 + 1.0) / 2
    assert pos.loss.item() == pytest.approx(-(2.56 + 1.0) / 2)
    assert pos.clipped_tokens == 1
    neg = ppo_clip_loss(logp, old, torch.tensor([-1.0]), mask, 0.2, 0.28, "token-mean", 2.0)
    # A<0: max(1.5, 1.28) * 1 = 1.5 ; max(0.5, 0.8) * 1 = 0.8 -> loss = (1.5 + 0.8) / 2
    assert neg.loss.item() == pytest.approx((1.5 + 0.8) / 2)
    assert neg.clipped_tokens == 1
    assert neg.kl_sum == pytest.approx(-(math.log(1.5) + math.log(0.5)))


def test_seq_mean_token_mean_weighs_sequences_equally():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    out = ppo_clip_loss(logp, logp, torch.tensor([1.0, 3.0]), mask, 0.2, 0.2, "seq-mean-token-mean", 2.0)
    assert out.loss.item() == pytest.approx(-(1.0 + 3.0) / 2)


def test_unknown_aggregation_is_an_error():
    z = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        ppo_clip_loss(z, z, torch.zeros(1), z + 1, 0.2, 0.2, "sum", 1.0)
