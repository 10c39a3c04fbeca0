"""bench.learning's arithmetic: the step that reaches the reward target, and the reward by quarter of the run."""

import math

import pytest

from bench.learning import WINDOW, quarters, time_to_target


def _rows(rewards: list[float]) -> list[dict]:
    return [{"step": i + 1, "reward/mean": r, "timing/elapsed_s": 2.0 * (i + 1)} for i, r in enumerate(rewards)]


def test_the_target_is_reached_by_the_rolling_mean_not_by_one_lucky_step():
    rewards = [0.0] * WINDOW + [1.0] + [0.0] * WINDOW + [0.8] * WINDOW
    step, wall = time_to_target(_rows(rewards), 0.6)
    assert step == 2 * WINDOW + 1 + 6  # the sixth 0.8 lifts the mean of the last WINDOW (8) steps to 0.6
    assert wall == 2.0 * step
    assert time_to_target(_rows([0.5] * 40), 0.6) == (None, None)


def test_quarters_average_each_quarter_of_the_steps():
    assert quarters(_rows([0.0] * 4 + [0.2] * 4 + [0.4] * 4 + [1.0] * 4)) == pytest.approx([0.0, 0.2, 0.4, 1.0])
    short = quarters(_rows([1.0, 0.0, 1.0]))  # fewer steps than quarters: one is empty, and says so
    assert short[:2] + short[3:] == [1.0, 0.0, 1.0] and math.isnan(short[2])
