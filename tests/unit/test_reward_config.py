"""The `reward.*` keys (pipeline/config/reward.py): verl's spellings, the cross-field rules, the checks at start, the
layout's reward-model actors, and what the wiring builds from them (pipeline/stream.py's reward_step)."""

import socket

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config.placement import HEAD, check, layout, resolve
from pipeline.config.reward import check_reward_sources
from pipeline.stream import judge_kwargs, reward_model_kwargs, reward_step
from stages.remote_reward import RemoteReward
from stages.reward import Reward
from tests.unit.test_reward_model import rm_dir  # noqa: F401 - the module-scoped fixture

CUSTOM = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"


@pytest.fixture
def custom(tmp_path):
    (tmp_path / "f.py").write_text(CUSTOM)
    return f"custom_reward_function.path={tmp_path / 'f.py'}"


@pytest.mark.parametrize(
    "overrides",
    [
        ["reward_model.enable=true", "reward_model.model.path=/m"],  # verl's legacy section
        ["reward.reward_model.enable=true", "reward.reward_model.model.path=/m"],
        ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m"],  # verl 0.9.1
    ],
)
def test_verl_spellings_of_the_reward_model(overrides):
    rm = load_config(None, overrides).reward.reward_model
    assert rm.enable and rm.model_path == "/m"


def test_a_reward_model_takes_the_scoring_out_of_the_engine():
    cfg = load_config(None, ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m"])
    assert not cfg.scores_in_engine()
    assert load_config(None).scores_in_engine()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reward.reward_model.enable=true"], "reward.reward_model.enable needs reward.reward_model.model_path"),
        (
            ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m", "rollout.score_in_engine=true"],
            "leaves no place for the reward model's stage",
        ),
        (["reward.remote.url=127.0.0.1:8000/score"], "must be an http:// or https:// URL"),
        (["reward.remote.max_concurrent=0"], "reward.remote.max_concurrent must be >= 1"),
        (
            ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m", "reward.remote.url=http://h/s"],
            "nothing combines them",
        ),
        (["reward.judge.enable=true"], "reward.judge.enable needs reward.judge.path"),
        (
            ["reward.judge.enable=true", "reward.judge.path=j.py", "rollout.score_in_engine=true"],
            "leaves no place for the judge's stage",
        ),
        (
            ["reward.judge.enable=true", "reward.judge.path=j.py", "reward.judge.max_model_len=64"],
            "reward.judge.max_model_len must exceed reward.judge.max_tokens",
        ),
        (
            [
                "reward.judge.enable=true",
                "reward.judge.path=j.py",
                "reward.reward_model.enable=true",
                "reward.reward_model.model_path=/m",
            ],
            "reward_model and judge each give a score and nothing combines them",
        ),
        (["reward.on_error=masked"], "Did you mean 'mask'"),
        (["reward.max_attempts=0"], "reward.max_attempts must be >= 1"),
    ],
)
def test_bad_reward_settings_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_custom_function_combines_two_model_sources(custom):
    cfg = load_config(
        None,
        [
            "reward.reward_model.enable=true",
            "reward.reward_model.model_path=/m",
            "reward.remote.url=http://h/s",
            custom,
        ],
    )
    step = reward_step(cfg)
    assert isinstance(step.rule, Reward) and step.rule_name == "custom"
    assert isinstance(step.remote, RemoteReward) and step.model_sources == ("reward_model",)


def test_a_judge_is_a_model_source_with_the_policys_weights_by_default(custom):
    on = ["reward.judge.enable=true", "reward.judge.path=j.py"]
    alone = load_config(None, on)
    assert not alone.scores_in_engine()
    step = reward_step(alone)
    assert step.rule is None and step.model_sources == ("judge",)  # alone, its score is the reward
    assert judge_kwargs(alone, "/policy")["model_dir"] == "/policy" and judge_kwargs(alone, "/p")["max_attempts"] == 1
    named = load_config(None, [*on, "reward.judge.model_path=/judge", "reward.on_error=retry"])
    assert judge_kwargs(named, "/policy")["model_dir"] == "/judge" and judge_kwargs(named, "/p")["max_attempts"] == 3
    both = reward_step(
        load_config(None, [*on, "reward.reward_model.enable=true", "reward.reward_model.model_path=/m", custom])
    )
    assert both.rule_name == "custom" and both.model_sources == ("reward_model", "judge")


def test_what_the_wiring_builds():
    default = reward_step(load_config(None))
    assert isinstance(default.rule, Reward) and default.rule_name == "rule" and default.remote is None
    assert default.on_error == "mask" and default.attempts == 1
    rm_only = load_config(
        None, ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m", "reward.on_error=retry"]
    )
    step = reward_step(rm_only)
    assert step.rule is None and step.model_sources == ("reward_model",) and step.attempts == 3
    assert reward_model_kwargs(rm_only)["max_attempts"] == 3
    remote = reward_step(load_config(None, ["reward.remote.url=http://127.0.0.1:1/score", "reward.remote.timeout_s=5"]))
    assert remote.rule is None and remote.remote.url == "http://127.0.0.1:1/score" and remote.remote.timeout_s == 5


def test_the_layout_counts_the_judge_replicas():
    cfg = load_config(None, ["reward.judge.enable=true", "reward.judge.path=j.py", "reward.judge.num_replicas=3"])
    gpu_node = [{"CPU": 16.0, "GPU": 2.0, HEAD: 1.0}]
    (judge,) = [g for g in layout(cfg, resolve(cfg.ray, gpu_node), 2.0, reference=False) if g.name == "judge"]
    assert judge.count == 3 and judge.bundle == {"CPU": 0.5, "GPU": 1.0}
    assert "3 x judge" in check(layout(cfg, resolve(cfg.ray, gpu_node), 2.0, reference=False), gpu_node)


def test_the_layout_counts_the_reward_model_replicas():
    cfg = load_config(
        None,
        ["reward.reward_model.enable=true", "reward.reward_model.model_path=/m", "reward.reward_model.num_replicas=2"],
    )
    gpu_node = [{"CPU": 16.0, "GPU": 2.0, HEAD: 1.0}]
    groups = layout(cfg, resolve(cfg.ray, gpu_node), 2.0, reference=False)
    (rm,) = [g for g in groups if g.name == "reward model"]
    assert rm.count == 2 and rm.bundle == {"CPU": 0.5, "GPU": 1.0}
    message = check(groups, gpu_node)  # an engine and two reward models want 3 GPUs of 2
    assert "2 x reward model" in message and "reward.reward_model.num_replicas" in message
    assert check(layout(cfg, resolve(cfg.ray, gpu_node), 0.0, reference=False), [{"CPU": 16.0, HEAD: 1.0}]) is None


def test_the_checks_at_start(rm_dir, tmp_path):  # noqa: F811
    check_reward_sources(load_config(None).reward)  # nothing to check
    ok = load_config(None, ["reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}"])
    check_reward_sources(ok.reward)
    missing = load_config(None, ["reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}/no"])
    with pytest.raises(ConfigError, match="has no config.json"):
        check_reward_sources(missing.reward)
    with socket.socket() as s:  # a port nothing listens on: held, never listened on, while it is probed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        down = load_config(None, [f"reward.remote.url=http://127.0.0.1:{port}/score"])
        with pytest.raises(ConfigError, match="cannot be reached"):
            check_reward_sources(down.reward)


def test_the_judges_checks_at_start(tmp_path):
    good, half = tmp_path / "judge.py", tmp_path / "half.py"
    good.write_text("def judge_prompt(*a):\n    return 'q'\n\n\ndef judge_score(*a):\n    return 1.0\n")
    half.write_text("def judge_prompt(*a):\n    return 'q'\n")
    on = ["reward.judge.enable=true"]
    check_reward_sources(load_config(None, [*on, f"reward.judge.path={good}"]).reward)  # the policy as judge
    with pytest.raises(ConfigError, match="defines no judge_score: define both"):
        check_reward_sources(load_config(None, [*on, f"reward.judge.path={half}"]).reward)
    with pytest.raises(ConfigError, match="no such file"):
        check_reward_sources(load_config(None, [*on, f"reward.judge.path={tmp_path}/none.py"]).reward)
    no_model = load_config(None, [*on, f"reward.judge.path={good}", f"reward.judge.model_path={tmp_path}/m"])
    with pytest.raises(ConfigError, match="reward.judge.model_path .* has no config.json"):
        check_reward_sources(no_model.reward)
