"""MoE route capture for rollout routing replay (verl's R3): which experts the engine's routers chose, per token.

With `rollout.enable_rollout_routing_replay` every engine request returns, besides its tokens, one row per token it
fed to the model: prompt and generated tokens except the last sampled one (it is never fed back). A row is every
MoE layer's top-k expert ids, layer after layer (layers * k uint8 values; schemas/sample.py's `routed_experts`).

Two ways to get them, one interface (`RouteCapture`):

- `NativeRoutes`: vLLM's own (`enable_return_routed_experts`; the final output's `routed_experts`, shape
  (tokens - 1, layers, k)). It needs vLLM's Model Runner V2, which needs Triton: it cannot run on CPU, so this path
  is unverified here.
- `HookRoutes`: the worker extension's capture function on every router (stages/engines/vllm_worker.py's RouteCapture),
  fetched after the request ends. Needs prefix caching off (a cached prefix is not recomputed, so it has no routes).
  Fetches of requests that end close together share one `collective_rpc`. With tensor parallelism every worker runs
  every router on the whole batch and files the same rows (measured on CPU at TP = 2: both workers' rows equal, and
  equal TP = 1's); the first worker's are taken, and every worker forgets its rows at the fetch.

Either way a request's rows cover its whole context, so a resumed or continued response gets the routes of its
whole context again: the caller replaces the stored routes, never appends to them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, Protocol

import numpy as np

CaptureMode = Literal["auto", "hook", "native"]


class RouteCapture(Protocol):
    def engine_args(self) -> dict[str, Any]:
        """Keywords the engine must be built with."""

    async def start(self, engine: Any) -> None:
        """Called once the engine runs."""

    async def rows(self, engine: Any, request_id: str, output: Any, num_rows: int, complete: bool) -> np.ndarray:
        """The request's first `num_rows` rows, (num_rows, layers * k) uint8, once it has ended (`output`: its final
        CompletionOutput). `complete`: the request ran to its end, so every row must be there; an aborted one may
        have fewer (it was cut short in its prefill), and gets those."""


def make_route_capture(mode: CaptureMode, on_gpu: bool) -> RouteCapture:
    """'auto' is vLLM's own capture where it can run (a GPU), else the hook."""
    if mode not in ("auto", "hook", "native"):
        raise ValueError(f"rollout.routed_experts_capture must be 'auto', 'hook' or 'native', not {mode!r}")
    return NativeRoutes() if mode == "native" or (mode == "auto" and on_gpu) else HookRoutes()


def _checked(rows: np.ndarray, num_rows: int, complete: bool, request_id: str) -> np.ndarray:
    if complete and len(rows) < num_rows:
        raise RuntimeError(
            f"{request_id}: the engine captured routes for {len(rows)} tokens, the context has {num_rows}"
        )
    return np.ascontiguousarray(rows[:num_rows])


class NativeRoutes:
    """vLLM's `enable_return_routed_experts` (Model Runner V2; unverified on this project's CPU-only machines)."""

    def engine_args(self) -> dict[str, Any]:
        return {"enable_return_routed_experts": True}

    async def start(self, engine: Any) -> None:
        return None

    async def rows(self, engine: Any, request_id: str, output: Any, num_rows: int, complete: bool) -> np.ndarray:
        routed = getattr(output, "routed_experts", None)
        if routed is None:
            raise RuntimeError(f"{request_id}: the engine returned no routed_experts (enable_return_routed_experts)")
        routed = np.asarray(routed)
        return _checked(routed.reshape(len(routed), -1).astype(np.uint8), num_rows, complete, request_id)


class HookRoutes:
    """The worker extension's router hook; one `fetch_routes` call for every request that ended meanwhile."""

    def __init__(self) -> None:
        self.width = 0  # layers * k
        self.pending: dict[str, asyncio.Future] = {}
        self.fetching: asyncio.Task | None = None

    def engine_args(self) -> dict[str, Any]:
        # Eager: the capture is a Python call in each forward, which a CUDA graph's replay or a compiled graph would
        # skip or bake in (on a GPU the engine is otherwise compiled and graphed by default).
        return {"enable_prefix_caching": False, "enforce_eager": True}

    async def start(self, engine: Any) -> None:
        shape = (await engine.collective_rpc("start_route_capture"))[0]
        self.width = shape["layers"] * shape["topk"]

    async def rows(self, engine: Any, request_id: str, output: Any, num_rows: int, complete: bool) -> np.ndarray:
        future = asyncio.get_running_loop().create_future()
        self.pending[request_id] = future
        if self.fetching is None or self.fetching.done():
            self.fetching = asyncio.create_task(self._fetch(engine))
        blob = await future
        rows = np.frombuffer(blob or b"", np.uint8).reshape(-1, self.width)
        return _checked(rows, num_rows, complete, request_id)

    async def _fetch(self, engine: Any) -> None:
        """Fetch for every pending request, until none is left (requests that end during a fetch go in the next)."""
        while self.pending:
            batch, self.pending = self.pending, {}
            try:
                blobs = (await engine.collective_rpc("fetch_routes", args=(list(batch),)))[0]  # the first worker's
            except Exception as err:  # every waiter sees the failure (an engine that died, say)
                for future in batch.values():
                    if not future.done():
                        future.set_exception(err)
                continue
            for future, blob in zip(batch.values(), blobs, strict=True):
                if not future.done():  # its waiter may have been cancelled meanwhile
                    future.set_result(blob)
