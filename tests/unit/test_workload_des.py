"""The simulated workload and the discrete-event model against closed forms on simple workloads."""

import math

import pytest

from pipeline.sim.des import Setting, simulate
from stages.sim.workload import Workload, bubble_bound, tail_utilisation
from stages.staleness import StalenessBudget

# 4 prompts x 8 responses of 100 tokens on 64 slots: generation 1 + 100 x 0.1 = 11 s, training 3200 tokens
# x 0.01 = 32 s, a sync 2 s.
WORK = Workload(length_mean=100, prefill_s=1, decode_s_per_token=0.1, train_s_per_token=0.01, sync_s=2, slots=64)
GEN, TRAIN, SYNC = 11.0, 32.0, 2.0


def _setting(s: float, k: int = 1, mode: str = "wait", slots: int = 64) -> Setting:
    budget = StalenessBudget(
        ppo_mini_batch_size=4, require_batches=1, trigger_parameter_sync_step=k, staleness_threshold=s
    )
    return Setting(budget, n=8, max_tokens=1000, slots=slots, in_engine=128, pause_mode=mode)


def test_lengths_are_fixed_per_sample_and_follow_the_mean():
    w = Workload(length_mean=4000, length_sigma=1.0)
    lengths = [w.response_length(f"p{i}/0", 28000) for i in range(20000)]
    assert lengths[:50] == [w.response_length(f"p{i}/0", 28000) for i in range(50)]  # same id, same length
    assert max(lengths) == 28000  # the cap is reached: the long tail
    assert 3700 < sum(lengths) / len(lengths) < 4000  # log-normal mean 4000, a little lost to the cap
    assert Workload(length_mean=50).response_length("x/0", 40) == 40  # sigma 0: the mean, capped


def test_workload_rejects_bad_values_by_name():
    with pytest.raises(ValueError, match="sim.slots"):
        Workload(slots=0)


def test_synchronous_step_is_generation_plus_training_plus_sync():
    out = simulate(WORK, _setting(0.0), steps=10)
    assert out.step_end_s[0] == pytest.approx(GEN + TRAIN)
    assert out.wall_s == pytest.approx(10 * (GEN + TRAIN + SYNC))
    assert out.trainer_idle_ratio == pytest.approx(1 - TRAIN / (GEN + TRAIN + SYNC))


def test_async_with_room_for_a_step_ahead_hides_generation():
    for mode in ("wait", "abort", "keep"):  # generation (11 s) fits inside a step (32 s): no sync interrupts it
        out = simulate(WORK, _setting(1.0, mode=mode), steps=10)
        assert out.wall_s == pytest.approx(GEN + TRAIN + SYNC + 9 * (TRAIN + SYNC)), mode


def test_half_a_step_of_staleness_hides_half_the_generation_wait():
    # s = 0.5: 2 of the 4 prompts of the next step are ready at the sync; the other 2 start after it.
    out = simulate(WORK, _setting(0.5), steps=10)
    assert out.wall_s == pytest.approx(10 * (GEN + TRAIN + SYNC))  # waiting for any prompt costs the full GEN


def test_queueing_for_slots_adds_waves():
    # 32 responses on 8 slots: four waves of 11 s.
    out = simulate(WORK, _setting(0.0, slots=8), steps=3)
    assert out.wall_s == pytest.approx(3 * (4 * GEN + TRAIN + SYNC))


def test_partial_rollout_freezes_sequences_for_the_sync():
    # Generation 40 s > training 32 s, so every sync lands mid-response. abort pays the prefill again, keep not.
    w = Workload(length_mean=390, prefill_s=1, decode_s_per_token=0.1, train_s_per_token=0.0025, sync_s=2, slots=64)
    keep = simulate(w, _setting(1.0, mode="keep"), steps=20)
    abort = simulate(w, _setting(1.0, mode="abort"), steps=20)
    wait = simulate(w, _setting(1.0, mode="wait"), steps=20)
    assert abort.wall_s > keep.wall_s  # the recomputed prefills
    assert keep.wall_s < wait.wall_s  # wait drains responses before every sync, keep does not
    # The difference is exactly the prefills: abort recomputes one per interrupted response (all 64 slots
    # interrupted run in parallel, so each sync costs one prefill of wall time while the engine is the bottleneck).
    assert abort.wall_s - keep.wall_s <= 20 * w.prefill_s + 1e-9


def test_tail_utilisation_and_bubble_bound():
    # All lengths equal: no tail, and the bound is only the switch.
    assert tail_utilisation(512, 100, 100, 64) == 1.0
    assert bubble_bound(10, 20, 3, 1.0) == pytest.approx(33 / 30)
    # 100 requests of mean 10, longest 100, 10 slots: 1000 / (1000 + 10 x 90)
    assert tail_utilisation(100, 10, 100, 10) == pytest.approx(1000 / 1900)
    assert math.isclose(bubble_bound(5, 5, 0, 0.5), 1.5)


def test_a_multi_turn_response_pays_its_tool_calls_and_a_prefill_per_turn():
    # 4 turns of 25 tokens and 3 tool calls of 5 s: generation 4 x (1 + 2.5) + 3 x 5 = 29 s instead of 11 s.
    w = Workload(**{**WORK.__dict__, "turns": 4, "tool_s": 5.0})
    assert w.turn_tokens(100) == [25, 25, 25, 25] and w.turn_tokens(2) == [1, 1] and w.turn_tokens(7)[:3] == [2, 2, 2]
    gen = 4 * (1 + 25 * 0.1) + 3 * 5.0
    out = simulate(w, _setting(0.0), steps=5)
    assert out.wall_s == pytest.approx(5 * (gen + TRAIN + SYNC))
    # The engine is busy only while a turn decodes: the tool calls leave it idle.
    assert out.rollouter_idle_ratio == pytest.approx(1 - 5 * 4 * (1 + 2.5) / out.wall_s)
    with pytest.raises(ValueError, match="sim.turns"):
        Workload(turns=0)


def test_the_slots_a_tool_call_frees_serve_other_requests():
    # 16 slots for 32 responses of 2 turns of 5 s (no prefill) and tool calls of 5 s: while one half calls its
    # tool, the other half decodes, so generation takes 4 turns of 5 s; holding the slots through the calls would
    # take 2 x (5 + 5 + 5) = 30 s.
    w = Workload(length_mean=100, decode_s_per_token=0.1, train_s_per_token=0.01, slots=16, turns=2, tool_s=5.0)
    out = simulate(w, _setting(0.0, slots=16), steps=3)
    assert out.wall_s == pytest.approx(3 * (4 * 5.0 + TRAIN))


def test_a_wait_sync_drains_whole_trajectories_and_partial_rollout_does_not():
    # 2 turns of 200 tokens (20 s each) and a tool call of 10 s: 50 s per response, against 8 s steps.
    w = Workload(length_mean=400, decode_s_per_token=0.1, train_s_per_token=0.000625, slots=64, turns=2, tool_s=10)
    wait = simulate(w, _setting(1.0, k=1, mode="wait"), steps=12)
    keep = simulate(w, _setting(1.0, k=1, mode="keep"), steps=12)
    assert wait.steps == keep.steps == 12
    assert keep.wall_s < wait.wall_s  # the syncs freeze turns in flight instead of waiting for both turns


def test_verls_bound_on_prompts_generating_at_once_admits_in_waves():
    # One prompt a replica, and the one verl holds: the step's 4 prompts generate 2 at a time, two waves of 11 s.
    budget = StalenessBudget(0.0, 1, 1, 4, concurrent_samples_per_replica=1)
    out = simulate(WORK, Setting(budget, n=8, max_tokens=1000, slots=64, in_engine=128), steps=10)
    assert out.max_generating == 2
    assert out.wall_s == pytest.approx(10 * (2 * GEN + TRAIN + SYNC))
    assert simulate(WORK, _setting(0.0), steps=10).max_generating == 4  # verl's default, 16, leaves all 4 at once
