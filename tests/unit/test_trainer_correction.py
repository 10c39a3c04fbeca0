"""TorchTrainer with `compute_prox_log_prob`: the anchor is the weights at the start of the step, and the
rollout-correction metrics see the gap between the engine's behaviour logprobs and the trainer's."""

import math

import numpy as np
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import CorrectionSettings, PolicySettings
from stages.trainer.torch_backend import TorchTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_embedded(tmp_path_factory.mktemp("corr"), num_prompts=8, seed=0).model_dir)


def _minibatch(trainer, seed, shift=0.0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 200, size=6).tolist() for _ in range(4)]
    responses = [rng.integers(10, 200, size=int(n)).tolist() for n in rng.integers(3, 9, size=4)]
    behaviour = [[x + shift for x in row] for row in trainer.logprobs(prompts, responses)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_logprobs": behaviour,
        "response_mask": [[1] * len(r) for r in responses],
        "advantage": [1.0, -1.0, 0.5, -0.5],
    }


def _trainer(model_dir, **kw):
    return TorchTrainer(model_dir, PolicySettings(lr=1e-2), compute_prox_log_prob=True, **kw)


def test_on_policy_behaviour_gives_unit_weights_and_zero_kl(model_dir):
    trainer = _trainer(model_dir, rollout_correction=CorrectionSettings(rollout_is="token", rollout_is_threshold=2.0))
    m = trainer.train_step([_minibatch(trainer, 0)])
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0, abs=1e-6)
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # one mini-batch: anchor == current weights


def test_anchor_is_taken_before_the_first_update(model_dir):
    trainer = _trainer(model_dir)
    m = trainer.train_step([_minibatch(trainer, 1), _minibatch(trainer, 2)])
    # The second mini-batch's anchor predates the first update, so its ratio has moved away from 1.
    assert abs(m["train/ratio_mean"] - 1.0) > 1e-4
    assert m["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-5)  # no correction configured, metrics still there


def test_stale_behaviour_is_weighted_and_truncated(model_dir):
    trainer = _trainer(model_dir, rollout_correction=CorrectionSettings(rollout_is="token", rollout_is_threshold=1.5))
    m = trainer.train_step([_minibatch(trainer, 3, shift=math.log(0.5))])  # the engine was half as likely
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.5, rel=1e-4)  # every weight 2, truncated at 1.5
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1.0)  # every raw weight 2 > 1.5
    assert m["rollout_corr/kl"] == pytest.approx(math.log(0.5), rel=1e-4)


def test_rejection_drops_every_token(model_dir):
    rejection = CorrectionSettings(rollout_rs="geometric", rollout_rs_threshold=1.5)
    trainer = _trainer(model_dir, rollout_correction=rejection)
    m = trainer.train_step([_minibatch(trainer, 4, shift=math.log(0.5))])
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0
    assert m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0


class RecordingTrainer(TorchTrainer):
    """A TorchTrainer that keeps, per update, the masks and IS weights its mini-batch was given."""

    def _update(self, mb, totals):
        self.seen = [*getattr(self, "seen", []), (mb.masks, mb.is_weights)]
        super()._update(mb, totals)


def _rows_of(seen):
    masks = [m.tolist() for ms, _ in seen for m in ms]
    weights = [w[: len(m)].tolist() for ms, ws in seen for m, w in zip(ms, ws, strict=True)]
    return masks, weights


def test_the_correction_is_per_step_so_splitting_into_minibatches_changes_nothing(model_dir):
    # The engine was 0.6x (mini-batch a) and 0.5x (b) as likely as the trainer: rho = 1/0.6 and 2 on every token.
    # Batch normalisation and the rejection see the whole step, as verl's once-per-batch correction does.
    settings = CorrectionSettings(
        rollout_is="token",
        rollout_is_batch_normalize=True,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.55_1.9",  # keeps rho in [1/1.9, 1/0.55] = [0.53, 1.82]: a kept, b rejected
    )
    split, whole = (RecordingTrainer(model_dir, PolicySettings(lr=1e-2), True, True, settings) for _ in range(2))
    a, b = _minibatch(split, 5, shift=math.log(0.6)), _minibatch(split, 6, shift=math.log(0.5))
    m_split = split.train_step([a, b])
    m_whole = whole.train_step([{k: a[k] + b[k] for k in a}])
    assert len(split.seen) == 2 and len(whole.seen) == 1
    (masks, weights), (masks_whole, weights_whole) = _rows_of(split.seen), _rows_of(whole.seen)
    assert (
        masks == masks_whole == [[1] * len(m) for m in a["response_mask"]] + [[0] * len(m) for m in b["response_mask"]]
    )
    assert all(np.allclose(w, v, rtol=1e-5) for w, v in zip(weights, weights_whole, strict=True))
    # token mean of the truncated weights over the whole step, not per mini-batch (which would make them all 1)
    n_a, n_b = (sum(map(len, mb["response_mask"])) for mb in (a, b))
    factor = (n_a / 0.6 + n_b * 2.0) / (n_a + n_b)
    assert m_split["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(factor, rel=1e-4)
    assert np.allclose(weights[0], (1 / 0.6) / factor, rtol=1e-4)
    corr = {k: v for k, v in m_split.items() if k.startswith("rollout_corr/")}
    assert corr == pytest.approx(
        {k: v for k, v in m_whole.items() if k.startswith("rollout_corr/")}, rel=1e-4, abs=1e-6
    )


def test_rejection_keys_load_from_the_command_line():
    base = ["async_training.compute_prox_log_prob=true", "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k3"]
    cfg = load_config(None, [*base, "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,3.0'"])
    assert cfg.algorithm.rollout_correction.rs_rules() == [("token_k1", 0.5, 2.0), ("seq_max_k3", None, 3.0)]
    cfg = load_config(None, [*base, "algorithm.rollout_correction.rollout_rs_threshold=2.0"])  # a number: "2.0"
    assert cfg.algorithm.rollout_correction.rs_rules() == [("token_k1", 0.5, 2.0), ("seq_max_k3", None, 2.0)]
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.rollout_rs has unknown option 'seq_max_k1'"):
        load_config(
            None,
            [
                *base[:1],
                "algorithm.rollout_correction.rollout_rs=seq_max_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
        )


def test_bypass_and_decoupled_mode_as_verl_selects_them(model_dir):
    def loaded(*overrides):
        cfg = load_config(None, list(overrides))
        return cfg.algorithm.rollout_correction.bypass_mode, cfg.async_training.compute_prox_log_prob, cfg.actor

    rc = "algorithm.rollout_correction"
    assert loaded()[:2] == (True, False)  # verl's fully_async default: the engine's logprobs are the anchor
    assert loaded(f"{rc}.bypass_mode=false")[:2] == (False, True)  # decoupled: proximal logprobs
    assert loaded("async_training.compute_prox_log_prob=true")[:2] == (False, True)  # the older keys
    assert loaded("actor_rollout_ref.actor.use_rollout_log_probs=false")[:2] == (False, True)
    # bypass mode with a correction to apply: verl swaps vanilla for its bypass_mode loss
    assert loaded(f"{rc}.rollout_is=token")[2].policy_loss.loss_mode == "bypass_mode"
    assert loaded(f"{rc}.rollout_is=token", f"{rc}.bypass_mode=false")[2].policy_loss.loss_mode == "vanilla"
    with pytest.raises(ConfigError, match=r"bypass_mode=true uses the engine's logprobs.*keep one of them"):
        loaded(f"{rc}.bypass_mode=true", "async_training.compute_prox_log_prob=true")
    with pytest.raises(ConfigError, match=r"cannot wrap actor.policy_loss.loss_mode=gspo.*bypass_mode=false"):
        loaded(f"{rc}.rollout_is=token", "actor.policy_loss.loss_mode=gspo")
    with pytest.raises(ConfigError, match=r"loss_mode=bypass_mode compares.*bypass_mode=true"):
        loaded(f"{rc}.bypass_mode=false", "actor.policy_loss.loss_mode=bypass_mode")
    with pytest.raises(ConfigError, match="Did you mean 'rollout_is_threshold'"):
        load_config(None, ["algorithm.rollout_correction.rollout_is_treshold=3"])
    # a trainer built by hand refuses a correction it would not apply
    with pytest.raises(ValueError, match="cannot wrap actor.policy_loss.loss_mode=vanilla"):
        TorchTrainer(model_dir, PolicySettings(lr=1e-3), rollout_correction=CorrectionSettings(rollout_is="token"))


def test_bypass_mode_corrects_inside_the_loss(model_dir):
    policy = PolicySettings(lr=1e-2)
    policy.policy_loss.loss_mode = "bypass_mode"
    settings = CorrectionSettings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.9_1.1")
    trainer = TorchTrainer(model_dir, policy, rollout_correction=settings)
    m = trainer.train_step([_minibatch(trainer, 3, shift=math.log(0.5))])  # every rho = 2: all rejected
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1.0)
    assert m["train/num_tokens"] == 0.0 and m["actor/pg_loss"] == 0.0
    m = trainer.train_step([_minibatch(trainer, 4, shift=0.0)])  # on policy: every token kept, rho 1
    assert m["rollout_corr/rollout_rs_masked_fraction"] == 0.0 and m["train/num_tokens"] > 0
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
