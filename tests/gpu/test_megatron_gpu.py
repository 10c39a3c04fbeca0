"""GPU checks of the Megatron trainer and the CUDA weight-sync transports (skip themselves without CUDA).

Written against vllm 0.33 and megatron-core 0.16.1 on CUDA, never run on this project's CPU machines: nccl (trainer
and engine on two GPUs), ipc (one GPU shared by both) and a short job with megatron's schedule and distributed
optimizer. Each asserts what its CPU counterpart asserts (tests/pipeline/test_megatron.py).
"""

import pytest
import torch

from pipeline import sync
from pipeline.clock import VersionClock
from pipeline.config import CONF_DIR
from pipeline.tasks.embedded import build_embedded
from stages.generate import VLLMGenerate
from stages.staleness import StalenessBudget
from stages.trainer.megatron_backend import MegatronTrainer
from stages.trainer.settings import PolicySettings
from tests.pipeline.test_megatron import MAX_TOKENS, TEXTS, _hf_greedy
from tests.pipeline.test_weight_sync import prompts


def _push_and_compare(ray, tmp_path, backend: str, trainer_gpus: float, engine_gpus: float) -> None:
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, 20, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    ns = f"gpu-{backend}"
    clock = (
        ray.remote(VersionClock)
        .options(name="clock", namespace=ns, num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.0, 1, 1, 2), 1)
    )
    trainer = (
        ray.remote(MegatronTrainer)
        .options(num_cpus=1, num_gpus=trainer_gpus)
        .remote(str(task.model_dir), PolicySettings(lr=1e-5), weight_sync_backend=backend)
    )
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1, num_gpus=engine_gpus)
        .remote(str(task.model_dir), "clock", ns, n=1, max_tokens=MAX_TOKENS, temperature=0.0)
    )
    batch = prompts(tokenizer, TEXTS)
    before = ray.get(engine.__call__.remote(batch))
    mb = {**before.to_pydict(), "advantage": [1.0, -1.0] * (before.num_rows // 2)}
    ray.get(trainer.train_step.remote([mb]))
    pusher = sync.Push(trainer, clock, 1, tmp_path)
    pusher.connect()
    assert pusher.sync(1)["sync/bytes"] > 0
    weights = tmp_path / "pushed.safetensors"
    ray.get(trainer.publish_weights.remote(str(weights)))
    after = ray.get(engine.__call__.remote(batch))
    assert after["response_ids"].to_pylist() == _hf_greedy(weights, task.model_dir, batch)
    ray.kill(engine)
    ray.kill(trainer)


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_push_reaches_an_engine_on_another_gpu(ray_session, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs the trainer and the engine on two GPUs")
    _push_and_compare(ray_session, tmp_path, "nccl", 1, 1)


@pytest.mark.gpu
@pytest.mark.slow
def test_ipc_push_reaches_an_engine_on_the_same_gpu(ray_session, tmp_path):
    _push_and_compare(ray_session, tmp_path, "ipc", 0.5, 0.5)


@pytest.mark.gpu
@pytest.mark.slow
def test_short_gpu_run_learns(run_job):
    summary, _ = run_job(
        "actor.megatron.tensor_model_parallel_size=1",
        "rollout.total_rollout_steps=200",
        "actor.lr=1e-3",
        config=str(CONF_DIR / "megatron.yaml"),
        name="megatron-gpu",
    )
    assert summary["audit_ok"]
    assert summary["reward_last"] > summary["reward_first"]
