"""Cross-field checks of a RunConfig: the rules that span fields or need a registry (agent loops, tools), which the
types alone cannot express. Each failure is one ConfigError that names the key and the fix; `load_config` runs them
after the merge."""

from __future__ import annotations

from pipeline.config.execution import execution_checks
from pipeline.config.reward import CustomRewardFunctionConfig, reward_checks
from pipeline.config.rollout import MultiTurnConfig
from pipeline.config.schema import ConfigError, RunConfig, monitor_names
from pipeline.config.targets import stage_kwargs

VLLM_GENERATE = "stages.generate.VLLMGenerate"


def validate(cfg: RunConfig) -> None:
    """Cross-field checks that the types alone cannot express."""
    at = cfg.async_training
    checks = [
        (at.staleness_threshold >= 0, "async_training.staleness_threshold must be >= 0"),
        (at.trigger_parameter_sync_step >= 1, "async_training.trigger_parameter_sync_step must be >= 1"),
        (at.require_batches >= 1, "async_training.require_batches must be >= 1"),
        (
            at.concurrent_samples_per_replica >= 1,
            "async_training.concurrent_samples_per_replica must be >= 1 (prompts each replica generates at once)",
        ),
        (cfg.actor.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size must be >= 1"),
        (cfg.rollout.n >= 1, "rollout.n must be >= 1"),
        (cfg.rollout.num_replicas >= 1, "rollout.num_replicas must be >= 1"),
        (cfg.rollout.engine_max_restarts >= 0, "rollout.engine_max_restarts must be >= 0 (0: no restarts)"),
        (cfg.trainer.max_restarts >= 0, "trainer.max_restarts must be >= 0 (0: a dead trainer ends the run)"),
        (
            cfg.trainer.torch_threads is None or cfg.trainer.torch_threads >= 1,
            "trainer.torch_threads must be >= 1, or null (decided by the run's shape)",
        ),
        (
            not (cfg.rollout.score_in_engine and cfg.uses_reference()),
            "rollout.score_in_engine leaves no place for the reference model between generation and scoring: set "
            "rollout.score_in_engine=false, or turn the KL off (actor.use_kl_loss, algorithm.use_kl_in_reward)",
        ),
        (
            cfg.trainer.save_freq == -1
            or (cfg.trainer.save_freq > 0 and cfg.trainer.save_freq % at.trigger_parameter_sync_step == 0),
            "trainer.save_freq must be -1 or a positive multiple of async_training.trigger_parameter_sync_step "
            "(a checkpoint is taken at a weight sync, so the engines can resume from exactly those weights)",
        ),
        (
            cfg.trainer.backend != "sim" or cfg.trainer.save_freq == -1,
            "trainer.backend=sim has no weights to checkpoint: set trainer.save_freq=-1",
        ),
        (
            not (cfg.rollout.test_freq > 0 or cfg.trainer.val_before_train) or bool(cfg.data.val_files),
            "validation (rollout.test_freq > 0 or trainer.val_before_train) needs data.val_files: a held-out prompt "
            "file, or 'embedded' with the embedded task",
        ),
        (cfg.rollout.val_kwargs.n >= 1, "rollout.val_kwargs.n must be >= 1"),
        (
            bool(cfg.ray.trainer_resource and cfg.ray.rollout_resource) or cfg.ray.placement == "anywhere",
            "ray.trainer_resource and ray.rollout_resource name the custom resources of trainer and rollout nodes: "
            "set both, or ray.placement=anywhere",
        ),
        *_multi_turn_checks(cfg.rollout.multi_turn),
        *_agent_checks(cfg.rollout.agent.default_agent_loop),
        (
            not at.use_trainer_do_validate or cfg.stages.generate["_target_"] == "stages.generate.VLLMGenerate",
            "async_training.use_trainer_do_validate runs a dedicated vLLM engine: it needs "
            "stages.generate._target_=stages.generate.VLLMGenerate",
        ),
        (not cfg.resume or bool(cfg.trainer.run_name), "resume=true needs trainer.run_name naming the run to continue"),
        *_routing_replay_checks(cfg),
        (
            cfg.rollout.total_rollout_steps >= at.require_batches * cfg.actor.ppo_mini_batch_size,
            "rollout.total_rollout_steps must cover at least one step (require_batches * ppo_mini_batch_size)",
        ),
    ]
    for ok, message in (
        checks
        + _correction_checks(cfg)
        + _megatron_checks(cfg)
        + _trainer_rank_checks(cfg)
        + _fsdp_checks(cfg)
        + _reward_checks(cfg)
        + reward_checks(cfg.reward, bool(cfg.reward.custom_reward_function.path), cfg.rollout.score_in_engine)
        + _engine_tp_checks(cfg)
        + _engine_checks(cfg)
        + execution_checks(cfg)
    ):
        if not ok:
            raise ConfigError(message)
    _check_monitors(cfg)
    for name in ("generate", "reward", "ref_logprob"):
        stage_kwargs(getattr(cfg.stages, name), f"stages.{name}")
    if "_target_" in cfg.stages.advantage:  # else algorithm.adv_estimator names the class
        stage_kwargs(cfg.stages.advantage, "stages.advantage")
    _check_custom_reward_function(cfg.reward.custom_reward_function)
    _check_reward_manager(cfg)
    _check_policy_loss(cfg)


def _check_monitors(cfg: RunConfig) -> None:
    """Each monitor named, and the package the tensorboard one writes with installed (said now, not after start)."""
    import importlib.util

    names = monitor_names(cfg.trainer.monitor)
    if "tensorboard" in names and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "trainer.monitor (verl: trainer.logger) names tensorboard, and the tensorboard package is not installed: "
            "pip install tensorboard, or leave it out of the list"
        )
    if cfg.trainer.console_interval < 1:
        raise ConfigError(f"trainer.console_interval must be >= 1, not {cfg.trainer.console_interval}")


def _engine_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    ro, d = cfg.rollout, cfg.data
    need = d.max_prompt_length + d.max_response_length
    return [
        (ro.top_k == -1 or ro.top_k >= 1, f"rollout.top_k must be -1 (off) or >= 1, not {ro.top_k}"),
        (
            ro.val_kwargs.top_k == -1 or ro.val_kwargs.top_k >= 1,
            f"rollout.val_kwargs.top_k must be -1 (off) or >= 1, not {ro.val_kwargs.top_k}",
        ),
        (
            ro.max_model_len is None or ro.max_model_len >= need,
            f"rollout.max_model_len={ro.max_model_len} is less than data.max_prompt_length + max_response_length = "
            f"{need}: raise it or leave it null",
        ),
        (
            all(v is None or 0 < v <= 1 for v in (ro.gpu_memory_utilization, ro.standalone_gpu_memory_utilization)),
            "rollout.gpu_memory_utilization and standalone_gpu_memory_utilization must be in (0, 1] (or null)",
        ),
        (ro.nnodes >= 1 and ro.n_gpus_per_node >= 0, "rollout.nnodes must be >= 1 and rollout.n_gpus_per_node >= 0"),
        (
            cfg.reward.on_error != "drop_group" or ro.prompts_per_call == 1,
            "reward.on_error=drop_group refills a dropped group's place through the gate, one prompt at a time: set "
            "rollout.prompts_per_call=1 (a gate call that admits part of a larger block holds that part until its "
            "call ends, and a dropped group's replacement may be in it)",
        ),
        (
            not cfg.algorithm.filter_groups.enable or ro.prompts_per_call == 1,
            "algorithm.filter_groups.enable=true admits prompts one at a time, as verl streams generation batches of "
            "one prompt under dynamic sampling: set rollout.prompts_per_call=1 (a gate call that admits part of a "
            "larger block holds that part until its call ends, and a filtered group's replacement may be in it)",
        ),
    ]


def _reward_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    spec = cfg.stages.reward
    if not isinstance(spec, dict) or spec.get("_target_") != "stages.reward.Reward":
        return []
    workers, timeout = spec.get("num_workers", 1), spec.get("timeout_s", 1.0)
    return [
        (isinstance(workers, int) and workers >= 1, f"stages.reward.num_workers must be >= 1, not {workers}"),
        (isinstance(timeout, int | float) and timeout > 0, f"stages.reward.timeout_s must be > 0, not {timeout}"),
    ]


def _check_custom_reward_function(crf: CustomRewardFunctionConfig) -> None:
    """Load the user's reward function now, so that a missing file or function, a file that fails to import, or a
    signature verl's call does not fit is one error before anything starts (user files are small; verl loads it at
    start too)."""
    if not crf.path:
        return
    from stages.verifiers import RewardFunctionError, check_score_signature, load_score_function

    if not crf.name:
        raise ConfigError(
            "reward.custom_reward_function.name is empty: name the function to call (verl: compute_score)."
        )
    try:
        check_score_signature(load_score_function(crf.path, crf.name), crf.name, crf.reward_kwargs, crf.path)
    except RewardFunctionError as err:
        raise ConfigError(str(err)) from None


def _check_reward_manager(cfg: RunConfig) -> None:
    manager = cfg.reward.reward_manager
    if manager.module.path is not None:
        raise ConfigError(
            "reward.reward_manager.module.path names a reward manager class of your own (verl's source=importlib), "
            "which is not supported: a reward.custom_reward_function can score any way you like"
        )
    try:
        cfg.reward_manager()
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_policy_loss(cfg: RunConfig) -> None:
    """A loss of the user's own (actor.policy_loss.path) is loaded now, so that a missing file or name is one error
    before anything starts (importing the registry imports torch: only when a path is given)."""
    settings = cfg.actor.policy_loss
    if not settings.path:
        return
    from stages.trainer.policy_loss import policy_loss_fn

    try:
        policy_loss_fn(settings)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _multi_turn_checks(mt: MultiTurnConfig) -> list[tuple[bool, str]]:
    from stages.tools import TOOL_NAMES  # names only: imports no tool code

    key = "rollout.multi_turn"
    unknown_tools = [t for t in mt.tools if t not in TOOL_NAMES]
    counts = ("max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length")
    checks = [(getattr(mt, name) >= 1, f"{key}.{name} must be >= 1") for name in counts]
    return checks + [
        (not unknown_tools, f"{key}.tools has unknown tool(s) {unknown_tools}; available: {', '.join(TOOL_NAMES)}"),
        (mt.sandbox_timeout_s > 0 and mt.sandbox_cpu_s >= 1, f"{key}.sandbox_timeout_s and sandbox_cpu_s must be > 0"),
        (mt.sandbox_memory_mb >= 64, f"{key}.sandbox_memory_mb must be >= 64 (the interpreter itself needs ~30 MiB)"),
    ]


def _agent_checks(name: str) -> list[tuple[bool, str]]:
    from stages.agents import UnknownAgentError, check_agent_name  # names only: imports no engine code

    try:
        check_agent_name(name, "rollout.agent.default_agent_loop")
    except UnknownAgentError as err:
        return [(False, str(err))]
    return []


def _routing_replay_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    replay = (
        cfg.actor.router_replay.mode != "R3" or cfg.rollout.enable_rollout_routing_replay,
        "actor.router_replay.mode=R3 trains with the engine's routes: set rollout.enable_rollout_routing_replay=true "
        "(verl asks for both), or actor.router_replay.mode=disabled",
    )
    if not cfg.rollout.enable_rollout_routing_replay:
        return [replay]
    return [
        replay,
        (
            cfg.stages.generate["_target_"] == "stages.generate.VLLMGenerate",
            "rollout.enable_rollout_routing_replay captures routes in the vLLM engine: it needs "
            "stages.generate._target_=stages.generate.VLLMGenerate",
        ),
        (
            cfg.model.path != "embedded" or cfg.model.arch == "moe",
            "rollout.enable_rollout_routing_replay needs an MoE model, and the embedded model is dense: set "
            "model.arch=moe (or use conf/moe.yaml)",
        ),
    ]


def _correction_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    from stages.trainer.settings import correction_mode_error

    recompute = cfg.async_training.compute_prox_log_prob or not cfg.async_training.use_rollout_log_probs
    error = correction_mode_error(cfg.algorithm.rollout_correction, recompute, cfg.actor.policy_loss.loss_mode)
    otb = cfg.algorithm.adv_estimator in ("optimal_token_baseline", "tir_optimal_token_baseline")
    return [
        (error is None, error or ""),
        (
            not otb or recompute,
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} takes sum pi^2 from the trainer's proximal "
            "logprob pass, which bypass mode skips (verl asserts the same): set "
            "algorithm.rollout_correction.bypass_mode=false",
        ),
        (
            not otb or cfg.actor.calculate_sum_pi_squared,
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs the proximal pass's sum pi^2: set "
            "actor.calculate_sum_pi_squared=true (verl requires the same)",
        ),
        (
            not cfg.actor.trainer_baseline,
            "actor.trainer_baseline is set from algorithm.adv_estimator: leave it out of the config",
        ),
        (
            not otb or cfg.trainer.backend != "sim",
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} needs a trainer that computes logprobs: "
            "trainer.backend=torch or megatron",
        ),
    ]


def _fsdp_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    size, key = cfg.actor.fsdp_config.fsdp_size, "actor.fsdp_config.fsdp_size"
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    return [
        (
            size >= 1,
            f"{key} must be >= 1 (the torch trainer's data-parallel ranks) or -1 with trainer.n_gpus_per_node "
            f"(every trainer rank), not {size}",
        ),
        (
            size == 1 or cfg.trainer.backend == "torch",
            f"{key}={size} shards the torch trainer, but trainer.backend={cfg.trainer.backend}: set "
            f"trainer.backend=torch or {key}=1",
        ),
        (
            cfg.trainer.backend != "torch" or not world or size == world,
            f"the torch backend runs {key}={size} ranks, but trainer.n_gpus_per_node x trainer.nnodes = {world}: "
            f"set {key}=-1 (all of them) or make them equal (shard groups smaller than the trainer, verl's HSDP, "
            "are not supported)",
        ),
    ]


def _trainer_rank_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    t, mg = cfg.trainer, cfg.actor.megatron
    world, replica = t.n_gpus_per_node * t.nnodes, mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size
    return [
        (
            t.n_gpus_per_node >= 0,
            f"trainer.n_gpus_per_node must be >= 0 (0: one model replica), not {t.n_gpus_per_node}",
        ),
        (t.nnodes >= 1, f"trainer.nnodes must be >= 1 (the trainer's nodes), not {t.nnodes}"),
        (
            t.nnodes == 1 or t.n_gpus_per_node > 0,
            f"trainer.nnodes={t.nnodes} spreads the trainer's ranks over nodes, trainer.n_gpus_per_node on each: "
            "set trainer.n_gpus_per_node (0 means one model replica on one node)",
        ),
        (
            t.backend != "megatron" or t.nnodes == 1 or t.n_gpus_per_node % mg.tensor_model_parallel_size == 0,
            f"trainer.n_gpus_per_node={t.n_gpus_per_node} is not a multiple of "
            f"actor.megatron.tensor_model_parallel_size={mg.tensor_model_parallel_size}: a tensor-parallel group "
            f"would span two of the trainer.nnodes={t.nnodes} nodes; keep each on one node",
        ),
        (
            t.backend != "megatron" or replica < 1 or world % replica == 0,
            f"trainer.n_gpus_per_node x trainer.nnodes = {world} trainer ranks is not a multiple of "
            f"actor.megatron.tensor_model_parallel_size x pipeline_model_parallel_size = {replica} (one model "
            "replica): the data-parallel size would not be whole",
        ),
    ]


def _engine_tp_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    tp, key = cfg.rollout.tensor_model_parallel_size, "rollout.tensor_model_parallel_size"
    target = cfg.stages.generate["_target_"]
    return [
        (tp >= 1, f"{key} must be >= 1 (the devices of each vLLM engine), not {tp}"),
        (
            tp == 1 or target == VLLM_GENERATE,
            f"{key}={tp} splits each vLLM engine over {tp} devices, but stages.generate._target_={target} runs no "
            f"vLLM engine: set {key}=1, or stages.generate._target_={VLLM_GENERATE}",
        ),
        (
            tp == 1 or cfg.weight_sync.backend != "ipc",
            f"weight_sync.backend=ipc shares one GPU between trainer and engine, and {key}={tp} puts each engine on "
            f"{tp} GPUs: use weight_sync.backend=nccl, or {key}=1",
        ),
    ]


def check_engine_heads(tp: int, model_config: dict, model: str) -> None:
    """vLLM splits the attention heads evenly over an engine's TP ranks (key and value heads that do not split are
    replicated): `tp` must divide the model's attention heads. Said before Ray starts, not by the engine in its actor.
    """
    heads = model_config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tp:
        raise ConfigError(
            f"rollout.tensor_model_parallel_size={tp} must divide the model's {heads} attention heads "
            f"(num_attention_heads of {model}): use one of {', '.join(str(d) for d in _divisors(heads))}"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _megatron_checks(cfg: RunConfig) -> list[tuple[bool, str]]:
    mg, key = cfg.actor.megatron, "actor.megatron"
    return [
        (mg.tensor_model_parallel_size >= 1, f"{key}.tensor_model_parallel_size must be >= 1"),
        (mg.pipeline_model_parallel_size >= 1, f"{key}.pipeline_model_parallel_size must be >= 1"),
        (mg.export_bucket_mb >= 1, f"{key}.export_bucket_mb must be >= 1"),
    ]
