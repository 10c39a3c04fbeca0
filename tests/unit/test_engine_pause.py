"""VLLMEngine.pause: vLLM's `pause_generation` without its fixed 20 ms sleep (stages/engines/vllm.py). Pure logic
over a stand-in that records the calls an AsyncLLM gets; the drift guard reads vLLM's own `pause_generation`, so a
vLLM whose pause does more than the calls the engine repeats fails here. Real pauses: tests/pipeline/
test_partial_rollout.py (abort, keep) and every stream test (wait, with the audit's per-token version checks)."""

import ast
import asyncio
import inspect
from types import SimpleNamespace

import pytest

from stages.engine_busy import EngineBusy
from stages.engines.base import PauseMode
from stages.engines.vllm import VLLMEngine


def recording_engine() -> tuple[VLLMEngine, list[tuple]]:
    calls: list[tuple] = []

    async def clear_mm_cache_async():
        calls.append(("clear_mm_cache",))

    async def pause_scheduler_async(mode, clear_cache):
        calls.append(("pause_scheduler", mode, clear_cache))

    async def pause_generation(**kwargs):
        calls.append(("pause_generation", kwargs))

    engine = VLLMEngine.__new__(VLLMEngine)  # no vLLM: only what pause touches
    engine.llm = SimpleNamespace(
        renderer=SimpleNamespace(clear_mm_cache_async=clear_mm_cache_async),
        engine_core=SimpleNamespace(pause_scheduler_async=pause_scheduler_async),
        pause_generation=pause_generation,
    )
    engine.busy = EngineBusy()
    return engine, calls


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (PauseMode.WAIT, [("clear_mm_cache",), ("pause_scheduler", "wait", True)]),
        (PauseMode.ABORT, [("clear_mm_cache",), ("pause_scheduler", "abort", True)]),
        (PauseMode.KEEP, [("pause_scheduler", "keep", False)]),  # the frozen requests' KV cache must survive
    ],
)
def test_a_pause_asks_the_scheduler_directly_and_never_sleeps(mode, expected):
    engine, calls = recording_engine()
    asyncio.run(engine.pause(mode))
    assert calls == expected  # pause_generation, and its 20 ms sleep, never called


def test_vllms_pause_generation_is_still_those_calls_and_a_sleep():
    from vllm.v1.engine.async_llm import AsyncLLM

    tree = ast.parse(inspect.getsource(AsyncLLM.pause_generation).strip())
    awaited = {ast.unparse(node.value.func) for node in ast.walk(tree) if isinstance(node, ast.Await)}
    assert awaited == {"self.renderer.clear_mm_cache_async", "self.engine_core.pause_scheduler_async", "asyncio.sleep"}
