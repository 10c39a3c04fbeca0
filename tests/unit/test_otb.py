"""verl's optimal token baseline (stages/advantage/otb.py) against values worked out by hand from verl's definition
(B_t = sum_i G_it W_it / (sum_i W_it + 1e-8), W the cumulated 1 - 2 pi + sum pi^2), its multi-turn form, the IS
weight and zero-tail rules; the stream's half (the returns); and the trainer's half: the proximal pass's sum pi^2
equals the model's own distribution's, padded and packed, and a step subtracts the baseline from the returns."""

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from stages.advantage.otb import OptimalTokenBaselineAdvantage, subtract_baseline
from stages.trainer.step import baseline_minibatches

LN = math.log
# Group a: a right answer of 2 tokens, a wrong one of 3; group b: one response. pi = exp(old logprob).
# w = 1 - 2 pi + sum pi^2: row 0 [1 - 1.8 + 0.82, 1 - 0.4 + 0.3] = [0.02, 0.9], W = [0.02, 0.92];
# row 1 [0.5, 0.5, 0.5], W = [0.5, 1.0, 1.5].
GROUPS = ["a", "a", "b"]
RETURNS = [[1.0, 1.0], [0.0, 0.0, 0.0], [0.7]]
LOGP = [[LN(0.9), LN(0.2)], [LN(0.5)] * 3, [LN(0.5)]]
PI2 = [[0.82, 0.3], [0.5] * 3, [0.5]]
MASKS = [[1, 1], [1, 1, 1], [1]]


def test_each_token_gets_its_groups_variance_weighted_baseline():
    b0, b1 = 0.02 / 0.52, 0.92 / 1.92  # position 2: row 0 has ended, row 1's return is 0, so B = 0
    adv = subtract_baseline("otb", GROUPS, RETURNS, MASKS, LOGP, PI2)
    np.testing.assert_allclose(adv[0], [1 - b0, 1 - b1], atol=1e-6)
    np.testing.assert_allclose(adv[1], [-b0, -b1, 0.0], atol=1e-6)
    np.testing.assert_allclose(adv[2], [0.7], atol=1e-6)  # a group of one keeps its returns
    # not GRPO's one baseline per group (the mean return, 0.5): the baseline follows the paths' variance
    assert abs(adv[0][0] - 0.5) > 0.4


def test_the_single_longest_response_has_no_baseline_past_the_second_longest():
    returns = [[1.0, 1.0], [1.0, 1.0, 1.0]]
    adv = subtract_baseline("otb", ["a", "a"], returns, MASKS[:2], LOGP[:2], PI2[:2])
    assert adv[1][2] == pytest.approx(1.0)  # B_2 = 1 by the formula, zeroed by handle_zero_tail
    kept = subtract_baseline("otb", ["a", "a"], returns, MASKS[:2], LOGP[:2], PI2[:2], handle_zero_tail=False)
    assert kept[1][2] == pytest.approx(0.0, abs=1e-6)


def test_is_weights_scale_each_tokens_variance_by_their_square():
    weights = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = subtract_baseline("otb", GROUPS, RETURNS, MASKS, LOGP, PI2, weights)
    # row 0's w becomes [0.08, 0.9], W [0.08, 0.98]
    np.testing.assert_allclose(adv[0], [1 - 0.08 / 0.58, 1 - 0.98 / 1.98], atol=1e-6)


def test_the_multi_turn_form_closes_up_the_masks_gaps():
    # row 0 has a tool token in the middle (mask 0): its W skips it, and its trained tokens are indices 0 and 1
    masks = [[1, 0, 1], [1, 1, 1]]
    returns, logp, pi2 = [[1.0, 9.0, 1.0], [0.0] * 3], [[LN(0.9), 0.0, LN(0.2)], LOGP[1]], [[0.82, 5.0, 0.3], PI2[1]]
    b0, b1 = 0.02 / 0.52, 0.92 / 1.92
    tir = subtract_baseline("tir", ["a", "a"], returns, masks, logp, pi2)
    np.testing.assert_allclose(tir[0], [1 - b0, 0.0, 1 - b1], atol=1e-6)
    np.testing.assert_allclose(tir[1], [-b0, -b1, 0.0], atol=1e-6)
    # the plain form compares row 0's third token with row 1's third: another baseline
    plain = subtract_baseline("otb", ["a", "a"], returns, masks, logp, pi2)
    assert plain[0][2] == pytest.approx(1 - 0.92 / (0.92 + 1.5), abs=1e-6)


def test_the_stream_writes_the_returns():
    table = pa.table(
        {
            "prompt_id": ["a", "a"],
            "reward": pa.array([1.0, 0.0], pa.float32()),
            "response_mask": pa.array([[1, 0, 1], [1, 1]], pa.list_(pa.int8())),
        }
    )
    out = OptimalTokenBaselineAdvantage(group_size=2)(table)
    assert out["token_advantages"].to_pylist() == [[1.0, 0.0, 1.0], [0.0, 0.0]]


def test_the_trainers_half_replaces_the_returns_with_the_advantages():
    rows = {"prompt_id": GROUPS, "token_advantages": RETURNS, "response_mask": MASKS}
    (out,) = baseline_minibatches("otb", [rows], [LOGP], [PI2], [(None, None)])
    np.testing.assert_allclose(out["token_advantages"][0], [1 - 0.02 / 0.52, 1 - 0.92 / 1.92], atol=1e-6)
    assert rows["token_advantages"] is RETURNS  # the caller's rows untouched


@pytest.mark.parametrize("packed", [False, True])
def test_the_proximal_pass_returns_the_models_sum_of_squared_probabilities(tmp_path, packed):
    from transformers import AutoModelForCausalLM

    from pipeline.tasks.embedded import build_model
    from stages.trainer.settings import ExecutionSettings, PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    build_model(tmp_path, 40, seed=0)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    trainer = TorchTrainer(
        str(tmp_path), PolicySettings(), execution=ExecutionSettings(use_remove_padding=packed), torch_threads=1
    )
    rows = trainer.logprobs(prompts, responses, sum_pi2=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    for (logp, spi), p, r in zip(rows, prompts, responses, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1].float()
        probs = torch.softmax(logits, -1)
        np.testing.assert_allclose(spi, probs.pow(2).sum(-1).numpy(), rtol=1e-4)
        np.testing.assert_allclose(logp, probs[range(len(r)), r].log().numpy(), atol=1e-4)


def test_a_step_trains_on_returns_minus_the_baseline_from_its_own_proximal_pass(tmp_path):
    from pipeline.tasks.embedded import build_model
    from stages.trainer.settings import PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    build_model(tmp_path, 40, seed=0)
    prompts, responses = [[1, 2, 3], [4, 5], [6, 7], [8]], [[6, 7], [8, 9, 10, 11], [12, 13, 14], [15, 16]]
    returns = [[1.0, 1.0], [0.0] * 4, [0.5] * 3, [1.0, 1.0]]

    def trainer(kind: str) -> TorchTrainer:
        policy = PolicySettings(lr=1e-2, trainer_baseline=kind)
        return TorchTrainer(str(tmp_path), policy, compute_prox_log_prob=True, torch_threads=1)

    def rows(advantages) -> dict:
        return {
            "prompt_id": ["a", "a", "b", "b"],
            "prompt_ids": prompts,
            "response_ids": responses,
            "response_logprobs": [[-1.0] * len(r) for r in responses],
            "response_mask": [[1] * len(r) for r in responses],
            "token_advantages": advantages,
        }

    by_hand = trainer("")
    logp, pi2 = zip(*by_hand.logprobs(prompts, responses, sum_pi2=True), strict=True)
    expected = subtract_baseline("otb", ["a", "a", "b", "b"], returns, rows(returns)["response_mask"], logp, pi2)
    want = by_hand.train_step([rows([a.tolist() for a in expected])])
    got = trainer("otb").train_step([rows(returns)])
    raw = trainer("").train_step([rows(returns)])  # the returns alone: another loss
    assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], abs=1e-6)
    assert got["actor/grad_norm"] == pytest.approx(want["actor/grad_norm"], rel=1e-5)
    assert abs(raw["actor/pg_loss"] - got["actor/pg_loss"]) > 1e-3
