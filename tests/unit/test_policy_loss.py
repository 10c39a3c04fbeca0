"""Every policy loss of verl's registry (stages/trainer/policy_loss) against values and gradients worked out by hand
from verl's definitions (verl/trainer/ppo/core_algos.py); the registry itself and a loss of the user's own.

Each example gives the current logprobs (log pi), the PPO anchor (log pi_old) and the advantages per token; the
expected numbers below are the formulas written out for those few tokens, not the implementation run again."""

import math

import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.trainer.loss import AggCounts
from stages.trainer.policy_loss import POLICY_LOSSES, LossInputs, PolicyLoss, policy_loss_fn
from stages.trainer.settings import POLICY_LOSS_MODES, CorrectionSettings, PolicyLossSettings, PolicySettings

ln = math.log


def _inputs(logp, old, adv, mask=None, agg="token-mean", weights=None, correction=None) -> LossInputs:
    logp = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    mask = torch.ones_like(logp) if mask is None else torch.tensor(mask, dtype=torch.float64)
    counts = AggCounts(tokens=float(mask.sum()), sequences=float(len(mask)), scale_factor=float(mask.shape[1]))
    w = None if weights is None else torch.tensor(weights, dtype=torch.float64)
    old, adv = torch.tensor(old, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64)
    return LossInputs(logp, old, adv, mask, counts, agg, w, correction)


def _run(mode: str, x: LossInputs, **policy):
    settings = PolicySettings(**policy)
    settings.policy_loss.loss_mode = mode
    terms = POLICY_LOSSES[mode](x, settings)
    terms.loss.backward()
    return terms, PolicyLoss.of(terms, x), x.logp.grad[0].tolist()


def _mean(record: PolicyLoss, name: str) -> float:
    return record.sums[name] / record.tokens


def test_every_verl_mode_is_registered_and_the_names_agree():
    assert set(POLICY_LOSS_MODES) == set(POLICY_LOSSES)  # settings.py spells them out so configs import no torch


def test_vanilla_with_dual_clip():
    # r = [1.5, 0.5, 0.5, 5, 1], A = [1, 1, -1, -1, 2], eps 0.2, c 3: t0 -min(1.5, 1.2) = -1.2, t1 -0.5,
    # t2 (A < 0) max(0.5, 0.8) = 0.8, t3 max(5, 1.2) = 5 capped at c = 3, t4 -2.
    ratios = [1.5, 0.5, 0.5, 5.0, 1.0]
    x = _inputs([[ln(r) for r in ratios]], [[0.0] * 5], [[1.0, 1.0, -1.0, -1.0, 2.0]])
    _, record, grad = _run("vanilla", x, clip_ratio=0.2, clip_ratio_c=3.0)
    assert record.loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 + 3.0 - 2.0) / 5)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 5)  # t0, t2
    assert _mean(record, "actor/pg_clipfrac_lower") == pytest.approx(1 / 5)  # t3
    assert _mean(record, "actor/ppo_kl") == pytest.approx(-sum(ln(r) for r in ratios) / 5)
    assert grad == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, -2.0 / 5])  # -A r / 5 where no clip binds


# DPPO's five tokens: (p_old, p, A); clip_ratio bounds the change of p, clip_ratio_c = 3 truncates the weight.
DPPO = [(0.5, 0.6, 1.0), (0.2, 0.5, 1.0), (0.5, 0.2, -1.0), (0.1, 0.05, -1.0), (0.01, 0.05, 1.0)]


def _dppo_inputs():
    return _inputs([[ln(p) for _, p, _ in DPPO]], [[ln(o) for o, _, _ in DPPO]], [[a for _, _, a in DPPO]])


def test_dppo_tv():
    # |p - p_old| trust region 0.2: t0 (+0.1) trains, t1 (+0.3, A > 0) and t2 (-0.3, A < 0) do not, t3 (-0.05) does,
    # t4 (+0.04) does with its ratio 5 truncated to 3. Loss -A * sg(min(r, 3)) * log p on the kept tokens.
    _, record, grad = _run("dppo_tv", _dppo_inputs(), clip_ratio=0.2, clip_ratio_c=3.0)
    kept = -1.2 * ln(0.6) + 0.5 * ln(0.05) - 3.0 * ln(0.05)
    assert record.loss.item() == pytest.approx(kept / 5)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 5)
    assert _mean(record, "actor/pg_clipfrac_lower") == pytest.approx(1 / 5)  # t4: ratio 5 > c, kept
    assert _mean(record, "actor/ppo_kl") == pytest.approx(-ln(3.0) / 5)  # the ratios multiply to 3
    assert grad == pytest.approx([-1.2 / 5, 0.0, 0.0, 0.5 / 5, -3.0 / 5])


def test_dppo_kl():
    # Binary KL(p_old || p) = p_old ln(p_old / p) + (1 - p_old) ln((1 - p_old) / (1 - p)), bound 0.1 for A > 0 and
    # 0.2 otherwise: t0 0.0204 and t4 0.0247 train; t1 0.193 > 0.1 with p up does not; t2 0.223 > 0.2 with p down
    # does not; t3 0.0207 trains.
    def bkl(old, p):
        return old * ln(old / p) + (1 - old) * ln((1 - old) / (1 - p))

    assert [round(bkl(o, p), 4) for o, p, _ in DPPO] == [0.0204, 0.1927, 0.2231, 0.0207, 0.0247]
    _, record, grad = _run("dppo_kl", _dppo_inputs(), clip_ratio_low=0.2, clip_ratio_high=0.1, clip_ratio_c=3.0)
    assert record.loss.item() == pytest.approx((-1.2 * ln(0.6) + 0.5 * ln(0.05) - 3.0 * ln(0.05)) / 5)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 5)
    assert grad == pytest.approx([-1.2 / 5, 0.0, 0.0, 0.5 / 5, -3.0 / 5])
    # A step back towards p_old always trains: A < 0 and p up from 0.2 to 0.9 (KL 1.08), its ratio 4.5 cut to 3.
    x = _inputs([[ln(0.9)]], [[ln(0.2)]], [[-1.0]])
    _, record, grad = _run("dppo_kl", x, clip_ratio=0.2, clip_ratio_c=3.0)
    assert record.loss.item() == pytest.approx(3.0 * ln(0.9)) and grad == pytest.approx([3.0])
    assert _mean(record, "actor/pg_clipfrac_lower") == 1.0


def test_cispo():
    # r = [1.5, 0.5, 1] clipped to [1.28, 0.8, 1] (eps 0.2 / 0.28), detached; loss -sg(clip r) * A * log p.
    logp = [ln(0.75), ln(0.25), ln(0.5)]
    x = _inputs([logp], [[ln(0.5)] * 3], [[1.0, -1.0, 2.0]])
    _, record, grad = _run("cispo", x, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert record.loss.item() == pytest.approx((-1.28 * logp[0] + 0.8 * logp[1] - 2.0 * logp[2]) / 3)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 3)
    assert _mean(record, "actor/pg_clipfrac_lower") == 0.0
    assert grad == pytest.approx([-1.28 / 3, 0.8 / 3, -2.0 / 3])  # a gradient on every token, clipped or not


def _two_rows(log_ratios_0, log_ratios_1, adv_0, adv_1, logp=-1.0, agg="token-mean"):
    """Row 0 of two tokens, row 1 of three (a trailing pad masked out of row 0)."""
    lr = [[*log_ratios_0, 0.0], log_ratios_1]
    return _inputs(
        [[logp] * 3, [logp] * 3],
        [[logp - r for r in lr[0]], [logp - r for r in lr[1]]],
        [[adv_0] * 3, [adv_1] * 3],
        mask=[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]],
        agg=agg,
    )


def test_gspo():
    # s_0 = exp(mean(0.2, 0.4)) = e^0.3 = 1.3499 > 1.28 with A = 1: clipped to -1.28 on both tokens (no gradient);
    # s_1 = exp(mean(-0.1, 0, -0.2)) = e^-0.1 with A = -1: -A s_1 on each token, gradient -A s_1 per token.
    s1 = math.exp(-0.1)
    x = _two_rows([0.2, 0.4], [-0.1, 0.0, -0.2], 1.0, -1.0)
    terms, record, _ = _run("gspo", x, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert record.loss.item() == pytest.approx((2 * -1.28 + 3 * s1) / 5)
    assert x.logp.grad.flatten().tolist() == pytest.approx([0.0, 0.0, 0.0] + [s1 / 5] * 3)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 5)
    assert _mean(record, "actor/ppo_kl") == pytest.approx(-(0.6 - 0.3) / 5)
    x = _two_rows([0.2, 0.4], [-0.1, 0.0, -0.2], 1.0, -1.0, agg="seq-mean-token-mean")
    seq = _run("gspo", x, clip_ratio_low=0.2, clip_ratio_high=0.28)[1]
    assert seq.loss.item() == pytest.approx((-1.28 + s1) / 2)
    # Each token's gradient is its own advantage times s (GSPO-token): with advantages +1 and -1 in one response
    # of ratio e^0.1 they pull apart, where a plain sequence ratio would give both the sum of the two, 0.
    x = _inputs([[-1.0, -1.0]], [[-1.1, -1.1]], [[1.0, -1.0]])
    _, _, grad = _run("gspo", x, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert grad == pytest.approx([-math.exp(0.1) / 2, math.exp(0.1) / 2])


def test_geo_mean():
    # Row 0, A = 1: log ratios (0.1, 0.5), the 0.5 clipped to 0.2 (the binding side for A > 0): ratio e^0.15.
    # Row 1, A = -1: (-0.5, 0.1, 0.3), max(l, clamp l): (-0.2, 0.1, 0.3), ratio e^(0.2 / 3).
    # Loss: mean over the 2 responses of -A_i * ratio_i, whatever loss_agg_mode says.
    r0, r1 = math.exp(0.15), math.exp(0.2 / 3)
    x = _two_rows([0.1, 0.5], [-0.5, 0.1, 0.3], 1.0, -1.0, agg="token-sum")
    _, record, _ = _run("geo_mean", x, clip_ratio=0.2)
    assert record.loss.item() == pytest.approx((-r0 + r1) / 2)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(1 / 5)  # row 0's 0.5, A > 0
    assert _mean(record, "actor/pg_clipfrac_lower") == pytest.approx(2 / 5)  # row 1's -0.5 and 0.3, A < 0
    # The clipped log ratios carry no gradient; the others d(-A ratio / 2) = -A ratio / len / 2.
    assert x.logp.grad.flatten().tolist() == pytest.approx([-r0 / 2 / 2, 0.0, 0.0, 0.0, r1 / 3 / 2, r1 / 3 / 2])


def test_sapo():
    # Gate f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau_pos = 1 where A > 0, tau_neg = 1.05 elsewhere; loss -f(r) A,
    # always the mean over each response's tokens, then over responses (verl ignores loss_agg_mode here).
    def sig(z):
        return 1.0 / (1.0 + math.exp(-z))

    f0, f1, f2 = 4 * sig(0.5), 4 * sig(1.05 * -0.5) / 1.05, 4 * sig(0.0)
    x = _inputs([[ln(1.5), ln(0.5)], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[1.0, -1.0], [1.0, 0.0]], [[1, 1], [1, 0]])
    _, record, _ = _run("sapo", x, tau_pos=1.0, tau_neg=1.05, loss_agg_mode="token-mean")
    assert record.loss.item() == pytest.approx(((-f0 + f1) / 2 + -f2) / 2)
    # d(-A f(r))/d log p = -A * 4 s (1 - s) * r, s = sigmoid(tau (r - 1)); divided by 2 tokens, 2 responses
    s0, s1 = sig(0.5), sig(-0.525)
    expected = [-4 * s0 * (1 - s0) * 1.5 / 4, 4 * s1 * (1 - s1) * 0.5 / 4, -1.0 / 2, 0.0]
    assert x.logp.grad.flatten().tolist() == pytest.approx(expected)
    assert _mean(record, "actor/pg_clipfrac") == 0.0


def test_gpg_and_dro():
    x = _inputs([[-1.0, -2.0]], [[-1.5, -1.0]], [[1.0, -0.5]])
    _, record, grad = _run("gpg", x)
    assert record.loss.item() == pytest.approx((1.0 - 1.0) / 2) and grad == pytest.approx([-0.5, 0.25])
    assert record.sums == {}  # verl's gpg reports no metric
    # dro, beta 2: -(A log p - beta / 2 (log p - log p_old)^2): t0 -(-1 - 0.25) = 1.25, t1 -(1 - 1) = 0
    x = _inputs([[-1.0, -2.0]], [[-1.5, -1.0]], [[1.0, -0.5]])
    _, record, grad = _run("dro", x, policy_loss=PolicyLossSettings(loss_mode="dro", dro_beta=2.0))
    assert record.loss.item() == pytest.approx(1.25 / 2)
    assert grad == pytest.approx([-(1.0 - 2.0 * 0.5) / 2, -(-0.5 - 2.0 * -1.0) / 2])
    assert _mean(record, "actor/ppo_kl") == pytest.approx(-(0.5 - 1.0) / 2)


# Four tokens for the covariance losses: log p and A; cov_t = (A_t - 1)(log p_t + 1.625) = 0.625, 0.75, 1.375, 2.25.
COV_LOGP, COV_ADV = [-1.0, -2.0, -3.0, -0.5], [2.0, -1.0, 0.0, 3.0]


def _cov_policy(**kw):
    return {"policy_loss": PolicyLossSettings(**kw), "clip_ratio": 0.2}


def test_clip_cov_cuts_the_gradient_of_tokens_with_a_large_covariance():
    # ratio 1 everywhere; candidates are covariances in (1, 5): t2 and t3; 0.5 of 4 tokens = 2 of them: both cut.
    x = _inputs([COV_LOGP], [COV_LOGP], [COV_ADV])
    _, record, grad = _run("clip_cov", x, **_cov_policy(loss_mode="clip_cov", clip_cov_ratio=0.5))
    assert record.loss.item() == pytest.approx((-2.0 + 1.0) / 4)
    assert grad == pytest.approx([-2.0 / 4, 1.0 / 4, 0.0, 0.0])
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(2 / 4)
    # A token PPO's clip already binds is no candidate: t3 at ratio 2 (A > 0) keeps its clipped -3 * 1.2.
    old = [*COV_LOGP[:3], COV_LOGP[3] - ln(2.0)]
    x = _inputs([COV_LOGP], [old], [COV_ADV])
    _, record, _ = _run("clip_cov", x, **_cov_policy(loss_mode="clip_cov", clip_cov_ratio=0.5))
    assert record.loss.item() == pytest.approx((-2.0 + 1.0 + 0.0 - 3.6) / 4)
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(1 / 4)  # only t2 was cut
    # With room for one of two candidates, exactly one is cut (picked at random, as verl does).
    x = _inputs([COV_LOGP], [COV_LOGP], [COV_ADV])
    _, record, _ = _run("clip_cov", x, **_cov_policy(loss_mode="clip_cov", clip_cov_ratio=0.25))
    assert _mean(record, "actor/pg_clipfrac") == pytest.approx(1 / 4)
    assert record.loss.item() in (pytest.approx((-2.0 + 1.0 - 3.0) / 4), pytest.approx((-2.0 + 1.0) / 4))


def test_kl_cov_penalises_the_tokens_with_the_largest_covariance():
    # log ratios (0.1, -0.2, 0.3, 0.4); 0.25 of 4 tokens = 1: t3 (cov 2.25) pays 0.1 * |0.4| besides -A r.
    lr = [0.1, -0.2, 0.3, 0.4]
    x = _inputs([COV_LOGP], [[p - r for p, r in zip(COV_LOGP, lr, strict=True)]], [COV_ADV])
    _, record, grad = _run("kl_cov", x, **_cov_policy(loss_mode="kl_cov", kl_cov_ratio=0.25, ppo_kl_coef=0.1))
    per = [-a * math.exp(r) for a, r in zip(COV_ADV, lr, strict=True)]
    assert record.loss.item() == pytest.approx((sum(per) + 0.1 * 0.4) / 4)
    assert grad == pytest.approx([per[0] / 4, per[1] / 4, 0.0, (per[3] + 0.1) / 4])
    assert _mean(record, "actor/ppo_kl") == pytest.approx(0.25)  # verl logs the mean |log r| here


# bypass_mode: current log p (-1, -2, -3) against the engine's (-1.1, -3.0, -2.8): rho = e^(0.1, 1.0, -0.2).
BYPASS = ([[-1.0, -2.0, -3.0]], [[-1.1, -3.0, -2.8]], [[1.0, 1.0, 1.0]])


def test_bypass_mode_ppo_clip_rejects_and_measures():
    # token_k1 with threshold 2 keeps rho in [1/2, 2]: t1 (rho e) is rejected; PPO clip on t0 and t2 without IS
    # weights, divided by the 3 tokens of the mini-batch (its count before rejection, as verl's global counts).
    rc = CorrectionSettings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="2")
    x = _inputs(*BYPASS, correction=rc)
    terms, record, grad = _run("bypass_mode", x, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert record.loss.item() == pytest.approx((-math.exp(0.1) - math.exp(-0.2)) / 3)
    assert grad == pytest.approx([-math.exp(0.1) / 3, 0.0, -math.exp(-0.2) / 3])
    assert record.tokens == 2 and _mean(record, "actor/ppo_kl") == pytest.approx((-0.1 + 0.2) / 2)
    assert record.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 3)
    assert record.metrics["rollout_corr/rollout_is_max"] == pytest.approx(2.0)  # measured (truncated), not applied


def test_bypass_mode_reinforce_applies_the_truncated_weights():
    # -A log p * min(rho, 2) on the kept tokens: t0 1.105 * 1, t2 0.819 * 3.
    rc = CorrectionSettings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="2", loss_type="reinforce")
    _, record, grad = _run("bypass_mode", _inputs(*BYPASS, correction=rc))
    assert record.loss.item() == pytest.approx((math.exp(0.1) * 1.0 + math.exp(-0.2) * 3.0) / 3)
    assert grad == pytest.approx([-math.exp(0.1) / 3, 0.0, -math.exp(-0.2) / 3])


def test_is_weights_multiply_every_tokens_loss():
    # decoupled correction's weights: -A r w per token (ratio 1, A 1), here for vanilla and cispo alike
    for mode in ("vanilla", "cispo", "gpg"):
        x = _inputs([[0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]], [[1, 1, 0]], weights=[[1.5, 0.5, 2.0]])
        _, _, grad = _run(mode, x)
        assert grad == pytest.approx([-0.75, -0.25, 0.0]), mode


def test_a_users_own_loss_from_a_file(tmp_path):
    path = tmp_path / "my_loss.py"
    path.write_text(
        "from stages.trainer.policy_loss import PolicyTerms, register_policy_loss\n"
        "@register_policy_loss('doubled')\n"
        "def doubled(x, policy):\n"
        "    return PolicyTerms(2 * x.agg(-x.advantages * x.logp))\n"
        "def halved(x, policy):\n"
        "    return PolicyTerms(0.5 * x.agg(-x.advantages * x.logp))\n"
    )
    x = _inputs([[-1.0, -2.0]], [[-1.0, -2.0]], [[1.0, 1.0]])
    assert policy_loss_fn(PolicyLossSettings("doubled", str(path)))(x, PolicySettings()).loss.item() == 3.0
    assert policy_loss_fn(PolicyLossSettings("halved", str(path)))(x, PolicySettings()).loss.item() == 0.75
    with pytest.raises(ValueError, match=r"'tripled' is not a registered policy loss nor does"):
        policy_loss_fn(PolicyLossSettings("tripled", str(path)))
    cfg = load_config(None, [f"actor.policy_loss.path={path}", "actor.policy_loss.loss_mode=halved"])
    assert cfg.actor.policy_loss.loss_mode == "halved"
    with pytest.raises(ConfigError, match=r"loss_mode='tripled' is not a registered policy loss"):
        load_config(None, [f"actor.policy_loss.path={path}", "actor.policy_loss.loss_mode=tripled"])


def test_loss_mode_keys_load_as_verl_spells_them():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
            "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.01",
            "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5",
            "actor_rollout_ref.actor.tau_neg=2.0",
        ],
    )
    loss = cfg.actor.policy().policy_loss
    assert (loss.loss_mode, loss.kl_cov_ratio, loss.ppo_kl_coef, cfg.actor.tau_neg) == ("kl_cov", 0.01, 0.5, 2.0)
    with pytest.raises(ConfigError, match=r"loss_mode='gpso'.*Did you mean 'gspo'"):
        load_config(None, ["actor.policy_loss.loss_mode=gpso"])
    with pytest.raises(ConfigError, match=r"loss_mode=dro needs actor.policy_loss.dro_beta > 0"):
        load_config(None, ["actor.policy_loss.loss_mode=dro"])
