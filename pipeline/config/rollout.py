"""The `rollout.*` section of the run configuration (verl's `actor_rollout_ref.rollout.*` and its fully_async
`rollout.*`): sampling, the engines and their knobs, agent loops. Part of schema.py's RunConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class ValKwargs:
    n: int = 1
    """Responses per held-out prompt."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling."""
    top_k: int = -1
    """Top-k sampling; -1 (vLLM's off; verl's HF rollout writes 0) keeps every token."""
    do_sample: bool | None = None
    """verl's switch: false is greedy whatever temperature says; true or null samples at temperature."""


@dataclass
class EngineKwargsConfig:
    """verl's `rollout.engine_kwargs`: keywords of the engine itself, per engine."""

    vllm: dict[str, Any] = field(default_factory=dict)
    """Passed to vLLM's AsyncEngineArgs as they are (compilation_config, enable_expert_parallel, ...), after every
    other engine setting, so they win."""


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
    top_k: int = -1
    """Top-k sampling; -1 (vLLM's off; verl's HF rollout writes 0 for it) keeps every token."""
    num_replicas: int = 1
    """Generate actors, each owning one engine."""
    nnodes: int = 1
    """verl's rollout nodes; with n_gpus_per_node they set the replicas: nnodes x n_gpus_per_node /
    tensor_model_parallel_size."""
    n_gpus_per_node: int = 0
    """verl's rollout GPUs per node (on CPU: engine devices per node); 0: rollout.num_replicas says how many."""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each engine's GPU (weights and KV cache); null: verl's 0.5 (a preset's
    stages.generate.gpu_memory_utilization may give another). vLLM on CPU sizes its KV cache by rollout.kv_cache_gb
    instead."""
    standalone_gpu_memory_utilization: float | None = None
    """verl's share for engines on GPUs of their own (its fully_async rollouter's standalone replicas, which every
    engine here is): over gpu_memory_utilization when set; null: gpu_memory_utilization."""
    max_model_len: int | None = None
    """The engine's context length; null: data.max_prompt_length + data.max_response_length."""
    max_num_batched_tokens: int | None = None
    """vLLM's token budget of one scheduler step; null: verl's 8,192 on a GPU (at least max_model_len without chunked
    prefill, which vLLM needs), vLLM's on CPU."""
    max_num_seqs: int | None = None
    """vLLM's most sequences in one batch; null: verl's 256 on a GPU, vLLM's on CPU (128 for the engine asyncrl
    starts; the fitted KV cache holds that many)."""
    enable_chunked_prefill: bool | None = None
    """vLLM's chunked prefill; null: vLLM's default."""
    enable_prefix_caching: bool | None = None
    """vLLM's prefix cache; null: vLLM's default (the MoE route-capture hook turns it off)."""
    enforce_eager: bool | None = None
    """vLLM without CUDA graphs or torch.compile (verl's key). null: verl's false on a GPU; true on CPU, where the
    compile adds more to an engine's start than its faster decode steps save on short jobs."""
    cudagraph_capture_sizes: list[int] | None = None
    """verl's key: the batch sizes vLLM captures CUDA graphs for (its compilation_config's; smaller lists hold less
    GPU memory), over engine_kwargs.vllm.compilation_config's. null: vLLM's own. Needs enforce_eager false."""
    disable_log_stats: bool = True
    """Turn off vLLM's statistics (its periodic log and Prometheus metrics, and the scheduler and iteration stats they
    are made from at every decode step), as verl's default does; false turns them on."""
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    """Keywords of the engine itself (verl's rollout.engine_kwargs.vllm)."""
    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks of each vLLM engine (verl's key): a replica's engine runs on this many devices of one
    node (GPUs; CPU cores on CPU), and every rank joins the weight sync. Must divide the model's attention heads."""
    prompts_per_call: int = 2
    """Prompts per Generate call; calls_in_flight of them run concurrently in each engine."""
    calls_in_flight: int = 4
    """Concurrent Generate calls per replica (continuous batching depth). Calls beyond it wait for one to end: where
    a step's prompts outnumber prompts_per_call x calls_in_flight and nothing else overlaps (on-policy), a step's
    generation runs in that many waves one after another."""
    engine_max_restarts: int = 3
    """Restarts of Generate replicas the run survives, all replicas together: Ray restarts a replica whose process
    or engine died, it loads the current weights and regenerates the prompts it had in flight. In push mode this
    writes every pushed version to weight_sync.store too (sync/snapshot_s); 0 turns both off."""
    score_in_engine: bool | None = None
    """Score, log and split each block in its engine's actor (stages/scored_generate.py), not in a stage after it:
    one hand-off between stages fewer per block, which on short steps is a good part of a step (bench.overhead).
    None (the default): wherever it can, i.e. unless a reference model sits between generation and scoring
    (actor.use_kl_loss, algorithm.use_kl_in_reward); true with a reference model is an error; false: never."""
    kv_cache_gb: float | None = None
    """KV cache GiB per CPU engine (per rank); null: room for what the engine runs at once, vLLM's max_num_seqs
    sequences of max_model_len tokens, at most 1 GiB (stages/engines/vllm_core.py, kv_cache_bytes)."""
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

    def engine_gpu_share(self) -> float | None:
        """Each engine's share of its GPU as verl's fully_async gives its standalone replicas; None: not configured."""
        return self.standalone_gpu_memory_utilization or self.gpu_memory_utilization

    def engine_args(self) -> dict[str, Any]:
        """vLLM's AsyncEngineArgs from the engine settings that are set, engine_kwargs.vllm over them, and
        cudagraph_capture_sizes over its compilation_config's (a JSON string there read as verl reads it)."""
        knobs = ("max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enable_prefix_caching")
        args = {k: getattr(self, k) for k in knobs if getattr(self, k) is not None}
        if self.enforce_eager is not None:  # else the engine's own default for its device (vllm.engine_defaults)
            args["enforce_eager"] = self.enforce_eager
        args = {"disable_log_stats": self.disable_log_stats, **args, **self.engine_kwargs.vllm}
        if self.cudagraph_capture_sizes is not None:
            compilation = args.get("compilation_config") or {}
            compilation = json.loads(compilation) if isinstance(compilation, str) else dict(compilation)
            args["compilation_config"] = compilation | {"cudagraph_capture_sizes": list(self.cudagraph_capture_sizes)}
        return args
