"""The reward-model stage on a GPU (skips itself without CUDA): the actor that is given a GPU scores there, and its
scores are the CPU's (float32), or close to them in bfloat16."""

import pytest
import torch

from stages.reward_model import RewardModel
from stages.reward_sources import records_of
from tests.unit.test_reward_model import PROMPTS, RESPONSES, block, rm_dir  # noqa: F401 - rm_dir: the fixture


@pytest.mark.gpu
def test_the_reward_model_scores_on_the_gpu_as_on_the_cpu(rm_dir, monkeypatch):  # noqa: F811
    gpu = RewardModel(str(rm_dir), micro_batch_size=3)
    assert gpu.device.type == "cuda" and next(gpu.model.parameters()).is_cuda
    on_gpu = [r["reward_model"]["score"] for r in records_of(gpu(block(PROMPTS, RESPONSES)))]
    half = RewardModel(str(rm_dir), micro_batch_size=3, dtype="bfloat16")
    in_bf16 = [r["reward_model"]["score"] for r in records_of(half(block(PROMPTS, RESPONSES)))]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = RewardModel(str(rm_dir), micro_batch_size=3)
    assert cpu.device.type == "cpu"
    on_cpu = [r["reward_model"]["score"] for r in records_of(cpu(block(PROMPTS, RESPONSES)))]
    assert on_gpu == pytest.approx(on_cpu, abs=1e-4)
    assert in_bf16 == pytest.approx(on_cpu, abs=5e-2)
