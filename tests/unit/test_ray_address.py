"""A driver started by Ray Jobs joins the cluster in RAY_ADDRESS and leaves the job's own variables alone.

No Ray is started here: `ray.init` is replaced by a recorder.
"""

import json

import pytest
import ray

from pipeline.config import load_config
from pipeline.prepare import start_ray

JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # what Ray Jobs sets for its driver (ray._private.runtime_env)


@pytest.fixture
def ray_init_calls(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    return calls


def test_driver_in_a_job_joins_the_cluster_in_ray_address(monkeypatch, tmp_path, ray_init_calls):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    monkeypatch.delenv(JOB_CONFIG_VAR, raising=False)
    assert start_ray(load_config(None), tmp_path) is False  # not ours to shut down
    (call,) = ray_init_calls
    assert call["address"] == "127.0.0.1:6390"
    assert "num_cpus" not in call  # ray.init refuses resources when it joins a cluster
    assert set(call["runtime_env"]["env_vars"]) == {"PYTHONPATH", "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM"}


def test_configured_address_wins_over_ray_address(monkeypatch, tmp_path, ray_init_calls):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    start_ray(load_config(None, ["ray.address=127.0.0.1:7000"]), tmp_path)
    assert ray_init_calls[0]["address"] == "127.0.0.1:7000"


def test_variables_the_job_sets_are_left_to_the_job(monkeypatch, tmp_path, ray_init_calls):
    # ray.init refuses to merge a driver runtime env that sets a variable the job's runtime env sets too
    job = {"runtime_env": {"working_dir": "/x", "env_vars": {"HF_HUB_OFFLINE": "0"}}, "metadata": {}}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    monkeypatch.setenv(JOB_CONFIG_VAR, json.dumps(job))
    start_ray(load_config(None), tmp_path)
    assert set(ray_init_calls[0]["runtime_env"]["env_vars"]) == {"PYTHONPATH", "TOKENIZERS_PARALLELISM"}


@pytest.mark.parametrize(
    "address, loopback",
    [("127.0.0.1:6390", True), ("localhost:6390", True), ("ray://127.0.0.1:10001", True), ("10.0.0.5:6379", False)],
)
def test_a_driver_joining_a_loopback_cluster_keeps_ray_on_loopback(
    monkeypatch, tmp_path, ray_init_calls, address, loopback
):
    # Ray turns 127.0.0.1 into the host's routable address unless its single-machine switch is on; then the driver
    # looks for a node there, where none of a loopback cluster's nodes is, and waits for ever.
    from ray._private import ray_constants

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "1")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    monkeypatch.delenv(JOB_CONFIG_VAR, raising=False)
    start_ray(load_config(None, [f"ray.address={address}"]), tmp_path)
    assert ray_constants.ENABLE_RAY_CLUSTER is not loopback


def test_job_config_variable_name_is_rays():
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    assert RAY_JOB_CONFIG_JSON_ENV_VAR == JOB_CONFIG_VAR
