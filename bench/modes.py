"""The pipeline against its own event model, in each of verl's modes, on one simulated workload, side by side.

What it measures: each mode runs through the real pipeline (Ray Data stream, gate, sink, syncs, audit) with simulated
engines and trainer (stages/sim/workload.py), and the same settings run through the discrete-event model
(pipeline/sim/des.py), which has the pipeline's rules and none of its costs. The table gives, per mode, the
pipeline's time, the model's, and how much slower the pipeline is: what the stream's own machinery (Ray Data's
scheduling and hand-offs, the gate's round trips, the logs) costs on this workload. Times are simulated seconds per
colocated step of the table (512 prompts for 7b, 32 in the scaled-down run), averaged over the sync windows between
the first (start-up) and the last (the end-of-run drain, when the gate has nothing left to admit); the spread over
those windows is printed too.

What it does not measure: the speedups over colocated sync are those of a workload calibrated to one of verl's
published tables (bench/calibrate.py: `7b`, the 128-GPU Qwen2.5-Math-7B run, the default, or `retool`, the 32-GPU
multi-turn run). The colocated training and switch times are the table's, and the engine's slots and decode rate are
fitted so that the colocated generation and the async trainer's wait match it: the speedup of the mode the table
reports (async + partial rollout) is then an input of the workload, not a comparison with verl. The table prints
these inputs apart from the results.

    python -m bench.modes                 # about 4 minutes on 2 cores
    python -m bench.modes --time-scale 0.2  # wall seconds per simulated second (the preset's: 0.05); 4x longer
    python -m bench.modes --table retool    # multi-turn: 4 turns and 3 tool calls per response
    python -m bench.modes --smoke           # seconds: every mode on a tiny batch, to check the code path
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from bench.calibrate import TABLES, Table
from pipeline.config import RunConfig, load_config
from pipeline.sim.des import Setting, simulate
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


# --smoke: the same modes and code path on a batch small enough to run in seconds (its figures mean nothing).
SMOKE = ["sim.time_scale=0.0005", "rollout.n=2", "sim.token_unit=2000"]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", default="7b", choices=sorted(TABLES), help="the published table calibrated to")
    parser.add_argument("--preset", default=None, help="sim preset (default: the table's, conf/sim/)")
    parser.add_argument(
        "--syncs",
        type=int,
        default=4,
        help="sync windows per pipeline run, 3 or more (the first and last not measured)",
    )
    parser.add_argument("--time-scale", type=float, default=None, help="sim.time_scale (default: the preset's)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds per mode on a tiny batch; figures void")
    args = parser.parse_args(argv)
    table = TABLES[args.table]
    args.preset = args.preset or str(table.preset)
    from pipeline.prepare import start_ray

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-modes-"))
    scale = [] if args.time_scale is None else [f"sim.time_scale={args.time_scale}"]
    scale += SMOKE if args.smoke else []
    base = load_config(args.preset, scale)
    start_ray(base, out)
    rows, started = {}, time.monotonic()
    model_windows = 3 if args.smoke else 40
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
        model = simulate(cfg.sim, setting(cfg), model_windows * cfg.async_training.trigger_parameter_sync_step)
        rows[name] = (cfg, res, model, per_unit(model.step_end_s, cfg, table))
        print(f"bench: {name}: {res['per_unit']:.1f} s per step (model {rows[name][3]:.1f})", flush=True)
    print_table(rows, base, table, time.monotonic() - started, out)
    return rows


FITTED = "async + partial rollout"  # the mode of verl's tables that the calibration reproduces


def print_table(rows: dict, base: RunConfig, table: Table, wall: float, out: Path) -> None:
    """The results (the pipeline against its model, per mode), then the speedups of the calibrated workload, then
    what was calibrated: the inputs, printed apart so that no input reads as a result."""
    print(f"\nbench.modes: {len(rows)} pipeline runs in {wall:.0f} s (run dirs in {out})")
    print(f"times: simulated seconds per {table.prompts} prompts ({unit(table)} in the scaled run)")
    print(
        f"{'mode':<25} {'pipeline s':>10} {'windows s':>13} {'model s':>8} {'vs model':>8} "
        f"{'trainer idle':>12} {'rollout idle':>12} {'max lag':>7} {'audit':>5}"
    )
    for name, (_cfg, res, _model, model_unit) in rows.items():
        spread = f"{min(res['windows']):.1f}-{max(res['windows']):.1f}"
        print(
            f"{name:<25} {res['per_unit']:>10.1f} {spread:>13} {model_unit:>8.1f} "
            f"{100 * (res['per_unit'] / model_unit - 1):>+7.1f}% {res['trainer_idle_ratio']:>12.2f} "
            f"{res['rollouter_idle_ratio']:>12.2f} {res['max_lag']:>7} {'PASS' if res['audit_ok'] else 'FAIL':>5}"
        )
    colo, colo_model_unit = rows["colocated sync"][1], rows["colocated sync"][3]
    print("\nspeedup over colocated sync of this calibrated workload (not a measurement of verl's system)")
    print(f"{'mode':<25} {'pipeline x':>10} {'model x':>8}  verl's table")
    for name, (_cfg, res, _model, model_unit) in rows.items():
        verl = table.verl.get(name)
        note = "-" if verl is None else f"{verl:.2f}" + (" (the calibration's target)" if name == FITTED else "")
        print(f"{name:<25} {colo['per_unit'] / res['per_unit']:>10.2f} {colo_model_unit / model_unit:>8.2f}  {note}")
    print_inputs(base, table)


def print_inputs(base: RunConfig, table: Table) -> None:
    """What bench.calibrate took from verl's table and what it fitted to it: inputs of every figure above."""
    w = base.sim
    print(f"\ncalibrated inputs ({table.preset.name}, bench/calibrate.py; inputs, not results):")
    print(
        f"  from verl's table: colocated training {table.colo_train:.2f} s and the rest of its step "
        f"{table.colo_switch:.2f} s per {table.prompts} prompts; async training {table.async_train:.2f} s and "
        f"{table.async_sync:.2f} s per sync"
    )
    print(
        f"  fitted to verl's table: {2 * w.slots} engine slots colocated, {w.slots} async (to the async trainer's "
        f"wait, {table.async_wait:.2f} s), {w.decode_s_per_token:.6f} s per token (to the colocated generation, "
        f"{table.colo_gen:.2f} s)"
    )
    print(
        f"  so {FITTED} over colocated sync is {table.colo_step:.2f} / {table.async_step:.2f} = "
        f"{table.colo_step / table.async_step:.2f}x by construction; the other modes follow from the same inputs"
    )
    print(f"workload: {dataclasses.asdict(w)}")


if __name__ == "__main__":
    main()
