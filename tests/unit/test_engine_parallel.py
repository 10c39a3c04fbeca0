"""rollout.tensor_model_parallel_size: the weight-sync ranks of the engines' workers, the CPU cores each rank gets,
the GPUs a replica asks Ray for, and the config errors. Pure logic, no Ray and no engine (tests/pipeline/
test_engine_tp.py runs the real thing)."""

import os

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.config.checks import check_engine_heads
from pipeline.config.placement import HEAD, check, engine_gpus, layout, resolve
from pipeline.sync import group_ranks, make_syncer
from stages.engines.vllm import CPU_BINDING, cpu_binding, parallel_args

KEY = "rollout.tensor_model_parallel_size"


def test_every_engine_worker_gets_its_own_rank_after_the_trainer():
    world, first = group_ranks([0, 2, 3], engine_tp=2)  # replica 1 is down: the live ones are packed
    assert world == 7 and first == {0: 1, 2: 3, 3: 5}
    workers = [first[r] + tp_rank for r in first for tp_rank in range(2)]
    assert sorted(workers) == list(range(1, world))  # no collision, no gap, rank 0 left to the trainer


def test_one_rank_per_engine_is_one_rank_per_replica():
    assert group_ranks([0, 1], engine_tp=1) == (3, {0: 1, 1: 2})


def test_push_forms_the_group_with_every_workers_rank(tmp_path):
    syncer = make_syncer(load_config(None, [f"{KEY}=4"]), None, None, tmp_path)
    assert syncer.engine_tp == 4


@pytest.mark.parametrize(
    ("cpus", "numa_nodes", "ranks", "binding"),
    [
        ([0, 1], 1, 2, "0|1"),  # this machine: a core per rank
        ([0, 1, 2, 3, 4], 1, 2, "0,1,2|3,4"),
        ([4, 5, 6, 7], 1, 4, "4|5|6|7"),
        ([3], 1, 2, "3|3"),  # fewer cores than ranks: they share
        ([0, 1, 2, 3], 2, 2, None),  # a NUMA node per rank: vLLM's own binding
    ],
)
def test_cpu_ranks_split_the_cores_when_numa_nodes_are_too_few(cpus, numa_nodes, ranks, binding):
    assert cpu_binding(cpus, numa_nodes, ranks) == binding


def test_one_rank_keeps_the_engine_in_process_and_several_take_a_worker_each(monkeypatch):
    monkeypatch.setenv(CPU_BINDING, "0|1")
    assert parallel_args(1, gpu=False) == {"distributed_executor_backend": "uni"}
    assert parallel_args(2, gpu=True) == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert parallel_args(2, gpu=False)["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        parallel_args(0, gpu=False)


def test_a_binding_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(CPU_BINDING, "nobind")
    parallel_args(2, gpu=False)
    assert os.environ[CPU_BINDING] == "nobind"


def test_verls_spelling_reaches_the_rollout_section():
    cfg = load_config(None, [f"actor_rollout_ref.{KEY}=2"])
    assert cfg.rollout.tensor_model_parallel_size == 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"{KEY}=0"], f"{KEY} must be >= 1"),
        (
            [f"{KEY}=2", "stages.generate._target_=stages.sim.generate.SimGenerate"],
            "stages.generate._target_=stages.sim.generate.SimGenerate runs no vLLM engine",
        ),
        ([f"{KEY}=2", "weight_sync.backend=ipc"], "use weight_sync.backend=nccl"),
    ],
)
def test_bad_engine_parallelism_is_one_config_error_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=KEY) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_the_engine_ranks_must_split_the_attention_heads():
    check_engine_heads(2, {"num_attention_heads": 4, "num_key_value_heads": 2}, "runs/x/model")
    check_engine_heads(4, {"num_attention_heads": 4, "num_key_value_heads": 2}, "runs/x/model")  # kv replicated
    with pytest.raises(ConfigError) as err:
        check_engine_heads(3, {"num_attention_heads": 4}, "runs/x/model")
    message = str(err.value)
    assert f"{KEY}=3" in message and "4 attention heads" in message and "runs/x/model" in message
    assert "use one of 1, 2, 4" in message


GPU_NODE = {"CPU": 16.0, "GPU": 8.0, HEAD: 1.0}
FOUR_GPU_NODE = {"CPU": 16.0, "GPU": 4.0}


def _problem(cfg, nodes):
    return check(layout(cfg, resolve(cfg.ray, nodes), sum(n.get("GPU", 0.0) for n in nodes), False), nodes)


def test_a_replica_asks_ray_for_a_gpu_per_engine_rank():
    cfg = load_config(None, [f"{KEY}=4", "rollout.num_replicas=2", "trainer.backend=sim"])  # a trainer without GPUs
    assert engine_gpus(cfg, 8.0) == 4.0
    assert engine_gpus(cfg, 0.0) == 0.0  # no GPU in the cluster: the engine runs on CPU
    assert _problem(cfg, [GPU_NODE]) is None  # two engines of 4 GPUs on one 8-GPU node


def test_an_engine_larger_than_any_node_is_refused_by_name():
    cfg = load_config(None, [f"{KEY}=8", "actor.megatron.tensor_model_parallel_size=1", "trainer.backend=sim"])
    message = _problem(cfg, [{**FOUR_GPU_NODE, HEAD: 1.0}, FOUR_GPU_NODE])  # 8 GPUs, but on two nodes
    assert "an engine (8 GPUs on one node) needs 1 CPU, 8 GPU on one node, and none has that much" in message
    assert KEY in message and "ray.gpus_per_engine" in message


def test_a_shared_gpu_cannot_hold_an_engine_of_several_ranks():
    cfg = load_config(None, [f"{KEY}=2", "ray.gpus_per_engine=0.5"])
    assert engine_gpus(cfg, 0.0) == 0.0  # on CPU the key does not apply
    with pytest.raises(ConfigError, match="set ray.gpus_per_engine=1"):
        engine_gpus(cfg, 8.0)
