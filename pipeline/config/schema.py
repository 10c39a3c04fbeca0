"""The run configuration's typed schema: one dataclass per section, a docstring under each field, and every
choice a `Literal`, so that omegaconf itself refuses a typo in a key or a value.

Key names follow verl's fully_async_policy where verl has one (`async_training.*`, `actor.ppo_mini_batch_size`,
`rollout.n`, `rollout.total_rollout_steps`, `data.max_response_length`), so a verl user's overrides work as they
are. The trainer's objective settings are stages/trainer/settings.py's own dataclasses (one definition for the
config and both trainer backends); the simulated workload is stages/sim/workload.py's; the rollout and reward
sections are rollout.py's and reward.py's.

Stages are swapped declaratively: each entry of `stages` names a class with `_target_` and its constructor
keywords beside it. The wiring (pipeline/stream.py) unpacks this into plain constructor arguments; nothing below
pipeline/ sees the whole config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from pipeline.config.reward import RewardConfig
from pipeline.config.rollout import RolloutConfig
from stages.reward_manager import OverlongBuffer, RewardManager
from stages.sim.workload import Workload
from stages.staleness import CONCURRENT_SAMPLES_PER_REPLICA
from stages.trainer.precision import DTypeName, MixedPrecision
from stages.trainer.settings import CorrectionSettings, MegatronRecompute, PolicySettings

MONITORS = ("console", "mlflow", "tensorboard", "file", "jsonl", "null")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


@dataclass
class AsyncTrainingConfig:
    staleness_threshold: float = 0.1
    """Share of extra (stale) prompts the generator may admit per weight version; 0 is synchronous. The defaults of
    this section are verl's fully_async config's (fully_async_ppo_trainer.yaml): 0.1, a sync every 4 steps, partial
    rollout on."""
    trigger_parameter_sync_step: int = 4
    """Optimizer steps between two weight syncs to the engines."""
    require_batches: int = 1
    """Mini-batches of `actor.ppo_mini_batch_size` prompts the trainer takes per step."""
    partial_rollout: bool = True
    """Interrupt in-flight generations at a sync and resume them with the new weights (with staleness 0 nothing is
    in flight at a sync, and the engines drain as without it)."""
    partial_rollout_mode: Literal["abort", "keep"] = "abort"
    """'abort': resubmit prompt + partial tokens (KV recomputed; verl, AReaL). 'keep': the engine keeps the requests
    and continues them with the new weights over the old KV cache (PipelineRL)."""
    use_rollout_log_probs: bool = True
    """Use the engine's behaviour logprobs as old_log_prob in the PPO ratio."""
    compute_prox_log_prob: bool = False
    """Recompute logprobs with the weights at the start of each step and use them as old_log_prob (decoupled PPO);
    needed by `algorithm.rollout_correction`."""
    concurrent_samples_per_replica: int = CONCURRENT_SAMPLES_PER_REPLICA
    """Prompts each replica generates at once at most: the gate admits no more than min(rollout.num_replicas * this,
    the version's max_required_samples) prompts that are not yet generated, plus the one verl's rollouter holds
    while it waits for a slot (verl's max_concurrent_samples; stages/staleness.py)."""
    use_trainer_do_validate: bool = False
    """Validate on a dedicated engine outside the training stream (verl: validation replicas beside the trainer),
    which loads each validated version from the weight store; the stream's engines never see a validation request."""
    parallel_validate_and_rollout: bool = True
    """On the stream's engines, interleave validation with training requests (the default, so training waits
    least); false holds a replica's new training requests until its share of the pass is done (verl's default)."""


# verl's registered estimators (verl/trainer/ppo/core_algos.py); stages.advantage.ESTIMATORS has the classes.
AdvEstimator = Literal[
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "grpo_vectorized",
    "rloo_vectorized",
    "grpo_passk",
    "opo",
    "gpg",
    "gae",
    "remax",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
]
# Those that need what the stream does not have, and what.
REFUSED_ESTIMATORS = {
    "gae": "a critic (a value model trained beside the actor)",
    "remax": "a greedy baseline rollout of every prompt beside its sampled responses",
}
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
class FilterGroupsConfig:
    """verl's `algorithm.filter_groups.*`: DAPO's dynamic sampling (stages/group_filter.py). A group whose metric is
    the same for every response carries no GRPO signal: it is logged, never trained, and the gate admits a prompt in
    its place, so every step still trains its full batch of groups."""

    enable: bool = False
    """Filter groups whose `metric` does not vary."""
    metric: str | None = None
    """'reward', 'seq_reward' or 'seq_final_reward' (the sample's reward), or a key of the reward function's extra
    info ('acc', 'score' with verl's dapo manager); a group without it fails the run, naming it."""
    max_num_gen_batches: int = 0
    """Fail the run once more than this many steps' worth of groups are filtered while one step fills (verl's DAPO
    cap: the data are too easy or too hard for the policy); 0: no cap."""


@dataclass
class AlgorithmConfig:
    """verl's `algorithm.*`: the advantage estimator, the KL in the reward, rollout correction."""

    adv_estimator: AdvEstimator = "grpo"
    """Advantage estimator (stages/advantage): 'grpo', 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline',
    'grpo_vectorized', 'rloo_vectorized', 'grpo_passk', 'opo', 'gpg' or 'gdpo'; verl's gae, remax and the
    optimal-token-baseline pair are refused naming what they need. An explicit `stages.advantage._target_` wins."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo: divide by the group's std (false: Dr.GRPO, s - mean only)."""
    gamma: float = 1.0
    """Discount of reinforce_plus_plus's token returns."""
    gdpo_reward_keys: list[str] | None = None
    """gdpo: the reward components, keys of the dict the reward function returns (e.g. ['format_reward',
    'accuracy_reward']), each normalised within its group apart; none: the reward is the one component."""
    gdpo_reward_weights: list[float] | None = None
    """gdpo: one weight per key of gdpo_reward_keys in the sum of the normalised components (none: 1 each)."""
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
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling."""

    def __post_init__(self) -> None:
        if self.adv_estimator in REFUSED_ESTIMATORS:
            raise ValueError(
                f"algorithm.adv_estimator={self.adv_estimator} needs {REFUSED_ESTIMATORS[self.adv_estimator]}, "
                "which asyncrl does not have: use grpo, rloo, reinforce_plus_plus(_baseline), grpo_passk, opo, gpg, "
                "gdpo or (tir_)optimal_token_baseline"
            )
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if weights is not None and len(weights) != len(keys or []):
            raise ValueError(
                f"algorithm.gdpo_reward_weights has {len(weights)} weights for the {len(keys or [])} "
                "algorithm.gdpo_reward_keys: give one weight per key, or none (equal weights)"
            )
        fg = self.filter_groups
        if fg.enable and not fg.metric:
            raise ValueError(
                "algorithm.filter_groups.enable=true needs algorithm.filter_groups.metric: 'seq_reward' (the reward) "
                "or a key of the reward function's extra info such as 'acc'"
            )
        if fg.enable and fg.metric == "seq_final_reward" and self.use_kl_in_reward:
            raise ValueError(
                "algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true would filter on "
                "the KL-paid token rewards, which are computed in the trainer: use metric=seq_reward"
            )
        if fg.max_num_gen_batches < 0:
            raise ValueError("algorithm.filter_groups.max_num_gen_batches is a count of steps (0: no cap)")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of trainer.backend=megatron (verl's key); must divide the model's kv heads."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel stages of trainer.backend=megatron (verl's key); must divide the model's layer count.
    The trainer has tensor_model_parallel_size x pipeline_model_parallel_size ranks."""
    export_bucket_mb: int = 64
    """Weights leave the trainer gathered across TP ranks in buckets of about this many MiB of local shards."""
    use_remove_padding: bool = False
    """The Megatron trainer's packing (verl's key), the reference model's too; with this backend it replaces
    model.use_remove_padding, as in verl's Megatron workers. Off by default, where verl has it on: verl packs through
    TransformerEngine's varlen attention, while this backend's local attention takes a packed row with a
    block-diagonal mask (stages/trainer/megatron_inputs.py) and computes all of its N x N scores, B times a padded
    micro-batch's: turn it on with a token budget (actor.use_dynamic_bsz) for long-tailed lengths."""
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
class DataConfig:
    train_files: str = "embedded"
    """Prompt file (parquet or jsonl, any fsspec URL) or 'embedded' for the built-in task."""
    max_prompt_length: int = 64
    """Prompts longer than this (in tokens) are an input error, unless truncation or filter_overlong_prompts says
    otherwise."""
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
    shuffle: bool = True
    """Reshuffle the prompts each epoch; false: the file's order every epoch."""
    prompt_key: str = "prompt"
    """verl format: the column holding each row's chat messages."""
    truncation: Literal["error", "left", "right", "middle"] = "error"
    """A prompt longer than max_prompt_length: 'error' stops the run naming the row; 'left' keeps its last tokens,
    'right' its first, 'middle' both ends (verl's choices)."""
    filter_overlong_prompts: bool = False
    """Drop the prompts longer than max_prompt_length when the file is opened (tokenizes every row up front)."""
    apply_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keywords of the tokenizer's chat template (e.g. a model's thinking switch), verl format only."""


@dataclass
class ModelConfig:
    path: str = "embedded"
    """HF model directory, or 'embedded' to build the tiny random model and tokenizer into the run directory."""
    override_config: dict[str, Any] = field(default_factory=dict)
    """Values of the model's config.json to replace, for the trainer and the engines (verl's key; e.g.
    max_position_embeddings); the user's directory is not written (pipeline/tasks/model_overrides.py)."""
    arch: Literal["dense", "moe"] = "dense"
    """The embedded model's architecture: 'dense' (Qwen2) or 'moe' (Qwen3-MoE, 4 experts, top-2). A model directory
    says what it is in its config.json; this key does not apply to it."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences into one row, attention confined to each (stages/trainer/packing.py), in
    the trainer, its proximal recompute and the reference model, instead of right-padding them (on by default, as
    in verl); false right-pads each micro-batch to its longest row. trainer.backend=megatron reads
    actor.megatron.use_remove_padding instead."""
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
    monitor: Any = field(default_factory=lambda: ["console", "mlflow"])
    """Where metrics go besides metrics.jsonl, which the run directory always holds (the summary is computed from it):
    one of MONITORS or a list, verl's trainer.logger spelling too. 'console' (a line per step where stderr is not
    a terminal), 'mlflow', 'tensorboard' (<run>/tensorboard, needs the tensorboard package), 'file' and 'jsonl' (the
    metrics.jsonl), 'null' (nothing more)."""
    mlflow_tracking_uri: str = ""
    """MLflow tracking store: an http(s):// server, a sqlite:///path.db, ...; empty keeps a sqlite store and the
    artifacts inside the run directory (<run>/mlflow)."""
    project_name: str = "asyncrl"
    """MLflow experiment of the run (created when missing): verl's project (a W&B project there). verl's
    trainer.experiment_name is the run's name: trainer.run_name."""
    resume_mode: Literal["auto", "disable", "resume_path"] | None = None
    """verl's resume switch: 'auto' continues trainer.run_name from its latest checkpoint when it has one and starts
    it fresh otherwise; 'disable' never resumes; 'resume_path' (a checkpoint of your choice) is not supported.
    null: `resume` decides."""
    console_interval: int = 1
    """The console monitor (trainer.monitor 'console'): where stderr is not a terminal (a Ray job's log, CI), one
    line of the main metrics every this many steps instead of a progress bar."""
    n_gpus_per_node: int = 0
    """verl's trainer ranks per node (GPUs on a GPU cluster, processes on CPU). trainer.backend=megatron runs
    n_gpus_per_node x nnodes ranks, data-parallel size = that / (tensor x pipeline parallel size); 0 means one
    model replica (TP x PP ranks). The torch backend's ranks are actor.fsdp_config.fsdp_size (-1: these)."""
    nnodes: int = 1
    """verl's trainer nodes: n_gpus_per_node ranks on each, one Ray placement bundle per node (each on a node of its
    own, with ray.trainer_resource when the cluster marks trainer nodes)."""
    seed: int = 0
    """Seed for model init, warm start and sampling."""
    torch_threads: int | None = None
    """Intra-op threads of the trainer process. null: every core the trainer's process may use where it trains
    alone (one trainer process, async_training.staleness_threshold=0 and trigger_parameter_sync_step=1: the engines
    wait for each sync, so engines and trainer never compute at once), else 1, which leaves the other cores to the
    engines that generate while the trainer trains (docs/benchmarks.md, "Workload (b) on-policy: where the step
    went")."""
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


def _stage(target: str) -> Any:
    # Only the target: keyword defaults live in the class, so swapping `_target_` inherits nothing stale.
    return field(default_factory=lambda: {"_target_": target})


@dataclass
class StagesConfig:
    generate: Any = _stage("stages.generate.VLLMGenerate")
    """Generation stage: class and its constructor keywords."""
    reward: Any = _stage("stages.reward.Reward")
    """Reward stage (its keywords: timeout_s, num_workers; reward.* is wired in)."""
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
    reward: RewardConfig = field(default_factory=RewardConfig)
    """verl's reward manager and custom reward function; the reward model, the remote service and the failure policy
    (pipeline/config/reward.py)."""
    sim: Workload = field(default_factory=Workload)
    """The simulated workload of stages.sim.generate.SimGenerate and trainer.backend=sim (stages/sim/workload.py)."""
    resume: bool = False
    """Continue the run named by trainer.run_name from its latest checkpoint."""
    notices: list[str] = field(default_factory=list)
    """Written by the loader, not read from any file: the verl keys of this run accepted without effect, each with
    why (pipeline/config/verl_keys.py); printed at start and kept in the run's config.yaml."""

    def uses_reference(self) -> bool:
        """Whether the stream computes reference logprobs: for the KL loss or the KL in the reward."""
        # actor.use_kl_loss belongs to the trainer's settings; read defensively so the stream does not depend on it.
        return bool(getattr(self.actor, "use_kl_loss", False)) or self.algorithm.use_kl_in_reward

    def reward_manager(self) -> RewardManager:
        """The Reward stage's manager: reward.reward_manager and reward.reward_kwargs, max_resp_len defaulting to
        data.max_response_length."""
        kw = self.reward.reward_kwargs
        overlong = OverlongBuffer(**dataclasses.asdict(kw.overlong_buffer_cfg))
        return RewardManager(
            self.reward.reward_manager.name, overlong, kw.max_resp_len or self.data.max_response_length
        )

    def scores_in_engine(self) -> bool:
        """rollout.score_in_engine resolved: on unless set false or a model (the reference, a reward model, a judge)
        needs a stage of its own between generation and scoring."""
        models = self.uses_reference() or self.reward.reward_model.enable or self.reward.judge.enable
        return self.rollout.score_in_engine is not False and not models


def monitor_names(value: Any) -> list[str]:
    """`trainer.monitor` (verl: trainer.logger) as a list of names: a name or a list of them, each one of MONITORS."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if "wandb" in names:
        raise ConfigError(
            "trainer.monitor (verl: trainer.logger) 'wandb': Weights & Biases is not supported here; use mlflow or "
            "tensorboard (and console)"
        )
    if not names or any(n not in MONITORS for n in names):
        raise ConfigError(f"trainer.monitor {value!r}: expected one of {', '.join(MONITORS)} or a list of them")
    return names
