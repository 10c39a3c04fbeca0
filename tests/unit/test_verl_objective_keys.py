"""verl's own GRPO example (examples/grpo_trainer/run_qwen2-7b.sh): its objective keys load as a verl user passes
them, with verl's long prefixes, and mean what they mean in verl."""

import pytest

from pipeline.config import ConfigError, load_config

# The actor_rollout_ref.* and algorithm.* keys of verl's GRPO example that concern the objective, values as there.
VERL_GRPO_EXAMPLE = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.n=5",
    "algorithm.use_kl_in_reward=False",
    # verl's defaults, spelt out
    "actor_rollout_ref.actor.clip_ratio=0.2",
    "actor_rollout_ref.actor.clip_ratio_c=3.0",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "algorithm.norm_adv_by_std_in_grpo=True",
    "algorithm.gamma=1.0",
    "algorithm.lam=1.0",
    "algorithm.kl_penalty=kl",
    "algorithm.kl_ctrl.type=fixed",
    "algorithm.kl_ctrl.kl_coef=0.001",
]


def test_verl_grpo_example_objective_keys_load():
    cfg = load_config(None, [*VERL_GRPO_EXAMPLE, "rollout.total_rollout_steps=1024"])
    a = cfg.actor
    assert (a.lr, a.ppo_mini_batch_size, a.micro_batch_size, cfg.rollout.n) == (1e-6, 256, 40, 5)
    assert (a.use_kl_loss, a.kl_loss_coef, a.kl_loss_type, a.entropy_coeff) == (True, 0.001, "low_var_kl", 0.0)
    assert (a.clip_ratio, a.clip_ratio_c, a.loss_agg_mode) == (0.2, 3.0, "token-mean")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo
    assert not cfg.algorithm.use_kl_in_reward


@pytest.mark.parametrize(
    "override, names",
    [
        ("algorithm.adv_estimator=gae_plus", ["grpo", "rloo", "reinforce_plus_plus"]),
        ("actor.kl_loss_type=k4", ["low_var_kl", "k3"]),
        ("actor.loss_agg_mode=seq-sum", ["seq-mean-token-sum-norm"]),
    ],
)
def test_an_unknown_choice_lists_the_valid_ones(override, names):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert all(n in str(err.value) for n in names), str(err.value)
