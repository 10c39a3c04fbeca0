"""bench.timeline's arithmetic: a step's path cut into its parts, from the logs' times."""

import pytest

from bench.timeline import paths


def _step(t: float, version: int, ids: list[str]) -> dict:
    return {"t": t, "v": version, "ids": set(ids)}


def test_a_steps_parts_follow_its_last_new_prompt_and_add_up_to_the_period():
    # Step 1 recorded at t=10. Version 1 opens at 10.1 (sync); step 2 trains "old" (carried over, version 0) and two
    # new prompts: "late" starts at 10.3 and ends at 10.6, after "early"; step 2 trains for 0.2 s and records at 10.9.
    prompts = {
        "old": {"v": 0, "adm": 9.0, "s": [9.1], "e": [9.4]},
        "early": {"v": 1, "adm": 10.1, "s": [10.15, 10.2], "e": [10.4, 10.5]},
        "late": {"v": 1, "adm": 10.1, "s": [10.3, 10.35], "e": [10.55, 10.6]},
    }
    steps = {1: _step(10.0, 0, ["a"]), 2: _step(10.9, 1, ["old", "early", "late"])}
    metrics = {1: {"timing/train_s": 0.2}, 2: {"timing/train_s": 0.2}}
    (row,), none_new = paths(prompts, steps, metrics, skip=0)
    assert none_new == 0
    assert row == pytest.approx(
        {"sync": 0.1, "admit": 0.2, "generate": 0.3, "deliver": 0.1, "train": 0.2, "period": 0.9}
    )
    assert sum(v for k, v in row.items() if k != "period") == pytest.approx(row["period"])


def test_a_step_of_carried_over_prompts_only_is_counted_apart():
    prompts = {"old": {"v": 0, "adm": 9.0, "s": [9.1], "e": [9.4]}}
    steps = {1: _step(10.0, 0, ["a"]), 2: _step(10.9, 1, ["old"])}
    metrics = {2: {"timing/train_s": 0.2}}
    assert paths(prompts, steps, metrics, skip=0) == ([], 1)
    assert paths(prompts, steps, metrics, skip=2) == ([], 0)  # skipped steps are not counted at all
