"""What the Generate stage needs to know about its vLLM engine beyond the engine's own API: the model's EOS id, the
engine-core processes, whether an error means the engine died, per-token versions from its version spans, and how
an engine runs over several devices."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


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

    On CPU vLLM turns 'uni' into 'mp' (vllm/platforms/cpu.py), so one rank still has a worker process of its own,
    bound by vLLM to its cores. VLLM_ENABLE_V1_MULTIPROCESSING=0 would keep the worker in the engine core and start
    the engine in 20 s instead of 30, but the embedded job's reward over its last 10 % of steps was 0.76, 0.87, 0.92
    and 0.94 in four runs that way, against 0.84, 0.95, 0.96 and 0.97 in four with the worker apart, with the same
    logprobs as the trainer's in both (a cause not found): not shown to learn as well, so left as vLLM sets it.

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
