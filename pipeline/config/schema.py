"""The run configuration's typed schema: one dataclass per section, a docstring under each field, and every
choice a `Literal`, so that omegaconf itself refuses a typo in a key or a value.

Key names follow verl's fully_async_policy where verl has one (`async_training.*`, `actor.ppo_mini_batch_size`,
`rollout.n`, `rollout.total_rollout_steps`, `data.max_response_length`), so a verl user's overrides work as they
are. The trainer's objective settings are stages/trainer/settings.py's own dataclasses (one definition for the
config and both trainer backends); the simulated workload is stages/sim/workload.py's.

Stages are swapped declaratively: each entry of `stages` names a class with `_target_` and its constructor
keywords beside it. The wiring (pipeline/stream.py) unpacks this into plain constructor arguments; nothing below
pipeline/ sees the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from stages.sim.workload import Workload
from stages.trainer.precision import DTypeName, MixedPrecision
from stages.trainer.settings import CorrectionSettings, MegatronRecompute, PolicySettings

MONITORS = ("mlflow", "jsonl", "null")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = 0.0
    """Share of extra (stale) prompts the generator may admit per weight version; 0 is synchronous."""
    trigger_parameter_sync_step: int = 1
    """Optimizer steps between two weight syncs to the engines."""
    require_batches: int = 1
    """Mini-batches of `actor.ppo_mini_batch_size` prompts the trainer takes per step."""
    partial_rollout: bool = False
    """Interrupt in-flight generations at a sync and resume them with the new weights (needs staleness > 0)."""
    partial_rollout_mode: Literal["abort", "keep"] = "abort"
    """'abort': resubmit prompt + partial tokens (KV recomputed; verl, AReaL). 'keep': the engine keeps the requests
    and continues them with the new weights over the old KV cache (PipelineRL)."""
    use_rollout_log_probs: bool = True
    """Use the engine's behaviour logprobs as old_log_prob in the PPO ratio."""
    compute_prox_log_prob: bool = False
    """Recompute logprobs with the weights at the start of each step and use them as old_log_prob (decoupled PPO);
    needed by `algorithm.rollout_correction`."""
    use_trainer_do_validate: bool = False
    """Validate on a dedicated engine outside the training stream (verl: validation replicas beside the trainer),
    which loads each validated version from the weight store; the stream's engines never see a validation request."""
    parallel_validate_and_rollout: bool = True
    """On the stream's engines, interleave validation with training requests (the default, so training waits
    least); false holds a replica's new training requests until its share of the pass is done (verl's default)."""


AdvEstimator = Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
# verl's KL estimators (stages/trainer/kl.py's KL_TYPES_ALL; written out so that loading a config imports no torch).
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"
]


@dataclass
class KLControlConfig:
    """verl's `algorithm.kl_ctrl.*`: the coefficient of the KL in the reward."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """'fixed' only: the adaptive controller is not supported."""
    kl_coef: float = 0.001
    """beta: every response token's reward pays beta * kl(behaviour, reference)."""
    horizon: int = 10000
    """Accepted for verl configs; used only by the adaptive controller."""
    target_kl: float = 0.1
    """Accepted for verl configs; used only by the adaptive controller."""

    def __post_init__(self) -> None:
        if self.type != "fixed":
            raise ValueError(
                f"algorithm.kl_ctrl.type={self.type}: only a fixed KL coefficient is supported; "
                "set algorithm.kl_ctrl.type=fixed and choose algorithm.kl_ctrl.kl_coef"
            )


@dataclass
class AlgorithmConfig:
    """verl's `algorithm.*`: the advantage estimator, the KL in the reward, rollout correction."""

    adv_estimator: AdvEstimator = "grpo"
    """Advantage estimator (stages/advantage): 'grpo', 'rloo', 'reinforce_plus_plus' or
    'reinforce_plus_plus_baseline'. An explicit `stages.advantage._target_` wins over it."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo: divide by the group's std (false: Dr.GRPO, s - mean only)."""
    gamma: float = 1.0
    """Discount of reinforce_plus_plus's token returns."""
    lam: float = 1.0
    """GAE's lambda; accepted for verl configs, unused by these estimators."""
    use_kl_in_reward: bool = False
    """Every response token's reward pays kl_ctrl.kl_coef * kl(behaviour, reference); starts the RefLogprob stage."""
    kl_penalty: KLType = "kl"
    """KL estimator of the KL in the reward (verl's names; stages/trainer/kl.py)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """The KL coefficient (fixed only)."""
    rollout_correction: CorrectionSettings = field(default_factory=CorrectionSettings)
    """verl's `algorithm.rollout_correction.*`: off-policy correction between engine and trainer."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of trainer.backend=megatron (verl's key); must divide the model's kv heads."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel stages of trainer.backend=megatron (verl's key); must divide the model's layer count.
    The trainer has tensor_model_parallel_size x pipeline_model_parallel_size ranks."""
    export_bucket_mb: int = 64
    """Weights leave the trainer gathered across TP ranks in buckets of about this many MiB of local shards."""
    override_transformer_config: MegatronRecompute = field(default_factory=MegatronRecompute)
    """megatron-core's activation recompute (verl's `recompute_granularity`, `recompute_method`,
    `recompute_num_layers`, `recompute_modules` under this key)."""
    dtype: Literal["bfloat16", "float32"] | None = None
    """The model's dtype (verl's key): 'bfloat16' trains bf16 parameters with megatron's fp32 main weights and fp32
    optimizer state (its distributed optimizer: a GPU only); null: bfloat16 on a GPU, float32 on CPU."""


@dataclass
class FSDPConfig:
    fsdp_size: int = 1
    """Data-parallel ranks of trainer.backend=torch (verl's key), each an FSDP2 shard of the model training its
    token-balanced share of every mini-batch; 1 is one process without sharding; -1 (verl's 'every trainer GPU')
    is trainer.n_gpus_per_node x trainer.nnodes."""
    param_offload: bool = False
    """Parameters and gradients in CPU memory between steps, on the GPU only during a step (torch backend; nothing
    moves on CPU)."""
    optimizer_offload: bool = False
    """AdamW's state in CPU memory between steps (torch backend; nothing moves on CPU)."""
    model_dtype: DTypeName = "fp32"
    """Dtype the weights are loaded in, updated and kept in by AdamW (verl's key): fp32 master weights by default."""
    mixed_precision: MixedPrecision = field(default_factory=MixedPrecision)
    """Dtype of the forward and backward and of the gradient reduction (verl's key; stages/trainer/precision.py):
    param_dtype null is bf16 on a GPU and fp32 on CPU."""


@dataclass
class ActorConfig(PolicySettings):
    """verl's `actor_rollout_ref.actor.*`: the objective's knobs (PolicySettings) plus the batch and parallelism."""

    ppo_mini_batch_size: int = 8
    """Prompts per mini-batch (each carries `rollout.n` trajectories)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of trainer.backend=megatron (verl's `actor_rollout_ref.actor.megatron.*`)."""
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Data parallelism of trainer.backend=torch (verl's `actor_rollout_ref.actor.fsdp_config.*`)."""

    def policy(self) -> PolicySettings:
        """The part both trainer backends take."""
        return PolicySettings(**{f.name: getattr(self, f.name) for f in fields(PolicySettings)})


@dataclass
class ValKwargs:
    n: int = 1
    """Responses per held-out prompt."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling."""


@dataclass
class AgentConfig:
    default_agent_loop: str = "single_turn_agent"
    """Agent loop (stages/agents) of prompts whose data has no `agent_name`: 'single_turn_agent' or 'tool_agent'."""


@dataclass
class MultiTurnConfig:
    max_assistant_turns: int = 4
    """Model turns per trajectory in tool_agent."""
    max_user_turns: int = 4
    """Tool-result turns per trajectory in tool_agent."""
    max_parallel_calls: int = 1
    """Tool calls of one assistant turn that are run; later ones are dropped."""
    max_tool_response_length: int = 256
    """Characters of a tool's result handed back to the model (the rest is cut)."""
    tools: list[str] = field(default_factory=lambda: ["calculator", "python"])
    """Tools the model may call (stages/tools)."""
    sandbox_timeout_s: float = 5.0
    """Wall-clock limit of one python tool call."""
    sandbox_memory_mb: int = 256
    """Address-space limit of the python tool's process (RLIMIT_AS)."""
    sandbox_cpu_s: int = 2
    """CPU-time limit of the python tool's process (RLIMIT_CPU)."""


@dataclass
class RolloutConfig:
    n: int = 8
    """Responses per prompt (the GRPO group size)."""
    total_rollout_steps: int = 1536
    """Prompts admitted over the whole run; trainer steps = this // (require_batches * ppo_mini_batch_size)."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling."""
    num_replicas: int = 1
    """Generate actors, each owning one engine."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of each vLLM engine (verl's key): a replica's engine runs on this many devices of one
    node (GPUs; CPU cores on CPU), and every rank joins the weight sync. Must divide the model's attention heads."""
    prompts_per_call: int = 2
    """Prompts per Generate call; calls_in_flight of them run concurrently in each engine."""
    calls_in_flight: int = 4
    """Concurrent Generate calls per replica (continuous batching depth)."""
    engine_max_restarts: int = 3
    """Restarts of Generate replicas the run survives, all replicas together: Ray restarts a replica whose process
    or engine died, it loads the current weights and regenerates the prompts it had in flight. In push mode this
    writes every pushed version to weight_sync.store too (sync/snapshot_s); 0 turns both off."""
    score_in_engine: bool | None = None
    """Score, log and split each block in its engine's actor (stages/scored_generate.py), not in a stage after it:
    one hand-off between stages fewer per block, which on short steps is a good part of a step (bench.overhead).
    None (the default): wherever it can, i.e. unless a reference model sits between generation and scoring
    (actor.use_kl_loss, algorithm.use_kl_in_reward); true with a reference model is an error; false: never."""
    kv_cache_gb: int = 1
    """KV cache GiB per CPU engine (VLLM_CPU_KVCACHE_SPACE, whole GiB)."""
    test_freq: int = -1
    """Validate on data.val_files every this many weight versions, right after the sync (-1: never)."""
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    """Sampling of validation responses."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Which agent loop generates a prompt's responses (verl's `rollout.agent`)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """tool_agent's limits and tools (verl's `rollout.multi_turn`)."""
    enable_rollout_routing_replay: bool = False
    """MoE models: the engines return the experts their routers chose for every token (the `routed_experts` column),
    for the trainer to force the same routes (verl's rollout key of router replay R3)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per forward pass of the trainer's proximal recompute (async_training.compute_prox_log_prob); null:
    actor.ppo_micro_batch_size_per_gpu."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut the proximal recompute's passes by token count (log_prob_max_token_len_per_gpu each); null: as
    actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """The proximal recompute's token budget per pass; null: actor.ppo_max_token_len_per_gpu."""
    dtype: Literal["bfloat16", "float32"] | None = None
    """The engines' dtype (verl's key): null is bfloat16 on a GPU, float32 on CPU."""
    routed_experts_capture: Literal["auto", "hook", "native"] = "auto"
    """How the engines capture routes: 'native' is vLLM's enable_return_routed_experts (needs its Model Runner V2,
    so a GPU; unverified here), 'hook' a capture function on every router in the engine worker (runs anywhere; turns
    prefix caching off), 'auto' native on a GPU, else the hook."""


@dataclass
class DataConfig:
    train_files: str = "embedded"
    """Prompt file (parquet or jsonl, any fsspec URL) or 'embedded' for the built-in task."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens) are an input error."""
    max_response_length: int = 48
    """max_tokens per response."""
    num_embedded_prompts: int = 2000
    """Size of the generated embedded data set."""
    embedded_task: Literal["reverse", "calc"] = "reverse"
    """Which embedded task: 'reverse' (letter lists) or 'calc' (multi-turn: multiplication through the calculator
    tool, pipeline/tasks/embedded_calc.py)."""
    val_files: str = ""
    """Held-out prompts for validation (parquet or jsonl, flat or verl format), 'embedded' for the embedded
    task's held-out set, or empty for no validation."""
    num_embedded_val_prompts: int = 64
    """Size of the embedded held-out set (prompts that are not in its training set)."""
    seed: int = 0
    """Shuffle seed; epoch e uses seed + e."""


@dataclass
class ModelConfig:
    path: str = "embedded"
    """HF model directory, or 'embedded' to build the tiny random model and tokenizer into the run directory."""
    arch: Literal["dense", "moe"] = "dense"
    """The embedded model's architecture: 'dense' (Qwen2) or 'moe' (Qwen3-MoE, 4 experts, top-2). A model directory
    says what it is in its config.json; this key does not apply to it."""
    use_remove_padding: bool = False
    """Pack each micro-batch's sequences into one row, attention confined to each (stages/trainer/packing.py), in
    the trainer, its proximal recompute and the reference model, instead of right-padding them."""
    enable_gradient_checkpointing: bool = False
    """Activation checkpointing of the torch backend's decoder layers: the backward recomputes each layer's
    activations from its input (trainer.backend=megatron: actor.megatron.override_transformer_config.recompute_*)."""
    warm_start_steps: int = 500
    """Supervised steps on the embedded task before RL (0 to skip); only for the embedded model."""
    warm_start_lr: float = 2e-3
    """Learning rate of the warm start."""
    warm_start_smoothing: float = 0.5
    """Label smoothing of the warm start: keeps sampled answers noisy while greedy ones are mostly right."""
    warm_start_cache: str = "${oc.env:ASYNCRL_CACHE_DIR,'~/.cache/asyncrl'}/warm_start"
    """Where warm-started models are kept, keyed by everything they depend on, so that a run with the same embedded
    model, task and warm start loads it in a second instead of training it again; '' (`model.warm_start_cache=''`)
    trains every time."""


@dataclass
class TrainerConfig:
    backend: Literal["torch", "megatron", "sim"] = "torch"
    """Trainer backend: 'torch' (an HF model, AdamW), 'megatron' (megatron-core, tensor parallel; actor.megatron)
    or 'sim' (spends the time `sim` gives; for benchmarks)."""
    output_dir: str = "runs"
    """Parent directory of run directories (any local path)."""
    run_name: str = ""
    """Run directory name; empty means a timestamp."""
    monitor: Any = "mlflow"
    """'mlflow', 'jsonl', 'null', or a list such as [mlflow,jsonl]. metrics.jsonl in the run directory is written in
    every case (the run summary is computed from it), so 'jsonl' and 'null' both mean: no MLflow."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking store: an http(s):// server, a sqlite:///path.db, ...; empty keeps a sqlite store and the
    artifacts inside the run directory (<run>/mlflow)."""
    experiment_name: str = "asyncrl"
    """MLflow experiment of the run (created when missing)."""
    n_gpus_per_node: int = 0
    """verl's trainer ranks per node (GPUs on a GPU cluster, processes on CPU). trainer.backend=megatron runs
    n_gpus_per_node x nnodes ranks, data-parallel size = that / (tensor x pipeline parallel size); 0 means one
    model replica (TP x PP ranks). The torch backend's ranks are actor.fsdp_config.fsdp_size (-1: these)."""
    nnodes: int = 1
    """verl's trainer nodes: n_gpus_per_node ranks on each, one Ray placement bundle per node (each on a node of its
    own, with ray.trainer_resource when the cluster marks trainer nodes)."""
    seed: int = 0
    """Seed for model init, warm start and sampling."""
    torch_threads: int = 1
    """Intra-op threads of the trainer process."""
    val_before_train: bool = False
    """Validate the starting weights before the first step (needs data.val_files)."""
    save_freq: int = -1
    """Checkpoint every this many steps (a multiple of trigger_parameter_sync_step); -1 never."""
    checkpoint_dir: str = ""
    """Where checkpoints go (any fsspec URL); empty means <run_dir>/checkpoints."""
    max_restarts: int = 3
    """If the trainer dies, the run restarts from its latest checkpoint in the same command (as resume=true would),
    up to this many times; it needs trainer.save_freq. Without a checkpoint the run stops and says so."""


@dataclass
class WeightSyncConfig:
    mode: Literal["push", "pull"] = "push"
    """'push': the trainer pauses the engines and broadcasts (verl). 'pull': the trainer publishes each version to
    `store` and goes on; each engine loads the newest at its own safe point (pipeline/sync.py)."""
    store: str = ""
    """Pull mode's parameter store, a directory or fsspec URL every engine can read; empty: shared memory
    (/dev/shm) on this node."""
    backend: Literal["gloo", "nccl", "ipc"] = "gloo"
    """Push mode's transport: 'gloo' (CPU tensors; works everywhere), 'nccl' (trainer and engines on different
    GPUs) or 'ipc' (one GPU shared by trainer and engine: CUDA IPC handles). nccl and ipc need CUDA."""
    connect_timeout_s: float = 30.0
    """Push mode: how long forming the weight-sync group may take before it is formed again with the replicas
    still alive (a replica that dies while it joins must not hold the others; a broadcast itself may wait 600 s,
    for an engine to drain its requests)."""


@dataclass
class RayConfig:
    address: str = ""
    """Cluster address; empty uses RAY_ADDRESS (Ray Jobs sets it for the job's driver), else starts a local Ray on
    127.0.0.1."""
    num_cpus: int = 8
    """Logical CPUs of a local Ray; more than cores, so actors holding a CPU each cannot deadlock a 2-core box."""
    no_progress_timeout_s: float = -1
    """Fail the stream when no block moves for this long; -1 (never) for real runs, set in tests."""
    gpus_per_engine: float = 1.0
    """GPUs each vLLM engine asks Ray for, on a cluster that has GPUs (a fraction shares one: 0.5 puts an engine
    and a trainer rank on one GPU)."""
    gpus_per_trainer_rank: float = 1.0
    """GPUs each trainer rank (Megatron's, FSDP's, or the torch backend's one) asks Ray for, on a cluster that has
    GPUs; it computes on that GPU."""
    gpus_per_reference: float = 0.0
    """GPUs the reference model's actor asks Ray for, on a cluster that has GPUs (a fraction shares one); 0 keeps
    the reference model on the CPU. It computes on the GPU it is given, in bf16."""
    placement: Literal["auto", "required", "anywhere"] = "auto"
    """Where the actors go (pipeline/config/placement.py). 'auto': the trainer's ranks on nodes that have the
    custom resource `trainer_resource`, the engines on nodes that have `rollout_resource`, each only if the cluster
    has such nodes, and then the control actors (clock, gate) on the head; on one machine nothing changes. 'required':
    the same, and a cluster without those nodes fails at start. 'anywhere': wherever Ray puts them."""
    trainer_resource: str = "trainer"
    """Custom resource that marks trainer nodes (`ray start --resources='{"trainer": 1}'`); a Megatron TP group
    stays on one such node."""
    rollout_resource: str = "rollout"
    """Custom resource that marks rollout nodes, where the vLLM engines (stream replicas and the validation engine)
    go."""


@dataclass
class CustomRewardFunctionConfig:
    """verl's `custom_reward_function.*`: a user's function scores every sample instead of the built-in verifiers."""

    path: str = ""
    """Python file defining the function (also `file://<path>`, or `pkg://<module>`); empty: the built-in verifier
    of each sample's data_source. Loaded and checked when the config loads."""
    name: str = "compute_score"
    """The function, called as name(data_source=..., solution_str=..., ground_truth=..., extra_info=...,
    **reward_kwargs); it returns a number (bool, int, float) or a dict with a 'score' key, whose other keys are
    logged as the sample's reward_extra_info."""
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keywords of every call; they win over the ones above, as in verl."""


def _stage(target: str) -> Any:
    # Only the target: keyword defaults live in the class, so swapping `_target_` inherits nothing stale.
    return field(default_factory=lambda: {"_target_": target})


@dataclass
class StagesConfig:
    generate: Any = _stage("stages.generate.VLLMGenerate")
    """Generation stage: class and its constructor keywords."""
    reward: Any = _stage("stages.reward.Reward")
    """Reward stage (its keywords: timeout_s, num_workers; custom_reward_function is wired in)."""
    advantage: Any = field(default_factory=dict)
    """Advantage stage: without a `_target_`, algorithm.adv_estimator's class (stages.advantage.ESTIMATORS) with
    these keywords; a `_target_` here names the class itself and wins over adv_estimator."""
    ref_logprob: Any = _stage("stages.ref_logprob.RefLogprob")
    """Reference-policy logprobs; built only with actor.use_kl_loss or algorithm.use_kl_in_reward."""


@dataclass
class RefFSDPConfig:
    param_offload: bool = False
    """The reference model's weights in CPU memory between calls, on its GPU only while it computes."""


@dataclass
class RefConfig:
    """verl's `actor_rollout_ref.ref.*`: how the reference model (stages.ref_logprob.RefLogprob) cuts its batches and
    keeps its weights."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Rows per forward pass; null: the stage's own micro_batch_size (stages.ref_logprob.micro_batch_size)."""
    log_prob_use_dynamic_bsz: bool | None = None
    """Cut the passes by token count (log_prob_max_token_len_per_gpu each); null: as actor.use_dynamic_bsz."""
    log_prob_max_token_len_per_gpu: int | None = None
    """The token budget per pass; null: actor.ppo_max_token_len_per_gpu."""
    fsdp_config: RefFSDPConfig = field(default_factory=RefFSDPConfig)
    """The reference model's offload."""


@dataclass
class RunConfig:
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    """verl's custom reward function (top level, as in verl)."""
    sim: Workload = field(default_factory=Workload)
    """The simulated workload of stages.sim.generate.SimGenerate and trainer.backend=sim (stages/sim/workload.py)."""
    resume: bool = False
    """Continue the run named by trainer.run_name from its latest checkpoint."""

    def uses_reference(self) -> bool:
        """Whether the stream computes reference logprobs: for the KL loss or the KL in the reward."""
        # actor.use_kl_loss belongs to the trainer's settings; read defensively so the stream does not depend on it.
        return bool(getattr(self.actor, "use_kl_loss", False)) or self.algorithm.use_kl_in_reward

    def scores_in_engine(self) -> bool:
        """rollout.score_in_engine resolved: on unless set false or a reference model needs a stage of its own."""
        return self.rollout.score_in_engine is not False and not self.uses_reference()


def monitor_names(value: Any) -> list[str]:
    """`trainer.monitor` as a list of names: a name or a list of them, each one of MONITORS."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if not names or any(n not in MONITORS for n in names):
        raise ConfigError(f"trainer.monitor {value!r}: expected one of {', '.join(MONITORS)} or a list of them")
    return names
