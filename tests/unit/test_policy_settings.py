"""The actor's objective keys (stages/trainer/settings.PolicySettings) as the config loads them."""

from typing import get_args

import pytest

from pipeline.config import ConfigError, load_config
from stages.trainer.kl import KL_TYPES_ALL
from stages.trainer.settings import KLType, PolicySettings


def test_clip_ratio_low_and_high_fall_back_to_clip_ratio():
    assert (PolicySettings().clip_low, PolicySettings().clip_high) == (0.2, 0.2)  # verl's clip_ratio default
    wide = PolicySettings(clip_ratio=0.3)
    assert (wide.clip_low, wide.clip_high) == (0.3, 0.3)
    asymmetric = PolicySettings(clip_ratio=0.3, clip_ratio_high=0.28)
    assert (asymmetric.clip_low, asymmetric.clip_high) == (0.3, 0.28)
    policy = load_config(None, ["actor.clip_ratio=0.1", "actor.clip_ratio_low=0.05"]).actor.policy()
    assert (policy.clip_low, policy.clip_high) == (0.05, 0.28)  # conf/default.yaml sets clip_ratio_high: 0.28


@pytest.mark.parametrize("value", ["1.0", "0.5"])
def test_a_dual_clip_bound_of_at_most_one_is_refused(value):
    with pytest.raises(ConfigError, match=r"actor.clip_ratio_c must be > 1"):
        load_config(None, [f"actor.clip_ratio_c={value}"])
    with pytest.raises(ConfigError, match=r"actor.clip_ratio_c must be > 1"):
        load_config(None, [f"actor_rollout_ref.actor.clip_ratio_c={value}"])


def test_objective_keys_and_their_verl_defaults():
    cfg = load_config(None, ["actor.use_kl_loss=true", "actor.loss_agg_mode=seq-mean-token-sum-norm"])
    policy = cfg.actor.policy()
    assert (policy.use_kl_loss, policy.kl_loss_coef, policy.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert (policy.entropy_coeff, policy.clip_ratio_c, policy.loss_scale_factor) == (0.0, 3.0, None)
    with pytest.raises(ConfigError, match=r"actor.kl_loss_type.*Did you mean 'low_var_kl'\?"):
        load_config(None, ["actor.kl_loss_type=low_var_k"])
    with pytest.raises(ConfigError, match=r"actor.loss_scale_factor must be > 0"):
        load_config(None, ["actor.loss_scale_factor=0"])


def test_the_kl_type_choices_are_the_estimators_kl_py_knows():
    assert get_args(KLType) == KL_TYPES_ALL
