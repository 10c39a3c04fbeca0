"""Smoke test: the embedded job, shortened, learns through the real asynchronous stream.

A shorter version of `make run` (100 steps instead of 192, staleness 0.5 as in the default): the mean reward of
the last 10% of steps must clearly exceed the first 10%. The embedded warm start leaves sampled answers noisy
(reward ~0.2), so the gain comes from RL; a sign error in the loss makes the reward fall, a loss that ignores
the advantage leaves it flat, and either fails this test.
"""

import json

import pytest


@pytest.mark.slow
def test_reward_rises(run_job):
    summary, run_dir = run_job("rollout.total_rollout_steps=800", name="learn")
    assert summary["steps"] == 100
    assert summary["audit_ok"]
    gain = summary["reward_last"] - summary["reward_first"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["reward/mean"], 2) for r in rows[::10]]
    assert gain >= 0.25, f"reward {summary['reward_first']:.3f} -> {summary['reward_last']:.3f}, curve {curve}"
