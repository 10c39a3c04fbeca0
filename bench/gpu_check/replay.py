"""MoE routing replay (R3) on the device: a trainer forcing the experts an engine chose, on a tiny Qwen3-MoE
(tests/moe_model.py), in fp32.

The routes are the model's own, computed token by token on the same device as an engine would (the `routed_experts`
column); then, replaying them:
- the logprobs equal the model's unforced ones (max difference 1e-5): the forced routes are the ones it picks;
- a step reports actor/router_mismatch 0 (none of the replayed experts differs from the trainer's own choice);
and replaying every expert shifted by one, which the router never picks:
- the logprobs move (by more than 1e-3): the routes are really forced, not ignored;
- actor/router_mismatch is at least 0.9 (nearly every replayed pair differs; the first step may move a few).

`--backend torch` is TorchTrainer (stages/trainer/hf_router_replay.py), `--backend megatron` MegatronTrainer
(megatron-core's RouterReplay, stages/trainer/megatron_moe.py), each in a process of its own.

    python -m bench.gpu_check.replay --device cuda --backend torch --out rows.json
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from bench.gpu_check.report import Meter, Record, device_name, max_abs_diff, save


def _trainer(backend: str, model_dir: Path, device: str):
    from stages.trainer.precision import MixedPrecision
    from stages.trainer.settings import PolicySettings, RouterReplaySettings

    policy = PolicySettings(router_replay=RouterReplaySettings(mode="R3"), micro_batch_size=2, lr=1e-3)
    if backend == "megatron":
        from stages.trainer.megatron_backend import MegatronTrainer

        return MegatronTrainer(str(model_dir), policy, dtype="float32")
    from stages.trainer.torch_backend import TorchTrainer

    return TorchTrainer(str(model_dir), policy, mixed_precision=MixedPrecision(param_dtype="fp32"), device=device)


def run(device: str, backend: str, work: Path) -> Record:
    from tests.moe_model import batch, build_tiny_moe, minibatch, other_routes, own_routes

    model_dir = build_tiny_moe(work / "moe")
    prompts, responses = batch()
    own = own_routes(model_dir, prompts, responses, device=device)
    shifted = other_routes(own)
    trainer = _trainer(backend, model_dir, device)
    record = Record(f"R3 replay, {backend} trainer, fp32", device_name(device))
    with Meter(device) as meter:
        plain = trainer.logprobs(prompts, responses)
        replayed = trainer.logprobs(prompts, responses, own)
        forced = trainer.logprobs(prompts, responses, shifted)
        own_step = trainer.train_step([minibatch(prompts, responses, own)])
        forced_step = trainer.train_step([minibatch(prompts, responses, shifted)])
    record.time_s, record.peak_gpu_mib = meter.time_s, meter.peak_gpu_mib
    record.check("own routes: logprob diff", max_abs_diff(replayed, plain), 1e-5)
    record.check("own routes: router_mismatch", own_step["actor/router_mismatch"], 0.0)
    record.check("shifted routes: logprob diff", max_abs_diff(forced, plain), 1e-3, at_least=True)
    record.check("shifted routes: router_mismatch", forced_step["actor/router_mismatch"], 0.9, at_least=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        save([run(args.device, args.backend, Path(work))], args.out)


if __name__ == "__main__":
    main()
