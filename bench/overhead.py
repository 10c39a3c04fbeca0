"""Pipeline overhead: samples per second through the real stream (Ray Data, gate, generate/reward/advantage/log
stages, sink, syncs, audit) with engines and trainer that take no time, and what that costs a typical step.

The generate stage is the simulated engine with zero prefill, decode, training and sync times, so everything
measured is the pipeline's own work: Ray Data's scheduling and hand-offs between stages, the gate's round trips
to the VersionClock, Arrow conversions, the sample and consumption logs, the sink's grouping.

    python -m bench.overhead               # about 3 minutes on 2 cores
    python -m bench.overhead --smoke       # seconds: one call shape, a few steps; figures void
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from pipeline.config import load_config
from pipeline.prepare import start_ray

SIM = Path(__file__).resolve().parents[1] / "conf" / "sim" / "toy.yaml"
INSTANT = [f"sim.{k}=0" for k in ("prefill_s", "decode_s_per_token", "train_s_per_token", "sync_s")]
PROMPTS = 256
N = 8
# Steps to weigh the overhead against: the embedded CPU job (64 samples per step, about 1 s per step measured by
# `make run`) and verl's published 7B step (512 prompts x 16 per 4 local steps of about 150 s, the fully async run).
TYPICAL = {"embedded job step (64 samples, ~1 s)": (64, 1.0), "verl 7B step (2048 samples, ~38 s)": (2048, 37.7)}


def run_once(
    out: Path, prompts_per_call: int, calls_in_flight: int, in_engine: bool = False, prompts: int = PROMPTS
) -> tuple[float, float, bool]:
    """(samples per second over the steady part of the run, total wall seconds, audit verdict). `in_engine`: score,
    log and split in the engine's actor (rollout.score_in_engine)."""
    from pipeline.run import run

    cfg = load_config(
        SIM,
        [
            *INSTANT,
            f"rollout.score_in_engine={str(in_engine).lower()}",
            "sim.length_sigma=0",
            "sim.length_mean=32",
            f"rollout.n={N}",
            f"rollout.total_rollout_steps={prompts}",
            f"rollout.prompts_per_call={prompts_per_call}",
            f"rollout.calls_in_flight={calls_in_flight}",
            "actor.ppo_mini_batch_size=8",
            "async_training.staleness_threshold=1.0",
            f"trainer.output_dir={out}",
            f"trainer.run_name=ppc{prompts_per_call}{'-in-engine' if in_engine else ''}",
        ],
    )
    summary = run(cfg)
    rows = [json.loads(line) for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    ends = [r["timing/elapsed_s"] for r in rows]
    skip = len(ends) // 4  # start-up: the first quarter of the steps
    samples = (len(ends) - 1 - skip) * 8 * N
    return samples / (ends[-1] - ends[skip]), ends[-1], summary["audit_ok"]


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one call shape, a few steps: seconds; figures void")
    args = parser.parse_args(argv)
    prompts, shapes = (48, ((4, 4),)) if args.smoke else (PROMPTS, ((1, 8), (4, 4), (8, 2)))
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-overhead-"))
    start_ray(load_config(SIM, []), out)
    rows = []
    for ppc, calls in shapes:
        for in_engine in (False, True):  # side by side: scoring in the stream's last stage, or in the engine's actor
            rate, wall, ok = run_once(out, ppc, calls, in_engine, prompts)
            rows.append((ppc, calls, "engine" if in_engine else "stage", rate, wall, ok))
            print(f"bench: prompts_per_call={ppc}, scored in the {rows[-1][2]}: {rate:.0f} samples/s", flush=True)
    print(
        f"\n{'prompts/call':>12} {'calls':>6} {'scored in':>9} {'samples/s':>10} {'ms/sample':>10} {'run s':>6} "
        f"{'audit':>6}  ",
        end="",
    )
    print("  ".join(f"{name}: share" for name in TYPICAL))
    for ppc, calls, where, rate, wall, ok in rows:
        shares = "  ".join(
            f"{samples / rate / step_s:>{len(name) + 7}.3f}" for name, (samples, step_s) in TYPICAL.items()
        )
        verdict = "PASS" if ok else "FAIL"
        print(f"{ppc:>12} {calls:>6} {where:>9} {rate:>10.0f} {1000 / rate:>10.2f} {wall:>6.1f} {verdict:>6}  {shares}")
    print(
        f"{prompts} prompts x {N} responses per run, engines and trainer instant, 2 cores for everything; share = "
        "the step's samples x ms/sample / step time, an upper bound: the stream does this work beside the step; "
        "scored in the engine: rollout.score_in_engine (the default), in a stage: rollout.score_in_engine=false"
    )
    return rows


if __name__ == "__main__":
    main()
