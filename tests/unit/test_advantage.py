"""Advantage estimators and the KL in the reward on hand-built blocks, against values worked out by hand from
verl's definitions (core_algos.py; SPEC §3 "KL in the reward", §4)."""

import json
import math

import numpy as np
import pyarrow as pa
import pytest

from schemas import MissingColumnsError
from stages.advantage import (
    GDPOAdvantage,
    GRPOAdvantage,
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
    RLOOAdvantage,
    whiten_step,
)


def block(prompt_ids, rewards, masks, logprobs=None, ref=None) -> pa.Table:
    cols = {"prompt_id": prompt_ids, "reward": pa.array(rewards, pa.float32()), "response_mask": masks}
    if logprobs is not None:
        cols["response_logprobs"] = pa.array(logprobs, pa.list_(pa.float32()))
    if ref is not None:
        cols["ref_logprobs"] = pa.array(ref, pa.list_(pa.float32()))
    return pa.table(cols)


def adv(table: pa.Table) -> list[float]:
    return table["advantage"].to_pylist()


def test_grpo_group_of_three_by_hand():
    # mean 2/3, unbiased std sqrt(1/3) = 0.57735: (s - mean) / (std + 1e-6)
    out = GRPOAdvantage(group_size=3)(block(["a"] * 3, [1.0, 0.0, 1.0], [[1, 1], [1], [0, 1]]))
    assert adv(out) == pytest.approx([0.577349, -1.154699, 0.577349], abs=1e-6)
    assert out["token_advantages"].to_pylist()[2] == pytest.approx([0.0, 0.577349], abs=1e-6)  # 0 where masked


def test_grpo_group_of_one_keeps_its_score():
    # verl: a group of one has mean 0 and std 1, so a = s / (1 + 1e-6)
    out = GRPOAdvantage(group_size=1)(block(["a", "b"], [0.7, 0.0], [[1, 1], [1]]))
    assert adv(out) == pytest.approx([0.7 / (1 + 1e-6), 0.0], abs=1e-7)
    assert adv(out)[0] != pytest.approx(0.7, abs=1e-8)  # the epsilon is there
    dr = GRPOAdvantage(group_size=1, norm_by_std=False)(block(["a"], [0.7], [[1]]))
    assert adv(dr) == pytest.approx([0.7])


def test_grpo_all_equal_and_dr_grpo():
    assert adv(GRPOAdvantage(group_size=2)(block(["a", "a"], [1.0, 1.0], [[1], [1]]))) == [0.0, 0.0]
    dr = GRPOAdvantage(group_size=3, norm_by_std=False)(block(["a"] * 3, [1.0, 0.0, 1.0], [[1]] * 3))
    assert adv(dr) == pytest.approx([1 / 3, -2 / 3, 1 / 3])  # s - mean, no std


def test_rloo_by_hand():
    # n / (n - 1) * (s - mean) = s - mean of the others: [1 - 0.5, 0 - 1, 1 - 0.5]
    out = RLOOAdvantage(group_size=3)(block(["a"] * 3, [1.0, 0.0, 1.0], [[1]] * 3))
    assert adv(out) == pytest.approx([0.5, -1.0, 0.5])
    # a group of one keeps its raw score (verl's `rloo`; `rloo_vectorized` would give 0)
    assert adv(RLOOAdvantage(group_size=1)(block(["a"], [0.7], [[1, 1]]))) == pytest.approx([0.7])


def test_reinforce_pp_returns_before_whitening():
    # gamma 0.5, score 1 on the last of 3 tokens: ret = [0.25, 0.5, 1]
    out = ReinforcePlusPlusAdvantage(group_size=1, gamma=0.5)(block(["a"], [1.0], [[1, 1, 1]]))
    assert out["token_advantages"].to_pylist() == [pytest.approx([0.25, 0.5, 1.0])]
    assert adv(out) == [0.25]  # the first trained token's
    # a masked token restarts the running return (run = ret_t * mask_t): ret = [0, 1, 1], times the mask
    out = ReinforcePlusPlusAdvantage(group_size=1)(block(["a"], [1.0], [[1, 0, 1]]))
    assert out["token_advantages"].to_pylist() == [pytest.approx([0.0, 0.0, 1.0])]
    assert adv(out) == [0.0]


def test_reinforce_pp_shared_example_whitened_over_the_step():
    # SPEC §4: A (3 tokens, score 1), B (2 tokens, score 0), gamma 1: returns {1,1,1,0,0}, mean 0.6, unbiased
    # variance 0.3; (1 - 0.6) / sqrt(0.3 + 1e-8) = 0.730297, (0 - 0.6) / sqrt(0.3 + 1e-8) = -1.095445
    rows = block(["a", "b"], [1.0, 0.0], [[1, 1, 1], [1, 1]])
    stage = ReinforcePlusPlusAdvantage(group_size=1)
    assert stage.whiten_over_step
    out = whiten_step(stage(rows))
    tokens = out["token_advantages"].to_pylist()
    assert tokens[0] == pytest.approx([0.730297] * 3, abs=1e-6) and tokens[1] == pytest.approx(
        [-1.095445] * 2, abs=1e-6
    )
    assert adv(out) == pytest.approx([0.730297, -1.095445], abs=1e-6)


def test_reinforce_pp_baseline_shared_example_and_group_of_one():
    # same uid: centred 0.5 x 3 and -0.5 x 2; whitening maps them to the same numbers as RF++
    stage = ReinforcePlusPlusBaselineAdvantage(group_size=2)
    assert stage.whiten_over_step
    centred = stage(block(["a", "a"], [1.0, 0.0], [[1, 1, 1], [1, 1]]))
    assert adv(centred) == pytest.approx([0.5, -0.5])
    out = whiten_step(centred)
    assert out["token_advantages"].to_pylist()[1] == pytest.approx([-1.095445] * 2, abs=1e-6)
    assert adv(out) == pytest.approx([0.730297, -1.095445], abs=1e-6)
    # a group of one has mean 0: it keeps its score before the whitening
    single = ReinforcePlusPlusBaselineAdvantage(group_size=1)(block(["a"], [0.7], [[1, 0]]))
    assert single["token_advantages"].to_pylist() == [pytest.approx([0.7, 0.0])]


def test_whitening_is_over_trained_tokens_only():
    # trained values {2, 4} (a masked 100 is ignored): mean 3, unbiased variance 2 -> -+1/sqrt(2 + 1e-8)
    table = pa.table(
        {
            "response_mask": [[1, 0], [1]],
            "token_advantages": pa.array([[2.0, 100.0], [4.0]], pa.list_(pa.float32())),
            "advantage": pa.array([2.0, 4.0], pa.float32()),
        }
    )
    out = whiten_step(table)
    h = 1 / math.sqrt(2 + 1e-8)
    assert out["token_advantages"].to_pylist() == [pytest.approx([-h, 0.0]), pytest.approx([h])]
    assert adv(out) == pytest.approx([-h, h])
    with pytest.raises(ValueError, match="at least 2 trained tokens"):
        whiten_step(table.slice(0, 1))


def test_kl_in_reward_changes_the_outcome_score():
    # row a: kl = lp - ref = [0.5, -1.0] on trained tokens, the tool token (mask 0) is not counted:
    #        score 1 - 0.1 * (0.5 - 1.0) = 1.05, reward_kl = -0.5 / 2 = -0.25
    # row b: kl 0, score 0.  RLOO, n = 2: 2 * (s - mean) = [1.05, -1.05]
    rows = block(
        ["a", "a"], [1.0, 0.0], [[1, 1, 0], [1]], logprobs=[[-1.0, -2.0, 0.0], [-1.0]], ref=[[-1.5, -1.0, -3.0], [-1.0]]
    )
    out = RLOOAdvantage(group_size=2, kl_in_reward=True, kl_coef=0.1)(rows)
    assert adv(out) == pytest.approx([1.05, -1.05], abs=1e-6)
    assert out["reward_kl"].to_pylist() == pytest.approx([-0.25, 0.0], abs=1e-6)
    assert out["reward"].to_pylist() == [1.0, 0.0]  # the verifier's score is kept as it was


def test_kl_in_reward_with_k3():
    # SPEC §3: lp -1.0, ref -1.5: k3 = e^-0.5 + 0.5 - 1 = 0.1065307; score 1 - 0.1 * 0.1065307, group of one
    rows = block(["a"], [1.0], [[1]], logprobs=[[-1.0]], ref=[[-1.5]])
    out = RLOOAdvantage(group_size=1, kl_in_reward=True, kl_coef=0.1, kl_penalty="low_var_kl")(rows)
    assert adv(out) == pytest.approx([1 - 0.01065307], abs=1e-6)
    assert out["reward_kl"].to_pylist() == pytest.approx([0.1065307], abs=1e-6)


def test_reinforce_pp_takes_the_token_rewards():
    # rewards = score on the last token - beta * kl per token = [-0.1 * 0.5, 1 - 0.1 * (-1.0)] = [-0.05, 1.1]
    # gamma 1 returns: [1.05, 1.1]
    rows = block(["a"], [1.0], [[1, 1]], logprobs=[[-1.0, -2.0]], ref=[[-1.5, -1.0]])
    out = ReinforcePlusPlusAdvantage(group_size=1, kl_in_reward=True, kl_coef=0.1)(rows)
    assert out["token_advantages"].to_pylist() == [pytest.approx([1.05, 1.1], abs=1e-6)]


def test_kl_in_reward_needs_the_reference_column():
    rows = block(["a"], [1.0], [[1]], logprobs=[[-1.0]])
    with pytest.raises(MissingColumnsError, match="ref_logprobs"):
        GRPOAdvantage(group_size=1, kl_in_reward=True)(rows)
    without = GRPOAdvantage(group_size=1)(rows)
    assert "reward_kl" not in without.column_names


def test_estimators_need_whole_groups():
    with pytest.raises(ValueError, match="group a has 2 of its 3 responses"):
        RLOOAdvantage(group_size=3)(block(["a", "a"], [1.0, 0.0], [[1], [1]]))


def test_empty_response_keeps_its_score():
    # no tokens: nothing to place the score on, but an outcome estimator still sees it (verl's row sum)
    out = RLOOAdvantage(group_size=2)(block(["a", "a"], [1.0, 0.0], [[], [1]]))
    assert adv(out) == pytest.approx([1.0, -1.0]) and out["token_advantages"].to_pylist()[0] == []
    assert np.isfinite(adv(out)).all()


# --- verl's other critic-free estimators ----------------------------------------------------------------------------
def test_rloo_vectorized_by_hand_and_its_group_of_one():
    from stages.advantage import RLOOVectorizedAdvantage

    # (n s - sum) / (n - 1): [(3 - 2) / 2, (0 - 2) / 2, (3 - 2) / 2], as rloo; a group of one gives 0 here
    out = RLOOVectorizedAdvantage(group_size=3)(block(["a"] * 3, [1.0, 0.0, 1.0], [[1]] * 3))
    assert adv(out) == pytest.approx([0.5, -1.0, 0.5])
    assert adv(RLOOVectorizedAdvantage(group_size=1)(block(["a"], [0.7], [[1, 1]]))) == [0.0]


def test_grpo_passk_only_the_best_response_learns():
    from stages.advantage import GRPOPassKAdvantage

    # scores (0.2, 0.9, 0.5): the best, 0.9, gets 0.9 - 0.5 over the unbiased std (0.35119), the others 0
    std = float(np.std([0.2, 0.9, 0.5], ddof=1))
    out = GRPOPassKAdvantage(group_size=3)(block(["a"] * 3, [0.2, 0.9, 0.5], [[1]] * 3))
    assert adv(out) == pytest.approx([0.0, 0.4 / (std + 1e-6), 0.0], abs=1e-6)
    raw = GRPOPassKAdvantage(group_size=3, norm_by_std=False)(block(["a"] * 3, [1.0, 1.0, 0.0], [[1]] * 3))
    assert adv(raw) == pytest.approx([0.0, 0.0, 0.0])  # a tie at the top: r_max - r_second = 0
    with pytest.raises(ValueError, match="rollout.n >= 2"):
        GRPOPassKAdvantage(group_size=1)(block(["a"], [0.5], [[1]]))


def test_opo_length_weighted_baseline_by_hand():
    from stages.advantage import OPOAdvantage

    # lengths (3 trained tokens, 1): baseline (3 * 1 + 1 * 0) / 4 = 0.75; a group of one has baseline 0
    out = OPOAdvantage(group_size=2)(block(["a", "a"], [1.0, 0.0], [[1, 1, 1], [0, 1]]))
    assert adv(out) == pytest.approx([0.25, -0.75])
    assert adv(OPOAdvantage(group_size=1)(block(["a"], [0.5], [[1]]))) == pytest.approx([0.5])


def test_gpg_centres_each_group_and_scales_over_the_step():
    from stages.advantage import GPGAdvantage

    step = GPGAdvantage(group_size=2)(block(["a", "a", "b", "b"], [1.0, 0.0, 0.0, 0.0], [[1, 1], [1], [1], [1]]))
    assert adv(step) == pytest.approx([0.5, -0.5, 0.0, 0.0])  # s - the group's mean
    scaled = GPGAdvantage.over_step(step)  # alpha = 4 rows / 1 nonzero reward
    assert adv(scaled) == pytest.approx([2.0, -2.0, 0.0, 0.0])
    assert scaled["token_advantages"].to_pylist()[0] == pytest.approx([2.0, 2.0])


def gdpo_block(prompt_ids, rewards, extras, masks) -> pa.Table:
    table = block(prompt_ids, rewards, masks)
    return table.append_column("reward_extra_info", pa.array([json.dumps(e) for e in extras], pa.string()))


def test_gdpo_normalises_each_component_in_its_group_then_weights_them():
    # verl's compute_gdpo_outcome_advantage before its batch whitening. Group a: fmt [1, 0, 1] and acc [1, 1, 0] each
    # have mean 2/3 and unbiased std sqrt(1/3): fmt -> [0.57735, -1.154701, 0.57735], acc -> [0.57735, 0.57735,
    # -1.154701]; with weights 1 and 0.5: [0.866025, -0.866025, 0]. Group b: fmt all 1 -> 0 (std 0, epsilon);
    # acc [0, 1, 0] -> 0.5 x [-0.57735, 1.154701, -0.57735].
    extras = [{"fmt": 1, "acc": 1}, {"fmt": 0, "acc": 1}, {"fmt": 1, "acc": 0}]
    extras += [{"fmt": 1, "acc": 0}, {"fmt": 1, "acc": 1}, {"fmt": 1, "acc": 0}]
    stage = GDPOAdvantage(group_size=3, reward_keys=["fmt", "acc"], reward_weights=[1.0, 0.5])
    assert stage.whiten_over_step  # the sink whitens the step's tokens, as verl's masked_whiten does the batch
    table = gdpo_block(["a"] * 3 + ["b"] * 3, [9.0] * 6, extras, [[1, 1]] * 6)  # the reward itself is not used
    expected = [0.866025, -0.866025, 0.0, -0.288675, 0.57735, -0.288675]
    assert adv(stage(table)) == pytest.approx(expected, abs=1e-5)
    # summed first (GRPO on fmt + 0.5 acc), group a would be [1.0, -0.5, 0.5] / std: not the same advantages
    summed = GRPOAdvantage(group_size=3)(block(["a"] * 3, [1.5, 0.5, 1.0], [[1, 1]] * 3))
    assert adv(summed) != pytest.approx(expected[:3], abs=1e-3)


def test_gdpo_without_keys_is_grpo_on_the_reward_and_names_a_missing_key():
    table = gdpo_block(["a"] * 3, [1.0, 0.0, 1.0], [{"acc": 1}, {"acc": 0}, {}], [[1]] * 3)
    plain = GRPOAdvantage(group_size=3)(block(["a"] * 3, [1.0, 0.0, 1.0], [[1]] * 3))
    assert adv(GDPOAdvantage(group_size=3)(table)) == pytest.approx(adv(plain))
    with pytest.raises(ValueError, match=r"gdpo_reward_keys names 'acc'.*has no extra info"):
        GDPOAdvantage(group_size=3, reward_keys=["acc"])(table)
    with pytest.raises(ValueError, match="2 weights for 1 gdpo_reward_keys"):
        GDPOAdvantage(group_size=3, reward_keys=["acc"], reward_weights=[1.0, 2.0])
