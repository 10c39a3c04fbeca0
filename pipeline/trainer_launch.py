"""Starting the trainer: which backend (`trainer.backend`, `actor.fsdp_config.fsdp_size`), its arguments from the
config, and where its ranks run.

The driver starts one actor, rank 0 of the trainer; a multi-rank backend (Megatron's TP x PP x DP grid, FSDP2)
starts its peers itself (stages/trainer/ranks.py). When the ranks span several nodes (`trainer.nnodes > 1`) the
driver first reserves one placement bundle per trainer node, each on a node of its own, and rank 0 goes in the
first: if the cluster cannot give them, the run stops here with what was asked for, instead of waiting for ever.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import ray

from pipeline.config import ConfigError
from pipeline.config.execution import trainer_execution
from pipeline.config.placement import (
    describe_nodes,
    describe_resources,
    megatron_data_parallel_size,
    trainer_bundle,
    trainer_nodes,
    trainer_rank_gpus,
    trainer_ranks,
    trainer_threads,
)
from stages.advantage.otb import BASELINES
from stages.trainer.ranks import RankPlacement
from stages.trainer.settings import PolicySettings

if TYPE_CHECKING:
    from pipeline.prepare import Attempt, RunContext

RESERVE_TIMEOUT_S = 300.0  # the layout check passed: the bundles wait only for what other jobs hold


def start_trainer(ctx: RunContext, attempt: Attempt):
    """The trainer actor (rank 0), its backend chosen and configured from ctx.cfg; what it reserves on the cluster
    is recorded on `attempt`, which ends it."""
    cfg, placement = ctx.cfg, ctx.placement
    if cfg.trainer.backend == "sim":
        from stages.sim.trainer import SimTrainer

        # It only sleeps: no CPU, so it never competes with the stages for one on a small machine.
        options = {"num_cpus": 0, "resources": placement.trainer_resources()}
        return ray.remote(SimTrainer).options(**options).remote(dataclasses.asdict(cfg.sim))
    Trainer, extra = _backend(ctx)
    # Trainers compute on GPUs when the cluster has them (rank 0 here, a multi-rank one's peers ask for theirs).
    gpus = trainer_rank_gpus(cfg, ray.cluster_resources().get("GPU", 0))
    if gpus:
        extra["gpus_per_rank"] = gpus
    options: dict = {"num_cpus": 1, "num_gpus": gpus, "resources": placement.trainer_resources()}
    ranks = _reserve_nodes(ctx, attempt)
    if ranks is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        extra["rank_placement"] = ranks
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(ranks.group, placement_group_bundle_index=0)
    return (
        ray.remote(Trainer)
        .options(**options)
        .remote(
            str(ctx.model_dir),
            policy=_policy(ctx),
            use_rollout_log_probs=cfg.async_training.use_rollout_log_probs,
            compute_prox_log_prob=cfg.async_training.compute_prox_log_prob,
            seed=cfg.trainer.seed,
            torch_threads=trainer_threads(cfg),
            optimizer_state=str(ctx.optimizer_state) if ctx.optimizer_state else None,
            **extra,
        )
    )


def _backend(ctx: RunContext) -> tuple[type, dict]:
    """The trainer class and its backend-specific arguments."""
    cfg, a = ctx.cfg, ctx.cfg.actor
    extra: dict = {
        "weight_sync_backend": cfg.weight_sync.backend,
        "rollout_correction": cfg.algorithm.rollout_correction,
        "execution": trainer_execution(cfg),
    }
    if cfg.trainer.backend == "megatron":
        from stages.trainer.megatron_backend import MegatronTrainer as Trainer

        megatron = dataclasses.asdict(a.megatron)
        del megatron["use_remove_padding"]  # in the execution settings (pipeline/config/execution.py: packs)
        extra |= megatron | {"data_parallel_size": megatron_data_parallel_size(cfg)}
        extra["rank_resources"] = ctx.placement.trainer_resources()
        return Trainer, extra
    fsdp = a.fsdp_config
    extra |= {"model_dtype": fsdp.model_dtype, "mixed_precision": fsdp.mixed_precision}
    if fsdp.fsdp_size > 1:
        from stages.trainer.fsdp_backend import FSDPTrainer as Trainer

        extra |= {"fsdp_size": fsdp.fsdp_size, "rank_resources": ctx.placement.trainer_resources()}
    else:
        from stages.trainer.torch_backend import TorchTrainer as Trainer
    return Trainer, extra


def _reserve_nodes(ctx: RunContext, attempt: Attempt) -> RankPlacement | None:
    """One bundle per trainer node, reserved once per attempt (ended with it, stop_ray); None on one node."""
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = trainer_nodes(ctx.cfg)
    if nodes == 1:
        return None
    bundle = trainer_bundle(ctx.cfg, ctx.placement, ray.cluster_resources().get("GPU", 0))
    group = placement_group([dict(bundle) for _ in range(nodes)], strategy="STRICT_SPREAD")
    ready, _ = ray.wait([group.ready()], timeout=RESERVE_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        nodes_now = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        raise ConfigError(
            f"the trainer's {nodes} nodes (trainer.nnodes={nodes}), each holding {describe_resources(bundle)}, were "
            f"not free after {RESERVE_TIMEOUT_S:g} s: other jobs hold them, or nodes left the cluster. Nodes: "
            f"{describe_nodes(nodes_now)}"
        )
    attempt.trainer_group = group
    return RankPlacement(group, trainer_ranks(ctx.cfg) // nodes)


def _policy(ctx: RunContext) -> PolicySettings:
    """The actor's objective; a null loss_scale_factor becomes data.max_response_length, verl's padded response
    width, so seq-mean-token-sum-norm divides every micro-batch by the same constant; the learning-rate schedule
    spans the run's trainer steps."""
    cfg = ctx.cfg
    policy = cfg.actor.policy()
    if policy.loss_scale_factor is None:
        policy = dataclasses.replace(policy, loss_scale_factor=cfg.data.max_response_length)
    steps = cfg.rollout.total_rollout_steps // (cfg.async_training.require_batches * cfg.actor.ppo_mini_batch_size)
    baseline = BASELINES.get(cfg.algorithm.adv_estimator, "")
    optim = dataclasses.replace(policy.optim, total_training_steps=steps)
    return dataclasses.replace(policy, optim=optim, trainer_baseline=baseline)
