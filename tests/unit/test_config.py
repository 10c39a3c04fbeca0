"""Typed config: every shipped YAML loads, a typo names the nearest key, verl's names work."""

import json
from pathlib import Path

import pytest

from pipeline.config import CONF_DIR, ConfigError, load_config

CONFIGS = sorted(Path(CONF_DIR).rglob("*.yaml"))


def test_conf_dir_has_configs():
    assert len(CONFIGS) >= 4


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.rollout.n >= 1


def test_typo_names_the_nearest_key():
    with pytest.raises(ConfigError, match=r"staleness_treshold.*Did you mean 'staleness_threshold'"):
        load_config(None, ["async_training.staleness_treshold=0.5"])


def test_typo_in_a_section_name():
    with pytest.raises(ConfigError, match="Did you mean 'rollout'"):
        load_config(None, ["rolout.n=4"])


def test_verl_long_prefixes_are_accepted():
    cfg = load_config(None, ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=2"])
    assert cfg.actor.ppo_mini_batch_size == 4
    assert cfg.rollout.n == 2


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(None, ["rollout.n=many"])


def test_stage_keyword_typo_names_the_parameter():
    from pipeline.config import bind, stage_class

    spec = dict(load_config(None).stages.reward, timout_s=3)
    cls, extra = stage_class(spec, "stages.reward")
    with pytest.raises(ConfigError, match="Did you mean 'timeout_s'"):
        bind(cls, "stages.reward", {}, extra)


def test_stage_target_must_import():
    from pipeline.config import stage_class

    with pytest.raises(ConfigError, match="cannot be imported"):
        stage_class({"_target_": "stages.reward.NoSuchStage"}, "stages.reward")


def test_stage_swap_is_declarative(tmp_path):
    yaml = tmp_path / "swap.yaml"
    yaml.write_text("stages:\n  advantage:\n    _target_: stages.advantage.GRPOAdvantage\n    norm_by_std: false\n")
    cfg = load_config(yaml)
    assert cfg.stages.advantage == {"_target_": "stages.advantage.GRPOAdvantage", "norm_by_std": False}


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="trigger_parameter_sync_step"):
        load_config(None, ["async_training.trigger_parameter_sync_step=0"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["rollout.n"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.yaml")


def test_scoring_in_the_engine_by_default_unless_a_reference_model_needs_its_stage():
    assert load_config(None).scores_in_engine()  # with engine restarts (the default 3)
    assert not load_config(None, ["rollout.score_in_engine=false"]).scores_in_engine()
    assert not load_config(None, ["algorithm.use_kl_in_reward=true"]).scores_in_engine()  # unset: the stage path
    with pytest.raises(ConfigError, match="reference model.*actor.use_kl_loss"):
        load_config(None, ["rollout.score_in_engine=true", "actor.use_kl_loss=true"])


def test_sim_section_and_backend_are_checked():
    with pytest.raises(ConfigError, match=r"sim.decode_s_per_tokn.*Did you mean 'decode_s_per_token'"):
        load_config(None, ["sim.decode_s_per_tokn=0.1"])
    with pytest.raises(ConfigError, match=r"sim.slots = 0 is out of range"):
        load_config(None, ["sim.slots=0"])
    with pytest.raises(
        ConfigError, match=r"trainer.backend': Invalid value 'jax', expected one of \['torch', 'megatron', 'sim'\]"
    ):
        load_config(None, ["trainer.backend=jax"])
    with pytest.raises(ConfigError, match="no weights to checkpoint"):
        load_config(CONF_DIR / "sim" / "toy.yaml", ["trainer.save_freq=2"])


def test_verl_validation_keys():
    cfg = load_config(None, ["async_training.use_trainer_do_validate=true"])
    assert cfg.async_training.use_trainer_do_validate and cfg.async_training.parallel_validate_and_rollout
    with pytest.raises(ConfigError, match=r"_and_rolout.*Did you mean 'parallel_validate_and_rollout'"):
        load_config(None, ["async_training.parallel_validate_and_rolout=false"])
    with pytest.raises(ConfigError, match="use_trainer_do_validate runs a dedicated vLLM engine"):
        load_config(CONF_DIR / "sim" / "toy.yaml", ["async_training.use_trainer_do_validate=true"])


@pytest.mark.parametrize(
    ("config", "fits"),
    [
        ({"max_position_embeddings": 256}, False),
        ({"max_position_embeddings": 512}, True),
        ({"max_position_embeddings": 256, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, True),
        ({}, True),
    ],
)
def test_prompt_and_response_must_fit_the_model(tmp_path, config, fits):
    from pipeline.prepare import check_context

    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config(None, ["data.max_prompt_length=224", "data.max_response_length=48"])
    if fits:
        check_context(cfg, tmp_path)
        return
    with pytest.raises(ConfigError, match=r"= 272 tokens, more than the model's 256 positions"):
        check_context(cfg, tmp_path)


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor.loss_agg_mode=token-men", r"actor.loss_agg_mode.*expected one of .*Did you mean 'token-mean'\?"),
        ("weight_sync.mode=pul", r"weight_sync.mode.*Did you mean 'pull'\?"),
        ("async_training.partial_rollout_mode=kep", r"partial_rollout_mode.*Did you mean 'keep'\?"),
        ("algorithm.rollout_correction.rollout_is=tokn", r"rollout_is.*Did you mean 'token'\?"),
    ],
)
def test_a_choice_outside_its_type_names_the_nearest_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_moved_stage_class_names_its_new_path():
    with pytest.raises(ConfigError, match="has moved: use 'stages.sim.generate.SimGenerate'"):
        load_config(None, ["stages.generate._target_=stages.sim_generate.SimGenerate"])


def test_actor_section_is_the_trainer_policy_settings():
    cfg = load_config(None, ["actor.clip_ratio_high=0.3", "actor.micro_batch_size=4"])
    policy = cfg.actor.policy()
    assert (policy.clip_ratio_high, policy.micro_batch_size, policy.lr) == (0.3, 4, cfg.actor.lr)
    assert not hasattr(policy, "ppo_mini_batch_size")
