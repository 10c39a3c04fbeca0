"""Colocated synchronous baseline against the four async modes, on one simulated workload, side by side.

Each mode runs through the real pipeline (Ray Data stream, gate, sink, syncs, audit) with simulated engines and
trainer (stages/sim/workload.py), and through the discrete-event model (pipeline/sim/des.py) for comparison. Times are
simulated seconds per colocated step of the table (512 prompts for 7b, 32 in the scaled-down run), averaged over the
sync windows between the first (start-up) and the last (the end-of-run drain, when the gate has nothing left to
admit); the table gives their spread too.
Each preset is calibrated to one of verl's published tables (bench/calibrate.py): `7b`, the 128-GPU
Qwen2.5-Math-7B run (the default), or `retool`, the 32-GPU multi-turn tool-calling run.

    python -m bench.modes                 # about 4 minutes on 2 cores
    python -m bench.modes --time-scale 0.2  # wall seconds per simulated second (the preset's: 0.05); 4x longer
    python -m bench.modes --table retool    # multi-turn: 4 turns and 3 tool calls per response
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from bench.calibrate import TABLES, Table, mean_length
from pipeline.config import RunConfig, load_config
from pipeline.sim.des import Setting, simulate
from stages.sim.workload import bubble_bound, tail_utilisation
from stages.staleness import StalenessBudget

_SYNC = ["async_training.staleness_threshold=0", "async_training.partial_rollout=false"]


def modes(base: RunConfig, table: Table) -> dict[str, list[str]]:
    """Each mode's overrides of the table's (async + partial rollout) preset."""
    colocated_step = f"async_training.require_batches={unit(table) // base.actor.ppo_mini_batch_size}"
    return {
        "colocated sync": colocated_overrides(base, table),
        "on-policy pipeline": [*_SYNC, "async_training.trigger_parameter_sync_step=1", colocated_step],
        "stream off-policy": _SYNC,
        "async stale samples": ["async_training.partial_rollout=false"],
        "async + partial rollout": [],
    }


def colocated_overrides(cfg_async: RunConfig, table: Table) -> list[str]:
    """All the GPUs generate, then all train: twice the slots, the colocated trainer (old_log_prob + update_actor
    over the same tokens) and the rest of the colocated step as the switch."""
    per_token = cfg_async.sim.train_s_per_token * table.colo_train / table.async_train
    return [
        *_SYNC,
        "async_training.trigger_parameter_sync_step=1",
        f"async_training.require_batches={unit(table) // cfg_async.actor.ppo_mini_batch_size}",
        f"sim.slots={2 * cfg_async.sim.slots}",
        f"sim.train_s_per_token={per_token:.6e}",
        f"sim.sync_s={table.colo_switch:.2f}",
    ]


def unit(table: Table) -> int:
    """Prompts of one colocated step in the scaled-down run: the unit the times are given per."""
    return table.prompts // table.scale


def setting(cfg: RunConfig) -> Setting:
    at, ro = cfg.async_training, cfg.rollout
    mode = at.partial_rollout_mode if at.partial_rollout and at.staleness_threshold > 0 else "wait"
    in_engine = ro.calls_in_flight * ro.prompts_per_call * ro.n * ro.num_replicas
    slots = cfg.sim.slots * ro.num_replicas
    return Setting(StalenessBudget.from_config(cfg), ro.n, cfg.data.max_response_length, slots, in_engine, mode)


def windows(step_end: list[float], cfg: RunConfig, table: Table) -> list[float]:
    """Seconds per colocated step's prompts of each sync window but the first (start-up) and the last (drain)."""
    k, b = cfg.async_training.trigger_parameter_sync_step, StalenessBudget.from_config(cfg).required_samples
    ends = step_end[k - 1 :: k]  # the last step of each window
    if len(ends) < 3:
        raise ValueError(f"{len(ends)} sync windows: the measurement needs 3 or more (start-up, measured, drain)")
    per = k * b / unit(table)
    return [(after - before) / per for before, after in zip(ends[:-2], ends[1:-1], strict=True)]


def per_unit(step_end: list[float], cfg: RunConfig, table: Table) -> float:
    measured = windows(step_end, cfg, table)
    return sum(measured) / len(measured)


def run_pipeline(cfg: RunConfig, table: Table) -> dict:
    from pipeline.run import run

    summary = run(cfg)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    ends = [r["timing/elapsed_s"] / cfg.sim.time_scale for r in rows]
    return {"per_unit": per_unit(ends, cfg, table), "windows": windows(ends, cfg, table), **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", default="7b", choices=sorted(TABLES), help="the published table to compare with")
    parser.add_argument("--preset", default=None, help="sim preset (default: the table's, conf/sim/)")
    parser.add_argument(
        "--syncs",
        type=int,
        default=4,
        help="sync windows per pipeline run, 3 or more (the first and last not measured)",
    )
    parser.add_argument("--time-scale", type=float, default=None, help="sim.time_scale (default: the preset's)")
    args = parser.parse_args()
    table = TABLES[args.table]
    args.preset = args.preset or str(table.preset)
    from pipeline.prepare import start_ray

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-modes-"))
    scale = [] if args.time_scale is None else [f"sim.time_scale={args.time_scale}"]
    base = load_config(args.preset, scale)
    start_ray(base, out)
    rows, started = {}, time.monotonic()
    for name, overrides in modes(base, table).items():
        overrides = [*scale, *overrides]
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
        res = run_pipeline(cfg, table)
        model = simulate(cfg.sim, setting(cfg), 40 * cfg.async_training.trigger_parameter_sync_step)
        rows[name] = (cfg, res, model, per_unit(model.step_end_s, cfg, table))
        print(f"bench: {name}: {res['per_unit']:.1f} s per step (model {rows[name][3]:.1f})", flush=True)
    print_table(rows, base, table, time.monotonic() - started, out)


def bound(colo: RunConfig, async_cfg: RunConfig, table: Table) -> tuple[float, float, float]:
    """S* of the colocated workload, the same with the async trainer's shorter step (no old_log_prob), and U_tail.
    (Tool calls count as generation here: the bound treats a multi-turn response as one decode.)"""
    w = colo.sim
    requests = unit(table) * colo.rollout.n
    mean = mean_length(w, table.max_len)
    u = tail_utilisation(requests, mean, table.max_len, w.slots)
    t_gen = requests * mean * w.decode_s_per_token / w.slots  # no tail: every slot busy to the end
    t_train = requests * mean * w.train_s_per_token
    t_train_async = requests * mean * async_cfg.sim.train_s_per_token
    s_star = bubble_bound(t_gen, t_train, w.sync_time_s(), u)
    return s_star, s_star * (t_gen + t_train) / (t_gen + t_train_async), u


def print_table(rows: dict, base: RunConfig, table: Table, wall: float, out: Path) -> None:
    colo_cfg, colo, colo_model, colo_model_unit = rows["colocated sync"]
    s_star, s_star_async, u = bound(colo_cfg, base, table)
    print(f"\nbench.modes: {len(rows)} pipeline runs in {wall:.0f} s (run dirs in {out})")
    print(
        f"times: simulated seconds per {table.prompts} prompts ({unit(table)} in the scaled run); speedup over "
        "colocated sync"
    )
    header = f"{'mode':<25} {'pipeline s':>10} {'windows s':>13} {'speedup':>8} {'model s':>8} {'model x':>8} "
    header += f"{'verl x':>7} "
    print(header + f"{'eff.':>5} {'eff.*':>5} {'trainer idle':>12} {'rollout idle':>12} {'max lag':>7} {'audit':>5}")
    for name, (_cfg, res, _model, model_unit) in rows.items():
        speedup = colo["per_unit"] / res["per_unit"]
        verl = f"{table.verl[name]:.2f}" if name in table.verl else "-"
        spread = f"{min(res['windows']):.1f}-{max(res['windows']):.1f}"
        print(
            f"{name:<25} {res['per_unit']:>10.1f} {spread:>13} {speedup:>8.2f} {model_unit:>8.1f} "
            f"{colo_model_unit / model_unit:>8.2f} {verl:>7} {speedup / s_star:>5.2f} {speedup / s_star_async:>5.2f} "
            f"{res['trainer_idle_ratio']:>12.2f} {res['rollouter_idle_ratio']:>12.2f} {res['max_lag']:>7} "
            f"{'PASS' if res['audit_ok'] else 'FAIL':>5}"
        )
    print(f"bubble bound S* = {s_star:.2f} (U_tail {u:.2f}); eff. = speedup / S*")
    print(
        f"S* counting the async trainer's step without old_log_prob ({table.async_train} s instead of "
        f"{table.colo_train:.2f} s per {table.prompts} prompts): {s_star_async:.2f}; eff.* = speedup / that"
    )
    print(f"workload: {dataclasses.asdict(base.sim)}")


if __name__ == "__main__":
    main()
