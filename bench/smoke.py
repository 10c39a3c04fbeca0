"""What a benchmark's `--smoke` runs in place of its real job: a few seconds of the same code path, for the test
suite (tests/pipeline/test_bench_smoke.py), whose figures mean nothing.

The benchmarks that run the embedded job on the real engine run conf/sim/toy.yaml instead: the real pipeline (Ray Data
stream, gate, sink, syncs, audit, validation, pull loads) with simulated engines and trainer that take milliseconds.
"""

from __future__ import annotations

from pathlib import Path

SIM_TOY = str(Path(__file__).resolve().parents[1] / "conf" / "sim" / "toy.yaml")
# Four prompts of two responses per step, and responses of a few simulated tokens.
TINY = ["actor.ppo_mini_batch_size=4", "rollout.n=2", "sim.length_mean=64", "sim.time_scale=0.0002"]


def job(smoke: bool) -> tuple[str | None, list[str], int]:
    """(config, overrides, prompts per step) of a benchmark's job: the embedded job (conf/default.yaml, 8 prompts a
    step), or the smoke's simulated one."""
    return (SIM_TOY, TINY, 4) if smoke else (None, [], 8)
