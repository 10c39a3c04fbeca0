"""Typed run configuration: dataclasses merged with omegaconf, so a typo is an error.

Key names follow verl's fully_async_policy where verl has one (`async_training.*`, `actor.ppo_mini_batch_size`,
`rollout.n`, `rollout.total_rollout_steps`, `data.max_response_length`), so a verl user's overrides work as they
are; verl's long prefixes `actor_rollout_ref.actor.` and `actor_rollout_ref.rollout.` are accepted too.

Stages are swapped declaratively: each entry of `stages` names a class with `_target_` and its constructor
keywords beside it. The wiring (pipeline/run.py) unpacks this into plain constructor arguments; nothing below
pipeline/ sees the whole config.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from pipeline.workload import Workload

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DEFAULT_CONFIG = CONF_DIR / "default.yaml"
MONITORS = ("mlflow", "jsonl", "null")
BACKENDS = ("torch", "sim", "megatron")
WEIGHT_SYNC_BACKENDS = ("gloo", "nccl", "ipc")
VERL_PREFIXES = {"actor_rollout_ref.actor.": "actor.", "actor_rollout_ref.rollout.": "rollout."}


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
    partial_rollout_mode: str = "abort"
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


@dataclass
class RolloutCorrectionConfig:
    rollout_is: str | None = None
    """Importance weights proximal / behaviour: 'token', 'sequence' or null (off)."""
    rollout_is_threshold: float = 2.0
    """Upper truncation of the importance weights (TIS)."""
    rollout_rs: str | None = None
    """Reject whole responses by their ratio: 'sequence' (product), 'geometric' (per-token mean) or null (off)."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the accepted ratio (required with rollout_rs)."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the accepted ratio; null means 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None
    """Reject a response when any token's ratio falls below this; null is off."""


@dataclass
class AlgorithmConfig:
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's `algorithm.rollout_correction.*`: off-policy correction between engine and trainer."""


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of trainer.backend=megatron (verl's key); must divide the model's kv heads."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel stages (verl's key); only 1 is supported."""
    export_bucket_mb: int = 64
    """Weights leave the trainer gathered across TP ranks in buckets of about this many MiB of local shards."""


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 8
    """Prompts per mini-batch (each carries `rollout.n` trajectories)."""
    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio_low: float = 0.2
    """PPO lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.28
    """PPO upper clip: ratio <= 1 + clip_ratio_high."""
    loss_agg_mode: str = "token-mean"
    """'token-mean' (every token of the mini-batch weighs the same) or 'seq-mean-token-mean'."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    micro_batch_size: int = 32
    """Trajectories per forward/backward pass (gradient accumulation; memory only)."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """Parallelism of trainer.backend=megatron (verl's `actor_rollout_ref.actor.megatron.*`)."""


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
    prompts_per_call: int = 2
    """Prompts per Generate call; calls_in_flight of them run concurrently in each engine."""
    calls_in_flight: int = 4
    """Concurrent Generate calls per replica (continuous batching depth)."""
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
    embedded_task: str = "reverse"
    """Which embedded task: 'reverse' (letter lists) or 'calc' (multi-turn: multiplication through the calculator
    tool, pipeline/embedded_calc.py)."""
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
    warm_start_steps: int = 500
    """Supervised steps on the embedded task before RL (0 to skip); only for the embedded model."""
    warm_start_lr: float = 2e-3
    """Learning rate of the warm start."""
    warm_start_smoothing: float = 0.5
    """Label smoothing of the warm start: keeps sampled answers noisy while greedy ones are mostly right."""


@dataclass
class TrainerConfig:
    backend: str = "torch"
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


@dataclass
class WeightSyncConfig:
    mode: str = "push"
    """'push': the trainer pauses the engines and broadcasts (verl). 'pull': the trainer publishes each version to
    `store` and goes on; each engine loads the newest at its own safe point (pipeline/sync.py)."""
    store: str = ""
    """Pull mode's parameter store, a directory or fsspec URL every engine can read; empty: shared memory
    (/dev/shm) on this node."""
    backend: str = "gloo"
    """Push mode's transport: 'gloo' (CPU tensors; works everywhere), 'nccl' (trainer and engines on different
    GPUs) or 'ipc' (one GPU shared by trainer and engine: CUDA IPC handles). nccl and ipc need CUDA."""


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
    """GPUs each Megatron trainer rank asks Ray for, on a cluster that has GPUs."""


def _stage(target: str) -> Any:
    # Only the target: keyword defaults live in the class, so swapping `_target_` inherits nothing stale.
    return field(default_factory=lambda: {"_target_": target})


@dataclass
class StagesConfig:
    generate: Any = _stage("stages.generate.VLLMGenerate")
    """Generation stage: class and its constructor keywords."""
    reward: Any = _stage("stages.reward.Reward")
    """Reward stage."""
    advantage: Any = _stage("stages.advantage.GRPOAdvantage")
    """Advantage stage."""


@dataclass
class RunConfig:
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    stages: StagesConfig = field(default_factory=StagesConfig)
    sim: Workload = field(default_factory=Workload)
    """The simulated workload of stages.sim_generate.SimGenerate and trainer.backend=sim (pipeline/workload.py)."""
    resume: bool = False
    """Continue the run named by trainer.run_name from its latest checkpoint."""


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


def _translate_verl(override: str) -> str:
    for long, short in VERL_PREFIXES.items():
        if override.startswith(long):
            return short + override[len(long) :]
    return override


def _nearest(key: str, node: DictConfig) -> str:
    options = [k for k in node.keys() if isinstance(k, str)] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


def _explain(err: Exception, schema: DictConfig) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    parts = key.split(".") if key else []
    node = schema
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, DictConfig) and part in node else None
    hint = _nearest(parts[-1], node) if parts and isinstance(node, DictConfig) else ""
    reason = getattr(err, "msg", str(err)).split("\n")[0]
    reason = reason.split(". Did you mean")[0].split(" Did you mean")[0].rstrip(".")  # omegaconf's own guess: ours
    return ConfigError(f"config key '{key}': {reason}.{hint}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Merge defaults <- YAML file <- `key=value` overrides into a validated RunConfig."""
    schema = OmegaConf.structured(RunConfig)
    layers = [schema]
    cfg_path = Path(path) if path else DEFAULT_CONFIG
    if not cfg_path.exists():
        raise ConfigError(f"config file {cfg_path} does not exist. Pass a YAML file from {CONF_DIR}.")
    layers.append(OmegaConf.load(cfg_path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. rollout.n=4).")
    layers.append(OmegaConf.from_dotlist([_translate_verl(o) for o in overrides]))
    try:
        merged = OmegaConf.merge(*layers)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        raise _explain(err, schema) from None
    except ValueError as err:  # a dataclass's own range check (sim.*)
        raise ConfigError(str(err)) from None
    from pipeline.config_checks import validate  # it reads this module's names: imported once this one is

    validate(cfg)
    return cfg


def monitor_names(value: Any) -> list[str]:
    """`trainer.monitor` as a list of names: a name or a list of them, each one of MONITORS."""
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if not names or any(n not in MONITORS for n in names):
        raise ConfigError(f"trainer.monitor {value!r}: expected one of {', '.join(MONITORS)} or a list of them")
    return names


def import_target(target: str, key: str) -> type:
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}._target_ '{target}' cannot be imported ({err}).") from None


def stage_kwargs(spec: dict[str, Any], key: str) -> tuple[str, dict[str, Any]]:
    """Split a stage spec into its target and constructor keywords, checked against the signature.

    The class itself is imported later, by the wiring (check_signature), so that loading a config imports no
    stage code and `asyncrl --help` stays instant.
    """
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(f"{key} needs a '_target_' naming the stage class (e.g. stages.reward.Reward).")
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    return spec["_target_"], kwargs


def check_signature(cls: type, kwargs: dict[str, Any], key: str, provided: set[str] = frozenset()) -> None:
    """Fail with the nearest valid name when a configured keyword is not a constructor parameter."""
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for name in kwargs:
        if name not in params:
            close = difflib.get_close_matches(name, params, n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else f" It takes: {', '.join(params)}."
            raise ConfigError(f"config key '{key}.{name}' is not a parameter of {cls.__name__}.{hint}")
        if name in provided:
            raise ConfigError(f"config key '{key}.{name}' is set by the wiring from the top-level config.")


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
