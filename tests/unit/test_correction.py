"""Rollout correction (decoupled PPO) against values computed by hand on small tensors."""

import math

import numpy as np
import pytest
import torch

from stages.trainer.correction import CorrectionSettings, finalize_stats, merge_stats, rollout_correction
from stages.trainer.loss import ppo_clip_loss


def _logs(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def _one_sequence():
    # One response of two tokens: token ratios prox/behaviour are 2.0 and 0.5, so the sequence ratio is 1.0.
    return _logs([0.5, 0.2]), _logs([0.25, 0.4]), torch.ones(1, 2)


def test_token_level_is_truncates_each_token():
    prox, behaviour, mask = _one_sequence()
    corr = rollout_correction(prox, behaviour, mask, CorrectionSettings(rollout_is="token", rollout_is_threshold=1.5))
    assert np.allclose(corr.weights.detach().numpy(), [[1.5, 0.5]])
    m = finalize_stats(corr.stats)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.25)  # raw weights 2.0 and 0.5
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(0.75)
    assert m["rollout_corr/rollout_is_clipped_fraction"] == pytest.approx(0.5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(0.8)  # (1.5 + 0.5)^2 / (2 * 2.5)
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-6)  # mean(log 0.5, log 2)
    assert m["rollout_corr/k3_kl"] == pytest.approx(((1 - math.log(2)) + (-0.5 + math.log(2))) / 2, abs=1e-6)
    assert corr.mask.tolist() == [[1.0, 1.0]]


def test_sequence_level_is_weighs_every_token_by_the_product():
    prox, behaviour, mask = _logs([0.5, 0.2], [0.9, 0.9]), _logs([0.25, 0.4], [0.3, 0.9]), torch.ones(2, 2)
    corr = rollout_correction(prox, behaviour, mask, CorrectionSettings(rollout_is="sequence", rollout_is_threshold=2))
    # Sequence ratios: 2.0 * 0.5 = 1.0, and 3.0 * 1.0 = 3.0 truncated to 2.0.
    assert np.allclose(corr.weights.detach().numpy(), [[1.0, 1.0], [2.0, 2.0]])
    m = finalize_stats(corr.stats)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.0)  # over sequences: (1 + 3) / 2
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(3.0)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(9 / (2 * 5))


def test_padding_never_counts():
    # Row 2 has one real token; its padded slot holds garbage that must not move weights, masks or metrics.
    prox = _logs([0.5, 0.2], [0.5, 1e-30])
    behaviour = _logs([0.25, 0.4], [0.25, 0.9])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    settings = CorrectionSettings(rollout_is="sequence", rollout_rs="sequence", rollout_rs_threshold=4.0)
    corr = rollout_correction(prox, behaviour, mask, settings)
    assert np.allclose(corr.weights.detach().numpy(), [[1.0, 1.0], [2.0, 0.0]])
    assert corr.mask.tolist() == mask.tolist()
    assert corr.stats["tokens"] == 3


def test_rejection_sequence_geometric_and_veto():
    # Token ratios per row: [3, 3] (product 9, geometric 3); [1.5, 1.5] (product 2.25, geometric 1.5);
    # [4, 0.25] (product 1, geometric 1); [1, 0.01] (one token far below the veto threshold).
    ratios = torch.tensor([[3.0, 3.0], [1.5, 1.5], [4.0, 0.25], [1.0, 0.01]])
    behaviour = torch.full((4, 2), math.log(0.1))
    prox = behaviour + torch.log(ratios)
    mask = torch.ones(4, 2)

    def kept(**kw):
        return rollout_correction(prox, behaviour, mask, CorrectionSettings(**kw)).mask[:, 0].tolist()

    assert kept(rollout_rs="sequence", rollout_rs_threshold=2.0) == [0, 0, 1, 0]  # bounds [0.5, 2]; 0.01 < 0.5
    assert kept(rollout_rs="geometric", rollout_rs_threshold=2.0) == [0, 1, 1, 0]  # 0.1 < 0.5
    assert kept(rollout_rs="geometric", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.05) == [0, 1, 1, 1]
    assert kept(rollout_token_veto_threshold=0.05) == [1, 1, 1, 0]
    corr = rollout_correction(prox, behaviour, mask, CorrectionSettings(rollout_rs="sequence", rollout_rs_threshold=2))
    m = finalize_stats(corr.stats)
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(6 / 8)
    assert m["rollout_corr/rollout_rs_masked_seq_fraction"] == pytest.approx(3 / 4)
    assert corr.weights.tolist() == mask.tolist()  # no IS configured: weights stay 1


def test_extreme_ratios_stay_finite():
    prox, behaviour, mask = torch.tensor([[0.0]]), torch.tensor([[-1000.0]]), torch.ones(1, 1)
    corr = rollout_correction(prox, behaviour, mask, CorrectionSettings(rollout_is="token", rollout_is_threshold=5))
    assert corr.weights.item() == 5.0
    assert math.isfinite(finalize_stats(corr.stats)["rollout_corr/rollout_is_max"])  # exp(20), clamped


def test_stats_merge_across_minibatches_like_one_batch():
    prox, behaviour, mask = _logs([0.5, 0.2], [0.9, 0.9]), _logs([0.25, 0.4], [0.3, 0.9]), torch.ones(2, 2)
    settings = CorrectionSettings(rollout_is="token", rollout_is_threshold=2.5)
    whole = finalize_stats(rollout_correction(prox, behaviour, mask, settings).stats)
    parts: dict[str, float] = {}
    for i in range(2):
        merge_stats(parts, rollout_correction(prox[i : i + 1], behaviour[i : i + 1], mask[i : i + 1], settings).stats)
    assert finalize_stats(parts) == pytest.approx(whole)


def test_is_weights_scale_the_token_loss():
    logp = torch.zeros(1, 3, requires_grad=True)
    weights = torch.tensor([[1.5, 0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    res = ppo_clip_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, 0.2, 0.28, "token-mean", 2.0, weights)
    assert res.loss.item() == pytest.approx(-(1.5 + 0.5) / 2)  # ratio 1, advantage 1: -w per trained token
    res.loss.backward()
    assert np.allclose(logp.grad.detach().numpy(), [[-0.75, -0.25, 0.0]])


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"rollout_is": "tokens"}, "rollout_is must be one of"),
        ({"rollout_rs": "sequence"}, "rollout_rs needs algorithm.rollout_correction.rollout_rs_threshold"),
        ({"rollout_rs": "seq"}, "rollout_rs must be one of"),
        ({"rollout_is_threshold": 0.0}, "must be > 0"),
    ],
)
def test_bad_settings_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        CorrectionSettings(**kw)


def test_inactive_settings_leave_everything_alone():
    prox, behaviour, mask = _one_sequence()
    corr = rollout_correction(prox, behaviour, mask, CorrectionSettings())
    assert not CorrectionSettings().active
    assert np.allclose(corr.weights.numpy(), 1.0) and corr.mask.tolist() == [[1.0, 1.0]]


def test_ess_never_exceeds_one_on_many_near_equal_weights():
    torch.manual_seed(0)
    behaviour = torch.log(torch.rand(64, 128) * 0.9 + 0.05)
    prox = behaviour + 1e-4 * torch.randn(64, 128)  # float32 ratios all ~1: rounding once pushed ESS above 1
    stats = rollout_correction(prox, behaviour, torch.ones(64, 128), CorrectionSettings(rollout_is="token")).stats
    assert 0.99 < finalize_stats(stats)["rollout_corr/rollout_is_eff_sample_size"] <= 1.0
