"""bench.peers' arithmetic, its letters reward and the TRL side's settings read from asyncrl's config."""

import math

import pytest

from bench.peers import SKIP, WINDOW, median_row, moving_average, rates, summary, time_to
from bench.peers_runs import LOOP_LINE, Run
from bench.peers_task import LETTER_TARGET, letters_score
from bench.peers_workloads import Workload, trl_config
from pipeline.config import load_config


def _run(rewards: list[float], start: float = 30.0, period: float = 0.5, tokens: float = 64.0) -> Run:
    """Steps 1..n, the first ending at `start` s after launch, then one every `period` s."""
    steps = [(i + 1, start + i * period, r, tokens) for i, r in enumerate(rewards)]
    return Run("asyncrl", "embedded", steps=steps, peak_bytes=2**30)


def test_a_target_is_reached_by_a_full_window_of_the_moving_average():
    # One lucky step early on does not count: the window is not full, and then its mean is 1 / WINDOW.
    rewards = [1.0] + [0.0] * WINDOW + [0.9] * WINDOW
    step, at = time_to(_run(rewards), 0.8)
    # The mean of the last WINDOW steps first reaches 0.8 when 9 of its 10 steps are 0.9 (0.81).
    assert step == 1 + WINDOW + 9
    assert at == pytest.approx(30.0 + (step - 1) * 0.5)
    assert time_to(_run([0.7] * 50), 0.8) is None
    assert moving_average([1.0, 0.0, 0.5], window=2) == [1.0, 0.5, 0.25]


def test_rates_leave_out_the_first_steps():
    # The first SKIP steps are slow (start-up); after them 4 steps/s of 64 tokens each.
    steps = [(i + 1, 10.0 * (i + 1), 0.0, 64.0) for i in range(SKIP)]
    steps += [(SKIP + i + 1, 10.0 * SKIP + 0.25 * (i + 1), 0.0, 64.0) for i in range(40)]
    steps_per_s, tokens_per_s = rates(Run("TRL", "embedded", steps=steps))
    assert steps_per_s == pytest.approx(4.0)
    assert tokens_per_s == pytest.approx(256.0)


def test_summary_counts_start_up_to_the_first_step_and_learning_after_it():
    row = summary(_run([0.0] * 20 + [1.0] * 30, start=40.0))
    assert row["startup_s"] == 40.0
    assert row["step0.6"] == 26  # steps 21-26 are 6 of the last 10
    assert row["to0.6"] == pytest.approx(40.0 + 25 * 0.5)
    assert row["train_to0.6"] == pytest.approx(25 * 0.5)
    assert (row["first"], row["last"], row["peak_gib"]) == (0.0, 1.0, 1.0)


def test_a_target_one_run_missed_is_missed_in_the_median():
    reached, missed = summary(_run([1.0] * 30)), summary(_run([0.0] * 30))
    med = median_row([reached, missed])
    assert math.isnan(med["to0.8"]) and med["step0.8"] is None
    assert med["startup_s"] == 30.0


def test_the_letters_reward_counts_single_letter_items():
    assert letters_score(" a b c<|endoftext|>") == pytest.approx(2 / LETTER_TARGET)  # 'c<|endoftext|>' is no letter
    assert letters_score(" ab ! a Z é") == pytest.approx(1 / LETTER_TARGET)
    assert letters_score(" a" * (2 * LETTER_TARGET)) == 1.0
    assert letters_score(None) == 0.0


def test_the_loop_line_is_the_one_the_driver_prints():
    line = "asyncrl: async (staleness 0.5), 192 steps, run dir runs/x-1\n"
    assert LOOP_LINE.match(line)["run_dir"] == "runs/x-1"


def test_trl_runs_the_algorithm_of_the_asyncrl_config():
    cfg = load_config(None, ["actor.lr=1e-4", "actor.clip_ratio_high=0.3", "rollout.n=4", "actor.micro_batch_size=16"])
    w = Workload("embedded", None, None, None, 10, cfg, "reverse")
    trl = trl_config(w)
    assert (trl["learning_rate"], trl["epsilon"], trl["epsilon_high"]) == (1e-4, 0.2, 0.3)
    assert trl["num_generations"] == 4 and trl["max_completion_length"] == cfg.data.max_response_length
    # 8 prompts x 4 responses = 32 completions per optimizer step, 16 per forward/backward.
    assert (trl["per_device_train_batch_size"], trl["gradient_accumulation_steps"]) == (16, 2)
    assert (trl["lr_scheduler_type"], trl["beta"], trl["loss_type"]) == ("constant", 0.0, "dapo")
    assert trl["delta"] == cfg.actor.clip_ratio_c  # verl's dual clip
    assert trl["bf16"] is False  # asyncrl's fp32 on a CPU
    with pytest.raises(SystemExit, match="token-mean"):
        trl_config(Workload("embedded", None, None, None, 10, load_config(None, ["actor.use_kl_loss=true"]), "reverse"))


def test_trl_computes_in_the_dtype_of_the_asyncrl_trainer_and_engine():
    bf16 = ["rollout.dtype=bfloat16", "actor.fsdp_config.mixed_precision.param_dtype=bf16"]
    assert trl_config(Workload("long", None, None, None, 10, load_config(None, bf16), "letters"))["bf16"] is True
    for one in bf16:  # TRL generates with the model it trains: one dtype for both
        with pytest.raises(SystemExit, match="differ"):
            trl_config(Workload("long", None, None, None, 10, load_config(None, [one]), "letters"))
