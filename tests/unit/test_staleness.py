"""verl's staleness arithmetic for its four modes, fractional thresholds, and our lag bound."""

import pytest

from stages.staleness import StalenessBudget, mode_name


def budget(s: float, k: int = 1, rb: int = 1, mb: int = 8) -> StalenessBudget:
    return StalenessBudget(
        staleness_threshold=s, trigger_parameter_sync_step=k, require_batches=rb, ppo_mini_batch_size=mb
    )


def test_on_policy_pipeline_admits_exactly_one_step():
    b = budget(0.0, k=1, rb=2, mb=8)
    assert b.required_samples == 16
    assert b.max_required_samples == 16
    assert b.lag_bound == 0
    assert mode_name(0.0, 1, False) == "on_policy_pipeline"


def test_stream_off_policy_admits_k_steps_per_version():
    b = budget(0.0, k=4, mb=8)
    assert b.max_required_samples == 32
    assert b.lag_bound == 0  # the version only changes at a sync, after all 32 are consumed
    assert mode_name(0.0, 4, False) == "stream_off_policy_pipeline"


@pytest.mark.parametrize(
    ("s", "k", "rb", "mb", "expected"),
    [
        (0.5, 1, 1, 8, 12),
        (0.5, 4, 4, 32, 768),  # verl's published 7B setting: 1.5 * 4 * 4 * 32
        (1.0, 2, 1, 8, 32),
        (0.1, 1, 1, 30, 33),  # 30 * 1.1 = 33.0 in verl's order (1.1 * 30 would be 33.000000000000004)
        (0.3, 1, 1, 10, 13),
        (0.25, 1, 1, 10, 12),  # 12.5 -> int() truncates: never admit more than allowed
        (0.15, 1, 1, 100, 114),  # verl: int(100 * 1.15) = int(114.99999999999999) = 114, not the exact 115
        (0.4, 5, 1, 3, 20),  # int(3 * 1.4 * 5) = int(20.999999999999996) = 20; 3 * 5 * 1.4 would give 21
        (0.1, 4, 1, 32, 140),  # verl's defaults s = 0.1, k = 4: int(140.8)
        (3.0, 2, 4, 256, 8192),  # the worked example of verl's design notes: 1024 * 4 * 2
    ],
)
def test_max_required_samples_matches_verl(s, k, rb, mb, expected):
    assert budget(s, k, rb, mb).max_required_samples == expected


@pytest.mark.parametrize(("s", "bound"), [(0.0, 0), (0.1, 1), (0.5, 1), (1.0, 1), (1.5, 2), (3.0, 3)])
def test_lag_bound_is_ceil_of_threshold(s, bound):
    assert budget(s).lag_bound == bound


def test_async_modes_by_name():
    assert mode_name(0.5, 1, False) == "async_stream_stale_samples"
    assert mode_name(0.5, 1, True) == "async_stream_partial_rollout"


def test_permits_subtract_admitted_and_carried_over():
    b = budget(0.5, mb=8)  # B = 12
    assert b.permits(0, 0) == 12
    assert b.permits(5, 4) == 3  # verl's counter restarts at the carried-over (unconsumed) prompts
    assert b.permits(8, 4) == 0
    assert b.permits(20, 4) == 0


def test_must_consume_now_spreads_backlog_over_remaining_steps():
    b = budget(0.5, k=3, mb=8)
    assert b.must_consume_now(outstanding_too_old=10, steps_left_after_this=2) == 0
    assert b.must_consume_now(outstanding_too_old=20, steps_left_after_this=1) == 12
    assert b.must_consume_now(outstanding_too_old=5, steps_left_after_this=0) == 5


def test_backlog_always_fits_the_next_version():
    """The counting argument behind lag_bound: after L versions the backlog is at most C."""
    for s in (0.0, 0.1, 0.5, 0.99, 1.0, 1.5, 2.0, 3.0):
        for k in (1, 2, 4):
            b = budget(s, k=k, mb=8)
            backlog_after_bound = b.max_required_samples - b.lag_bound * b.consumed_per_version
            assert backlog_after_bound <= b.consumed_per_version, (s, k)
