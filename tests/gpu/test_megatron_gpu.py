"""GPU checks through the real stream's actors (Ray, vLLM 0.33): the Megatron trainer's push to an engine over NCCL
(two GPUs) and CUDA IPC (one GPU shared), and a short job on one GPU laid out as conf/gpu/colocated_1gpu.yaml lays it.

The push tests start the engine from one random model and the trainer from another of the same shape, so a push
that does nothing leaves the engine visibly different: after one update and the push, the engine must hold the
trainer's values, checked twice: the sum of a layer's weight on every engine worker is that of the trainer's
published weights (and was not before the push), and its greedy tokens are an HF model's holding those weights (and
not the tokens it generated before). Engine and trainer run in fp32 here (rollout.dtype / actor.megatron.dtype), so
HF's fp32 greedy tokens are the exact reference.

Needs CUDA (each test skips without it), Ray and vLLM (the module skips with one line without them). The trainer side
alone, without either, is bench/gpu_check (make gpu-check).
"""

import numpy as np
import pytest
import torch

for _needed in ("ray", "vllm"):
    pytest.importorskip(_needed, reason=f"the engine-side GPU tests need {_needed}: pip install -e '.[gpu]'")

from pipeline import sync  # noqa: E402 - after the skip: these import Ray and vLLM
from pipeline.clock import VersionClock  # noqa: E402
from pipeline.config import CONF_DIR  # noqa: E402
from pipeline.tasks.embedded import build_embedded, build_model  # noqa: E402
from stages.generate import VLLMGenerate  # noqa: E402
from stages.staleness import StalenessBudget  # noqa: E402
from stages.trainer.megatron_backend import MegatronTrainer  # noqa: E402
from stages.trainer.settings import PolicySettings  # noqa: E402
from tests.pipeline.engine_checks import prompts  # noqa: E402
from tests.pipeline.test_megatron import MAX_TOKENS, SHORT_RUN, TEXTS, _hf_greedy  # noqa: E402

# The one-GPU layout of conf/gpu/colocated_1gpu.yaml on the embedded task: half the GPU each, weights by CUDA IPC.
ONE_GPU = [
    "weight_sync.backend=ipc",
    "ray.gpus_per_engine=0.5",
    "ray.gpus_per_trainer_rank=0.5",
    "stages.generate.gpu_memory_utilization=0.4",
]
# Whole on a TP=1 engine's worker, named as in HF, and random (a norm starts at ones in both models; the embedding's
# rows past the vocabulary are vLLM's padding).
CHECKED = ("model.layers.0.mlp.down_proj.weight",)


def _engine_sums(ray, engine, name: str) -> list[float]:
    """The sum of one parameter on each engine worker."""
    rpc = lambda stage: stage.replica.run(stage.replica.engine.llm.collective_rpc("weight_checksum", args=(name,)))  # noqa: E731
    return ray.get(engine.__ray_call__.remote(rpc))


def _push_and_compare(ray, tmp_path, backend: str, trainer_gpus: float, engine_gpus: float) -> None:
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, 20, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    other = tmp_path / "other"
    build_model(other, len(tokenizer), seed=7)  # same shape and vocabulary, other weights: the trainer's start
    ns = f"gpu-{backend}"
    clock = (
        ray.remote(VersionClock)
        .options(name="clock", namespace=ns, num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.0, 1, 1, 2), 1)
    )
    trainer = (
        ray.remote(MegatronTrainer)
        .options(num_cpus=1, num_gpus=trainer_gpus)
        .remote(str(other), PolicySettings(lr=1e-5), weight_sync_backend=backend, dtype="float32")
    )
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1, num_gpus=engine_gpus)
        .remote(
            str(task.model_dir), "clock", ns, n=1, max_tokens=MAX_TOKENS, temperature=0.0, dtype="float32",
            gpu_memory_utilization=0.4,
        )
    )  # fmt: skip
    try:
        batch = prompts(tokenizer, TEXTS)
        before = ray.get(engine.__call__.remote(batch))
        rng = np.random.default_rng(0)
        mb = {**before.to_pydict(), "advantage": rng.choice([-1.0, 1.0], before.num_rows).tolist()}
        ray.get(trainer.train_step.remote([mb]))
        weights = tmp_path / "pushed.safetensors"
        ray.get(trainer.publish_weights.remote(str(weights)))  # the values the engine must hold after the push
        sent = load_file(weights)
        for name in CHECKED:  # before the push the engine holds other values
            assert all(abs(s - float(sent[name].double().sum())) > 1e-3 for s in _engine_sums(ray, engine, name))
        pusher = sync.Push(trainer, clock, 1, tmp_path)
        pusher.connect()
        assert pusher.sync(1)["sync/bytes"] > 0
        for name in CHECKED:
            want = float(sent[name].double().sum())
            assert _engine_sums(ray, engine, name) == pytest.approx([want], rel=1e-5, abs=1e-4)
        after = ray.get(engine.__call__.remote(batch))
        engine_tokens = after["response_ids"].to_pylist()
        assert engine_tokens == _hf_greedy(weights, other, batch)
        assert engine_tokens != before["response_ids"].to_pylist()  # the push changed what the engine generates
    finally:
        ray.kill(engine)
        ray.kill(trainer)


@pytest.mark.gpu
@pytest.mark.slow
def test_nccl_push_reaches_an_engine_on_another_gpu(ray_session, tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"nccl puts the trainer and the engine on two GPUs; this machine has {torch.cuda.device_count()}")
    _push_and_compare(ray_session, tmp_path, "nccl", 1, 1)


@pytest.mark.gpu
@pytest.mark.slow
def test_ipc_push_reaches_an_engine_on_the_same_gpu(ray_session, tmp_path):
    _push_and_compare(ray_session, tmp_path, "ipc", 0.5, 0.5)


@pytest.mark.gpu
@pytest.mark.slow
def test_short_run_on_one_gpu_learns(run_job):
    summary, _ = run_job(*SHORT_RUN, *ONE_GPU, config=str(CONF_DIR / "megatron.yaml"), name="megatron-1gpu")
    assert summary["audit_ok"]
    assert summary["reward_last"] > summary["reward_first"]
