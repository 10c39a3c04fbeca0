"""The weight push from a trainer to a receiver in another process: CUDA IPC on one GPU, gloo on CPU.

Both ends are the run's code: the sender is a TorchTrainer's weight sync (`open_weight_sync`, `push_weights`), the
receiver an engine worker's WeightReceiver (`init_weight_group`, `receive_weights`, stages/engines/vllm_worker.py) with
vLLM's model runner replaced by `LoadsIntoModel`, which copies each received tensor into an HF model it loaded from
the same directory (the engine's weights before the push). The trainer takes one step (every tensor moves), writes
its weights to a safetensors file (`publish_weights`: the values the receiver must end up with), and pushes. The
receiver then checks, tensor by tensor:
- every weight it holds equals the trainer's, bit for bit (a push that delivers nothing, stale or wrong values
  fails here: the receiver still holds the old weights);
- the push changed something: the weights it holds differ from the ones it started with.
A runner that keeps its old weights (the test suite's mutation) fails the first.

Then the push is timed, warm, PUSHES times, as GB/s of weights moved, beside a device-to-device copy of the same
tensors on the same device (what the bytes cost without a transport).

    python -m bench.gpu_check.transport --device cuda --size gpu --out rows.json
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
from pathlib import Path

import torch

from bench.gpu_check.models import batch, build_dense
from bench.gpu_check.report import Meter, Record, device_name, save
from stages.transports import GroupAddress, WeightMeta

PUSHES = 3  # the first is checked, the others timed


class LoadsIntoModel:
    """Stands in for vLLM's model runner: an HF model loaded from `model_dir` on `device`, each received tensor
    copied into the parameter of its name."""

    def __init__(self, model_dir: str, device: str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
        self.params = dict(self.model.named_parameters())

    @torch.no_grad()
    def reload_weights(self, weights_iterator) -> None:
        for name, tensor in weights_iterator:
            self.params[name].copy_(tensor)

    def get_model(self) -> torch.nn.Module:
        return self.model


def receive(
    info: GroupAddress, meta: WeightMeta, model_dir: str, device: str, expected: str, runner_cls: type, queue
) -> None:
    """The receiver's process: join the trainer's group, take PUSHES pushes, check the first against `expected`."""
    from safetensors.torch import load_file

    from stages.engines.vllm_worker import WeightReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = WeightReceiver()
    receiver.model_runner, receiver.rank = runner_cls(model_dir, device), 0
    start = {n: p.detach().cpu().clone() for n, p in receiver.model_runner.get_model().named_parameters()}
    receiver.init_weight_group(info.host, info.port, 1, 2, info.backend, info.connect_timeout_s)
    args = (list(meta.names), [list(s) for s in meta.shapes], list(meta.dtypes))
    receiver.receive_weights(*args)
    want = load_file(expected)
    held = {n: p.detach().cpu() for n, p in receiver.model_runner.get_model().named_parameters()}
    queue.put(
        {
            "tensors": len(want),
            "unequal": sum(not torch.equal(held[n], t) for n, t in want.items()),
            "changed": sum(not torch.equal(held[n], start[n]) for n in want),
        }
    )
    for _ in range(PUSHES - 1):
        receiver.receive_weights(*args)


def copy_gbps(tensors: list[torch.Tensor], device: str) -> float:
    """GB/s of weights copied once on `device`, tensor by tensor (the best of three)."""
    best = float("inf")
    total = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(3):
        with Meter(device) as meter:
            for t in tensors:
                torch.empty_like(t).copy_(t)
        best = min(best, meter.time_s)
    return total / best / 1e9


def run(device: str, size: str, work: Path, runner_cls: type = LoadsIntoModel) -> Record:
    from stages.trainer.precision import MixedPrecision
    from stages.trainer.settings import PolicySettings
    from stages.trainer.torch_backend import TorchTrainer

    backend = "ipc" if device.startswith("cuda") else "gloo"
    model_dir = str(build_dense(work / "model", size))
    trainer = TorchTrainer(
        model_dir,
        PolicySettings(lr=1e-3, micro_batch_size=4),
        weight_sync_backend=backend,
        mixed_precision=MixedPrecision(param_dtype="fp32"),
        device=device,
    )
    trainer.train_step([batch(size)])  # every tensor moves: the receiver's start is not the trainer's now
    expected = str(work / "expected.safetensors")
    trainer.publish_weights(expected)
    meta = trainer.weight_meta()
    info = trainer.open_weight_sync(2, connect_timeout_s=120.0)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = (info, meta, model_dir, str(trainer.device), expected, runner_cls, queue)
    proc = ctx.Process(target=receive, args=args, daemon=True)
    proc.start()
    trainer.wait_weight_sync()
    with Meter(device) as first:
        sent = trainer.push_weights()["sync/bytes"]
    verdict = queue.get(timeout=600)
    meters = []
    for _ in range(PUSHES - 1):
        with Meter(device) as meter:
            trainer.push_weights()
        meters.append(meter)
    proc.join(timeout=120)
    push_s = min(m.time_s for m in meters)
    tensors = [t for _, t in trainer.export()]
    record = Record(f"weight push ({backend}) to a receiver process", device_name(device), time_s=push_s)
    record.peak_gpu_mib = max(m.peak_gpu_mib for m in [first, *meters])
    record.values = {
        "MB": sent / 1e6,
        "tensors": verdict["tensors"],
        "push GB/s": sent / push_s / 1e9,
        "copy GB/s": copy_gbps(tensors, device),
        "first push s": first.time_s,
    }
    record.check("tensors unequal to the trainer's", verdict["unequal"], 0)
    record.check("tensors changed by the push", verdict["changed"], 1, at_least=True)
    record.check("receiver exit code", abs(proc.exitcode if proc.exitcode is not None else 1), 0)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        save([run(args.device, args.size, Path(work))], args.out)


if __name__ == "__main__":
    main()
