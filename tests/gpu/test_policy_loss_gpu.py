"""Every policy loss computes on CUDA what it computes on the CPU: its loss, its metrics and its gradient (float64
both ways, so the two agree to rounding). Skips itself without a GPU."""

import pytest
import torch

from stages.trainer.loss import AggCounts
from stages.trainer.policy_loss import POLICY_LOSSES, LossInputs, PolicyLoss
from stages.trainer.settings import CorrectionSettings, PolicyLossSettings, PolicySettings

pytestmark = pytest.mark.gpu


def _inputs(device: str) -> LossInputs:
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 3
    logp = (old + torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.3).clamp(max=-1e-3)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.float64)
    mask[1, 4:] = 0.0
    weights = torch.rand(3, 6, generator=g, dtype=torch.float64) + 0.5
    rc = CorrectionSettings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0")
    to = {"device": device}
    return LossInputs(
        logp.to(**to).requires_grad_(),
        old.to(**to),
        adv.to(**to),
        mask.to(**to),
        AggCounts(float(mask.sum()), 3.0, 6.0),
        "token-mean",
        weights.to(**to),
        rc,
    )


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_each_loss_is_the_same_on_cuda(mode):
    # clip_cov chooses its tokens at random: a share of 1 takes every candidate, on either device
    loss = PolicyLossSettings(mode, clip_cov_ratio=1.0, kl_cov_ratio=0.2, dro_beta=0.5)
    policy = PolicySettings(clip_ratio_high=0.28, policy_loss=loss)
    results = {}
    for device in ("cpu", "cuda"):
        x = _inputs(device)
        record = PolicyLoss.of(POLICY_LOSSES[mode](x, policy), x)
        record.loss.backward()
        results[device] = (record.loss.item(), record.sums, record.metrics, x.logp.grad.cpu())
    cpu, cuda = results["cpu"], results["cuda"]
    assert cuda[0] == pytest.approx(cpu[0], rel=1e-9, abs=1e-12)
    assert cuda[1] == pytest.approx(cpu[1], rel=1e-9, abs=1e-12) and cuda[2] == pytest.approx(cpu[2], rel=1e-9)
    assert torch.allclose(cuda[3], cpu[3], rtol=1e-9, atol=1e-12)
