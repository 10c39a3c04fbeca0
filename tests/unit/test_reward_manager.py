"""verl's reward managers (stages/reward_manager.py) in the Reward stage: naive records the score as `acc`, dapo
adds the overlong buffer's penalty worked out by hand, the managers verl registers for other interfaces are refused
with their reason, and the keys load as verl spells them (its current `reward.*` and its older spellings)."""

import json

import pyarrow as pa
import pytest

from pipeline.config import ConfigError, load_config
from stages.reward import Reward
from stages.reward_manager import OverlongBuffer, RewardManager


def _block(lengths: list[int], right: bool = True) -> pa.Table:
    n = len(lengths)
    return pa.table(
        {
            "sample_id": [f"p/{i}" for i in range(n)],
            "response_text": ["c b a" if right else "a b c"] * n,
            "ground_truth": ["c b a"] * n,
            "data_source": ["reverse"] * n,
            "num_tokens": pa.array(lengths, pa.int32()),
        }
    )


def _score(manager: RewardManager, lengths: list[int], right: bool = True) -> tuple[list, list]:
    stage = Reward(num_workers=1, manager=manager)
    out = stage(_block(lengths, right))
    stage.close()
    return out["reward"].to_pylist(), [json.loads(x) for x in out["reward_extra_info"].to_pylist()]


def test_naive_records_the_score_as_acc():
    rewards, extras = _score(RewardManager(), [3, 30])
    assert rewards == [1.0, 1.0] and extras == [{"acc": 1.0}, {"acc": 1.0}]


def test_dapo_overlong_buffer_by_hand():
    # max_resp_len 20, buffer 8: free up to 12 tokens, then -(L - 12) / 8 * 0.5, down to -0.5 at 20 tokens
    manager = RewardManager("dapo", OverlongBuffer(enable=True, len=8, penalty_factor=0.5, log=True), 20)
    rewards, extras = _score(manager, [5, 12, 16, 20])
    assert rewards == pytest.approx([1.0, 1.0, 1.0 - 4 / 8 * 0.5, 1.0 - 8 / 8 * 0.5])
    assert [e["overlong_reward"] for e in extras] == pytest.approx([0.0, 0.0, -0.25, -0.5])
    assert [e["overlong"] for e in extras] == [False, False, True, True]
    assert all(e["acc"] == 1.0 for e in extras)  # acc stays the score before shaping
    wrong, _ = _score(manager, [20], right=False)
    assert wrong == pytest.approx([0.0 - 0.5])  # a wrong answer pays too
    quiet = RewardManager("dapo", OverlongBuffer(enable=True, len=8, penalty_factor=0.5), 20)
    assert _score(quiet, [20])[1] == [{"acc": 1.0}]  # log=false: the penalty applies, unrecorded
    off = RewardManager("dapo", OverlongBuffer(enable=False, len=8), 20)
    assert _score(off, [20])[0] == [1.0]


def test_a_failed_score_stays_zero_and_unshaped():
    manager = RewardManager("dapo", OverlongBuffer(enable=True, len=8), 20)
    assert manager.shape(0.0, "timed out", None, 20) == (0.0, "timed out", None)


def test_the_dapo_recipe_keys_load_as_verl_writes_them():
    dapo = [
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=True",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=16",
        "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
        "+reward.reward_kwargs.overlong_buffer_cfg.log=False",
        "+reward.reward_kwargs.max_resp_len=48",
    ]
    manager = load_config(None, dapo).reward_manager()
    assert (manager.name, manager.overlong, manager.max_resp_len) == ("dapo", OverlongBuffer(True, 16, 1.0), 48)
    # verl's older spelling: reward_model.reward_manager and reward_model.reward_kwargs
    older = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"]
    manager = load_config(None, [*older, "+reward_model.reward_kwargs.overlong_buffer_cfg.len=16"]).reward_manager()
    assert manager.name == "dapo" and manager.overlong.len == 16
    assert manager.max_resp_len == load_config(None, []).data.max_response_length  # null: the run's length


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.reward_manager.name=batch"], "calls the reward function once with lists"),
        (["reward.reward_manager.name=rate_limited"], "throttles calls to a remote scoring API"),
        (["reward.reward_manager.name=naiv"], "expected one of naive, dapo, gdpo, prime, remote"),
        (["reward.reward_manager.module.path=my.py"], "reward manager class of your own"),
        (
            ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.enable=true"],
            "overlong_buffer_cfg.len <= max_resp_len",
        ),
        (["reward.reward_kwargs.overlong_buffer_cfg.lenght=4"], "Did you mean 'len'"),
    ],
)
def test_bad_manager_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_prime_and_remote_score_as_naive():
    for name in ("prime", "remote"):
        assert _score(RewardManager(name), [3]) == ([1.0], [{"acc": 1.0}])


def test_gdpo_keeps_a_dict_results_score_beside_its_components():
    manager = RewardManager("gdpo")
    assert manager.shape(0.5, None, json.dumps({"fmt": 1.0}), 3) == (0.5, None, json.dumps({"score": 0.5, "fmt": 1.0}))
    assert manager.shape(0.5, None, None, 3) == (0.5, None, json.dumps({"acc": 0.5}))  # a number: as naive
