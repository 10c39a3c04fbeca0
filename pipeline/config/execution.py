"""How the trainer and the reference model run their models, from verl's keys: padding-free packing
(`model.use_remove_padding`; `actor.megatron.use_remove_padding` with the Megatron backend), token-budget
micro-batches (`actor.use_dynamic_bsz`, `rollout.log_prob_*`, `ref.log_prob_*`), activation checkpointing
(`model.enable_gradient_checkpointing`; Megatron's `actor.megatron.override_transformer_config.recompute_*`) and
offload (`actor.fsdp_config.*_offload`, `ref.fsdp_config.param_offload`). None of them changes what is trained,
only time and memory.

As in verl, the proximal recompute's and the reference's token budgets default to the actor's.
"""

from __future__ import annotations

from pipeline.config.schema import RunConfig
from stages.trainer.micro_batches import MicroBatching
from stages.trainer.settings import ExecutionSettings


def packs(cfg: RunConfig) -> bool:
    """Whether the trainer and the reference model pack: the Megatron backend's own key, else the model's (verl's
    Megatron workers read actor.megatron.use_remove_padding, its FSDP workers model.use_remove_padding)."""
    if cfg.trainer.backend == "megatron":
        return cfg.actor.megatron.use_remove_padding
    return cfg.model.use_remove_padding


def trainer_execution(cfg: RunConfig) -> ExecutionSettings:
    """The trainer's ExecutionSettings (stages/trainer/settings.py)."""
    actor, ro, fsdp = cfg.actor, cfg.rollout, cfg.actor.fsdp_config
    log_prob = MicroBatching(
        ro.log_prob_micro_batch_size_per_gpu or actor.micro_batch_size,
        actor.use_dynamic_bsz if ro.log_prob_use_dynamic_bsz is None else ro.log_prob_use_dynamic_bsz,
        ro.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu,
        "rollout.log_prob_max_token_len_per_gpu",
    )
    return ExecutionSettings(
        use_remove_padding=packs(cfg),
        enable_gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
        log_prob=log_prob,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
    )


def reference_options(cfg: RunConfig) -> dict:
    """The keywords the wiring gives stages.ref_logprob.RefLogprob; micro_batch_size only when ref's key sets it
    (else the stage's own, stages.ref_logprob.micro_batch_size, applies)."""
    ref, actor = cfg.ref, cfg.actor
    out = {
        "use_remove_padding": packs(cfg),
        "use_dynamic_bsz": actor.use_dynamic_bsz
        if ref.log_prob_use_dynamic_bsz is None
        else ref.log_prob_use_dynamic_bsz,
        "max_token_len": ref.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu,
        "param_offload": ref.fsdp_config.param_offload,
    }
    if ref.log_prob_micro_batch_size_per_gpu is not None:
        out["micro_batch_size"] = ref.log_prob_micro_batch_size_per_gpu
    return out


def execution_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    """(holds, message) rules across these keys: budgets that fit the longest row, keys of the other backend."""
    sizes = [
        (cfg.rollout.log_prob_micro_batch_size_per_gpu, "rollout.log_prob_micro_batch_size_per_gpu"),
        (cfg.ref.log_prob_micro_batch_size_per_gpu, "ref.log_prob_micro_batch_size_per_gpu"),
        (cfg.rollout.log_prob_max_token_len_per_gpu, "rollout.log_prob_max_token_len_per_gpu"),
        (cfg.ref.log_prob_max_token_len_per_gpu, "ref.log_prob_max_token_len_per_gpu"),
    ]
    bad = [
        (False, f"{key} must be >= 1 or null, not {value}") for value, key in sizes if value is not None and value < 1
    ]
    if bad:  # before the settings below are built from them
        return bad
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    run = trainer_execution(cfg)
    ref = reference_options(cfg)
    budgets = [
        (cfg.actor.use_dynamic_bsz, cfg.actor.ppo_max_token_len_per_gpu, "actor.ppo_max_token_len_per_gpu"),
        (run.log_prob.use_dynamic_bsz, run.log_prob.max_token_len, "rollout.log_prob_max_token_len_per_gpu"),
        (cfg.uses_reference() and ref["use_dynamic_bsz"], ref["max_token_len"], "ref.log_prob_max_token_len_per_gpu"),
    ]
    megatron = cfg.trainer.backend == "megatron"
    recompute = cfg.actor.megatron.override_transformer_config.recompute_granularity is not None
    offload = run.param_offload or run.optimizer_offload
    return [
        *(
            (
                not on or budget >= longest,
                f"{key}={budget} is less than the longest row, data.max_prompt_length + data.max_response_length = "
                f"{longest}: a row is never split, so raise {key} to at least {longest}",
            )
            for on, budget, key in budgets
        ),
        (
            not (megatron and run.enable_gradient_checkpointing),
            "model.enable_gradient_checkpointing is the torch backend's: with trainer.backend=megatron set "
            "actor.megatron.override_transformer_config.recompute_granularity (and recompute_method, "
            "recompute_num_layers) instead",
        ),
        (
            not (recompute and not megatron),
            "actor.megatron.override_transformer_config.recompute_* are trainer.backend=megatron's: with the torch "
            "backend set model.enable_gradient_checkpointing=true instead",
        ),
        (
            not (run.param_offload and cfg.weight_sync.mode == "push" and cfg.weight_sync.backend != "gloo"),
            f"actor.fsdp_config.param_offload keeps the weights in CPU memory between steps, where a push reads them, "
            f"and weight_sync.backend={cfg.weight_sync.backend} sends GPU tensors: use weight_sync.backend=gloo or "
            "weight_sync.mode=pull, or turn param_offload off",
        ),
        (
            not (megatron and offload),
            "actor.fsdp_config.param_offload / optimizer_offload are the torch backend's (FSDP2); the megatron backend "
            "has no offload here: set them false",
        ),
    ]
