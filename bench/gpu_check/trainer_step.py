"""The torch trainer on the device: one step in fp32 and in bf16, as a single rank and as FSDP2 (a one-rank world,
NCCL on a GPU, gloo on CPU), and as a single rank on verl's efficient path (packed sequences, which on a GPU in bf16
attend through torch's varlen flash kernel; token-budget micro-batches; activation checkpointing), each against the
same padded step on the CPU in fp32 (the reference, made in the same process).

What a step is compared on: the mini-batch's loss (actor/pg_loss) and entropy, the gradient's norm before clipping
(actor/grad_norm), every token's logprob before the update (the forward), and the update itself: the cosine between
its change of every parameter and the reference's, and every token's logprob after it. Tolerances:
- fp32: relative 1e-4 on loss, entropy and gradient norm, 2e-3 absolute on every logprob before and after the
  update, update cosine at least 0.99 (another device sums in another order; nothing else may differ);
- bf16 (autocast forward over fp32 master weights): relative 2e-2 on loss and entropy, 5e-2 on the gradient norm,
  0.1 absolute on every logprob before the update (bf16 keeps 8 bits of mantissa: a logit of 10 is off by up to
  0.04), update cosine at least 0.9 and 0.02 on the mean logprob difference after it. Not the largest difference
  after it: Adam's first step moves every weight by about lr whatever its gradient's size, so a weight whose
  gradient bf16 rounds across zero moves the other way, and a few tokens' logprobs move far (measured on an H100
  with the `gpu` model: 1.67 with the single rank, 0.06 with FSDP2).

Each variant then takes a second step on the same batch, timed warm (the first includes CUDA's start-up).

    python -m bench.gpu_check.trainer_step --device cuda --size gpu --variant single --out rows.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.gpu_check.models import batch, build_dense
from bench.gpu_check.report import Meter, Record, device_name, max_abs_diff, relative, save

TOLERANCES = {
    "fp32": {"loss": 1e-4, "entropy": 1e-4, "grad_norm": 1e-4, "logprobs": 2e-3, "cosine": 0.99},
    "bf16": {"loss": 2e-2, "entropy": 2e-2, "grad_norm": 5e-2, "logprobs": 0.1, "cosine": 0.9, "after_mean": 2e-2},
}
LR, MICRO = 1e-4, 4
VARIANT_NAMES = {
    "single": "torch single rank",
    "fsdp": "torch FSDP2, one rank",
    "packed": "torch single rank, packed + token budget + checkpointing",
}


def run_step(
    model_dir: Path, rows: dict, device: str, dtype: str, fsdp: bool, warm: bool = True, packed: bool = False
) -> dict:
    """One TorchTrainer step on `rows` and what it measured; `fsdp`: as FSDP2's only rank (the process group is
    destroyed afterwards, so the next variant can form its own); `warm`: time a second step too; `packed`: the
    efficient path verl's recipes switch on (padding-free packing, micro-batches by a token budget of two of the
    longest rows, activation checkpointing), which must give the padded step's numbers."""
    import os

    import torch.distributed as dist

    from stages.trainer.fsdp import DPRank
    from stages.trainer.precision import MixedPrecision
    from stages.trainer.ranks import free_port
    from stages.trainer.settings import ExecutionSettings, PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    rank = DPRank(0, 1, free_port(), fsdp=True) if fsdp else None
    longest = max(len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"], strict=True))
    policy = PolicySettings(
        lr=LR, micro_batch_size=MICRO, use_dynamic_bsz=packed, ppo_max_token_len_per_gpu=2 * longest
    )
    execution = ExecutionSettings(use_remove_padding=packed, enable_gradient_checkpointing=packed)
    trainer = TorchTrainer(
        str(model_dir),
        policy,
        execution=execution,
        data_parallel=rank,
        mixed_precision=MixedPrecision(param_dtype=dtype),
        device=device,
        torch_threads=os.cpu_count() if device == "cpu" else 1,
    )
    before = trainer.logprobs(rows["prompt_ids"], rows["response_ids"])
    start = weights(trainer)
    with Meter(device) as first:
        metrics = trainer.train_step([rows])
    after = trainer.logprobs(rows["prompt_ids"], rows["response_ids"])
    update = [new - old for new, old in zip(weights(trainer), start, strict=True)]
    names = [name for name, _ in trainer.export(tied_head=False)]
    meters = [first]
    if warm:
        with Meter(device) as second:
            trainer.train_step([rows])
        meters.append(second)
    if fsdp:
        dist.destroy_process_group()
    return {
        "loss": metrics["actor/pg_loss"],
        "entropy": metrics["actor/entropy"],
        "grad_norm": metrics["actor/grad_norm"],
        "before": before,
        "after": after,
        "update": update,
        "names": names,
        "time_s": first.time_s,
        "warm_s": meters[-1].time_s,
        "peak_gpu_mib": max(m.peak_gpu_mib for m in meters),
    }


GROUPS = ("embed_tokens", "lm_head", "norm", "bias", "self_attn", "mlp")


def weights(trainer) -> list:
    """The trainer's parameters as fp32 CPU copies, in export order."""
    return [t.detach().float().cpu().clone() for _, t in trainer.export(tied_head=False)]


def group_of(name: str) -> str:
    """The kind of parameter `name` is, for the per-kind update cosines (the first of GROUPS in its name)."""
    return next(g for g in (*GROUPS, "") if g in name)


def cosine(update: list, reference: list) -> float:
    """The cosine between two updates of the whole model (lists of per-tensor parameter changes)."""
    dot = sum(float((a.double() * b.double()).sum()) for a, b in zip(update, reference, strict=True))
    norms = [sum(float(t.double().pow(2).sum()) for t in u) ** 0.5 for u in (update, reference)]
    return dot / max(norms[0] * norms[1], 1e-30)


def mean_abs_diff(rows: list[list[float]], reference: list[list[float]]) -> float:
    pairs = [(a, b) for r, q in zip(rows, reference, strict=True) for a, b in zip(r, q, strict=True)]
    return sum(abs(a - b) for a, b in pairs) / max(len(pairs), 1)


def compare(piece: str, device: str, got: dict, ref: dict, dtype: str) -> Record:
    """A variant's record: its step against the CPU fp32 reference, within `dtype`'s tolerances."""
    tol = TOLERANCES[dtype]
    record = Record(piece, device_name(device), time_s=got["time_s"], peak_gpu_mib=got["peak_gpu_mib"])
    record.values = {k: got[k] for k in ("loss", "entropy", "grad_norm")} | {
        "cpu loss": ref["loss"],
        "warm step s": got["warm_s"],
    }
    after_mean = mean_abs_diff(got["after"], ref["after"])
    after_max = max_abs_diff(got["after"], ref["after"])
    for key in ("loss", "entropy", "grad_norm"):
        record.check(f"{key} rel diff", relative(got[key], ref[key]), tol[key])
    record.check("logprob diff before step", max_abs_diff(got["before"], ref["before"]), tol["logprobs"])
    record.check("update cosine", cosine(got["update"], ref["update"]), tol["cosine"], at_least=True)
    record.values["mean logprob diff before step"] = mean_abs_diff(got["before"], ref["before"])
    record.values["mean logprob diff after step"] = after_mean
    for group in GROUPS:  # which kinds of parameters the update differs in
        index = [i for i, n in enumerate(got["names"]) if group_of(n) == group]
        record.values[f"cos {group}"] = cosine([got["update"][i] for i in index], [ref["update"][i] for i in index])
    if "after_mean" in tol:
        record.values["logprob diff after step"] = after_max
        record.check("mean logprob diff after step", after_mean, tol["after_mean"])
    else:
        record.check("logprob diff after step", after_max, tol["logprobs"])
    return record


def reference_model(model_dir: Path, rows: dict, device: str) -> Record:
    """The reference model's stage (RefLogprob) on `device` in its default dtype (bf16 on a GPU) against the same
    stage on the CPU in fp32: every response token's logprob."""
    import pyarrow as pa
    import torch

    from stages.ref_logprob import RefLogprob

    table = pa.table({"prompt_ids": rows["prompt_ids"], "response_ids": rows["response_ids"]})
    cpu = RefLogprob(str(model_dir), device="cpu")(table).column("ref_logprobs").to_pylist()
    stage = RefLogprob(str(model_dir), device=device)
    with Meter(device) as meter:
        got = stage(table).column("ref_logprobs").to_pylist()
    dtype = "bf16" if stage.model.dtype == torch.bfloat16 else "fp32"
    record = Record(f"reference model (RefLogprob) {dtype}", device_name(device), time_s=meter.time_s)
    record.peak_gpu_mib = meter.peak_gpu_mib
    record.check("logprob diff", max_abs_diff(got, cpu), TOLERANCES[dtype]["logprobs"])
    return record


def run(device: str, size: str, variant: str, work: Path) -> list[Record]:
    """The variant's fp32 and bf16 steps on `device`, each against the CPU fp32 step on the same model and batch
    (and, with the single rank, the reference model's stage on `device` against the CPU)."""
    model_dir = build_dense(work / "model", size)
    rows = batch(size)
    ref = run_step(model_dir, rows, "cpu", "fp32", fsdp=False, warm=False)
    records = []
    for dtype in ("fp32", "bf16"):
        got = run_step(model_dir, rows, device, dtype, fsdp=variant == "fsdp", packed=variant == "packed")
        records.append(compare(f"{VARIANT_NAMES[variant]} {dtype}", device, got, ref, dtype))
    if variant == "single":
        records.append(reference_model(model_dir, rows, device))
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--variant", choices=tuple(VARIANT_NAMES), default="single")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        save(run(args.device, args.size, args.variant, Path(work)), args.out)


if __name__ == "__main__":
    main()
