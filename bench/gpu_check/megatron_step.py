"""The Megatron trainer at TP = PP = 1: a few steps on one fixed batch, on the device it is given.

On CUDA the step is megatron's own: its DistributedDataParallel, its distributed optimizer (fp32 main weights; with
bf16 parameters, `actor.megatron.dtype`) and its schedule (forward_backward_no_pipelining over the micro-batches). On
CPU it is the hand-written update of stages/trainer/megatron_rank.py (a plain loop, torch AdamW): the path every CPU
test checks. The driver runs the CPU path first (CUDA hidden) and hands its record to the CUDA run, which checks:
- step 1's loss and gradient norm against the CPU path's (relative 1e-4 in fp32; 2e-2 and 5e-2 in bf16): the same
  objective, the same weights, another update loop;
- the loss lower after STEPS steps on the fixed batch than at the first (the optimizer steps at all, downhill).

Each run is a process of its own: megatron's parallel state and the process group are global.

    python -m bench.gpu_check.megatron_step --device cuda --dtype fp32 --reference cpu.json --out rows.json
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.gpu_check.models import batch, build_dense
from bench.gpu_check.report import Meter, Record, device_name, load, relative, save

STEPS, LR, MICRO = 5, 1e-4, 4
TOLERANCES = {"fp32": {"loss": 1e-4, "grad_norm": 1e-4}, "bf16": {"loss": 2e-2, "grad_norm": 5e-2}}
MEGATRON_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def run(device: str, size: str, dtype: str, work: Path, reference: Record | None) -> Record:
    """STEPS steps of a MegatronTrainer on the fixed batch; checked against `reference` (the CPU path's record)."""
    from stages.trainer.megatron_backend import MegatronTrainer
    from stages.trainer.settings import PolicySettings

    model_dir = build_dense(work / "model", size)
    rows = batch(size)
    threads = os.cpu_count() if device == "cpu" else 1
    policy = PolicySettings(lr=LR, micro_batch_size=MICRO)
    trainer = MegatronTrainer(str(model_dir), policy, torch_threads=threads, dtype=MEGATRON_DTYPE[dtype])
    losses, norms, meters = [], [], []
    for _ in range(STEPS):
        with Meter(device) as meter:
            metrics = trainer.train_step([rows])
        losses.append(metrics["actor/pg_loss"])
        norms.append(metrics["actor/grad_norm"])
        meters.append(meter)
    path = "megatron's DDP, distributed optimizer and schedule" if device != "cpu" else "the CPU path"
    record = Record(
        f"megatron TP=PP=1 {dtype} ({path})",
        device_name(trainer.rank.device),
        time_s=meters[0].time_s,
        peak_gpu_mib=max(m.peak_gpu_mib for m in meters),
    )
    record.values = {"loss 1": losses[0], f"loss {STEPS}": losses[-1], "grad_norm 1": norms[0]}
    record.values["warm step s"] = sum(m.time_s for m in meters[1:]) / (STEPS - 1)
    record.check(f"loss 1 - loss {STEPS}", losses[0] - losses[-1], 1e-6, at_least=True)
    if reference is not None:
        tol = TOLERANCES[dtype]
        record.values["cpu loss 1"] = reference.values["loss 1"]
        record.check("loss 1 rel diff", relative(losses[0], reference.values["loss 1"]), tol["loss"])
        record.check("grad_norm 1 rel diff", relative(norms[0], reference.values["grad_norm 1"]), tol["grad_norm"])
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--dtype", choices=tuple(TOLERANCES), default="fp32")
    parser.add_argument("--reference", type=Path, help="the CPU path's rows: step 1 is checked against them")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if args.device == "cpu":  # megatron computes on CUDA whenever it sees it: hide it for the CPU path
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    reference = load(args.reference)[0] if args.reference else None
    with tempfile.TemporaryDirectory() as work:
        save([run(args.device, args.size, args.dtype, Path(work), reference)], args.out)


if __name__ == "__main__":
    main()
