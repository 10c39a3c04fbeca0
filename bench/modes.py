"""Colocated synchronous baseline against the four async modes, on one simulated workload, side by side.

Each mode runs through the real pipeline (Ray Data stream, gate, sink, syncs, audit) with simulated engines and
trainer (stages/sim/workload.py), and through the discrete-event model (pipeline/sim/des.py) for comparison. Times are
simulated seconds per 512 prompts (32 in the scaled-down run), averaged over the sync windows between the first
(start-up) and the last (the end-of-run drain, when the gate has nothing left to admit); the table gives their
spread too.
The default preset is calibrated to verl's published 128-GPU 7B table (bench/calibrate.py).

    python -m bench.modes                 # about 4 minutes on 2 cores
    python -m bench.modes --time-scale 0.2  # wall seconds per simulated second (the preset's: 0.05); 4x longer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from bench.calibrate import ASYNC_TRAIN, COLO_SWITCH, COLO_TRAIN, MAX_LEN, mean_length
from pipeline.config import RunConfig, load_config
from pipeline.sim.des import Setting, simulate
from stages.sim.workload import bubble_bound, tail_utilisation
from stages.staleness import StalenessBudget

PRESET = Path(__file__).resolve().parents[1] / "conf" / "sim" / "verl_7b_128gpu.yaml"
PROMPTS_PER_UNIT = 32  # verl's step of 512 prompts, scaled down 16x
VERL = {
    "stream off-policy": 1.6,
    "async + partial rollout": 2.35,
}  # verl's fully_async_policy table, 128 GPUs, over colocated sync

_SYNC = ["async_training.staleness_threshold=0", "async_training.partial_rollout=false"]
MODES = {
    "colocated sync": None,  # colocated_overrides()
    "on-policy pipeline": [*_SYNC, "async_training.trigger_parameter_sync_step=1", "async_training.require_batches=16"],
    "stream off-policy": _SYNC,
    "async stale samples": ["async_training.partial_rollout=false"],
    "async + partial rollout": [],
}


def colocated_overrides(cfg_async: RunConfig) -> list[str]:
    """All 128 GPUs generate, then all train: twice the slots, the colocated trainer (old_log_prob + update_actor
    over the same tokens) and the rest of the colocated step as the switch."""
    per_token = cfg_async.sim.train_s_per_token * COLO_TRAIN / ASYNC_TRAIN
    return [
        *_SYNC,
        "async_training.trigger_parameter_sync_step=1",
        "async_training.require_batches=16",
        f"sim.slots={2 * cfg_async.sim.slots}",
        f"sim.train_s_per_token={per_token:.6e}",
        f"sim.sync_s={COLO_SWITCH:.2f}",
    ]


def setting(cfg: RunConfig) -> Setting:
    at, ro = cfg.async_training, cfg.rollout
    mode = at.partial_rollout_mode if at.partial_rollout and at.staleness_threshold > 0 else "wait"
    in_engine = ro.calls_in_flight * ro.prompts_per_call * ro.n * ro.num_replicas
    slots = cfg.sim.slots * ro.num_replicas
    return Setting(StalenessBudget.from_config(cfg), ro.n, cfg.data.max_response_length, slots, in_engine, mode)


def windows(step_end: list[float], cfg: RunConfig) -> list[float]:
    """Seconds per 32 prompts of each sync window but the first (start-up) and the last (drain)."""
    k, b = cfg.async_training.trigger_parameter_sync_step, StalenessBudget.from_config(cfg).required_samples
    ends = step_end[k - 1 :: k]  # the last step of each window
    if len(ends) < 3:
        raise ValueError(f"{len(ends)} sync windows: the measurement needs 3 or more (start-up, measured, drain)")
    return [(after - before) / (k * b / PROMPTS_PER_UNIT) for before, after in zip(ends[:-2], ends[1:-1], strict=True)]


def per_unit(step_end: list[float], cfg: RunConfig) -> float:
    measured = windows(step_end, cfg)
    return sum(measured) / len(measured)


def run_pipeline(cfg: RunConfig) -> dict:
    from pipeline.run import run

    summary = run(cfg)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    ends = [r["timing/elapsed_s"] / cfg.sim.time_scale for r in rows]
    return {"per_unit": per_unit(ends, cfg), "windows": windows(ends, cfg), **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=str(PRESET))
    parser.add_argument(
        "--syncs",
        type=int,
        default=4,
        help="sync windows per pipeline run, 3 or more (the first and last not measured)",
    )
    parser.add_argument("--time-scale", type=float, default=None, help="sim.time_scale (default: the preset's)")
    args = parser.parse_args()
    from pipeline.prepare import start_ray

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-modes-"))
    scale = [] if args.time_scale is None else [f"sim.time_scale={args.time_scale}"]
    base = load_config(args.preset, scale)
    start_ray(base, out)
    rows, started = {}, time.monotonic()
    for name, overrides in MODES.items():
        overrides = [*scale, *(colocated_overrides(base) if overrides is None else overrides)]
        probe = load_config(args.preset, overrides)
        prompts = (
            args.syncs
            * probe.async_training.trigger_parameter_sync_step
            * StalenessBudget.from_config(probe).required_samples
        )
        cfg = load_config(
            args.preset,
            [
                *overrides,
                f"rollout.total_rollout_steps={prompts}",
                f"trainer.output_dir={out}",
                f"trainer.run_name={name.replace(' ', '_').replace('+', 'and')}",
            ],
        )
        res = run_pipeline(cfg)
        model = simulate(cfg.sim, setting(cfg), 40 * cfg.async_training.trigger_parameter_sync_step)
        rows[name] = (cfg, res, model, per_unit(model.step_end_s, cfg))
        print(f"bench: {name}: {res['per_unit']:.1f} s per 512 prompts (model {rows[name][3]:.1f})", flush=True)
    print_table(rows, base, time.monotonic() - started, out)


def bound(colo: RunConfig, async_cfg: RunConfig) -> tuple[float, float, float]:
    """S* of the colocated workload, the same with the async trainer's shorter step (no old_log_prob), and U_tail."""
    w = colo.sim
    requests = PROMPTS_PER_UNIT * colo.rollout.n
    mean = mean_length(w)
    u = tail_utilisation(requests, mean, MAX_LEN, w.slots)
    t_gen = requests * mean * w.decode_s_per_token / w.slots  # no tail: every slot busy to the end
    t_train = requests * mean * w.train_s_per_token
    t_train_async = requests * mean * async_cfg.sim.train_s_per_token
    s_star = bubble_bound(t_gen, t_train, w.sync_time_s(), u)
    return s_star, s_star * (t_gen + t_train) / (t_gen + t_train_async), u


def print_table(rows: dict, base: RunConfig, wall: float, out: Path) -> None:
    colo_cfg, colo, colo_model, colo_model_unit = rows["colocated sync"]
    s_star, s_star_async, u = bound(colo_cfg, base)
    print(f"\nbench.modes: {len(rows)} pipeline runs in {wall:.0f} s (run dirs in {out})")
    print("times: simulated seconds per 512 prompts (32 in the scaled run); speedup over colocated sync")
    header = f"{'mode':<25} {'pipeline s':>10} {'windows s':>13} {'speedup':>8} {'model s':>8} {'model x':>8} "
    header += f"{'verl x':>7} "
    print(header + f"{'eff.':>5} {'eff.*':>5} {'trainer idle':>12} {'rollout idle':>12} {'max lag':>7} {'audit':>5}")
    for name, (_cfg, res, _model, model_unit) in rows.items():
        speedup = colo["per_unit"] / res["per_unit"]
        verl = f"{VERL[name]:.2f}" if name in VERL else "-"
        spread = f"{min(res['windows']):.1f}-{max(res['windows']):.1f}"
        print(
            f"{name:<25} {res['per_unit']:>10.1f} {spread:>13} {speedup:>8.2f} {model_unit:>8.1f} "
            f"{colo_model_unit / model_unit:>8.2f} {verl:>7} {speedup / s_star:>5.2f} {speedup / s_star_async:>5.2f} "
            f"{res['trainer_idle_ratio']:>12.2f} {res['rollouter_idle_ratio']:>12.2f} {res['max_lag']:>7} "
            f"{'PASS' if res['audit_ok'] else 'FAIL':>5}"
        )
    print(f"bubble bound S* = {s_star:.2f} (U_tail {u:.2f}); eff. = speedup / S*")
    print(
        f"S* counting the async trainer's step without old_log_prob ({ASYNC_TRAIN} s instead of {COLO_TRAIN:.2f} s "
        f"per 512 prompts): {s_star_async:.2f}; eff.* = speedup / that"
    )
    print(f"workload: {dataclasses.asdict(base.sim)}")


if __name__ == "__main__":
    main()
