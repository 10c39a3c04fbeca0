"""Rollout correction (decoupled PPO) against values worked out by hand from verl's definitions (SPEC.md §5;
verl/trainer/ppo/rollout_corr_helper.py). mmean(x, m) = sum(x m) / (sum m + 1e-8), so a fully masked row's mean
is 0; log rho = proximal - behaviour."""

import math

import numpy as np
import pytest
import torch

from stages.trainer.correction import correct_step
from stages.trainer.loss import AggCounts
from stages.trainer.policy_loss import LossInputs
from stages.trainer.policy_loss.clip import vanilla
from stages.trainer.settings import CorrectionSettings, PolicySettings


def _rows(log_ratios, behaviour=-1.0):
    """Ragged proximal / behaviour logprobs / masks whose log ratio is `log_ratios`, every token trained."""
    beh = [[behaviour] * len(r) for r in log_ratios]
    prox = [[b + lr for b, lr in zip(br, lrs, strict=True)] for br, lrs in zip(beh, log_ratios, strict=True)]
    return prox, beh, [[1.0] * len(r) for r in log_ratios]


def _metric(out, name):
    return out.metrics[f"rollout_corr/{name}"]


# SPEC §5's worked example: rho rows [[3, 0.25, 1], [1.2], []], the last response fully masked.
WORKED = _rows([[math.log(3), math.log(0.25), 0.0], [math.log(1.2)], []])


def test_token_is_worked_example():
    out = correct_step(*WORKED, CorrectionSettings(rollout_is="token", rollout_is_threshold=2.0))
    w = [2.0, 0.25, 1.0, 1.2]  # the applied weights: 3 truncated at 2
    mean, mean_sq = sum(w) / 4, sum(v * v for v in w) / 4
    q = [(2.0 + 0.25 + 1.0) / 3, 1.2, 0.0]  # per-row mean of the applied weights, the empty row 0
    q_mean = sum(q) / 3
    expected = {
        "rollout_is_mean": mean,  # of the applied (truncated) weights, as verl
        "rollout_is_ratio_fraction_high": 0.25,  # raw 3 > 2
        "rollout_is_ratio_fraction_low": 0.25,  # raw 0.25 < 1/2
        "rollout_is_max": 2.0,
        "rollout_is_min": 0.25,
        "rollout_is_std": math.sqrt(mean_sq - mean**2),  # population std of the applied weights
        "rollout_is_eff_sample_size": mean**2 / mean_sq,  # 1 / mean((w / mean w)^2)
        "rollout_is_seq_mean": q_mean,
        "rollout_is_seq_std": math.sqrt(sum((v - q_mean) ** 2 for v in q) / 2),  # unbiased
        "rollout_is_seq_max": 1.2,
        "rollout_is_seq_min": 0.0,
        "rollout_is_seq_max_deviation": 1.0,  # max |q - 1|, from the empty row
        "rollout_is_seq_fraction_high": 0.0,  # raw row means (4.25 / 3, 1.2, 0) against 2
        "rollout_is_seq_fraction_low": 1 / 3,  # and against 1/2
    }
    for name, value in expected.items():
        assert _metric(out, name) == pytest.approx(value, abs=1e-6), name
    assert "rollout_corr/rollout_is_batch_norm_factor" not in out.metrics
    # TIS: truncated from above only; 0.25 stays (nothing is zeroed by IS) and the mask is untouched
    assert [w.tolist() for w in out.weights] == [[2.0, 0.25, 1.0], [pytest.approx(1.2)], []]
    assert [m.tolist() for m in out.masks] == [[1, 1, 1], [1], []]


def test_token_is_batch_normalize_divides_by_the_truncated_token_mean():
    settings = CorrectionSettings(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True)
    out = correct_step(*WORKED, settings)
    assert _metric(out, "rollout_is_batch_norm_factor") == pytest.approx(4.45 / 4)  # (2 + 0.25 + 1 + 1.2) / 4
    assert np.allclose(out.weights[0], [1.797753, 0.224719, 0.898876]) and np.allclose(out.weights[1], [1.078652])
    assert _metric(out, "rollout_is_mean") == pytest.approx(4.45 / 4)  # metrics: the weights before normalising


def test_icepop_zeroes_the_weights_outside_lo_hi():
    out = correct_step(*WORKED, CorrectionSettings(rollout_is="token", rollout_is_threshold="0.5_2.0"))
    # raw [3, 0.25, 1, 1.2]: 3 and 0.25 fall outside [0.5, 2] and become 0; the others stay as they are
    assert [w.tolist() for w in out.weights] == [[0.0, 0.0, 1.0], [pytest.approx(1.2)], []]
    assert _metric(out, "rollout_is_oob_ratio") == pytest.approx(0.5)
    assert _metric(out, "rollout_is_mean") == pytest.approx(2.2 / 4)
    assert (_metric(out, "rollout_is_max"), _metric(out, "rollout_is_min")) == (pytest.approx(1.2), 0.0)
    assert _metric(out, "rollout_is_ratio_fraction_low") == pytest.approx(0.25)  # against lo, not 1 / hi
    seq = correct_step(*WORKED, CorrectionSettings(rollout_is="sequence", rollout_is_threshold="0.8_1.5"))
    assert np.allclose(seq.weights[0], [0.0] * 3) and np.allclose(seq.weights[1], [1.2])  # 0.75 < 0.8
    with pytest.raises(ValueError, match=r"'lo_hi' needs lo <= hi"):
        CorrectionSettings(rollout_is="token", rollout_is_threshold="2.0_0.5")


def test_sequence_is_worked_example():
    out = correct_step(*WORKED, CorrectionSettings(rollout_is="sequence", rollout_is_threshold=2.0))
    # S = [log 0.75, log 1.2, 0]: one weight per response on each of its tokens
    assert np.allclose(out.weights[0], [0.75] * 3) and np.allclose(out.weights[1], [1.2])
    assert _metric(out, "rollout_is_mean") == pytest.approx((0.75 * 3 + 1.2) / 4)  # 0.8625: token-weighted
    assert _metric(out, "rollout_is_max") == pytest.approx(1.2)
    assert _metric(out, "rollout_is_min") == pytest.approx(0.75)  # over all rows; the empty row's exp(0) = 1
    assert _metric(out, "rollout_is_ratio_fraction_high") == 0.0 and _metric(out, "rollout_is_ratio_fraction_low") == 0


def test_sequence_is_batch_normalize_averages_over_non_empty_responses():
    settings = CorrectionSettings(rollout_is="sequence", rollout_is_batch_normalize=True)
    out = correct_step(*WORKED, settings)
    factor = (0.75 + 1.2) / 2  # the empty response does not count
    assert _metric(out, "rollout_is_batch_norm_factor") == pytest.approx(factor)
    assert np.allclose(out.weights[0], 0.75 / factor) and np.allclose(out.weights[1], 1.2 / factor)


def test_sequence_is_truncates_the_product():
    out = correct_step(*_rows([[math.log(3), math.log(2)]]), CorrectionSettings(rollout_is="sequence"))
    assert np.allclose(out.weights[0], [2.0, 2.0])  # 3 * 2 = 6, truncated at 2
    assert _metric(out, "rollout_is_max") == pytest.approx(6.0)
    assert _metric(out, "rollout_is_ratio_fraction_high") == pytest.approx(1.0)


# Log ratios for the rejection modes. Per token: k1 = -l, k2 = l^2 / 2, k3 = e^l - 1 - l.
#   row 0 [0.5, -0.5]:       k2 [0.125, 0.125]  k3 [0.148721, 0.106531]
#   row 1 [1.0, 0.0]:        k2 [0.5, 0]        k3 [0.718282, 0]
#   row 2 [-0.2, -0.2, -0.2]: k2 0.02 each       k3 0.018731 each
RS_ROWS = _rows([[0.5, -0.5], [1.0, 0.0], [-0.2, -0.2, -0.2]])


@pytest.mark.parametrize(
    "option, threshold, kept",
    [
        ("token_k1", "0.5_2.0", [[1, 1], [0, 1], [1, 1, 1]]),  # -l in [log 0.5, log 2]: -1 is out
        ("token_k2", "0.2", [[1, 1], [0, 1], [1, 1, 1]]),
        ("token_k3", "0.12", [[0, 1], [0, 1], [1, 1, 1]]),
        ("seq_sum_k1", "0.5_2.0", [[1, 1], [0, 0], [1, 1, 1]]),  # sums of -l: 0, -1, 0.6
        ("seq_sum_k2", "0.2", [[0, 0], [0, 0], [1, 1, 1]]),  # 0.25, 0.5, 0.06
        ("seq_sum_k3", "0.3", [[1, 1], [0, 0], [1, 1, 1]]),  # 0.255252, 0.718282, 0.056192
        ("seq_mean_k1", "1.5", [[1, 1], [0, 0], [1, 1, 1]]),  # means 0, -0.5, 0.2 in [-log 1.5, log 1.5]
        ("seq_mean_k2", "0.1", [[0, 0], [0, 0], [1, 1, 1]]),  # 0.125, 0.25, 0.02
        ("seq_mean_k3", "0.1", [[0, 0], [0, 0], [1, 1, 1]]),  # 0.127626, 0.359141, 0.018731
        ("seq_max_k2", "0.2", [[1, 1], [0, 0], [1, 1, 1]]),  # 0.125, 0.5, 0.02
        ("seq_max_k3", "0.12", [[0, 0], [0, 0], [1, 1, 1]]),  # 0.148721, 0.718282, 0.018731
    ],
)
def test_each_rejection_option(option, threshold, kept):
    out = correct_step(*RS_ROWS, CorrectionSettings(rollout_rs=option, rollout_rs_threshold=threshold))
    assert [m.tolist() for m in out.masks] == kept
    rejected = 7 - sum(map(sum, kept))
    assert _metric(out, f"rollout_rs_{option}_masked_fraction") == pytest.approx(rejected / 7)
    assert _metric(out, "rollout_rs_masked_fraction") == pytest.approx(rejected / 7)
    assert _metric(out, "rollout_rs_seq_masked_fraction") == pytest.approx(sum(0 in k for k in kept) / 3)
    assert out.weights is None  # no IS configured


def test_rejection_chain_is_a_logical_and_with_one_threshold_per_option():
    settings = CorrectionSettings(rollout_rs="token_k3, seq_mean_k1,token_k3", rollout_rs_threshold="0.12,1.5")
    out = correct_step(*RS_ROWS, settings)  # the duplicate is dropped, so two thresholds fit two options
    assert [m.tolist() for m in out.masks] == [[0, 1], [0, 0], [1, 1, 1]]
    assert _metric(out, "rollout_rs_token_k3_masked_fraction") == pytest.approx(2 / 7)
    assert _metric(out, "rollout_rs_seq_mean_k1_masked_fraction") == pytest.approx(2 / 7)
    assert _metric(out, "rollout_rs_masked_fraction") == pytest.approx(3 / 7)
    assert _metric(out, "rollout_rs_seq_masked_fraction") == pytest.approx(2 / 3)


def test_rejection_metrics_of_one_option():
    out = correct_step(*RS_ROWS, CorrectionSettings(rollout_rs="seq_mean_k1", rollout_rs_threshold=1.5))
    p = "rollout_rs_seq_mean_k1_"
    lo = -math.log(1.5)
    expected = {
        "mean": (0 * 2 - 0.5 * 2 + 0.2 * 3) / 7,  # row values broadcast to tokens: token-weighted
        "max": 0.2,
        "min": -0.5,
        "fraction_high": 0.0,  # rows above log 1.5
        "fraction_low": 1 / 3,  # rows below -log 1.5
        # population std over tokens of the values clamped to [lo, log 1.5]: [0, 0, lo, lo, 0.2, 0.2, 0.2]
        "std": math.sqrt((2 * lo**2 + 3 * 0.04) / 7 - ((2 * lo + 0.6) / 7) ** 2),
        "seq_mean": -0.1,
        "seq_std": math.sqrt(0.26 / 2),  # unbiased over [0, -0.5, 0.2]
        "seq_max": 0.2,
        "seq_min": -0.5,
        "seq_max_deviation": 0.5,
        "seq_fraction_high": 0.0,
        "seq_fraction_low": 1 / 3,
        "seq_masked_fraction": 1 / 3,
    }
    for name, value in expected.items():
        assert _metric(out, p + name) == pytest.approx(value, abs=1e-6), name


def test_k1_bounds_apply_to_minus_log_rho_as_verl_does():
    # verl's own example: under token_k1 "0.5_2.0", rho = e^-1 is rejected and rho = e^0.5 kept; the IS weights
    # of a rejected token are left alone (0.368), only the mask drops it.
    rows = _rows([[-1.0] * 5, [0.5] * 5], behaviour=-1.5)
    settings = CorrectionSettings(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.5_2.0"
    )
    out = correct_step(*rows, settings)
    assert [m.tolist() for m in out.masks] == [[0] * 5, [1] * 5]
    assert np.allclose(out.weights[0], math.exp(-1)) and np.allclose(out.weights[1], math.exp(0.5))
    assert _metric(out, "rollout_rs_masked_fraction") == pytest.approx(0.5)
    # asymmetric "0.8_1.5" keeps log 0.8 <= -log rho <= log 1.5, i.e. rho in [1/1.5, 1/0.8] = [0.667, 1.25]
    rho = [0.6, 0.7, 1.2, 1.3]
    out = correct_step(
        *_rows([[math.log(r) for r in rho]]), CorrectionSettings(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.5")
    )
    assert out.masks[0].tolist() == [0, 1, 1, 0]


def test_legacy_sequence_and_geometric_are_verl_k1_options():
    # Token ratios per row: [3, 3] (product 9, geometric 3); [1.5, 1.5] (2.25, 1.5); [4, 0.25] (1, 1);
    # [1, 0.01] (0.01, 0.1).
    rows = _rows([[math.log(a), math.log(b)] for a, b in [(3, 3), (1.5, 1.5), (4, 0.25), (1, 0.01)]])

    def kept(**kw):
        return [m[0] for m in correct_step(*rows, CorrectionSettings(**kw)).masks]

    assert kept(rollout_rs="sequence", rollout_rs_threshold=2.0) == [0, 0, 1, 0]  # product in [0.5, 2]
    assert kept(rollout_rs="geometric", rollout_rs_threshold=2.0) == [0, 1, 1, 0]  # geometric mean in [0.5, 2]
    assert kept(rollout_rs="geometric", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=0.05) == [0, 1, 1, 1]
    # ratio bounds [lower, upper] are verl's k1 bounds "1/upper_1/lower"
    legacy = correct_step(
        *rows, CorrectionSettings(rollout_rs="sequence", rollout_rs_threshold=4.0, rollout_rs_threshold_lower=0.005)
    )
    named = correct_step(*rows, CorrectionSettings(rollout_rs="seq_sum_k1", rollout_rs_threshold="0.25_200.0"))
    assert [m.tolist() for m in legacy.masks] == [m.tolist() for m in named.masks] == [[0, 0], [1, 1], [1, 1], [1, 1]]
    assert legacy.metrics == pytest.approx(named.metrics)
    geo = correct_step(*rows, CorrectionSettings(rollout_rs="geometric", rollout_rs_threshold=2.0))
    assert "rollout_corr/rollout_rs_seq_mean_k1_masked_fraction" in geo.metrics


def test_legacy_token_veto_rejects_the_whole_response():
    rows = _rows([[math.log(a), math.log(b)] for a, b in [(3, 3), (1.5, 1.5), (4, 0.25), (1, 0.01)]])
    out = correct_step(*rows, CorrectionSettings(rollout_token_veto_threshold=0.05))
    assert [m.tolist() for m in out.masks] == [[1, 1], [1, 1], [1, 1], [0, 0]]  # 0.01 < 0.05
    assert _metric(out, "rollout_rs_token_veto_masked_fraction") == pytest.approx(2 / 8)
    assert _metric(out, "rollout_rs_token_veto_seq_masked_fraction") == pytest.approx(1 / 4)
    both = CorrectionSettings(rollout_rs="token_k2", rollout_rs_threshold=0.5, rollout_token_veto_threshold=0.05)
    out = correct_step(*rows, both)  # k2 = (log r)^2 / 2: 0.60 for r = 3 and 0.96 for 4 and 0.25 exceed 0.5
    assert [m.tolist() for m in out.masks] == [[0, 0], [1, 1], [0, 0], [0, 0]]


def test_offpolicy_metrics():
    out = correct_step(*RS_ROWS, CorrectionSettings())  # behaviour logprob -1 everywhere
    # per-row mean logprobs: proximal [-1, -0.5, -1.2], behaviour [-1, -1, -1]; D = behaviour - proximal means
    expected = {
        "training_ppl": (math.e + math.exp(0.5) + math.exp(1.2)) / 3,
        "training_log_ppl": 0.9,
        "rollout_ppl": math.e,
        "rollout_log_ppl": 1.0,
        "kl": -(0.0 + 1.0 - 0.6) / 7,  # mmean(behaviour - proximal)
        "k3_kl": (math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5 + math.e - 2 + 3 * (math.exp(-0.2) - 0.8)) / 7,
        "log_ppl_diff": -0.1,  # D = [0, -0.5, 0.2]
        "log_ppl_abs_diff": 0.7 / 3,
        "log_ppl_diff_max": 0.2,
        "log_ppl_diff_min": -0.5,
        "ppl_ratio": (1 + math.exp(-0.5) + math.exp(0.2)) / 3,
        "chi2_token": (math.e + math.exp(-1) + math.exp(2) + 1 + 3 * math.exp(-0.4)) / 7 - 1,  # mmean(rho^2) - 1
        "chi2_seq": (1 + math.exp(2) + math.exp(-1.2)) / 3 - 1,  # mean(exp(2 S)) - 1, S = [0, 1, -0.6]
    }
    assert set(out.metrics) == {f"rollout_corr/{k}" for k in expected}  # nothing configured: diagnostics only
    for name, value in expected.items():
        assert _metric(out, name) == pytest.approx(value, abs=1e-6), name
    assert [m.tolist() for m in out.masks] == [[1, 1], [1, 1], [1, 1, 1]] and out.weights is None


def test_padding_and_masked_tokens_never_count():
    # Row 1's second token is masked and holds garbage that must not move weights, masks or metrics.
    prox, beh, _ = _rows([[math.log(2.0), 0.0], [math.log(2.0), -50.0]])
    masks = [[1.0, 1.0], [1.0, 0.0]]
    settings = CorrectionSettings(rollout_is="sequence", rollout_rs="seq_sum_k1", rollout_rs_threshold=4.0)
    out = correct_step(prox, beh, masks, settings)
    assert [w.tolist() for w in out.weights] == [[2.0, 2.0], [2.0, 0.0]]
    assert [m.tolist() for m in out.masks] == masks
    assert _metric(out, "kl") == pytest.approx(-math.log(2) * 2 / 3)


def test_extreme_ratios_stay_finite():
    out = correct_step([[0.0]], [[-1000.0]], [[1.0]], CorrectionSettings(rollout_is="token", rollout_is_threshold=5))
    assert out.weights[0].tolist() == [5.0]
    assert _metric(out, "rollout_is_max") == 5.0  # the applied weight; the raw one safety-clamped at e^20
    assert _metric(out, "rollout_is_ratio_fraction_high") == pytest.approx(1.0)
    assert all(math.isfinite(v) for k, v in out.metrics.items() if "rollout_is" in k)


def test_a_step_without_trained_tokens_passes_through():
    out = correct_step([[0.0], []], [[-1.0], []], [[0.0], []], CorrectionSettings(rollout_is="token"))
    assert out.metrics == {} and [m.tolist() for m in out.masks] == [[0.0], []]
    assert [w.tolist() for w in out.weights] == [[0.0], []]


def test_ess_of_near_equal_weights_is_one():
    rng = np.random.default_rng(0)
    beh = np.log(rng.random((64, 128)) * 0.9 + 0.05)
    prox = beh + 1e-4 * rng.standard_normal((64, 128))  # ratios all ~1
    out = correct_step(list(prox), list(beh), [[1.0] * 128] * 64, CorrectionSettings(rollout_is="token"))
    # (0, 1] by Cauchy-Schwarz; verl's 1e-8 guard in the normalisation lifts equal weights a hair above 1, as here
    assert _metric(out, "rollout_is_eff_sample_size") == pytest.approx(1.0, abs=1e-6)


def test_is_weights_scale_the_token_loss():
    logp = torch.zeros(1, 3, requires_grad=True)
    weights = torch.tensor([[1.5, 0.5, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    x = LossInputs(logp, torch.zeros(1, 3), torch.ones(1, 3), mask, AggCounts(2, 1, 3), "token-mean", weights)
    res = vanilla(x, PolicySettings(clip_ratio_high=0.28))
    assert res.loss.item() == pytest.approx(-(1.5 + 0.5) / 2)  # ratio 1, advantage 1: -w per trained token
    res.loss.backward()
    assert np.allclose(logp.grad.detach().numpy(), [[-0.75, -0.25, 0.0]])


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"rollout_is": "tokens"}, "rollout_is must be one of"),
        ({"rollout_is_threshold": 0.0}, "rollout_is_threshold must be > 0"),
        ({"rollout_is_threshold": "two"}, "is a number or 'lo_hi'"),
        ({"rollout_is_batch_normalize": True}, "set algorithm.rollout_correction.rollout_is"),
        ({"rollout_rs": "token_k1"}, "rollout_rs needs algorithm.rollout_correction.rollout_rs_threshold"),
        ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": "2"}, r"unknown option 'seq_max_k1'.*seq_max_k2"),
        ({"rollout_rs": "seq_men_k2", "rollout_rs_threshold": "2"}, "Did you mean 'seq_mean_k2'"),
        ({"rollout_rs": "token_k1,sequence", "rollout_rs_threshold": "2"}, "alone the legacy sequence"),
        ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "2,3,4"}, "3 entries for 2 rollout_rs options"),
        ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "one upper bound"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"}, "needs lo < hi"),
        ({"rollout_rs": "seq_sum_k3", "rollout_rs_threshold": "-1"}, "must be > 0"),
        ({"rollout_rs": "seq_sum_k3", "rollout_rs_threshold": "big"}, "'big' is not a number"),
        ({"rollout_rs": "sequence", "rollout_rs_threshold": "0.5_2.0"}, "is one number"),
        ({"rollout_rs": "token_k1", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": 0.5}, "'lo_hi'"),
        ({"rollout_rs_threshold_lower": 0.5}, "needs rollout_rs 'sequence' or 'geometric'"),
        ({"rollout_rs": "geometric", "rollout_rs_threshold": 2, "rollout_rs_threshold_lower": 3}, "0 < rollout_rs_"),
    ],
)
def test_bad_settings_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        CorrectionSettings(**kw)


def test_thresholds_parse_as_verl():
    rules = CorrectionSettings(rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.4_1.8, 3.0").rs_rules()
    assert rules == [("token_k1", 0.4, 1.8), ("seq_max_k3", None, 3.0)]
    shared = CorrectionSettings(rollout_rs="seq_mean_k1,token_k2", rollout_rs_threshold=2.0).rs_rules()
    assert shared == [("seq_mean_k1", 0.5, 2.0), ("token_k2", None, 2.0)]  # one value hi: lo = 1/hi for k1
    assert not CorrectionSettings().active and CorrectionSettings().rs_rules() == []
