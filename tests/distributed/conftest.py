"""Runs that several tests of this folder compare against, made once per session."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@pytest.fixture(scope="session")
def megatron_layouts(tmp_path_factory):
    """Megatron ranks' runs by layout (megatron_layouts.py), each trained once: TP and PP share the one-rank run."""
    from tests.distributed.megatron_layouts import Layouts

    return Layouts(tmp_path_factory.mktemp("megatron_layouts"))


@dataclass
class OneRank:
    """MegatronTrainer at DP = TP = PP = 1, two steps on test_megatron_dp's mini-batches: the baseline of the
    data-parallel and the PP x DP backend tests."""

    model_dir: str
    batch: list[dict]
    start: dict
    meta: dict
    first: dict
    second: dict
    end: dict


@pytest.fixture(scope="session")
def megatron_one_rank(ray_session, tmp_path_factory) -> OneRank:
    from pipeline.tasks.embedded import build_embedded
    from stages.trainer.megatron_backend import MegatronTrainer
    from tests.distributed.test_megatron_dp import POLICY, _minibatches, _published

    ray, tmp = ray_session, tmp_path_factory.mktemp("megatron_dp")
    model_dir = str(build_embedded(tmp, 8, seed=5).model_dir)
    one = ray.remote(MegatronTrainer).options(num_cpus=0).remote(model_dir, policy=POLICY, compute_prox_log_prob=True)
    batch = _minibatches(one)
    start, meta = _published(ray, one, tmp / "start.safetensors"), ray.get(one.weight_meta.remote())
    first, second = ray.get(one.train_step.remote(batch)), ray.get(one.train_step.remote(batch))
    end = _published(ray, one, tmp / "one.safetensors")
    ray.kill(one)
    return OneRank(model_dir, batch, start, meta, first, second, end)
