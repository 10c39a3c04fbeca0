"""Trainer efficiency: the torch trainer's step time and peak memory on a long-tailed mini-batch, for each way of
running its micro-batches, side by side in one run, on the embedded model's shape and on a larger one.

The mini-batch (`--workload long_tail`): 64 rows (8 prompts x 8 responses) whose response lengths follow the seed's
workload scaled down (conf/sim/verl_7b_128gpu.yaml: log-normal, sigma 1, mean 4000 capped at 28000 tokens; here mean
64 capped at 448, drawn with stages/sim/workload.py), each after a prompt of 8 to 24 tokens. `--workload default`
draws the default CPU job's shape instead (64 rows, the embedded task's prompts of 4 to 21 tokens, responses of mean
20 capped at data.max_response_length = 48), to decide its defaults; `--workload peers_long` bench.peers' workload (b)
(the same prompts, responses of mean 242 tokens, most at the 256-token cap).

The variants (one fresh TorchTrainer each, from the same weights; fp32 unless named, one optimizer update per step):
- padded: right-padded micro-batches of `--micro` rows (the trainer's path before packing);
- packed: the same micro-batches, each packed into one row (model.use_remove_padding, per-sequence attention);
- packed_nxn: the same, but with transformers' own packed attention (SDPA over the N x N block-diagonal mask it
  builds from the restarting positions), to show why the per-sequence path is ours;
- packed_budget: packed, micro-batches by a token budget of `--budget` (actor.use_dynamic_bsz);
- packed_budget_ckpt: and activation checkpointing (model.enable_gradient_checkpointing);
- packed_bf16: packed, the forward and backward in bf16 over the fp32 weights
  (actor.fsdp_config.mixed_precision.param_dtype=bf16): on a CPU with AMX (`lscpu` lists amx_bf16) bf16 matmuls run
  at several times fp32's rate, which pays for autocast's casts once the model is wide enough (`--models long`).

Measured per variant: step time, the median of `--steps` steps after a warm-up step, the variants taking their steps
in turn (whatever else the machine runs slows them alike); peak memory, over one more step:
the most bytes the process's malloc had in use (glibc's mallinfo2, sampled after every torch op of the forward,
backward and update) above what it had in use when the step started (the weights, the optimizer state and the previous
step's gradients, which the step frees and allocates again), i.e. the activations and the temporaries.
Ratios are against `padded` of the same model (the first variant run when `padded` is not). Targets (2 cores):
packed_budget at most 0.5x padded's step time, packed_budget_ckpt at most 0.5x padded's peak memory.

    python -m bench.trainer_efficiency                 # both models, a few minutes on 2 cores
    python -m bench.trainer_efficiency --workload default --models embedded
    python -m bench.trainer_efficiency --models embedded,long --variants packed,packed_bf16   # bf16 against fp32
    python -m bench.trainer_efficiency --models long --workload peers_long --variants packed_bf16 --micro 32
    python -m bench.trainer_efficiency --smoke         # seconds: a tiny model, to check the bench runs
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.peers_task import LONG_SHAPE
from stages.sim.workload import Workload
from stages.trainer.settings import ExecutionSettings, PolicySettings

VOCAB = 300
# Qwen2 shapes: the embedded model's (pipeline/tasks/embedded.py), one 8x its parameters, and bench.peers' workload
# (b)'s (bench/peers_task.py's LONG_SHAPE, ~18M parameters at this vocabulary).
MODELS = {
    "embedded": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4),
    "larger": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4),
    "long": LONG_SHAPE,
    "smoke": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1),
}
VARIANTS = {
    "padded": dict(packed=False, budget=False, ckpt=False),
    "packed": dict(packed=True, budget=False, ckpt=False),
    "packed_nxn": dict(packed=True, budget=False, ckpt=False, nxn=True),
    "packed_budget": dict(packed=True, budget=True, ckpt=False),
    "packed_budget_ckpt": dict(packed=True, budget=True, ckpt=True),
    "packed_bf16": dict(packed=True, budget=False, ckpt=False, bf16=True),
}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks")] + [
        (n, ctypes.c_size_t) for n in ("fsmblks", "uordblks", "fordblks", "keepcost")
    ]


@functools.cache
def _mallinfo2():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back: in its arenas and in mmapped blocks."""
    info = _mallinfo2()()
    return info.uordblks + info.hblkhd


class PeakMemory(TorchDispatchMode):
    """The peak of malloc's bytes in use, sampled after every torch op run inside the block, above the start."""

    def __enter__(self):
        self.start = self.top = _malloc_in_use()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.top = max(self.top, _malloc_in_use())
        return out

    @property
    def peak(self) -> int:
        return self.top - self.start


@dataclass
class Shape:
    """A mini-batch: `rows` (prompt, response) pairs, responses log-normal (sigma 1) of mean `mean` capped at `cap`
    tokens (stages/sim/workload.py's draw), prompts uniform in `prompt`."""

    rows: int
    mean: int
    cap: int
    prompt: tuple[int, int]


WORKLOADS = {
    "long_tail": Shape(rows=64, mean=64, cap=448, prompt=(8, 24)),  # the seed's 4000 / 28000, scaled down
    "default": Shape(rows=64, mean=20, cap=48, prompt=(4, 21)),  # the default job: 8 prompts x 8, max 48 tokens
    "smoke": Shape(rows=6, mean=16, cap=112, prompt=(2, 4)),
    # bench.peers' workload (b): the embedded task's prompts, answers mostly at their 256-token cap, as its runs' are
    "peers_long": Shape(rows=64, mean=1024, cap=256, prompt=(4, 21)),
}


def minibatch(shape: Shape, seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    lengths = Workload(length_mean=shape.mean, length_sigma=1.0, seed=seed)
    responses, prompts = [], []
    for i in range(shape.rows):
        n = lengths.response_length(f"row{i}", shape.cap)
        responses.append(rng.integers(2, VOCAB, n).tolist())
        prompts.append(rng.integers(2, VOCAB, int(rng.integers(shape.prompt[0], shape.prompt[1] + 1))).tolist())
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "response_logprobs": [[-float(np.log(VOCAB))] * len(r) for r in responses],  # a uniform policy's
        "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
    }


def build(out: Path, shape: dict) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB, **{"num_key_value_heads": max(1, shape["num_attention_heads"] // 2), **shape}
    )
    Qwen2ForCausalLM(config).save_pretrained(out)
    return str(out)


def trainer(model_dir: str, variant: dict, args):
    from stages.trainer.precision import MixedPrecision
    from stages.trainer.torch_backend import TorchTrainer

    policy = PolicySettings(
        lr=1e-6,
        micro_batch_size=args.micro,
        use_dynamic_bsz=variant["budget"],
        ppo_max_token_len_per_gpu=args.budget,
    )
    run = ExecutionSettings(use_remove_padding=variant["packed"], enable_gradient_checkpointing=variant["ckpt"])
    precision = MixedPrecision(param_dtype="bf16" if variant.get("bf16") else "fp32")
    out = TorchTrainer(model_dir, policy, torch_threads=args.threads, execution=run, mixed_precision=precision)
    if variant.get("nxn"):
        out.model.set_attn_implementation("sdpa")  # transformers builds the block-diagonal N x N mask itself
    return out


def measure(model_dir: str, rows: dict, names: list[str], args) -> dict[str, dict[str, float]]:
    """Each variant's median step time, the variants' steps taken in turn (so that whatever else the machine does
    slows them alike), then each one's peak memory over one more step."""
    trainers = {name: trainer(model_dir, VARIANTS[name], args) for name in names}
    for t in trainers.values():
        t.train_step([rows])  # warm-up: the optimizer state exists from here on
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.steps):
        for name, t in trainers.items():
            start = time.perf_counter()
            t.train_step([rows])
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, t in trainers.items():
        with PeakMemory() as memory:
            t.train_step([rows])
        dtype = str(t.compute_dtype).removeprefix("torch.")
        out[name] = {"step_s": statistics.median(times[name]), "peak_mb": memory.peak / 2**20, "dtype": dtype}
    return out


def computed_tokens(rows: dict, policy: PolicySettings, packed: bool) -> int:
    """Tokens the forward computes: every micro-batch's rows times its longest, or only the real ones packed."""
    from stages.trainer.balance import row_tokens
    from stages.trainer.step import Minibatch

    lengths = row_tokens(rows)
    cut = Minibatch.of(rows, policy).micro_batches(policy)
    return sum(sum(lengths[i] for i in p) if packed else len(p) * max(lengths[i] for i in p) for p in cut)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="embedded,larger", help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--workload", default="long_tail", choices=list(WORKLOADS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--micro", type=int, default=8, help="rows per fixed-size micro-batch")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per token-budget micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch, one step: seconds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.models, args.workload, args.steps, args.budget, args.micro = "smoke", "smoke", 1, 512, 2
    rows = minibatch(WORKLOADS[args.workload])
    lengths = [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"], strict=True)]
    print(f"{len(lengths)} rows, tokens: total {sum(lengths)}, mean {np.mean(lengths):.0f}, max {max(lengths)}")
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build(Path(tmp) / name, MODELS[name])
            print(f"\n{name} ({MODELS[name]}), {args.threads} threads")
            names = args.variants.split(",")
            base_name = "padded" if "padded" in names else names[0]
            against = f"x {base_name}"
            print(f"{'variant':<20}{'computed tok':>13}{'step s':>9}{against:>10}{'peak MiB':>10}{against:>10}")
            measured = measure(model_dir, rows, names, args)
            base = measured[base_name]
            for variant in names:
                spec, res = VARIANTS[variant], measured[variant]
                res["step_ratio"], res["peak_ratio"] = res["step_s"] / base["step_s"], res["peak_mb"] / base["peak_mb"]
                policy = PolicySettings(
                    micro_batch_size=args.micro, use_dynamic_bsz=spec["budget"], ppo_max_token_len_per_gpu=args.budget
                )
                res["computed_tokens"] = computed_tokens(rows, policy, spec["packed"])
                results[(name, variant)] = res
                print(
                    f"{variant:<20}{res['computed_tokens']:>13}{res['step_s']:>9.3f}{res['step_ratio']:>10.2f}"
                    f"{res['peak_mb']:>10.1f}{res['peak_ratio']:>10.2f}"
                )
    return results


if __name__ == "__main__":
    main()
