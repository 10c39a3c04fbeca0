"""ray.placement: which actors ask for which node marker, the check that refuses a layout the cluster cannot hold, and
the cores the trainer computes on.

Nodes are written as Ray reports them (`ray.nodes()[i]["Resources"]`); no Ray is started here.
"""

import os

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.config.placement import HEAD, SHARE, Placement, check, layout, resolve

HEAD_NODE = {"CPU": 2.0, HEAD: 1.0, "node:127.0.0.1": 1.0, "memory": 8e9, "object_store_memory": 2e9}
TRAINER_NODE = {"CPU": 1.0, "trainer": 1.0, "node:127.0.0.1": 1.0}
ROLLOUT_NODE = {"CPU": 3.0, "rollout": 1.0, "node:127.0.0.1": 1.0}
ONE_MACHINE = [{"CPU": 8.0, HEAD: 1.0, "node:127.0.0.1": 1.0}]
SPLIT = [HEAD_NODE, TRAINER_NODE, ROLLOUT_NODE]


def cfg_of(*overrides):
    return load_config(None, list(overrides))


def problem(cfg, nodes, reference=False):
    where = resolve(cfg.ray, nodes)
    return check(layout(cfg, where, sum(n.get("GPU", 0.0) for n in nodes), reference), nodes)


def test_one_machine_keeps_todays_options():
    where = resolve(cfg_of().ray, ONE_MACHINE)
    assert where == Placement()
    assert where.trainer_resources() == where.rollout_resources() == where.head_resources() == {}


def test_marked_nodes_steer_trainer_engines_and_control_actors():
    where = resolve(cfg_of().ray, SPLIT)
    assert where.trainer_resources() == {"trainer": SHARE}
    assert where.rollout_resources() == {"rollout": SHARE}
    assert where.head_resources() == {HEAD: SHARE}


def test_only_the_kind_of_node_the_cluster_has_is_used_in_auto():
    where = resolve(cfg_of().ray, [HEAD_NODE, ROLLOUT_NODE])
    assert where == Placement(trainer="", rollout="rollout", head=True)


def test_anywhere_ignores_the_markers_and_custom_names_are_read():
    assert resolve(cfg_of("ray.placement=anywhere").ray, SPLIT) == Placement()
    nodes = [HEAD_NODE, {"CPU": 4.0, "learner": 1.0}]
    where = resolve(cfg_of("ray.trainer_resource=learner").ray, nodes)
    assert where.trainer_resources() == {"learner": SHARE} and where.rollout_resources() == {}


def test_a_layout_that_fits_passes():
    assert problem(cfg_of("rollout.num_replicas=2"), SPLIT) is None
    assert problem(cfg_of("rollout.num_replicas=2"), ONE_MACHINE, reference=True) is None


def test_too_many_engines_for_the_rollout_nodes_names_asked_available_and_keys():
    message = problem(cfg_of("rollout.num_replicas=4"), SPLIT)  # the engines' actors score and split
    assert "4 x engine (1 CPU) ask for 4 CPU on nodes with `rollout`, which has 3 CPU" in message
    message = problem(cfg_of("rollout.num_replicas=4", "rollout.score_in_engine=false"), SPLIT)
    # the split stage's actors go beside the engines: one per replica, 0.25 CPU each
    assert (
        "4 x engine (1 CPU), 4 x split stage (0.25 CPU) ask for 5 CPU on nodes with `rollout`, which has 3 CPU"
        in message
    )
    assert "rollout.num_replicas" in message and "ray.placement=anywhere" in message
    assert "node 3: 3 CPU, 1 rollout" in message  # what each node has


def test_too_many_engines_on_one_machine():
    message = problem(cfg_of("rollout.num_replicas=8"), ONE_MACHINE)
    assert "ask for 9.1 CPU on the cluster, which has 8 CPU" in message
    message = problem(cfg_of("rollout.num_replicas=8", "rollout.score_in_engine=false"), ONE_MACHINE)
    assert "ask for 11.1 CPU on the cluster, which has 8 CPU" in message  # and 8 split actors
    assert "ray.num_cpus" in message and "rollout.num_replicas" in message


def test_required_without_marked_nodes_fails():
    message = problem(cfg_of("ray.placement=required", "rollout.score_in_engine=false"), ONE_MACHINE)
    assert "the trainer must go on nodes with `trainer`, and no node has it" in message
    assert "the engine and the split stage must go on nodes with `rollout`, and no node has it" in message
    assert "ray.trainer_resource" in message


def test_a_head_without_cpus_cannot_hold_the_gate():
    nodes = [{**HEAD_NODE, "CPU": 0.0}, TRAINER_NODE, ROLLOUT_NODE]
    message = problem(cfg_of(), nodes)
    assert "a staleness gate needs 0.1 CPU on the head, which has less" in message
    assert "the head's --num-cpus" in message


def test_gpus_are_counted_on_the_rollout_nodes():
    nodes = [HEAD_NODE, {"CPU": 32.0, "GPU": 8.0, "trainer": 1.0}, {"CPU": 32.0, "GPU": 4.0, "rollout": 1.0}]
    assert problem(cfg_of("rollout.num_replicas=4"), nodes) is None
    message = problem(cfg_of("rollout.num_replicas=8"), nodes)
    assert "ask for 8 GPU on nodes with `rollout`, which has 4 GPU" in message
    assert "ray.gpus_per_engine" in message


@pytest.mark.parametrize("tp, pp, fits", [(4, 1, True), (8, 1, False), (2, 2, True), (4, 2, False)])
def test_a_megatron_tp_group_must_fit_on_one_trainer_node(tp, pp, fits):
    # 8 trainer GPUs in all, 4 per node: TP x PP = 8 cannot be packed on one node although the sum would do
    nodes = [HEAD_NODE, *[{"CPU": 32.0, "GPU": 4.0, "trainer": 1.0}] * 2, {"CPU": 32.0, "GPU": 8.0, "rollout": 1.0}]
    sizes = [f"actor.megatron.tensor_model_parallel_size={tp}", f"actor.megatron.pipeline_model_parallel_size={pp}"]
    cfg = cfg_of("trainer.backend=megatron", *sizes)
    message = problem(cfg, nodes)
    if fits:
        assert message is None
    else:
        assert "a trainer (8 ranks on one node) needs 1 CPU, 8 GPU on one node with `trainer`" in message
        assert "actor.megatron.tensor_model_parallel_size" in message


def test_the_validation_engine_counts_as_an_engine():
    cfg = cfg_of("rollout.num_replicas=3", "async_training.use_trainer_do_validate=true")
    assert "4 x engine (1 CPU) ask for 4 CPU" in problem(cfg, SPLIT)
    cfg = cfg_of(
        "rollout.num_replicas=3", "async_training.use_trainer_do_validate=true", "rollout.score_in_engine=false"
    )
    assert "4 x engine (1 CPU), 3 x split stage (0.25 CPU) ask for 4.75 CPU" in problem(cfg, SPLIT)


def test_an_empty_marker_name_is_a_config_error():
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="set both, or ray.placement=anywhere"):
        cfg_of("ray.rollout_resource=''")
    assert cfg_of("ray.rollout_resource=''", "ray.placement=anywhere").ray.rollout_resource == ""


def test_the_message_names_only_keys_that_change_the_shortfall():
    message = problem(cfg_of("rollout.num_replicas=4"), SPLIT)  # CPU engines: their GPU key changes nothing
    assert "Change rollout.num_replicas, or add nodes" in message


def test_a_trainer_over_two_nodes_needs_two_trainer_nodes_that_each_hold_its_ranks():
    # verl's layout: 8 GPUs per node x 2 nodes = DP 4 of TP 4; each node's bundle holds its 8 ranks' GPUs
    gpu_trainer = {"CPU": 32.0, "GPU": 8.0, "trainer": 1.0}
    rollout = {"CPU": 32.0, "GPU": 8.0, "rollout": 1.0}
    keys = ["trainer.backend=megatron", "actor.megatron.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=8"]
    cfg = cfg_of(*keys, "trainer.nnodes=2")
    (group,) = [g for g in layout(cfg, resolve(cfg.ray, SPLIT), 16.0, False) if g.name.startswith("trainer")]
    assert (group.count, group.spread, group.bundle) == (2, True, {"CPU": 1.0, "GPU": 8.0, "trainer": 8 * SHARE})
    assert problem(cfg, [HEAD_NODE, gpu_trainer, gpu_trainer, rollout]) is None
    message = problem(cfg, [HEAD_NODE, {**gpu_trainer, "GPU": 16.0}, rollout])  # enough GPUs, on one node
    assert "2 x trainer node (8 of the trainer's 16 ranks, one node each) need 2 nodes with `trainer`" in message
    assert "and there are 1" in message and "trainer.nnodes" in message
    assert problem(cfg_of(*keys, "trainer.nnodes=1"), [HEAD_NODE, gpu_trainer, rollout]) is None


def test_peer_ranks_go_in_their_nodes_bundle():
    from stages.trainer.ranks import LOOPBACK, RankPlacement

    one_node = RankPlacement()
    assert not one_node.multi_node and one_node.host() == LOOPBACK
    group = object()  # a placement group handle; strategy() only passes it on
    spread = RankPlacement(group, ranks_per_node=4)
    bundles = [spread.strategy(r).placement_group_bundle_index for r in range(1, 8)]
    assert bundles == [0, 0, 0, 1, 1, 1, 1]  # ranks 0-3 (one TP group of 4) on the first node
    assert spread.strategy(5).placement_group is group


def test_every_trainer_that_holds_weights_asks_for_its_gpus():
    from pipeline.config.placement import trainer_rank_gpus

    assert trainer_rank_gpus(cfg_of(), cluster_gpus=1) == 1.0  # the torch backend's single rank too
    assert trainer_rank_gpus(cfg_of("trainer.backend=megatron"), cluster_gpus=1) == 1.0
    assert trainer_rank_gpus(cfg_of("actor.fsdp_config.fsdp_size=2"), cluster_gpus=2) == 1.0
    assert trainer_rank_gpus(cfg_of("trainer.backend=sim"), cluster_gpus=1) == 0.0  # it holds no weights
    assert trainer_rank_gpus(cfg_of(), cluster_gpus=0) == 0.0  # a CPU cluster


def test_one_gpu_holds_an_engine_and_the_torch_trainer_only_in_halves():
    one_gpu = [{"CPU": 16.0, "GPU": 1.0, HEAD: 1.0, "node:127.0.0.1": 1.0}]
    message = problem(cfg_of(), one_gpu)
    assert "ask for 2 GPU on the cluster, which has 1 GPU" in message
    assert "ray.gpus_per_trainer_rank" in message and "ray.gpus_per_engine" in message
    assert problem(cfg_of("ray.gpus_per_engine=0.5", "ray.gpus_per_trainer_rank=0.5"), one_gpu) is None


def test_the_reference_model_asks_for_the_gpu_it_is_given():
    one_gpu = [{"CPU": 16.0, "GPU": 1.0, HEAD: 1.0, "node:127.0.0.1": 1.0}]
    halves = ["ray.gpus_per_engine=0.5", "ray.gpus_per_trainer_rank=0.5"]
    assert problem(cfg_of(*halves), one_gpu, reference=True) is None  # 0 by default: on the CPU
    message = problem(cfg_of(*halves, "ray.gpus_per_reference=0.25"), one_gpu, reference=True)
    assert "ask for 1.25 GPU" in message and "ray.gpus_per_reference" in message
    tenths = ["ray.gpus_per_engine=0.45", "ray.gpus_per_trainer_rank=0.45", "ray.gpus_per_reference=0.1"]
    assert problem(cfg_of(*tenths), one_gpu, reference=True) is None


@pytest.mark.parametrize(
    "overrides, threads",
    [
        ([], 1),  # the default job: the engine generates while the trainer trains
        (["async_training.staleness_threshold=0"], 0),  # on-policy: every core of the trainer's process
        (["async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=2"], 1),
        (["async_training.staleness_threshold=0", "actor.fsdp_config.fsdp_size=2"], 1),  # two ranks share the cores
        (["async_training.staleness_threshold=0", "trainer.torch_threads=1"], 1),  # the key wins
        (["trainer.torch_threads=3"], 3),
    ],
)
def test_the_trainer_takes_every_core_only_where_it_trains_alone(overrides, threads):
    from pipeline.config.placement import trainer_threads

    assert trainer_threads(load_config(None, overrides)) == threads


def test_no_trainer_threads_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="trainer.torch_threads must be >= 1"):
        load_config(None, ["trainer.torch_threads=0"])


def test_a_trainer_given_no_thread_count_takes_every_core_of_its_process(tmp_path):
    from pipeline.tasks.embedded import build_model
    from stages.trainer.torch_backend import TorchTrainer

    build_model(tmp_path, 40, seed=0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        TorchTrainer(str(tmp_path), torch_threads=0)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
    finally:
        torch.set_num_threads(before)
