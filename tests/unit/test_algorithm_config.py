"""verl's `algorithm.*` keys load and choose the stages: the estimator class, the step-level whitening, the
reference stage, and the metrics of the KL in the reward."""

from types import SimpleNamespace
from typing import get_args

import pyarrow as pa
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config.schema import AdvEstimator, KLType
from pipeline.observe.metrics import reward_kl_metrics
from pipeline.stream import advantage_stage, reference_model_dir, step_transform
from stages.advantage import (
    ESTIMATORS,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
    RLOOAdvantage,
    whiten_step,
)
from stages.trainer.kl import KL_TYPES_ALL


def test_defaults_are_verls():
    alg = load_config(None).algorithm
    assert (alg.adv_estimator, alg.norm_adv_by_std_in_grpo, alg.gamma, alg.lam) == ("grpo", True, 1.0, 1.0)
    assert (alg.use_kl_in_reward, alg.kl_penalty, alg.kl_ctrl.type, alg.kl_ctrl.kl_coef) == (
        False,
        "kl",
        "fixed",
        0.001,
    )
    assert (alg.kl_ctrl.horizon, alg.kl_ctrl.target_kl) == (10000, 0.1)


def test_every_new_key_loads():
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "algorithm.gamma=0.99",
            "algorithm.lam=0.95",
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=low_var_kl",
            "algorithm.kl_ctrl.type=fixed",
            "algorithm.kl_ctrl.kl_coef=0.01",
            "algorithm.kl_ctrl.horizon=500",
            "algorithm.kl_ctrl.target_kl=0.2",
            "stages.ref_logprob.micro_batch_size=4",
        ],
    )
    alg = cfg.algorithm
    assert (alg.adv_estimator, alg.norm_adv_by_std_in_grpo, alg.gamma, alg.lam) == (
        "reinforce_plus_plus",
        False,
        0.99,
        0.95,
    )
    assert (alg.use_kl_in_reward, alg.kl_penalty, alg.kl_ctrl.kl_coef) == (True, "low_var_kl", 0.01)
    assert (alg.kl_ctrl.horizon, alg.kl_ctrl.target_kl) == (500, 0.2)
    assert cfg.stages.ref_logprob == {"_target_": "stages.ref_logprob.RefLogprob", "micro_batch_size": 4}


def test_verl_grpo_example_keys_load():
    # verl's examples/grpo_trainer scripts pass these as they are
    cfg = load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.use_kl_in_reward is False


def test_unknown_estimator_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"adv_estimator.*'gae_plus'.*grpo.*rloo.*reinforce_plus_plus_baseline"):
        load_config(None, ["algorithm.adv_estimator=gae_plus"])
    with pytest.raises(ConfigError, match=r"Did you mean 'rloo'"):
        load_config(None, ["algorithm.adv_estimator=rlo"])


def test_adaptive_kl_controller_is_refused():
    with pytest.raises(ConfigError, match="only a fixed KL coefficient is supported"):
        load_config(None, ["algorithm.kl_ctrl.type=adaptive"])
    with pytest.raises(ConfigError, match="algorithm.kl_penalty"):
        load_config(None, ["algorithm.kl_penalty=full"])  # verl's 'full' is not implemented there either


def test_the_literals_match_the_code():
    from pipeline.config.schema import REFUSED_ESTIMATORS

    assert set(get_args(AdvEstimator)) == set(ESTIMATORS) | set(REFUSED_ESTIMATORS)
    assert not set(ESTIMATORS) & set(REFUSED_ESTIMATORS)
    assert set(get_args(KLType)) == set(KL_TYPES_ALL)


@pytest.mark.parametrize(
    ("name", "cls", "whitened"),
    [
        ("grpo", GRPOAdvantage, False),
        ("rloo", RLOOAdvantage, False),
        ("reinforce_plus_plus", ReinforcePlusPlusAdvantage, True),
        ("reinforce_plus_plus_baseline", ReinforcePlusPlusBaselineAdvantage, True),
        ("grpo_vectorized", GRPOAdvantage, False),
    ],
)
def test_adv_estimator_picks_the_class(name, cls, whitened):
    cfg = load_config(None, [f"algorithm.adv_estimator={name}", "rollout.n=4", "algorithm.gamma=0.5"])
    got, kwargs = advantage_stage(cfg)
    assert got is cls and kwargs["group_size"] == 4
    assert step_transform(cfg) is (whiten_step if whitened else None)
    if name == "reinforce_plus_plus":
        assert kwargs["gamma"] == 0.5


def test_grpo_gets_verls_std_switch_and_the_kl_settings():
    cfg = load_config(
        None,
        ["algorithm.norm_adv_by_std_in_grpo=false", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.2"],
    )
    cls, kwargs = advantage_stage(cfg)
    stage = cls(**kwargs)
    assert stage.norm_by_std is False and stage.kl_in_reward is True and stage.kl_coef == 0.2


def test_an_explicit_target_wins_over_adv_estimator(tmp_path):
    yaml = tmp_path / "own.yaml"
    yaml.write_text(
        "algorithm:\n  adv_estimator: rloo\nstages:\n  advantage:\n    _target_: stages.advantage.GRPOAdvantage\n"
    )
    cls, _ = advantage_stage(load_config(yaml))
    assert cls is GRPOAdvantage
    # keywords without a target go to adv_estimator's class
    cls, kwargs = advantage_stage(load_config(None, ["stages.advantage.epsilon=0.5"]))
    assert cls is GRPOAdvantage and kwargs["epsilon"] == 0.5


def test_a_key_the_wiring_sets_is_refused_in_the_stage_spec():
    with pytest.raises(ConfigError, match="stages.advantage.norm_by_std.*set by the wiring"):
        advantage_stage(load_config(None, ["stages.advantage.norm_by_std=false"]))


def test_kl_in_reward_needs_a_stage_that_takes_it():
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true", "stages.advantage._target_=stages.reward.Reward"])
    with pytest.raises(ConfigError, match="use_kl_in_reward needs an advantage stage that takes `kl_in_reward`"):
        advantage_stage(cfg)


def test_reference_stage_only_when_a_kl_needs_it():
    assert not load_config(None).uses_reference()
    assert load_config(None, ["algorithm.use_kl_in_reward=true"]).uses_reference()
    cfg = load_config(None)
    cfg.actor.use_kl_loss = True  # the trainer's key (PolicySettings); set here as the config would
    assert cfg.uses_reference()


def test_reference_model_is_the_start_even_on_resume():
    cfg = load_config(None)
    assert reference_model_dir(cfg, "/ckpt/model", "/runs/x") == "/ckpt/model"
    cfg.resume = True
    assert reference_model_dir(cfg, "/ckpt/model", "/runs/x") == "/runs/x/model"  # the embedded start
    cfg.model.path = "/models/qwen"
    assert reference_model_dir(cfg, "/ckpt/model", "/runs/x") == "/models/qwen"


def test_reward_kl_metrics_only_with_the_column():
    # verl: actor/reward_kl_penalty = mean over samples of each sample's masked mean KL
    table = pa.table({"reward_kl": pa.array([0.2, -0.1, 0.5], pa.float32())})
    m = reward_kl_metrics(table, 0.001)
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.2) and m["actor/reward_kl_penalty_coeff"] == 0.001
    assert reward_kl_metrics(pa.table({"reward": [1.0]}), 0.001) == {}


@pytest.mark.parametrize(
    ("name", "needs"),
    [
        ("gae", "a critic"),
        ("remax", "a greedy baseline rollout"),
    ],
)
def test_an_estimator_that_needs_what_the_stream_lacks_names_it(name, needs):
    with pytest.raises(ConfigError, match=f"adv_estimator={name} needs {needs}"):
        load_config(None, [f"algorithm.adv_estimator={name}"])


@pytest.mark.parametrize("name, kind", [("optimal_token_baseline", "otb"), ("tir_optimal_token_baseline", "tir")])
def test_the_optimal_token_baseline_needs_the_proximal_pass_and_the_torch_trainer(name, kind):
    from pipeline.trainer_launch import _policy

    on = [f"algorithm.adv_estimator={name}"]
    with pytest.raises(ConfigError, match=f"{name} takes sum pi.2 from the trainer's proximal logprob pass"):
        load_config(None, on)  # the default is bypass mode
    decoupled = [*on, "algorithm.rollout_correction.bypass_mode=false"]
    with pytest.raises(ConfigError, match="set actor.calculate_sum_pi_squared=true"):
        load_config(None, decoupled)
    decoupled.append("actor_rollout_ref.actor.calculate_sum_pi_squared=true")  # verl's spelling
    with pytest.raises(ConfigError, match="actor.trainer_baseline is set from algorithm.adv_estimator"):
        load_config(None, [*decoupled, "actor.trainer_baseline=otb"])
    with pytest.raises(ConfigError, match="needs a trainer that computes logprobs"):
        load_config(None, [*decoupled, "trainer.backend=sim"])
    cfg = load_config(None, decoupled)
    assert _policy(SimpleNamespace(cfg=cfg)).trainer_baseline == kind
    assert _policy(SimpleNamespace(cfg=load_config(None))).trainer_baseline == ""


def test_gpg_scales_over_the_step():
    from pipeline.stream import step_transform
    from stages.advantage import GPGAdvantage

    assert step_transform(load_config(None, ["algorithm.adv_estimator=gpg"])) == GPGAdvantage.over_step
    assert step_transform(load_config(None, ["algorithm.adv_estimator=opo"])) is None
