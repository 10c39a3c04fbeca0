"""Trainer step time at DP = 1 and DP = 2 on the same mini-batch, side by side in one run, and the weight export
(gather every parameter, what a push or a publish does), for both backends: torch (FSDP2, `actor.fsdp_config.
fsdp_size`) and Megatron (DP x TP = 1 x 1, 2 x 1 and 1 x 2: `trainer.n_gpus_per_node` over
`actor.megatron.tensor_model_parallel_size`).

The embedded model, one step of one 64-row mini-batch (the embedded job's step: 8 prompts x 8 responses) with the
proximal pass on; the trainers alternate for ROUNDS rounds and the median of each is reported, so the machine's
background load falls on both alike. Each rank runs one torch thread, so DP = 2 uses two cores where DP = 1 uses one.

    python -m bench.data_parallel          # a few minutes on 2 cores
    python -m bench.data_parallel --smoke  # every layout's start-up, then one step of 8 rows each; figures void
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round of one 8-row step per layout; figures void")
    args = parser.parse_args(argv)
    rounds, rows = (1, 8) if args.smoke else (ROUNDS, 64)
    import ray

    from pipeline.config import load_config
    from pipeline.prepare import start_ray
    from pipeline.tasks.embedded import build_embedded
    from stages.trainer.fsdp_backend import FSDPTrainer
    from stages.trainer.megatron_backend import MegatronTrainer
    from stages.trainer.settings import PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-dp-"))
    start_ray(load_config(None, []), out)
    model_dir = str(build_embedded(out, 8, seed=5).model_dir)
    policy, batch = PolicySettings(lr=1e-5, micro_batch_size=16), minibatch(rows)
    args = dict(policy=policy, compute_prox_log_prob=True)
    megatron = ray.remote(MegatronTrainer).options(num_cpus=0)
    trainers = {
        "torch DP1": ray.remote(TorchTrainer).options(num_cpus=0).remote(model_dir, **args),
        "torch DP2": ray.remote(FSDPTrainer).options(num_cpus=0).remote(model_dir, **args),
        "megatron DP1xTP1": megatron.remote(model_dir, **args),
        "megatron DP2xTP1": megatron.remote(model_dir, **args, data_parallel_size=2),
        "megatron DP1xTP2": megatron.remote(model_dir, **args, tensor_model_parallel_size=2),
    }
    steps: dict[str, list[float]] = {name: [] for name in trainers}
    exports: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(rounds + 1):  # the first round warms them up and is not counted
        for name, trainer in trainers.items():
            step = timed(ray, lambda t=trainer: t.train_step.remote([batch]))
            path = str(out / f"{name.replace(' ', '_')}.safetensors")
            export = timed(ray, lambda t=trainer, f=path: t.publish_weights.remote(f))
            if i:
                steps[name].append(step)
                exports[name].append(export)
    ray.shutdown()
    step = {name: statistics.median(v) for name, v in steps.items()}
    export = {name: statistics.median(v) for name, v in exports.items()}
    tokens = sum(len(p) + len(r) for p, r in zip(batch["prompt_ids"], batch["response_ids"], strict=True))
    print(f"\nbench.data_parallel: one step of {len(batch['prompt_ids'])} rows ({tokens} tokens), median of {rounds}")
    print(f"{'layout':>18} {'step s':>8} {'step / DP1':>10} {'export s':>9} {'export / DP1':>12}")
    for name in trainers:
        base = "torch DP1" if name.startswith("torch") else "megatron DP1xTP1"
        print(
            f"{name:>18} {step[name]:>8.3f} {step[name] / step[base]:>10.2f} {export[name]:>9.3f} "
            f"{export[name] / export[base]:>12.2f}"
        )
    return step


if __name__ == "__main__":
    main()
