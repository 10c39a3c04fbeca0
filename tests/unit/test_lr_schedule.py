"""The learning-rate schedule (stages/trainer/lr_schedule.py) against verl's formulas worked out by hand, its keys as
verl spells them, and the schedule's position surviving a checkpoint of the optimizer."""

import math

import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.trainer.lr_schedule import OptimSettings, apply_lr

LR = 1e-3


def test_the_default_is_a_constant_rate():
    assert [OptimSettings(total_training_steps=10).lr_at(k, LR) for k in (0, 5, 50)] == [LR, LR, LR]


def test_linear_warmup_then_constant_as_verls_fsdp_engine():
    s = OptimSettings(lr_warmup_steps=10, total_training_steps=100)
    # LambdaLR from step 0: k / W during warmup (the first update runs at rate 0, as in verl), then lr
    assert [s.lr_at(k, LR) for k in (0, 5, 9, 10, 99)] == pytest.approx([0.0, LR / 2, 0.9 * LR, LR, LR])
    ratio = OptimSettings(lr_warmup_steps_ratio=0.1, total_training_steps=50)  # warmup int(0.1 * 50) = 5
    assert ratio.warmup_steps() == 5 and ratio.lr_at(1, LR) == pytest.approx(LR / 5)


def test_cosine_with_a_floor_ratio():
    s = OptimSettings(lr_decay_style="cosine", min_lr_ratio=0.1, total_training_steps=100)
    # lr * (m + (1 - m) (1 + cos(pi p)) / 2), p the progress: 0.55 lr half way, the floor at the end and after
    assert s.lr_at(0, LR) == pytest.approx(LR)
    assert s.lr_at(50, LR) == pytest.approx(LR * (0.1 + 0.9 * 0.5))
    assert s.lr_at(100, LR) == pytest.approx(0.1 * LR) and s.lr_at(150, LR) == pytest.approx(0.1 * LR)
    # warmup 10 then cosine over the remaining 90 steps: step 55 is half way
    warm = OptimSettings(lr_decay_style="cosine", lr_warmup_steps=10, total_training_steps=100)
    assert warm.lr_at(55, LR) == pytest.approx(LR * 0.5)
    # num_cycles 1: a whole wave, the floor half way and back up at the end (verl's FSDP formula)
    wave = OptimSettings(lr_decay_style="cosine", num_cycles=1.0, total_training_steps=100)
    assert (wave.lr_at(50, LR), wave.lr_at(100, LR)) == (pytest.approx(0.0), pytest.approx(LR))


def test_megatron_keys_decay_steps_min_lr_and_warmup_init():
    s = OptimSettings(lr_decay_style="linear", min_lr=1e-4, lr_decay_steps=20, total_training_steps=1000)
    assert s.lr_at(10, LR) == pytest.approx(1e-4 + 9e-4 * 0.5)
    assert s.lr_at(20, LR) == pytest.approx(1e-4) and s.lr_at(21, LR) == pytest.approx(1e-4)
    warm = OptimSettings(lr_warmup_steps=4, lr_warmup_init=1e-5, total_training_steps=10)
    assert warm.lr_at(2, LR) == pytest.approx(1e-5 + (LR - 1e-5) / 2) and warm.lr_at(4, LR) == LR
    # the warmup ratio is of the decay steps (Megatron) when they are given
    assert OptimSettings(lr_warmup_steps_ratio=0.5, lr_decay_steps=8, total_training_steps=100).warmup_steps() == 4


def test_the_position_is_in_the_optimizer_state_so_a_checkpoint_keeps_it():
    params = [torch.nn.Parameter(torch.zeros(2))]
    settings = OptimSettings(lr_warmup_steps=4, total_training_steps=10)
    optimizer = torch.optim.AdamW(params, lr=LR)
    rates = [apply_lr(optimizer, settings, LR) for _ in range(3)]
    assert rates == pytest.approx([0.0, LR / 4, LR / 2]) and optimizer.param_groups[0]["lr"] == LR / 2
    resumed = torch.optim.AdamW(params, lr=LR)
    resumed.load_state_dict(optimizer.state_dict())
    assert apply_lr(resumed, settings, LR) == pytest.approx(3 * LR / 4)  # step 3, not step 0 again


def test_verls_optim_keys_load():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=10",
            "actor_rollout_ref.actor.optim.lr_decay_style=constant",
            "actor_rollout_ref.actor.optim.lr_decay_steps=51200",
            "actor_rollout_ref.actor.optim.weight_decay=0.1",
            "actor_rollout_ref.actor.optim.clip_grad=1.0",
            "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        ],
    )
    a = cfg.actor
    assert (a.lr, a.weight_decay, a.grad_clip, a.optim.lr_warmup_steps, a.optim.lr_decay_steps) == (
        1e-6,
        0.1,
        1.0,
        10,
        51200,
    )
    assert tuple(a.optim.betas) == (0.9, 0.95)
    for spelling in ("lr_scheduler_type", "warmup_style"):  # verl's FSDP names of the decay style
        loaded = load_config(None, [f"actor_rollout_ref.actor.optim.{spelling}=cosine"]).actor.optim
        assert loaded.lr_decay_style == "cosine"
    with pytest.raises(ConfigError, match="min_lr and actor.optim.min_lr_ratio both"):
        load_config(None, ["actor.optim.min_lr=1e-5", "actor.optim.min_lr_ratio=0.1"])
    with pytest.raises(ConfigError, match=r"lr_decay_style.*Did you mean 'cosine'"):
        load_config(None, ["actor.optim.lr_decay_style=cosin"])


def test_the_run_passes_its_trainer_steps_to_the_schedule():
    from pipeline.trainer_launch import _policy

    class Ctx:
        cfg = load_config(None, ["rollout.total_rollout_steps=96", "actor.ppo_mini_batch_size=4"])

    # 96 prompts, 4 per mini-batch, require_batches 1 (conf/default.yaml): 24 trainer steps
    assert _policy(Ctx).optim.total_training_steps == 96 // (4 * Ctx.cfg.async_training.require_batches)
    assert math.isfinite(_policy(Ctx).optim.lr_at(5, LR))
