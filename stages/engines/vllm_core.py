"""How a vLLM engine's core process starts: its environment and, for a one-rank CPU engine, a forkserver.

AsyncLLM always runs its engine core in a process of its own. From a Ray actor vLLM spawns it (a fork of an actor,
whose Ray threads hold locks, is unsafe), so every start pays a fresh interpreter's import of vLLM after the actor's
own import of it, one after the other. A one-rank CPU engine instead forks its core from a forkserver
(`CoreLauncher`) that the engine starts as it is made: the server is a fresh interpreter too, but it imports vLLM's
engine-core modules while the actor imports vLLM, on another core, and the core forked from it at
`AsyncLLM.from_engine_args` has them already (docs/benchmarks.md, "The engine core's start"). The server holds the
engine core's environment (`engine_core_env`), which its forks inherit. The server ends with the actor (its pipe to
the actor closes), and a core forked from it dies with the server (`CoreProcess`): the actor's grandchild, it is out
of reach of Ray's clean-up of a dead worker's children.

GPU engines and TP > 1 engines keep vLLM's own start: neither has run the forkserver on its hardware.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from multiprocessing.context import ForkServerContext, ForkServerProcess

from stages.fate import die_with

# What the engine core imports before its model: the engine-core loop, the one-process executor, the CPU worker and
# this project's worker extension (stages/engines/vllm_worker.py). The model's own module is imported after the fork.
PRELOAD = [
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "stages.engines.vllm_worker",
    "stages.engines.vllm_core",  # CoreProcess, which the server unpickles for every fork
]


GIB = 1 << 30
KV_CACHE_CAP = GIB  # the most a fitted KV cache takes (every CPU engine's fixed size before the fit)
KV_BLOCK = 256  # tokens per block the fit rounds to: vLLM's CPU default is 128, DeepSeek-V4's 256
# A CPU engine's blocks hold 7/8 of the bytes it is given as keys and values (32 MiB: 28,672 tokens of the embedded
# model's 1,024 bytes each): the fit asks for 10/8 of the keys and values it needs.
KV_PAGE_OVERHEAD_EIGHTHS = 10
DEFAULT_MAX_NUM_SEQS = 128  # vLLM's for an AsyncLLM (SchedulerConfig's; the defaults by hardware are for LLM, serve)


def engine_core_env(tensor_parallel_size: int, gpu: bool) -> dict[str, str]:
    """The environment the engine-core process starts with. A one-rank CPU engine: VLLM_ENABLE_V1_MULTIPROCESSING=0,
    read by vLLM's CPU platform, keeps the model's worker inside the engine core instead of a process of its own: one
    process and one vLLM import fewer at every start, and no hop between scheduler and worker at every decode step
    (docs/benchmarks.md, "One CPU engine's worker"). The worker then sets no thread binding, so its thread count is
    given as vLLM's own binding would give it: the process's cores less the one vLLM reserves for the scheduler (at
    least one). AsyncLLM always runs the engine core in a process of its own, so the variable changes nothing else;
    in the actor it is set only while the engine starts (`environment`)."""
    if gpu or tensor_parallel_size > 1:
        return {}
    threads = max(1, len(os.sched_getaffinity(0)) - 1)
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(threads)}


class CoreLauncher:
    """Starts one engine's core process: forked from a preloaded forkserver where `engine_core_env` gives the engine
    an environment of its own (a one-rank CPU engine), else spawned by vLLM. Make it as early as the engine is known:
    the server's imports run from then on."""

    def __init__(self, tensor_parallel_size: int) -> None:
        self.gpu = on_gpu()
        self.env = engine_core_env(tensor_parallel_size, self.gpu)
        self.context = forkserver(self.env) if self.env else None

    @contextlib.contextmanager
    def launching(self) -> Iterator[None]:
        """Around `AsyncLLM.from_engine_args`: the engine's configuration is made with the core's environment (vLLM's
        CPU platform reads it there too), and the core is forked from the server, if there is one."""
        with environment(self.env), vllm_context(self.context):
            yield


def kv_cache_bytes(
    config: dict, kv_cache_gb: float | None, max_model_len: int, dtype: str, engine_args: dict, ranks: int = 1
) -> int:
    """A CPU engine's KV cache per rank in bytes (vLLM's kv_cache_memory_bytes): `kv_cache_gb` GiB when given, else
    room for the most sequences the engine runs at once (`engine_args`' max_num_seqs, else vLLM's default for an
    AsyncLLM, DEFAULT_MAX_NUM_SEQS) at `max_model_len` tokens each, rounded up to whole blocks (`engine_args`'
    block_size, at least KV_BLOCK), the KV heads split over `ranks` tensor-parallel ranks, at most KV_CACHE_CAP.
    vLLM allocates and touches the whole cache as its core starts, seconds of it for the 1 GiB every CPU engine got
    before (docs/benchmarks.md, "The KV cache fitted to the engine"). The fit reads
    `config` (the model's config.json): keys and values of every layer's KV heads in `dtype`. A config it cannot
    read that way (no head counts, layers that are not attention) gets KV_CACHE_CAP."""
    if kv_cache_gb is not None:
        return int(kv_cache_gb * GIB)
    text = config.get("text_config") or config
    layer_types = set(text.get("layer_types") or ["full_attention"])
    try:
        heads = text["num_attention_heads"]
        kv_heads = text.get("num_key_value_heads") or heads
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        layers = text["num_hidden_layers"]
    except (KeyError, TypeError, ZeroDivisionError):
        return KV_CACHE_CAP
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return KV_CACHE_CAP
    rank_heads = max(1, kv_heads // ranks)  # fewer KV heads than ranks: each rank holds one, replicated
    per_token = 2 * layers * rank_heads * head_dim * (2 if dtype in ("bfloat16", "float16", "half") else 4)
    per_token = per_token * KV_PAGE_OVERHEAD_EIGHTHS // 8
    block = max(KV_BLOCK, engine_args.get("block_size") or 0)
    tokens = (engine_args.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS) * -(-max_model_len // block) * block
    return min(KV_CACHE_CAP, tokens * per_token)


def on_gpu() -> bool:
    """Whether this process sees a CUDA device. A CPU build of torch (version `...+cpu`) never does, and is answered
    without importing torch: seconds of an engine actor's start that would otherwise come before its core's server
    starts."""
    from importlib import metadata

    with contextlib.suppress(metadata.PackageNotFoundError):
        if metadata.version("torch").endswith("+cpu"):
            return False
    import torch

    return torch.cuda.is_available()


class CoreProcess(ForkServerProcess):
    """A process forked from the forkserver that dies with it (one that died between the fork and `run` is not
    caught: the core would then run on with no client). What it inherits from the server (vLLM's modules) is frozen
    out of the garbage collector's sight: the engine core collects several times while it starts, each a pass over
    every object it holds (docs/benchmarks.md, "The engine core's start")."""

    def run(self) -> None:
        die_with(os.getppid())
        gc.freeze()
        super().run()


class CoreContext(ForkServerContext):
    Process = CoreProcess


def forkserver(env: dict[str, str]) -> CoreContext:
    """This process's forkserver, started with `env` and importing PRELOAD (its own process; it exits with this one).
    A process has one forkserver: a second engine made in the same process shares the first one's."""
    from multiprocessing import forkserver as server

    context = CoreContext()
    context.set_forkserver_preload(PRELOAD)
    with environment(env):
        server.ensure_running()  # returns at once; the server imports PRELOAD in the background
    return context


@contextlib.contextmanager
def vllm_context(context: CoreContext | None) -> Iterator[None]:
    """vLLM's engine-core launcher (vllm/v1/engine/utils.py, CoreEngineProcManager) takes its multiprocessing context
    from `get_mp_context` at each launch: inside the block it gets `context` (None: vLLM's own)."""
    if context is None:
        yield
        return
    import vllm.v1.engine.utils as launcher

    own = launcher.get_mp_context
    launcher.get_mp_context = lambda: context
    try:
        yield
    finally:
        launcher.get_mp_context = own


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ inside the block, the previous environment restored after it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
