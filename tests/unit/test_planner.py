"""The planner and the calibrated preset, on the event model (no Ray)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.calibrate import TABLES
from bench.modes import colocated_overrides, per_unit, setting
from pipeline.config import load_config
from pipeline.sim.des import simulate
from pipeline.sim.planner import Hardware, candidates, colocated

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["7b", "retool"])
def test_calibrated_preset_reproduces_the_seed_table(name):
    table = TABLES[name]
    base = load_config(table.preset, [])
    colo = load_config(table.preset, colocated_overrides(base, table))
    colo_out = simulate(colo.sim, setting(colo), 24)
    colo_step = per_unit(colo_out.step_end_s, colo, table)
    async_out = simulate(base.sim, setting(base), 96)
    async_step = per_unit(async_out.step_end_s, base, table)
    assert colo_step == pytest.approx(table.colo_step, rel=0.05)
    gen = colo_step - colo.sim.sync_s - colo_out.train_s / 24
    assert gen == pytest.approx(table.colo_gen, rel=0.05)
    assert async_step == pytest.approx(table.async_step, rel=0.10)  # 7b: verl's 150.63 s per 512 prompts


@pytest.mark.parametrize("name", ["7b", "retool"])
def test_each_preset_bounds_the_prompts_generating_at_once_as_its_fit_did(name):
    from bench.calibrate import concurrent_prompts
    from stages.staleness import StalenessBudget

    table = TABLES[name]
    budget = StalenessBudget.from_config(load_config(table.preset, []))
    if table.servers is None:  # the fit left verl's bound out: the preset's must not bind
        assert budget.max_concurrent_samples == budget.max_required_samples
    else:  # verl's 16 a server, scaled as the fit scaled it, and binding as on verl's run
        assert budget.max_concurrent_samples == concurrent_prompts(table) < budget.max_required_samples


def _toy(*extra: str):
    # Generation of a step on 8 GPUs takes as long as its training on 8 GPUs: the even split should win.
    return load_config(
        ROOT / "conf" / "sim" / "toy.yaml",
        [
            "sim.length_sigma=0",
            "sim.length_mean=1000",
            "sim.prefill_s=0",
            "sim.decode_s_per_token=0.01",  # 10 s per response
            "sim.slots=64",  # 8 prompts x 8 responses at once on the 8 GPUs the config stands for
            "sim.train_s_per_token=0.000156",  # 64k tokens: 10 s on 8 GPUs
            "sim.sync_s=0",
            *extra,
        ],
    )


def test_balanced_workload_gets_the_even_split_and_async_beats_colocated():
    cfg = _toy()
    hw = Hardware(gpus=16, gpus_per_replica=4, sim_engine_gpus=8, sim_trainer_gpus=8, switch_s=0.0)
    ranked = candidates(cfg, hw, max_staleness=1.0)
    assert (ranked[0].trainer_gpus, ranked[0].rollout_gpus) == (8, 8)
    assert ranked[0].staleness > 0
    # Colocated on 16 GPUs: more slots do not make one response faster, so 10 s of generation, then 5 s of
    # training. Split 8:8 and overlapped: max(10, 10) s.
    assert colocated(cfg, hw) == pytest.approx(15.0, rel=0.01)
    assert ranked[0].step_s == pytest.approx(10.0, rel=0.02)


def test_max_staleness_limits_the_candidates():
    ranked = candidates(_toy(), Hardware(16, 4, 8, 8, 0.0), max_staleness=0.25)
    assert {c.staleness for c in ranked} == {0.0, 0.25}


def test_the_trainer_gets_whole_model_replicas_and_the_report_names_its_data_parallel_keys():
    from pipeline.sim.planner import replica_gpus, report

    cfg = _toy("trainer.backend=megatron", "actor.megatron.tensor_model_parallel_size=4")
    hw = Hardware(24, 2, 8, 8, 0.0, trainer_replica_gpus=replica_gpus(cfg))
    ranked = candidates(cfg, hw, max_staleness=0.5)
    assert {c.trainer_gpus for c in ranked} == {4, 8, 12, 16, 20}  # 2-GPU engine steps, but 4-GPU replicas
    assert all(c.data_parallel * 4 == c.trainer_gpus for c in ranked)
    best = ranked[0]
    assert f"data-parallel size {best.data_parallel} x 4 GPUs" in report(cfg, hw, 0.5)
    with pytest.raises(ValueError, match="whole 4-GPU model replicas"):
        candidates(cfg, Hardware(6, 3, 8, 8, 0.0, trainer_replica_gpus=4), max_staleness=0.5)


def test_plan_command_prints_a_recommendation_and_refuses_a_budget_too_small():
    cmd = [sys.executable, "-m", "pipeline.cli", "plan", "conf/sim/toy.yaml", "--gpus", "32"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "colocated sync on 32 GPUs" in done.stdout and "recommended: trainer" in done.stdout
    bad = subprocess.run([*cmd[:-1], "8"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--gpus 8 leaves no room" in bad.stderr


@pytest.mark.parametrize("name", ["7b", "retool"])
def test_calibrate_smoke_fits_a_candidate(name, capsys):
    # bench.calibrate's code path on two candidates and a coarse fit (its figures mean nothing at this size)
    from bench.calibrate import main

    slots, decode, wait = main([name, "--smoke"])
    assert slots in TABLES[name].slot_range and 1e-4 < decode < 0.1 and wait > 0
    assert f"fit: slots {slots}" in capsys.readouterr().out
