"""VLLMEngine: the Engine (stages/engines/base.py) of an async vLLM engine that takes weight updates mid-stream.

The engine runs on its replica's event loop (stages/replica.py). Per-token versions come from the engine core
itself: it labels every output batch with its weight version (`update_weight_version`), and the final output of a
request carries the version spans over its tokens (`expand_spans`). That label is exact even for tokens still in
transit when the weights change.

A pause is vLLM's scheduler pause (`pause_generation` without its sleep: `VLLMEngine.pause`): `wait` drains the
requests in the engine (new ones queue), `abort` ends each with its partial tokens and logprobs (the agent loop
resubmits it as prompt + partial tokens, and the paused engine queues it), `keep` freezes them over their KV cache,
which therefore survives the pause. Weights arrive through the worker extension's receiver (stages/engines/
vllm_worker.py; stages/transports), every worker of the engine (one per tensor-parallel rank) loading its shard.

With route capture (MoE models, rollout routing replay) every request also returns the experts the engine's routers
chose for each token of its context (stages/engines/vllm_routes.py).

Below the engine: what it needs to know beyond vLLM's API (the model's EOS id, whether an error means the engine core
died, its processes, how it runs over several devices).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from pathlib import Path
from typing import Any

from stages.agents import Segment
from stages.engine_busy import EngineBusy
from stages.engines.base import Broadcast, PauseMode, Sampling, Weights
from stages.engines.vllm_core import CoreLauncher, kv_cache_bytes
from stages.engines.vllm_routes import make_route_capture
from stages.transports import GroupAddress


def engine_defaults(gpu: bool, max_model_len: int, chunked_prefill: bool | None = None) -> dict[str, Any]:
    """What an engine gets unless its engine arguments say otherwise (rollout.engine_args() gives them from the
    config): no statistics, as verl's vLLM servers. On a GPU verl's batch (256 sequences, 8,192 tokens a scheduler
    step, at least the context length without chunked prefill; an AsyncLLM left to vLLM would take 128 and 2,048)
    and CUDA graphs with torch.compile, as verl and vLLM default to. On CPU vLLM's batch, which the fitted KV cache
    is sized for, and eager mode, since the compile lengthens the engine's start by more than its faster decode steps
    give back on short jobs (docs/benchmarks.md, "vLLM's compile on CPU")."""
    if not gpu:
        return {"enforce_eager": True, "disable_log_stats": True}
    budget = 8192 if chunked_prefill is not False else max(8192, max_model_len)
    return {"enforce_eager": False, "max_num_seqs": 256, "max_num_batched_tokens": budget, "disable_log_stats": True}


class VLLMEngine:
    name = "vLLM"

    def __init__(
        self,
        model_dir: str,
        seed: int,
        max_model_len: int = 256,
        kv_cache_gb: float | None = None,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        gpu_memory_utilization: float = 0.5,
        ignore_eos: bool = False,
        routed_experts_capture: str | None = None,
        engine_args: dict[str, Any] | None = None,
        launcher: CoreLauncher | None = None,
    ) -> None:
        """`gpu_memory_utilization`: vLLM's share of its GPU (weights and KV cache); unused on CPU, where
        `kv_cache_gb` sizes the cache (None: fitted, vllm_core.kv_cache_bytes). `tensor_parallel_size`: the engine's
        TP ranks, one worker process each (on the GPUs Ray gave this actor; on CPU, on the cores `cpu_binding` gives
        them). `ignore_eos`: fixed-length responses, for benchmarks and tests. `dtype`: the engine's (rollout.dtype);
        None: bfloat16 on a GPU, float32 on CPU. `routed_experts_capture`: capture MoE routes that way
        (vllm_routes.py); None: no capture. `engine_args`: more of vLLM's AsyncEngineArgs (rollout.engine_args():
        eager mode, chunked prefill, batch limits, engine_kwargs.vllm) over `engine_defaults`. Route capture's own
        needs win over them. `launcher`: how the engine core will start (vllm_core.py), made earlier by a caller that
        wants its imports under way; None: made here."""
        self.eos = eos_token_id(model_dir)
        self.ignore_eos = ignore_eos
        self.launcher = launcher or CoreLauncher(tensor_parallel_size)
        gpu = self.launcher.gpu
        dtype = dtype or ("bfloat16" if gpu else "float32")
        self.kwargs = dict(model=model_dir, max_model_len=max_model_len, dtype=dtype, seed=seed)
        self.kwargs |= parallel_args(tensor_parallel_size, gpu)
        if gpu:
            self.kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        engine_args = engine_args or {}
        defaults = engine_defaults(gpu, max_model_len, engine_args.get("enable_chunked_prefill"))
        self.kwargs |= {**defaults, **engine_args}
        if not gpu and "kv_cache_memory_bytes" not in self.kwargs:  # engine_kwargs.vllm may give it
            config = json.loads((Path(model_dir) / "config.json").read_text())
            fit = kv_cache_bytes(config, kv_cache_gb, max_model_len, dtype, self.kwargs, tensor_parallel_size)
            self.kwargs["kv_cache_memory_bytes"] = fit
        self.route_capture = None if routed_experts_capture is None else make_route_capture(routed_experts_capture, gpu)
        if self.route_capture is not None:
            self.kwargs |= self.route_capture.engine_args()
        self.llm: Any = None

    async def start(self, version: int) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            skip_tokenizer_init=True,  # token ids in, token ids out: the replica decodes with its own tokenizer
            worker_extension_cls="stages.engines.vllm_worker.EngineWorker",
            **self.kwargs,
        )
        with self.launcher.launching():  # the engine-core process starts here
            self.llm = AsyncLLM.from_engine_args(args)
        if self.route_capture is not None:
            await self.route_capture.start(self.llm)
        await self.llm.update_weight_version(str(version))  # the weights in model_dir (a checkpoint's on resume)
        self.version = version
        self.busy = EngineBusy()  # touched only on the engine's event loop

    async def generate(self, prompt: list[int], max_tokens: int, request_id: str, sampling: Sampling) -> Segment:
        """One request, its output taken once, when it ends (vLLM's FINAL_ONLY: every token, logprob and version
        span; an abort ends it too, with its partial tokens), not one delta per decoded token, which cost the
        actor a message to handle per token. Its routes are fetched for every request when captured (the capture
        keeps a request's rows until then)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            logprobs=0,  # the sampled token's logprob: the behaviour policy
            stop_token_ids=[] if self.ignore_eos else [self.eos],  # the engine has no tokenizer: tell it EOS
            output_kind=RequestOutputKind.FINAL_ONLY,
            ignore_eos=self.ignore_eos,
        )
        final = None
        engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.busy.request_started()
        try:
            async for out in self.llm.generate({"prompt_token_ids": prompt}, params, request_id=engine_id):
                final = out.outputs[0]  # the one output
        finally:
            self.busy.request_finished()
        tokens = list(final.token_ids)
        logprobs = [step[tok].logprob for step, tok in zip(final.logprobs, tokens, strict=True)]
        routes = None
        if self.route_capture is not None:
            rows, complete = len(prompt) + len(tokens) - 1, final.finish_reason != "abort"
            routes = await self.route_capture.rows(self.llm, engine_id, final, rows, complete)
        versions = expand_spans(final.weight_versions, len(tokens), request_id)
        first = versions[0] if versions else self.version  # the weights whose prefill computed the routes
        return Segment(tokens, logprobs, versions, final.finish_reason, routes, first)

    async def pause(self, mode: PauseMode) -> None:
        # vLLM's `pause_generation` without its last line, a fixed 20 ms sleep that lets in-flight requests' last
        # outputs reach their callers before it returns: an ordering for display, its comment says, not needed for
        # correctness. Here it would be 20 ms of every sync (docs/benchmarks.md, "The pause's sleep"), and nothing
        # needs it: the engine core labels each output with its weight version, so an output still in transit keeps
        # the version that sampled it, and an aborted request resubmitted after the resume is labelled the new one.
        clear = mode != PauseMode.KEEP  # `keep` continues the frozen requests over their KV cache: it must survive
        if clear:
            await self.llm.renderer.clear_mm_cache_async()
        await self.llm.engine_core.pause_scheduler_async(mode=mode.value, clear_cache=clear)
        self.busy.pause()  # after the drain: in `wait` mode the engine works until the scheduler has paused

    async def resume(self) -> None:
        await self.llm.resume_generation()
        self.busy.resume()

    async def join(self, group: GroupAddress, rank: int, world_size: int) -> None:
        args = (group.host, group.port, rank, world_size, group.backend, group.connect_timeout_s)
        await self.llm.collective_rpc("init_weight_group", args=args)

    async def load(self, weights: Weights, version: int) -> int:
        if isinstance(weights, Broadcast):
            m = weights.meta
            args = (list(m.names), [list(s) for s in m.shapes], list(m.dtypes))  # msgspec: no tensors, no tuples
            loaded = await self.llm.collective_rpc("receive_weights", args=args)
        else:
            loaded = await self.llm.collective_rpc("load_weights_file", args=(weights.url,))
        await self.llm.update_weight_version(str(version))
        self.version = version
        return len(loaded)  # one count per worker: every TP rank loads

    async def watch(self) -> str:
        """A call into a dead engine (the weight load of a sync, say) may never return, and an idle replica would
        notice only at its next request: poll the engine's own flag."""
        while not self.llm.errored:
            await asyncio.sleep(1.0)
        return "its vLLM engine died (EngineDeadError)"

    def died(self, err: BaseException) -> bool:
        return engine_dead(err)

    def processes(self) -> list[int]:
        return engine_pids(self.llm)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()


def eos_token_id(model_dir: str) -> int:
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return eos[0] if isinstance(eos, list) else int(eos)
    raise ValueError(f"{model_dir} declares no eos_token_id in generation_config.json or config.json")


def engine_dead(err: BaseException) -> bool:
    """Whether `err` says the engine core process is gone (vLLM's EngineDeadError), at any depth of causes."""
    from vllm.v1.engine.exceptions import EngineDeadError

    while err is not None:
        if isinstance(err, EngineDeadError):
            return True
        err = err.__cause__ or err.__context__
    return False


def expand_spans(spans: Any, num_tokens: int, sample_id: str) -> list[int]:
    """Per-token versions from the engine's [(version, start, end)] spans."""
    if num_tokens == 0:
        return []
    if not spans:
        raise RuntimeError(f"{sample_id}: the engine reported no weight version for its tokens")
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"{sample_id}: version spans cover {len(versions)} tokens, the response has {num_tokens}")
    return versions


def engine_pids(engine: Any) -> list[int]:
    """The engine-core processes of an AsyncLLM (one per engine with the uni executor), for processes.json."""
    manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", [])]


# vLLM's variable for the cores of each CPU rank's OpenMP threads: "0-3|4-7" binds rank 0 to 0-3 and rank 1 to 4-7.
CPU_BINDING = "VLLM_CPU_OMP_THREADS_BIND"


def parallel_args(tensor_parallel_size: int, gpu: bool) -> dict[str, Any]:
    """The engine's keywords for `tensor_parallel_size` ranks. One rank: the 'uni' executor, on GPUs the worker in
    the engine-core process (the fastest start). Several: the 'mp' executor, one worker process per rank, which
    all-reduce over NCCL on GPUs (the GPUs Ray gave the replica's actor, one each) and over shared memory and gloo on
    CPU.

    On CPU vLLM turns 'uni' into 'mp' (vllm/platforms/cpu.py) unless multiprocessing is off, so one rank would get a
    worker process of its own; `vllm_core.engine_core_env` keeps it in the engine core.

    On CPU, vLLM binds each rank's threads to a NUMA node of its own and refuses a machine with fewer NUMA nodes than
    ranks ("Not enough allowed NUMA nodes to bind threads", vllm/utils/ompmultiprocessing.py); there the cores this
    process may use are split between the ranks instead (`cpu_binding`, set in this process's environment, which the
    engine's processes inherit), unless VLLM_CPU_OMP_THREADS_BIND is set already."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, not {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return {"distributed_executor_backend": "uni"}
    if not gpu and CPU_BINDING not in os.environ:
        from vllm.utils.cpu_resource_utils import get_visible_memory_node

        binding = cpu_binding(sorted(os.sched_getaffinity(0)), len(get_visible_memory_node()), tensor_parallel_size)
        if binding is not None:
            os.environ[CPU_BINDING] = binding
    return {"tensor_parallel_size": tensor_parallel_size, "distributed_executor_backend": "mp"}


def cpu_binding(cpus: list[int], numa_nodes: int, ranks: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU ranks on `cpus`: None where vLLM's own binding works (a NUMA node per
    rank), else `cpus` cut into `ranks` runs of consecutive entries, the first ones one longer when they do not divide
    evenly; with fewer cores than ranks, ranks share them."""
    if numa_nodes >= ranks:
        return None
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    size, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (r < extra)
        groups.append(",".join(str(c) for c in cpus[start:end]))
        start = end
    return "|".join(groups)
