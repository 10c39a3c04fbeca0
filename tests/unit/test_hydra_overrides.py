"""Command-line overrides read as verl's hydra reads them: `+key=value` and `++key=value` set what `key=value` sets
(verl's scripts write `+` for keys its config lacks), in verl's spelling and ours; hydra's other forms are errors."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config

DAPO_REWARD = [
    "reward_model.reward_manager=dapo",
    "{p}reward.reward_kwargs.overlong_buffer_cfg.enable=True",
    "{p}reward.reward_kwargs.overlong_buffer_cfg.len=16",
    "{p}reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "{p}reward.reward_kwargs.max_resp_len=48",
    '{p}actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.cudagraph_capture_sizes="[8, 16]"',
    "{p}actor_rollout_ref.actor.clip_ratio_high=0.28",
    "{p}actor_rollout_ref.actor.optim.lr=1e-6",
]


@pytest.mark.parametrize("prefix", ["+", "++"])
def test_plus_and_double_plus_set_what_the_plain_key_sets(prefix):
    plain = load_config(None, [o.format(p="") for o in DAPO_REWARD])
    hydra = load_config(None, [o.format(p=prefix) for o in DAPO_REWARD])
    assert hydra == plain
    buffer = hydra.reward.reward_kwargs.overlong_buffer_cfg
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 16, 1.0)
    assert hydra.reward.reward_kwargs.max_resp_len == 48
    assert hydra.rollout.engine_kwargs.vllm == {"compilation_config": {"cudagraph_capture_sizes": "[8, 16]"}}
    assert hydra.actor.clip_ratio_high == 0.28 and hydra.actor.lr == 1e-6


def test_values_take_hydras_types():
    cfg = load_config(
        None,
        [
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.enforce_eager=True",  # a bool, not the string 'True'
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_num_seqs=64",
            "++actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=auto",
            "++actor_rollout_ref.rollout.engine_kwargs.vllm.cudagraph_capture_sizes=[8,16]",
            "+actor_rollout_ref.rollout.engine_kwargs.vllm.tokenizer=null",
        ],
    )
    assert cfg.rollout.engine_kwargs.vllm == {
        "enforce_eager": True,
        "max_num_seqs": 64,
        "kv_cache_dtype": "auto",
        "cudagraph_capture_sizes": [8, 16],
        "tokenizer": None,
    }


def test_the_last_override_of_a_key_wins_whatever_its_prefix():
    cfg = load_config(None, ["rollout.n=4", "++rollout.n=6", "+rollout.n=2"])
    assert cfg.rollout.n == 2


@pytest.mark.parametrize(
    "override", ["+++rollout.n=4", "~rollout.n", "~rollout.n=4", "+~rollout.n=4", "rollout.n", "rollout@x=4", "++=4"]
)
def test_hydras_other_forms_are_one_error_naming_the_valid_ones(override):
    with pytest.raises(ConfigError, match=r"key=value, \+key=value or \+\+key=value"):
        load_config(None, [override])
