"""bench.multi_turn's arithmetic: the steady windows of a run and a mode's summary over its repeats."""

import pytest

from bench.multi_turn import steady_windows, summarize


def _run(step_s: list[float], reward_last: float, audit_ok: bool = True) -> dict:
    elapsed, t = [], 0.0
    for s in step_s:
        t += s
        elapsed.append(t)
    summary = {"reward_first": 0.2, "reward_last": reward_last, "trainer_idle_ratio": 0.5, "rollouter_idle_ratio": 0.1}
    return {"elapsed": elapsed, "tools": 1.0, "summary": {**summary, "audit_ok": audit_ok, "wall_s": t}}


def test_steady_windows_leave_out_the_start_and_the_drain():
    steps = [9.0] * 2 + [1.0] * 4 + [3.0] * 4 + [9.0] * 2  # 12 steps: slow start, two windows, slow drain
    assert steady_windows(_run(steps, 0.9)["elapsed"], skip=2, window=4) == [1.0, 3.0]


def test_a_mode_is_the_mean_of_its_runs_with_the_spread_over_runs_and_windows():
    fast = _run([9.0] * 2 + [1.0] * 4 + [2.0] * 4 + [9.0] * 2, reward_last=0.8)  # windows 1.0, 2.0: 1.5 s/step
    slow = _run([9.0] * 2 + [3.0] * 4 + [4.0] * 4 + [9.0] * 2, reward_last=1.0, audit_ok=False)  # 3.5 s/step
    mode = summarize([fast, slow], skip=2, window=4)
    assert mode["runs"] == [1.5, 3.5] and mode["s_per_step"] == 2.5
    assert mode["windows"] == (1.0, 4.0)
    assert mode["reward"] == pytest.approx((0.2, 0.9))
    assert not mode["audit_ok"]  # one failed audit fails the mode
