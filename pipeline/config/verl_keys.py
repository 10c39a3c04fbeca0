"""verl's keys that have nothing to configure here, each with why, by one rule (README, "verl's keys"):

- a key that only tunes a component not in use here (sglang's engine kwargs with a vLLM engine, the critic when no
  estimator needs one, the reference worker's layout) or a speed or memory knob whose absence leaves every result
  the same is accepted and listed once at start as having no effect, with the reason (`note`);
- a key that asks for a capability asyncrl lacks (another engine, multi-token prediction, sequence parallelism, a
  dataset class of the user's) is an error that names the capability, unless its value asks for nothing (an off
  switch, a parallel size of 1), which is then noted like the first kind (`capability`).
Keys asyncrl implements are not here: they are fields of the schema (schema.py) or verl spellings of them
(load.py's VERL_ALIASES). Keys are written as they read after those spellings are translated (actor.*, rollout.*,
model.*), `prefix.*` covering everything under a prefix; a key the schema has always wins over this table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _off(value: Any) -> bool:
    return value in (None, False, 0, 0.0, "", "none", "None", "null", "false", "False")


def _at_most_one(value: Any) -> bool:
    return value in (None, 0, 1, "null", "None")


def _one_of(*allowed: Any) -> Callable[[Any], bool]:
    return lambda value: value in allowed


@dataclass(frozen=True)
class Rule:
    why: str  # the reason it has no effect, or the capability it asks for
    asks_nothing: Callable[[Any], bool] | None = None  # capability keys: values that ask for nothing (then noted)

    @property
    def capability(self) -> bool:
        return self.asks_nothing is not None


def note(why: str) -> Rule:
    return Rule(why)


def capability(why: str, asks_nothing: Callable[[Any], bool] = _off) -> Rule:
    return Rule(why, asks_nothing)


_FUSION = "a kernel choice of Megatron's TransformerConfig; the trainer builds its own (local spec), results the same"
_REF = (
    "the reference model is its own stage (stages.ref_logprob, one actor); verl's reference-worker layout has no "
    "counterpart"
)
_OWN_MAP = "weights convert with asyncrl's own HF <-> Megatron map (stages/trainer/megatron_convert.py)"
_SLEEP = "the engines run apart from the trainer and never sleep (fully async), so there is nothing to free or wake"

RULES: dict[str, Rule] = {
    # --- the trainer ----------------------------------------------------------------------------------------------
    "actor.strategy": capability(
        "a trainer strategy other than FSDP: verl picks Megatron by its config file, here trainer.backend=megatron",
        _one_of("fsdp", "fsdp2"),
    ),
    "actor.fsdp_config.strategy": capability(
        "a trainer strategy other than FSDP (trainer.backend=megatron picks Megatron)", _one_of("fsdp", "fsdp2")
    ),
    "critic.*": note("there is no critic: the advantage estimators in use need none"),
    "actor.fsdp_config.forward_prefetch": note("FSDP2 (fully_shard) prefetches on its own; results the same"),
    "actor.fsdp_config.reshard_after_forward": capability(
        "keeping gathered parameters between forward and backward: FSDP2 reshards after forward here",
        _one_of(True, "True", "true", None),
    ),
    "actor.fsdp_config.use_torch_compile": capability("torch.compile of the trainer's model"),
    "actor.use_torch_compile": capability("torch.compile of the trainer's model"),
    "actor.fsdp_config.entropy_checkpointing": note("the entropy is computed in one pass; memory only"),
    "actor.entropy_from_logits_with_chunking": note("the entropy is computed in one pass; memory only"),
    "actor.checkpoint.*": note(
        "a checkpoint holds the HF model and the optimizer state, written at a sync step (pipeline/checkpoint.py)"
    ),
    "actor.ulysses_sequence_parallel_size": capability("Ulysses sequence parallelism", _at_most_one),
    "actor.megatron.context_parallel_size": capability("context parallelism", _at_most_one),
    "actor.megatron.expert_model_parallel_size": capability(
        "expert parallelism in the trainer (Megatron splits MoE layers by tensor parallelism here)", _at_most_one
    ),
    "actor.megatron.expert_tensor_parallel_size": capability("a tensor-parallel size for experts", _at_most_one),
    "actor.megatron.virtual_pipeline_model_parallel_size": capability("an interleaved pipeline", _at_most_one),
    "actor.megatron.use_dist_checkpointing": note("checkpoints are HF directories and one optimizer state per rank"),
    "actor.megatron.use_mbridge": note(_OWN_MAP),
    "actor.megatron.vanilla_mbridge": note(_OWN_MAP),
    "actor.megatron.override_transformer_config.*": note(_FUSION),
    "actor.megatron.override_transformer_config.context_parallel_size": capability("context parallelism", _at_most_one),
    "actor.megatron.override_transformer_config.fp8": capability("FP8 training"),
    "actor.megatron.override_transformer_config.moe_aux_loss_coeff": capability(
        "an MoE load-balancing loss in the objective"
    ),
    "actor.megatron.override_transformer_config.moe_z_loss_coeff": capability("an MoE router z-loss in the objective"),
    "actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage": capability(
        "uneven pipeline stages (the layers split evenly over pipeline_model_parallel_size)"
    ),
    "actor.megatron.override_transformer_config.num_layers_in_last_pipeline_stage": capability(
        "uneven pipeline stages (the layers split evenly over pipeline_model_parallel_size)"
    ),
    "actor_rollout_ref.hybrid_engine": capability(
        "a hybrid engine (trainer and engine time-sharing the GPUs): fully async runs them apart, as verl's "
        "fully_async requires hybrid_engine=False",
    ),
    "actor_rollout_ref.nccl_timeout": note(
        "the weight sync's waits are weight_sync.connect_timeout_s to form a group and 600 s per broadcast"
    ),
    "ref.*": note(_REF),  # verl's actor_rollout_ref.ref.*, as the aliases spell it
    # --- the model ------------------------------------------------------------------------------------------------
    "model.use_fused_kernels": note("logprobs and entropy come from the model's plain forward; results the same"),
    "model.trust_remote_code": note("models load with transformers' own architectures; no remote code runs"),
    "model.mtp.*": note("it tunes multi-token prediction, which is off (model.mtp.enable)"),
    "model.mtp.enable": capability("multi-token prediction (MTP)"),
    "model.lora_rank": capability("LoRA adapters (the whole model trains)"),
    "model.lora_alpha": note("it tunes LoRA, which is off (model.lora_rank)"),
    "model.target_modules": note("it tunes LoRA, which is off (model.lora_rank)"),
    "model.external_lib": capability("a library of the user's to register a model class"),
    # --- the engines ----------------------------------------------------------------------------------------------
    "rollout.name": capability("an inference engine other than vLLM", _one_of("vllm")),
    "rollout.mode": capability("a synchronous engine: the engines here are async (vLLM's AsyncLLM)", _one_of("async")),
    "rollout.calculate_log_probs": note("the engine always returns each sampled token's logprob"),
    "rollout.engine_kwargs.sglang.*": note("sglang's engine kwargs; the engine is vLLM"),
    "rollout.engine_kwargs.trtllm.*": note("TensorRT-LLM's engine kwargs; the engine is vLLM"),
    "rollout.quantization": capability("a quantized engine (fp8 and the like)"),
    "rollout.free_cache_engine": note(_SLEEP),
    "rollout.enable_sleep_mode": note(_SLEEP),
    "rollout.data_parallel_size": capability(
        "data parallelism inside one engine: each replica is one engine; rollout.num_replicas (or "
        "rollout.nnodes x n_gpus_per_node) sets how many",
        _at_most_one,
    ),
    "rollout.expert_parallel_size": capability(
        "expert parallelism in the engine: set rollout.engine_kwargs.vllm.enable_expert_parallel=true to spread an "
        "MoE model's experts over its tensor-parallel ranks (vLLM's way)",
        _at_most_one,
    ),
    "rollout.agent.num_workers": note("agent loops run as coroutines in each engine's actor"),
    "rollout.checkpoint_engine.*": note(
        "the weight sync packs tensors of up to 16 MiB per broadcast (stages/trainer/weight_sync.py; Megatron's "
        "export buckets are actor.megatron.export_bucket_mb)"
    ),
    "rollout.prometheus.enable": capability(
        "a Prometheus endpoint: the run's metrics are in MLflow and <run>/metrics.jsonl"
    ),
    "rollout.prometheus.*": note("it tunes the Prometheus endpoint, which is off (rollout.prometheus.enable)"),
    "rollout.multi_turn.enable": note(
        "a prompt runs multi-turn where its agent_name (or rollout.agent.default_agent_loop) is tool_agent"
    ),
    "rollout.multi_turn.format": capability(
        "a tool-call format other than hermes (<tool_call>{json}</tool_call>, what tool_agent parses)",
        _one_of("hermes", None),
    ),
    "rollout.multi_turn.tool_config_path": capability(
        "verl's tool config files: the tools are asyncrl's own (rollout.multi_turn.tools: calculator, python)"
    ),
    "rollout.single_turn_response_length": note("verl's code does not read it either"),
    # --- data -----------------------------------------------------------------------------------------------------
    "data.train_batch_size": capability(
        "a fixed train batch: fully async trains require_batches x ppo_mini_batch_size prompts per step, and verl's "
        "fully_async asks for data.train_batch_size=0",
        _one_of(0, None),
    ),
    "data.gen_batch_size": capability(
        "batched generation: prompts stream one by one (rollout.prompts_per_call groups them per engine call), and "
        "verl's fully_async asks for data.gen_batch_size=1",
        _one_of(1, None),
    ),
    "data.return_raw_chat": note("prompts are rendered with the model's chat template and tokenized up front"),
    "data.val_batch_size": note("validation prompts stream through the engines; there is no batch"),
    "data.trust_remote_code": note("tokenizers load with transformers' own classes; no remote code runs"),
    "data.image_key": capability("image inputs (multimodal prompts)"),
    "data.custom_cls.*": capability("a dataset class of your own (pipeline/tasks/source.py reads verl's RL format)"),
    # --- the algorithm --------------------------------------------------------------------------------------------
    "algorithm.filter_groups.max_inflight_gen_batches": note(
        "verl's bound on concurrent generation batches under dynamic sampling: prompts stream one by one here, and a "
        "filtered group's place is taken by the next prompt the gate admits"
    ),
    "async_training.use_dynamic_resource_scheduling": capability(
        "dynamic resource scheduling (moving GPUs between rollout and training during the run)"
    ),
    "async_training.dynamic_schedule_*": note(
        "it tunes dynamic resource scheduling, which is off (async_training.use_dynamic_resource_scheduling)"
    ),
    # --- the run --------------------------------------------------------------------------------------------------
    "trainer.critic_warmup": capability("critic warmup steps (there is no critic)", _one_of(0, None)),
    "trainer.device": capability("a device other than CUDA GPUs or the CPU (NPUs)", _one_of("cuda", "cpu", None)),
    "trainer.log_val_generations": note("every validation sample is kept in <run>/validation/ for the notebook"),
    "trainer.max_actor_ckpt_to_keep": note("every checkpoint is kept (trainer.save_freq sets how often)"),
    "trainer.total_training_steps": note(
        "verl's fully_async derives the steps from rollout.total_rollout_steps and does not read it either"
    ),
    "trainer.total_epochs": note(
        "the run's length is rollout.total_rollout_steps prompts, the data repeating in reshuffled epochs "
        "(verl takes the smaller of that and total_epochs x the prompts)"
    ),
    "trainer.worker_env.*": note(
        "set it in the environment of `asyncrl run` (a local Ray's workers inherit it) or in a Ray job's runtime_env"
    ),
}

# Left to the trainer-efficiency settings (their own schema fields): never noted here, so until they exist they are
# unknown keys rather than silently accepted.
EFFICIENCY_KEYS = (
    "actor.use_dynamic_bsz",
    "actor.ppo_max_token_len_per_gpu",
    "actor.fsdp_config.param_offload",
    "actor.fsdp_config.optimizer_offload",
    "actor.fsdp_config.offload_policy",
    "actor.fsdp_config.mixed_precision",
    "actor.fsdp_config.model_dtype",
    "actor.megatron.param_offload",
    "actor.megatron.grad_offload",
    "actor.megatron.optimizer_offload",
    "actor.megatron.override_transformer_config.recompute_",
    "actor.optim.override_optimizer_config.",
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
    "rollout.log_prob_use_dynamic_bsz",
    "rollout.log_prob_max_token_len_per_gpu",
    "model.use_remove_padding",
    "model.enable_gradient_checkpointing",
    "model.enable_activation_offload",
    "model.dtype",
)


def efficiency_key(key: str) -> bool:
    return any(key == k or (k.endswith(("_", ".")) and key.startswith(k)) for k in EFFICIENCY_KEYS)


def rule_of(key: str) -> Rule | None:
    """The rule of `key`: its own, else that of the longest `prefix.*` (or `prefix_*`) covering it."""
    if efficiency_key(key):
        return None
    if key in RULES:
        return RULES[key]
    best = None
    for pattern, rule in RULES.items():
        if pattern.endswith("*") and key.startswith(pattern[:-1]) and (best is None or len(pattern) > len(best[0])):
            best = (pattern, rule)
    return best[1] if best else None


def judge(key: str, value: Any) -> tuple[str | None, str | None]:
    """(notice, error) for a verl key the schema lacks: a notice when it is accepted without effect, an error when it
    asks for a capability; (None, None) when no rule covers it (it stays an unknown key)."""
    rule = rule_of(key)
    if rule is None:
        return None, None
    shown = f"{key}={value}"
    if rule.capability and not rule.asks_nothing(value):
        return None, f"{shown} asks for {rule.why}, which asyncrl does not have."
    if rule.capability:
        return f"{shown}: accepted (it does not ask for {rule.why}, which asyncrl lacks)", None
    return f"{shown}: accepted, no effect here: {rule.why}", None
