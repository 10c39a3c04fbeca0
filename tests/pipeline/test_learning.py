"""Smoke test: the embedded job, shortened, learns through the real asynchronous stream.

A shorter version of `make run` (100 steps instead of 192, staleness 0.5 as in the default) in verl's mode d with
its correction: partial rollout (responses interrupted at every sync and resumed with the new weights) and
decoupled PPO (proximal logprobs recomputed each step, token-level truncated importance weights proximal /
behaviour). The mean reward of the last 10% of steps must clearly exceed the first 10%. The embedded warm start
leaves sampled answers noisy (reward ~0.2), so the gain comes from RL; a sign error in the loss makes the reward
fall, a loss that ignores the advantage leaves it flat, and either fails this test.

The default job without partial rollout learns in the held-out curve of test_validation.py and in `make run`; the
other trainer backends and the multi-turn task have learning tests of their own.
"""

import json

import pytest

PARTIAL_DECOUPLED = [
    "async_training.partial_rollout=true",
    "async_training.compute_prox_log_prob=true",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
]


@pytest.mark.slow
def test_reward_rises_with_partial_rollout_and_decoupled_ppo(run_job):
    summary, run_dir = run_job("rollout.total_rollout_steps=800", *PARTIAL_DECOUPLED, name="learn-partial")
    assert summary["steps"] == 100
    assert summary["audit_ok"]
    gain = summary["reward_last"] - summary["reward_first"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["reward/mean"], 2) for r in rows[::10]]
    assert gain >= 0.25, f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, curve {curve}"
    # the correction ran on every step (whether a sync catches responses in flight is up to timing;
    # test_partial_rollout.py forces that case)
    assert all(0.0 < r["rollout_corr/rollout_is_eff_sample_size"] <= 1.0 for r in rows)
