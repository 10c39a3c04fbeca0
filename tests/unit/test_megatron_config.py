"""The megatron and weight-sync config keys: typos name the nearest key, bad values one clear error, and every
GPU preset loads as a valid config (they are not run on CPU)."""

import json

import pytest

from pipeline.config import CONF_DIR, ConfigError, load_config


def test_megatron_preset_and_keys():
    cfg = load_config(CONF_DIR / "megatron.yaml")
    assert cfg.trainer.backend == "megatron"
    assert cfg.actor.megatron.tensor_model_parallel_size == 2
    verl = load_config(None, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    assert verl.actor.megatron.tensor_model_parallel_size == 4


def test_a_typo_in_the_megatron_section_names_the_nearest_key():
    with pytest.raises(ConfigError, match="Did you mean 'tensor_model_parallel_size'"):
        load_config(None, ["actor.megatron.tensor_model_paralel_size=2"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.megatron.pipeline_model_parallel_size=0", "pipeline_model_parallel_size must be >= 1"),
        ("actor.megatron.tensor_model_parallel_size=0", "tensor_model_parallel_size must be >= 1"),
        ("weight_sync.backend=rdma", r"weight_sync.backend': Invalid value 'rdma', expected one of \['gloo'"),
    ],
)
def test_bad_values_are_one_clear_error(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["trainer.backend=megatron", override])


def test_megatron_takes_rollout_correction_in_both_modes():
    rc = "algorithm.rollout_correction"
    decoupled = load_config(None, ["trainer.backend=megatron", f"{rc}.bypass_mode=false", f"{rc}.rollout_is=token"])
    assert decoupled.async_training.compute_prox_log_prob and decoupled.actor.policy_loss.loss_mode == "vanilla"
    bypass = load_config(None, ["trainer.backend=megatron", f"{rc}.rollout_is=token"])
    assert bypass.actor.policy_loss.loss_mode == "bypass_mode"


@pytest.mark.parametrize("preset", sorted((CONF_DIR / "gpu").glob("*.yaml")), ids=lambda p: p.name)
def test_gpu_presets_load(preset):
    cfg = load_config(preset)
    assert cfg.trainer.backend == "megatron"
    assert cfg.weight_sync.backend in ("nccl", "ipc")
    assert cfg.model.path != "embedded"


@pytest.mark.parametrize(("preset", "gpus"), [("colocated_1gpu.yaml", 1), ("split_4_4.yaml", 8)])
def test_gpu_presets_ask_ray_for_the_gpus_they_name(preset, gpus):
    from pipeline.stream import engine_gpus

    cfg = load_config(CONF_DIR / "gpu" / preset)
    engines = cfg.rollout.num_replicas * engine_gpus(cfg, cluster_gpus=gpus)
    trainer = cfg.actor.megatron.tensor_model_parallel_size * cfg.ray.gpus_per_trainer_rank
    assert engines + trainer == gpus  # more and Ray never places them all; fewer leaves a GPU idle
    assert engine_gpus(cfg, cluster_gpus=0) == 0.0  # a CPU cluster: no engine waits for a GPU


def test_random_model_fits_every_gpu_preset(tmp_path):
    from pipeline.tasks.random_model import SHAPE, build
    from stages.trainer.megatron_convert import ModelShape

    small = SHAPE | {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1}  # the preset's heads
    model_dir = build(tmp_path, num_prompts=10, shape=small)
    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    for preset in (CONF_DIR / "gpu").glob("*.yaml"):
        shape.check_tp(load_config(preset).actor.megatron.tensor_model_parallel_size)
    assert (tmp_path / "data" / "train.parquet").exists()


def test_nccl_and_ipc_need_cuda():
    import torch

    from stages.transports import make_sender

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    for backend in ("nccl", "ipc"):
        with pytest.raises(RuntimeError, match="use weight_sync.backend=gloo on CPU"):
            make_sender(backend)
    assert make_sender("gloo").backend == "gloo"
