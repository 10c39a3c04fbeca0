"""KL estimators against values worked out by hand from their definitions (logp = -1.0, ref = -1.5: d = 0.5)."""

import math

import pytest
import torch

from stages.trainer.kl import KL_TYPES_ALL, kl_penalty

LOGP, REF = -1.0, -1.5


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("kl", 0.5),
        ("k1", 0.5),
        ("abs", 0.5),
        ("mse", 0.125),
        ("k2", 0.125),
        ("low_var_kl", math.exp(-0.5) + 0.5 - 1.0),  # 0.1065307
        ("k3", math.exp(-0.5) + 0.5 - 1.0),
    ],
)
def test_each_estimator_by_hand(kind, expected):
    value = kl_penalty(torch.tensor([[LOGP]]), torch.tensor([[REF]]), kind)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_k3_clamps_the_log_ratio_and_the_value():
    # d = -40: -d is clamped to 20 before exp, then the value to 10
    value = kl_penalty(torch.tensor([[-41.0]]), torch.tensor([[-1.0]]), "low_var_kl")
    assert value.item() == 10.0
    # d = +40: -d clamped to -20: exp(-20) + 20 - 1 = 19.000000002 -> clamped to 10
    assert kl_penalty(torch.tensor([[39.0]]), torch.tensor([[-1.0]]), "k3").item() == 10.0
    # k3 is never negative inside the clamps
    d = torch.linspace(-5, 5, 101)[None]
    assert (kl_penalty(d, torch.zeros_like(d), "k3") >= 0).all()


@pytest.mark.parametrize("kind", ["k1+", "k3+", "abs+", "low_var_kl+"])
def test_straight_through_has_the_value_of_its_estimator_and_the_gradient_of_k2(kind):
    logp = torch.tensor([[LOGP]], requires_grad=True)
    value = kl_penalty(logp, torch.tensor([[REF]]), kind)
    assert value.item() == pytest.approx(kl_penalty(logp.detach(), torch.tensor([[REF]]), kind[:-1]).item())
    value.sum().backward()
    assert logp.grad.item() == pytest.approx(0.5)  # d(d^2/2)/dlogp = d


def test_gradient_flows_into_logp_only():
    logp = torch.tensor([[LOGP]], requires_grad=True)
    ref = torch.tensor([[REF]], requires_grad=True)
    kl_penalty(logp, ref, "k3").sum().backward()
    assert ref.grad is None
    assert logp.grad.item() == pytest.approx(1.0 - math.exp(-0.5))  # d/dlogp of exp(-d) + d - 1


def test_an_unknown_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: kl, k1, abs"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "full")
    assert "k3+" in KL_TYPES_ALL
