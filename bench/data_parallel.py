"""Trainer step time at DP = 1 and DP = 2 (the torch backend: FSDP2, `actor.fsdp_config.fsdp_size`), on the same
mini-batch, side by side in one run, and the weight export (gather every parameter, what a push or a publish does)
at both.

The embedded model, one step of one 64-row mini-batch (the embedded job's step: 8 prompts x 8 responses) with the
proximal pass on; the two trainers alternate for ROUNDS rounds and the median of each is reported, so the machine's
background load falls on both alike. Each rank runs one torch thread, so DP = 2 uses two cores where DP = 1 uses one.

    python -m bench.data_parallel          # about a minute on 2 cores
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROUNDS = 6


def minibatch(rows: int = 64, seed: int = 0) -> dict[str, list]:
    """A mini-batch shaped like the embedded job's: short prompts, responses of 4 to 40 tokens."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 200, int(rng.integers(6, 14))).tolist() for _ in range(rows)]
    responses = [rng.integers(10, 200, int(rng.integers(4, 40))).tolist() for _ in range(rows)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "response_logprobs": [[-2.0] * len(r) for r in responses],
        "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
    }


def timed(ray, call) -> float:
    start = time.perf_counter()
    ray.get(call())
    return time.perf_counter() - start


def main() -> None:
    import ray

    from pipeline.config import load_config
    from pipeline.prepare import start_ray
    from pipeline.tasks.embedded import build_embedded
    from stages.trainer.fsdp_backend import FSDPTrainer
    from stages.trainer.settings import PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-dp-"))
    start_ray(load_config(None, []), out)
    model_dir = str(build_embedded(out, 8, seed=5).model_dir)
    policy, batch = PolicySettings(lr=1e-5, micro_batch_size=16), minibatch()
    trainers = {
        1: ray.remote(TorchTrainer).options(num_cpus=0).remote(model_dir, policy, compute_prox_log_prob=True),
        2: ray.remote(FSDPTrainer).options(num_cpus=0).remote(model_dir, policy, compute_prox_log_prob=True),
    }
    steps: dict[int, list[float]] = {1: [], 2: []}
    exports: dict[int, list[float]] = {1: [], 2: []}
    for i in range(ROUNDS + 1):  # the first round warms both up and is not counted
        for dp, trainer in trainers.items():
            step = timed(ray, lambda t=trainer: t.train_step.remote([batch]))
            export = timed(ray, lambda t=trainer, f=out / f"dp{dp}.safetensors": t.publish_weights.remote(str(f)))
            if i:
                steps[dp].append(step)
                exports[dp].append(export)
    ray.shutdown()
    step1, step2 = statistics.median(steps[1]), statistics.median(steps[2])
    exp1, exp2 = statistics.median(exports[1]), statistics.median(exports[2])
    tokens = sum(len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"], strict=True))
    print(f"\nbench.data_parallel: one step of {len(batch['prompt_ids'])} rows ({tokens} tokens), median of {ROUNDS}")
    print(f"{'':>24} {'DP = 1':>8} {'DP = 2':>8} {'DP2 / DP1':>10}")
    print(f"{'train step s':>24} {step1:>8.3f} {step2:>8.3f} {step2 / step1:>10.2f}")
    print(f"{'weight export s':>24} {exp1:>8.3f} {exp2:>8.3f} {exp2 / exp1:>10.2f}")


if __name__ == "__main__":
    main()
