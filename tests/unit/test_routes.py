"""MoE route capture for routing replay, without an engine: the worker's filing of router outputs by request and
position (on a hand-written model runner), the stage's fetch, the agent loops' replace-never-append rule, the audit's
row check and the config rules."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.observe.audit_tokens import route_rows, route_width
from stages.agents import complete_routes, generate_resumable
from stages.agents.single_turn import SingleTurnAgentLoop
from stages.engines.vllm_routes import HookRoutes, NativeRoutes, make_route_capture
from stages.engines.vllm_worker import RouteCapture
from tests.unit.test_agents import CALL, FakeEngine, run, tool_loop

LAYERS, K = 2, 2


def route_row(context: list[int], p: int) -> list[int]:
    """What the fake engine's routers choose at position p: a function of the token there and its position, so a row
    filed at the wrong place, or one row too many, shows."""
    return [context[p] % 251, p % 251, (context[p] + 1) % 251, (p + 3) % 251]


class RoutingEngine(FakeEngine):
    """FakeEngine whose requests return the routes of their whole context, as vLLM's do."""

    async def segment(self, context, max_tokens, request_id):
        seg = await super().segment(context, max_tokens, request_id)
        full = list(context) + seg.tokens
        seg.routes = np.array([route_row(full, p) for p in range(len(full) - 1)], np.uint8).reshape(-1, LAYERS * K)
        return seg


def expected_routes(context: list[int]) -> np.ndarray:
    return np.array([route_row(context, p) for p in range(len(context) - 1)], np.uint8)


# --- agent loops: routes are replaced, never appended -------------------------------------------------------------
def test_a_resumed_response_gets_the_routes_of_its_whole_context_once():
    engine = RoutingEngine(["hello world"])
    engine.abort_after = 5

    async def go():
        task = asyncio.create_task(SingleTurnAgentLoop(engine, max_tokens=64).run([1, 2, 3], "p/0"))
        await engine.waiting.wait()  # aborted: the resubmitted request waits for the sync to end
        engine.resume()
        return await task

    traj = run(go())
    assert traj.num_resumes == 1
    assert traj.num_route_rows == 3 + 11 + 1 - 1
    np.testing.assert_array_equal(traj.routes, expected_routes(traj.context))  # appended would be 7 + 14 rows


def test_generate_resumable_keeps_the_last_request_routes():
    engine = RoutingEngine(["abcdef"])
    engine.abort_after = 2

    async def go():
        task = asyncio.create_task(generate_resumable(engine, [9, 9], 10, "r"))
        await engine.waiting.wait()  # aborted: the resubmitted request waits for the sync to end
        engine.resume()
        return await task

    seg, resumes = run(go())
    assert resumes == 1 and len(seg.routes) == 2 + 7 - 1


def test_a_new_turn_replaces_the_routes_and_tool_results_at_the_end_get_theirs():
    engine = RoutingEngine([CALL, " 42"])
    from stages.tools.calculator import calculator

    traj = run(tool_loop(engine, {"calculator": calculator}).run([5], "p/0"))
    np.testing.assert_array_equal(traj.routes, expected_routes(traj.context))
    # A trajectory that ends with the tool's result (budget spent): one more request computes its rows.
    engine = RoutingEngine([CALL, " 42"])
    traj = run(tool_loop(engine, {"calculator": calculator}, max_tokens=len(CALL) + 10).run([5], "p/0"))
    assert traj.mask[-1] == 0 and len(traj.routes) < traj.num_route_rows
    run(complete_routes(engine, traj, "p/0@routes"))
    np.testing.assert_array_equal(traj.routes, expected_routes(traj.context))
    assert engine.requests[-1][1:] == (len(traj.context) - 1, 1)  # the context but its last token, one token


def test_complete_routes_leaves_samples_without_capture_alone():
    engine = FakeEngine(["ab"])
    traj = run(SingleTurnAgentLoop(engine, 8).run([1, 2], "p/0"))
    run(complete_routes(engine, traj, "p/0@routes"))
    assert traj.routes is None and len(engine.requests) == 1


# --- the worker's capture, on a hand-written model runner ---------------------------------------------------------
class FakeRouter:
    def __init__(self) -> None:
        self.top_k, self.global_num_experts, self.capture_fn = K, 4, None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn


class FakeRunner:
    """The attributes of vLLM's model runner the capture reads: the scheduled batch, back to back."""

    def __init__(self) -> None:
        self.max_model_len = 32
        self.routers = [FakeRouter() for _ in range(LAYERS)]

    def forward(self, batch: list[tuple[str, int, list[list[int]]]]) -> None:
        """batch: (request id, first position, per token the experts every layer chose, layer after layer)."""
        self.input_batch = SimpleNamespace(num_reqs=len(batch), req_ids=[r for r, _, _ in batch])
        counts = [len(rows) for _, _, rows in batch]
        self.query_start_loc = SimpleNamespace(np=np.concatenate([[0], np.cumsum(counts)]))
        self.positions = torch.tensor([p + i for _, p, rows in batch for i in range(len(rows))])
        ids = np.array([row for _, _, rows in batch for row in rows]).reshape(-1, LAYERS, K)
        for layer, router in enumerate(self.routers):
            router.capture_fn(torch.from_numpy(ids[:, layer]).to(torch.int32))


class CaptureWorker(RouteCapture):
    def __init__(self) -> None:
        self.model_runner = FakeRunner()

    def start_route_capture(self):  # vLLM's model is replaced by the fake routers
        self._route_slot = {lid: lid for lid in range(LAYERS)}
        self._route_topk, self._route_rows, self._route_filled, self._route_step = K, {}, {}, None
        for lid, router in enumerate(self.model_runner.routers):
            router.set_capture_fn(lambda ids, lid=lid: self._capture_route(lid, ids))
        return {"layers": LAYERS, "topk": K}


def rows(n: int, base: int) -> list[list[int]]:
    return [[(base + i) % 4, (base + i + 1) % 4, (base + i + 2) % 4, (base + i + 3) % 4] for i in range(n)]


def test_the_worker_files_rows_by_request_and_position_across_prefill_chunks_and_decode():
    worker = CaptureWorker()
    worker.start_route_capture()
    runner = worker.model_runner
    runner.forward([("a-x-12345678", 0, rows(3, 0)), ("b-y-87654321", 0, rows(5, 1))])  # chunked prefill of a
    runner.forward([("a-x-12345678", 3, rows(2, 3)), ("b-y-87654321", 5, rows(1, 6))])
    runner.forward([("b-y-87654321", 0, rows(6, 2))])  # b preempted and recomputed: its rows are overwritten
    a, b, missing = worker.fetch_routes(["a-x", "b-y", "c-z"])  # the ids the stage submitted under
    np.testing.assert_array_equal(np.frombuffer(a, np.uint8).reshape(-1, 4), rows(5, 0))
    np.testing.assert_array_equal(np.frombuffer(b, np.uint8).reshape(-1, 4), rows(6, 2))
    assert missing is None
    assert worker.fetch_routes(["a-x"]) == [None]  # fetched rows are forgotten


# --- the stage's side ---------------------------------------------------------------------------------------------
class RpcEngine:
    """Answers collective_rpc like one worker with rows for every request id it is asked about."""

    def __init__(self, available: dict[str, np.ndarray]) -> None:
        self.available, self.calls = available, []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))
        if method == "start_route_capture":
            return [{"layers": LAYERS, "topk": K}]
        await asyncio.sleep(0)  # an await point, as the real call's: requests that end meanwhile wait for the next
        return [[self.available[r].tobytes() if r in self.available else None for r in args[0]]]


def test_hook_routes_share_one_fetch_and_check_complete_requests():
    full = {f"r{i}": np.full((5 + i, LAYERS * K), i, np.uint8) for i in range(3)}
    engine, capture = RpcEngine(full), HookRoutes()

    async def go():
        await capture.start(engine)
        return await asyncio.gather(*(capture.rows(engine, f"r{i}", None, 4 + i, True) for i in range(3)))

    got = run(go())
    assert [g.shape for g in got] == [(4, 4), (5, 4), (6, 4)] and got[2][0, 0] == 2
    assert [m for m, _ in engine.calls] == ["start_route_capture", "fetch_routes"]  # one fetch for all three
    with pytest.raises(RuntimeError, match="captured routes for 5 tokens, the context has 9"):
        run(capture.rows(RpcEngine({"r": full["r0"]}), "r", None, 9, True))
    assert len(run(capture.rows(RpcEngine({"r": full["r0"]}), "r", None, 9, False))) == 5  # aborted: what it has


def test_native_routes_flatten_layers_and_choose_by_mode():
    output = SimpleNamespace(routed_experts=np.arange(24, dtype=np.int16).reshape(6, LAYERS, K))
    got = run(NativeRoutes().rows(None, "r", output, 5, True))
    assert got.dtype == np.uint8 and got.shape == (5, 4) and list(got[1]) == [4, 5, 6, 7]
    assert NativeRoutes().engine_args() == {"enable_return_routed_experts": True}
    assert HookRoutes().engine_args() == {"enable_prefix_caching": False, "enforce_eager": True}
    assert isinstance(make_route_capture("auto", on_gpu=False), HookRoutes)
    assert isinstance(make_route_capture("auto", on_gpu=True), NativeRoutes)
    assert isinstance(make_route_capture("hook", on_gpu=True), HookRoutes)


# --- audit and config ---------------------------------------------------------------------------------------------
def test_the_audit_finds_appended_routes():
    prompt, response = [1, 2, 3], [4, 5]
    good = [[0, 1, 2, 3]] * 4
    table = pa.table(
        {
            "sample_id": ["p/0", "p/1", "p/2"],
            "prompt_ids": [prompt, prompt, prompt],
            "response_ids": [response, response, response],
            "routed_experts": [good, good + good[:2], None],  # the second: a resume appended its context's rows
        }
    )
    check = route_rows(table, 4)
    assert not check.ok and check.detail.startswith("1 of 3") and "p/1 (6 rows for 5 context tokens)" in check.detail
    assert route_rows(table.slice(0, 1), 4).ok and not route_rows(table.slice(0, 1), 6).ok


def test_route_width_reads_the_model_config(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "config.yaml").write_text("model:\n  path: embedded\n")
    config = {"num_experts_per_tok": 2, "num_hidden_layers": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    assert route_width(tmp_path) == 2 * 3
    (tmp_path / "model" / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    assert route_width(tmp_path) is None


def test_routing_replay_needs_the_moe_model():
    with pytest.raises(ConfigError, match="set model.arch=moe"):
        load_config("conf/default.yaml", ["rollout.enable_rollout_routing_replay=true"])
    cfg = load_config("conf/moe.yaml", [])
    assert cfg.model.arch == "moe" and cfg.rollout.enable_rollout_routing_replay
    with pytest.raises(ConfigError, match="stages.generate._target_=stages.generate.VLLMGenerate"):
        load_config("conf/moe.yaml", ["stages.generate._target_=stages.sim.generate.SimGenerate"])
