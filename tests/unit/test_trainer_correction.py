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
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(2.0, rel=1e-4)
    assert m["rollout_corr/rollout_is_clipped_fraction"] == 1.0
    assert m["rollout_corr/kl"] == pytest.approx(math.log(0.5), rel=1e-4)


def test_rejection_drops_every_token(model_dir):
    rejection = CorrectionSettings(rollout_rs="geometric", rollout_rs_threshold=1.5)
    trainer = _trainer(model_dir, rollout_correction=rejection)
    m = trainer.train_step([_minibatch(trainer, 4, shift=math.log(0.5))])
    assert m["rollout_corr/rollout_rs_masked_seq_fraction"] == 1.0
    assert m["actor/pg_loss"] == 0.0 and m["actor/grad_norm"] == 0.0


def test_correction_needs_the_proximal_logprobs(model_dir):
    with pytest.raises(ValueError, match="compute_prox_log_prob"):
        TorchTrainer(model_dir, PolicySettings(lr=1e-3), rollout_correction=CorrectionSettings(rollout_is="token"))
    with pytest.raises(ConfigError, match="async_training.compute_prox_log_prob=true"):
        load_config(None, ["algorithm.rollout_correction.rollout_is=token"])
    with pytest.raises(ConfigError, match="Did you mean 'rollout_is_threshold'"):
        load_config(None, ["algorithm.rollout_correction.rollout_is_treshold=3"])
    cfg = load_config(
        None, ["algorithm.rollout_correction.rollout_is=sequence", "async_training.compute_prox_log_prob=true"]
    )
    assert cfg.algorithm.rollout_correction.rollout_is == "sequence"
