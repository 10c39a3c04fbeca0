"""Where validation runs, side by side on one job: what each placement costs the trainer.

The embedded CPU job (vLLM-CPU, torch trainer) validated every `--test-freq` versions and before the first step,
three ways: on the stream's engine with its requests interleaved (the default), on the stream's engine holding new
training requests until the pass is done (`parallel_validate_and_rollout=false`, verl's default), and on a
dedicated engine outside the stream (`use_trainer_do_validate=true`). Per mode: the trainer's blocked time per
sync and in all (syncs, plus the weight file each dedicated pass costs), its idle ratio, and the wall time.

    python -m bench.validation             # about 6 minutes on 2 cores
    python -m bench.validation --smoke     # seconds, on the simulated toy workload (bench/smoke.py), less `dedicated`
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.smoke import job
from pipeline.config import load_config
from pipeline.prepare import start_ray

MODES = {
    "interleaved": [],
    "serial": ["async_training.parallel_validate_and_rollout=false"],
    "dedicated": ["async_training.use_trainer_do_validate=true"],
}
SMOKE_MODES = ("interleaved", "serial")  # the dedicated engine is vLLM: the config refuses it on simulated ones


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--test-freq", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="seconds, on the simulated toy workload; figures void")
    args = parser.parse_args(argv)
    config, tiny, per_step = job(args.smoke)
    steps = 8 if args.smoke else args.steps
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-validation-"))
    start_ray(load_config(config, tiny), out)
    from pipeline.run import run

    results = {}
    for mode, extra in MODES.items():
        if args.smoke and mode not in SMOKE_MODES:
            continue
        cfg = load_config(
            config,
            [
                *tiny,
                f"rollout.total_rollout_steps={per_step * steps}",
                "data.val_files=embedded",
                "data.num_embedded_val_prompts=32",
                f"rollout.test_freq={args.test_freq}",
                "trainer.val_before_train=true",
                "rollout.val_kwargs.n=4",
                "rollout.val_kwargs.temperature=1.0",
                "trainer.monitor=jsonl",
                f"trainer.output_dir={out}",
                f"trainer.run_name={mode}",
                *extra,
            ],
        )
        summary = run(cfg)
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        syncs = [r["sync/trainer_blocked_s"] for r in rows if "sync/trainer_blocked_s" in r]
        publish = [r["val/trainer_blocked_s"] for r in rows if "val/trainer_blocked_s" in r]
        passes = sum("val/version" in r for r in rows)
        results[mode] = (syncs, publish, passes, summary)
        print(f"bench: {mode}: trainer blocked {sum(syncs) + sum(publish):.2f} s in all", flush=True)
    print(
        f"\n{'mode':<12} {'passes':>6} {'blocked s/sync':>14} {'max s':>6} {'val s':>6} {'blocked s':>9} "
        f"{'trainer idle':>12} {'wall s':>7} {'audit':>5}"
    )
    for mode, (syncs, publish, passes, s) in results.items():
        print(
            f"{mode:<12} {passes:>6} {statistics.mean(syncs):>14.3f} {max(syncs):>6.2f} {sum(publish):>6.3f} "
            f"{sum(syncs) + sum(publish):>9.2f} {s['trainer_idle_ratio']:>12.2f} {s['wall_s']:>7.1f} "
            f"{'PASS' if s['audit_ok'] else 'FAIL':>5}"
        )
    return results


if __name__ == "__main__":
    main()
