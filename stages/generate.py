"""VLLMGenerate: the Generate stage on an async vLLM engine that takes weight updates mid-stream.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source, agent_name (optional), admitted_version,
                admitted_time
Output columns: stages/replica.py's: the input columns for each of the n responses, plus the response's tokens,
                logprobs, per-token weight versions, mask, turns and (with route capture) MoE routes

A replica (stages/replica.py: membership, syncs, validation, partial rollout) around a vLLM engine
(stages/engines/vllm.py), each response made by the agent loop its row names (stages/agents: `single_turn_agent`,
`tool_agent`). This class only turns the stage's configuration into the two; `_target_: stages.generate.VLLMGenerate`
names it in a config, and stages.sim.generate.SimGenerate swaps in a simulated engine.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from stages.control import ClockLink, Validate, Validated
from stages.engines.base import PauseMode, Sampling
from stages.engines.vllm import VLLMEngine
from stages.engines.vllm_core import CoreLauncher
from stages.replica import VALIDATION_REPLICA, AgentSampler, Replica


class VLLMGenerate:
    def __init__(
        self,
        model_dir: str,
        clock_name: str,
        namespace: str,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_model_len: int = 256,
        kv_cache_gb: float | None = None,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        seed: int = 0,
        pause_mode: str = "wait",
        ignore_eos: bool = False,
        initial_version: int = 0,
        default_agent_loop: str = "single_turn_agent",
        multi_turn: dict[str, Any] | None = None,
        validation_only: bool = False,
        gpu_memory_utilization: float = 0.5,
        enable_rollout_routing_replay: bool = False,
        routed_experts_capture: str = "auto",
        top_k: int = -1,
        engine_args: dict[str, Any] | None = None,
    ) -> None:
        """`pause_mode`: what a sync does to requests in flight (stages/engines/base.py's PauseMode).
        `default_agent_loop`: the loop of rows whose agent_name is null; `multi_turn`: rollout.multi_turn.
        `validation_only`: the dedicated validation engine (async_training.use_trainer_do_validate), outside the
        stream: it joins neither the clock nor the broadcast group, and the driver calls `validate_version`.
        `enable_rollout_routing_replay`: fill `routed_experts` (an MoE model), captured the `routed_experts_capture`
        way (stages/engines/vllm_routes.py). `top_k`: top-k sampling (-1 off). The engine's own keywords
        (`engine_args` among them): stages/engines/vllm.py."""
        mode = PauseMode.of(pause_mode)
        sampler = AgentSampler(default_agent_loop, max_tokens, multi_turn)  # checks the loop's name first
        launcher = CoreLauncher(tensor_parallel_size)  # the engine core's imports start now
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def engine(replica: int) -> VLLMEngine:
            return VLLMEngine(
                model_dir,
                seed=seed + (replica if replica != VALIDATION_REPLICA else 1_000_003),  # each replica samples apart
                max_model_len=max_model_len,
                kv_cache_gb=kv_cache_gb,
                tensor_parallel_size=tensor_parallel_size,
                dtype=dtype,
                gpu_memory_utilization=gpu_memory_utilization,
                ignore_eos=ignore_eos,
                routed_experts_capture=routed_experts_capture if enable_rollout_routing_replay else None,
                engine_args=engine_args,
                launcher=launcher,
            )

        clock = None if validation_only else ClockLink(clock_name, namespace)
        sampling = Sampling(temperature, top_p, top_k)
        self.replica = Replica(
            clock, engine, sampler, n, sampling, mode, initial_version, tokenizer, stage=type(self).__name__
        )

    async def __call__(self, batch: pa.Table) -> pa.Table:
        return await self.replica.generate(batch)

    async def validate_version(self, msg: Validate) -> Validated:
        return await self.replica.validate_version(msg)

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.shutdown()
